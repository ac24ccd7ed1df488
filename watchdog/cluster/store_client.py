"""A bounded client of torch's TCPStore, in pure Python: only the operations rankwatch's exchange uses.

torch's own client trusts its server: a value's length prefix is allocated as it comes (a store, or any
process listening where a job's ``MASTER_ADDR`` points, answers a ``get`` with "2 GiB follow" and root's
daemon zero-fills 2 GiB before the first byte arrives), and its timeout is per ``recv``, so a server that
trickles a byte a second holds a call for ever. This client speaks the same wire protocol
(``torch/csrc/distributed/c10d/TCPStore.cpp`` and its two server backends, libuv and the classic one; the
interop tests run every operation against both) with limits that hold whatever the peer sends:

* a value whose length prefix exceeds ``StoreClientPolicy.max_value_bytes`` is refused before anything is
  allocated for it and the connection is closed (the rest of that value is never read);
* a multi-key read refuses more than ``max_keys`` keys, and stops once its values pass ``max_read_bytes``;
* every operation has one deadline for all of its sends and receives, however the peer paces them;
* one connection per client, opened again on the next call after an error (the stream's position is lost).

Wire format (little-endian, as the C++ client writes its native integers): a request is one query byte
(``QueryType``), then its arguments; strings and values are a uint64 length then the bytes, a key count is a
uint64. torch's Python ``TCPStore`` stores every key under a ``/`` prefix, so this client adds it too: both
clients see the same keys. A connection starts with ``VALIDATE`` + magic and a ``PING`` whose nonce the server
echoes. A ``GET`` of a missing key answers an empty value (libuv) or closes the connection (classic): after a
``CHECK`` said the key exists, either means it was deleted in between (``KeyVanished``).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

_T = TypeVar("_T")

# QueryType (TCPStoreBackend.hpp)
_VALIDATE, _SET, _COMPARE_SET, _GET, _ADD, _CHECK, _WAIT = 0, 1, 2, 3, 4, 5, 6
_DELETE_KEY, _MULTI_GET, _CANCEL_WAIT, _PING = 8, 10, 12, 13
_MAGIC = 0x3C85F7CE  # validationMagicNumber
_READY, _NOT_READY = 0, 1  # CheckResponseType
_STOP_WAITING, _WAIT_CANCELED = 0, 1  # WaitResponseType
KEY_PREFIX = "/"  # what torch's Python TCPStore puts before every key

_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")


@dataclass(frozen=True)
class StoreClientPolicy:
    """What one store connection may cost the process that opens it (root's daemon)."""

    # the largest value rankwatch writes is a node snapshot of 4,096 ranks, kept under 4 MiB by its writer
    # (``store.MAX_VALUE_BYTES``): anything longer is not rankwatch's and is refused unread
    max_value_bytes: int = 4 << 20
    # keys in one CHECK/WAIT/MULTI_GET: one per node of a job, and ``correlate.MAX_NODES`` caps nodes at 4,096
    max_keys: int = 4096
    # bytes one multi-key read may bring in: the leader's read of every node's evidence (a node's is ~50 KiB
    # of views plus at most 512 KiB of flight recorder), 64 MiB is 100+ nodes at their largest; beyond it the
    # caller reads key by key and stops at the same budget (``JobStore``)
    max_read_bytes: int = 64 << 20
    # one operation, all its sends and receives: a healthy store answers in a millisecond on a LAN; 2 s also
    # covers a 4 MiB value over a slow link
    op_timeout_s: float = 2.0
    # the TCP connect and the validation (resolving the name happens before, in ``socket.getaddrinfo``)
    connect_timeout_s: float = 10.0
    # keys are short paths (``rankwatch/<job>/evidence/<gen>/<node>``); torch's libuv server refuses > 8 KiB
    max_key_bytes: int = 8 << 10


class StoreClientError(Exception):
    """The connection failed, timed out or the peer spoke out of protocol; the connection is closed."""


class ValueTooLarge(StoreClientError):
    """A length prefix over the policy's limit (or a read past its byte budget): refused unread."""


class PeerClosed(StoreClientError):
    """The store closed the connection in the middle of an answer."""


class KeyVanished(StoreClientError):
    """A key the store said exists was missing when its value was read (deleted in between)."""


class StoreClient:
    """One connection to a TCPStore. Thread-safe (one request at a time), but meant for one thread."""

    def __init__(self, host: str, port: int, policy: StoreClientPolicy | None = None) -> None:
        self.host, self.port = host, port
        self.policy = policy or StoreClientPolicy()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._deadline = 0.0

    # -- connection ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Open and validate the connection now, trying again until ``connect_timeout_s`` as torch's client
        does: the node that hosts the store may start after the others (``rankwatch inspect`` on every node)."""
        deadline = time.monotonic() + self.policy.connect_timeout_s
        pause = 0.1
        with self._lock:
            while True:
                try:
                    self._ensure(max(0.1, deadline - time.monotonic()))
                    return
                except StoreClientError:
                    left = deadline - time.monotonic()
                    if left <= pause:
                        raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

    def _ensure(self, timeout: float | None = None) -> socket.socket:
        if self._sock is not None:
            return self._sock
        timeout = self.policy.connect_timeout_s if timeout is None else timeout
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as exc:
            raise StoreClientError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._deadline = time.monotonic() + timeout
        nonce = os.getpid() & 0xFFFFFFFF
        try:
            self._send(bytes((_VALIDATE,)) + _U32.pack(_MAGIC) + bytes((_PING,)) + _U32.pack(nonce))
            if _U32.unpack(self._recv(4))[0] != nonce:
                raise StoreClientError("the peer is not a TCPStore (wrong ping answer)")
        except StoreClientError as exc:
            self._drop()
            raise StoreClientError(f"{self.host}:{self.port}: {exc}") from None
        return sock

    def _drop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._drop()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # -- framing under one deadline ------------------------------------------------------------------
    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise StoreClientError(f"no answer within {self.policy.op_timeout_s:g}s")
        return left

    def _send(self, data: bytes) -> None:
        assert self._sock is not None
        view = memoryview(data)
        try:
            while view:
                self._sock.settimeout(self._left())
                sent = self._sock.send(view)
                view = view[sent:]
        except TimeoutError:
            raise StoreClientError(f"send not taken within {self.policy.op_timeout_s:g}s") from None
        except OSError as exc:
            raise StoreClientError(f"send failed: {exc}") from None

    def _recv(self, n: int) -> bytes:
        """Exactly ``n`` bytes (``n`` already checked against the limits by the caller)."""
        assert self._sock is not None
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        try:
            while got < n:
                self._sock.settimeout(self._left())
                k = self._sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise PeerClosed(f"the store closed the connection ({got} of {n} bytes read)")
                got += k
        except TimeoutError:
            raise StoreClientError(f"no answer within {self.policy.op_timeout_s:g}s") from None
        except OSError as exc:
            raise StoreClientError(f"receive failed: {exc}") from None
        return bytes(buf)

    def _recv_value(self, budget: int | None = None) -> bytes:
        (size,) = _U64.unpack(self._recv(8))
        limit = self.policy.max_value_bytes if budget is None else min(self.policy.max_value_bytes, budget)
        if size > limit:
            what = "the value limit" if limit == self.policy.max_value_bytes else "what is left of the read budget"
            raise ValueTooLarge(f"the store announced a value of {size} bytes, over {what} ({limit} bytes): refused")
        return self._recv(size)

    def _key(self, key: str) -> bytes:
        raw = (KEY_PREFIX + key).encode()
        if len(raw) > self.policy.max_key_bytes:
            raise StoreClientError(f"key of {len(raw)} bytes")
        return _U64.pack(len(raw)) + raw

    def _keys(self, keys: Sequence[str]) -> bytes:
        if len(keys) > self.policy.max_keys:
            raise StoreClientError(f"{len(keys)} keys in one request, over the limit of {self.policy.max_keys}")
        return _U64.pack(len(keys)) + b"".join(self._key(k) for k in keys)

    @staticmethod
    def _value(data: bytes) -> bytes:
        return _U64.pack(len(data)) + data

    def _op(self, fn: Callable[[], _T], timeout_s: float | None = None) -> _T:
        """Run one request/response under the deadline; any failure closes the connection (its stream
        position is unknown after it), and the next call opens a fresh one."""
        with self._lock:
            self._ensure()
            self._deadline = time.monotonic() + (self.policy.op_timeout_s if timeout_s is None else timeout_s)
            try:
                return fn()
            except StoreClientError:
                self._drop()
                raise

    # -- the operations rankwatch uses ----------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """No answer comes for a set: a later request on the same connection sees it done."""
        if len(value) > self.policy.max_value_bytes:
            raise ValueTooLarge(f"refusing to write {len(value)} bytes")
        self._op(lambda: self._send(bytes((_SET,)) + self._key(key) + self._value(value)))

    def get(self, key: str) -> bytes:
        """The value of an existing key (``check`` first): an empty answer or a closed connection is
        ``KeyVanished`` (rankwatch never writes an empty value)."""

        def run() -> bytes:
            self._send(bytes((_GET,)) + self._key(key))
            try:
                value = self._recv_value()
            except PeerClosed as exc:  # the classic server's answer to a GET of a missing key
                raise KeyVanished(f"{key}: {exc}") from None
            if not value:
                raise KeyVanished(f"{key}: no value (deleted after it was seen)")
            return value

        return self._op(run)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Every key's value in one round trip, at most ``max_read_bytes`` in all; an empty value (a key
        deleted since it was seen) is ``KeyVanished`` for the whole read."""

        def run() -> list[bytes]:
            self._send(bytes((_MULTI_GET,)) + self._keys(keys))
            out: list[bytes] = []
            left = self.policy.max_read_bytes
            for _ in keys:
                value = self._recv_value(budget=left)
                left -= len(value)
                out.append(value)
            missing = [k for k, v in zip(keys, out, strict=True) if not v]
            if missing:
                raise KeyVanished(f"{missing[0]}: no value (deleted after it was seen)")
            return out

        return self._op(run)

    def check(self, keys: Sequence[str]) -> bool:
        def run() -> bool:
            self._send(bytes((_CHECK,)) + self._keys(keys))
            answer = self._recv(1)[0]
            if answer not in (_READY, _NOT_READY):
                raise StoreClientError(f"check: unexpected answer {answer}")
            return answer == _READY

        return self._op(run)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists, False after ``timeout_s`` (the wait is then cancelled on the server,
        as torch's client does, so the connection stays usable)."""

        def run() -> bool:
            self._send(bytes((_WAIT,)) + self._keys(keys))
            assert self._sock is not None
            self._sock.settimeout(max(0.0, timeout_s))
            try:
                first = self._sock.recv(1)
            except TimeoutError:
                first = None
            except OSError as exc:
                raise StoreClientError(f"wait failed: {exc}") from None
            if first == b"":
                raise StoreClientError("the store closed the connection during a wait")
            if first is not None:
                if first[0] != _STOP_WAITING:
                    raise StoreClientError(f"wait: unexpected answer {first[0]}")
                return True
            self._deadline = time.monotonic() + self.policy.op_timeout_s
            self._send(bytes((_CANCEL_WAIT,)))
            answer = self._recv(1)[0]
            if answer == _STOP_WAITING:  # the keys came just before the cancel: the cancel's answer follows
                if self._recv(1)[0] != _WAIT_CANCELED:
                    raise StoreClientError("wait: expected the cancel's answer")
                return True
            if answer != _WAIT_CANCELED:
                raise StoreClientError(f"wait: unexpected answer {answer}")
            return False

        return self._op(run, timeout_s=timeout_s + self.policy.op_timeout_s)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``b""``: if it is absent); the value now
        stored comes back."""
        if len(desired) > self.policy.max_value_bytes or len(expected) > self.policy.max_value_bytes:
            raise ValueTooLarge("refusing to write a value over the limit")

        def run() -> bytes:
            self._send(bytes((_COMPARE_SET,)) + self._key(key) + self._value(expected) + self._value(desired))
            return self._recv_value()

        return self._op(run)

    def add(self, key: str, amount: int) -> int:
        def run() -> int:
            self._send(bytes((_ADD,)) + self._key(key) + _I64.pack(amount))
            return int(_I64.unpack(self._recv(8))[0])

        return self._op(run)

    def delete_key(self, key: str) -> bool:
        def run() -> bool:
            self._send(bytes((_DELETE_KEY,)) + self._key(key))
            return int(_I64.unpack(self._recv(8))[0]) == 1

        return self._op(run)
