"""The workers' protocol: length-prefixed typed frames, and the checked values every answer is read with.

A worker runs as a job owner, so the owner can kill it, and a bug in it could be made to answer anything:
the root side treats every answer as hostile. A frame is a 4-byte big-endian length and a JSON object
(``MAX_FRAME`` at most); file descriptors travel beside the length with SCM_RIGHTS. Values are taken out
of an answer only through the typed readers below (``w_int``, ``w_str``...), never unpickled.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from typing import Any

MAX_FRAME = 24 << 20  # the largest answer: a py-spy dump of many threads with locals stays below this
MAX_FDS = 4
_LEN = struct.Struct(">I")
MAX_STR = 512


class WireError(Exception):
    """A frame is malformed, oversized, late, or the peer is gone."""


def send_frame(sock: socket.socket, doc: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(doc, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise WireError(f"frame of {len(data)} bytes over {MAX_FRAME}")
    head = _LEN.pack(len(data))
    if fds:
        sent = socket.send_fds(sock, [head], list(fds))
        if sent != len(head):
            sock.sendall(head[sent:])
    else:
        sock.sendall(head)
    sock.sendall(data)


def recv_frame(sock: socket.socket, deadline: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """One frame, with any fds that came with it; WireError on EOF, a bad frame, or past ``deadline``."""
    fds: list[int] = []
    head = b""
    while len(head) < _LEN.size:
        _timeout(sock, deadline)
        try:
            chunk, got, _flags, _addr = socket.recv_fds(sock, _LEN.size - len(head), MAX_FDS)
        except (TimeoutError, OSError) as exc:
            _close_all(fds)
            raise WireError(f"no answer: {exc}") from None
        fds += got
        if not chunk:
            _close_all(fds)
            raise WireError("peer closed")
        head += chunk
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME:
        _close_all(fds)
        raise WireError(f"frame of {size} bytes over {MAX_FRAME}")
    buf = bytearray()
    while len(buf) < size:
        _timeout(sock, deadline)
        try:
            chunk = sock.recv(min(size - len(buf), 1 << 20))
        except (TimeoutError, OSError) as exc:
            _close_all(fds)
            raise WireError(f"answer cut: {exc}") from None
        if not chunk:
            _close_all(fds)
            raise WireError("peer closed mid-frame")
        buf += chunk
    try:
        doc = json.loads(bytes(buf))
    except (ValueError, RecursionError):
        _close_all(fds)
        raise WireError("frame is not JSON") from None
    if not isinstance(doc, dict):
        _close_all(fds)
        raise WireError("frame is not an object")
    return doc, fds


def _timeout(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise WireError("deadline passed")
    sock.settimeout(left)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- values ---------------------------------------------------------------------------------------
def w_int(v: Any, lo: int = 0, hi: int = (1 << 64) - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise WireError(f"expected an integer in [{lo}, {hi}]")
    return v


def w_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WireError("expected a finite number")
    return float(v)


def w_str(v: Any, limit: int = MAX_STR) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise WireError(f"expected a string of at most {limit} chars")
    return v


def w_opt_str(v: Any, limit: int = MAX_STR) -> str | None:
    return None if v is None else w_str(v, limit)


I64 = (-(1 << 63), (1 << 63) - 1)
