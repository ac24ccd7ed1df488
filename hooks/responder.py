"""Dump responder: a daemon thread that sends this rank's Python stacks and flight-recorder trace on request.

Transport: a unix stream socket ``rank-<g>.ctl`` in the job dir (0700, this user's). The daemon connects,
writes ``dump <token>\n`` and reads the answer on the same connection, as frames ``<kind> <length>\n``
followed by ``length`` bytes: ``stacks`` (JSON: every thread's Python stack, no local variables), then
``fr`` (the flight-recorder trace, when torch recorded anything) or ``fr_err`` (why not), then ``done 0``.
Blocking C++ calls (a gloo/NCCL wait) release the GIL and Python loops yield it every few ms, so the
thread answers while the training thread is stuck. ``faulthandler`` on SIGUSR2 is the fallback that
needs no GIL at all.

Why a socket and not a FIFO plus answer files (the earlier design): the daemon runs as root but, under the
shipped systemd unit, without CAP_DAC_OVERRIDE (``systemd/rankwatch.service``). Reading other users'
records already needs CAP_DAC_READ_SEARCH (read any file, search any dir) — and that is all the daemon
needs here too:

* it reaches the socket through the 0700 job dir with CAP_DAC_READ_SEARCH's search permission; a
  unix socket is opened by ``connect``, which wants write permission on the socket file, so the socket is
  0666 — only processes that can search the 0700 job dir (this user, or CAP_DAC_READ_SEARCH/OVERRIDE)
  reach it at all. A FIFO would have to be opened for writing, which a 0600 FIFO of another user refuses
  to root without CAP_DAC_OVERRIDE;
* the answer comes back over the connection: nothing is written into the job dir for the daemon to read
  and then delete (deleting in another user's 0700 dir would need CAP_DAC_OVERRIDE);
* the responder checks its peer with ``SO_PEERCRED``: only uid 0 or this rank's own uid may ask for
  stacks, and the daemon checks in turn that the peer answering is the rank process (pid from the record).

Every connection is served under a timeout, one at a time, so a client that stalls costs only this
thread's time, never the training thread's.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import re
import signal
import socket
import stat
import struct
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_REQUEST = 256
# a connection that sends no request within this time is dropped; each send of the answer may take this
# long (the daemon runs py-spy on this rank between asking and reading, ~0.1-5 s)
IO_TIMEOUT_S = 30.0
# connect needs write permission on the socket; the 0700 job dir is the gate, SO_PEERCRED the check
SOCKET_MODE = 0o666
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def ctl_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"rank-{rank}.ctl")


# sun_path holds 108 bytes with its NUL: longer socket paths are reached through the dir's fd
SUN_PATH_MAX = 107


@contextlib.contextmanager
def socket_address(path: str) -> Iterator[str]:
    """An address ``bind``/``connect`` accept for ``path``, however deep the job dir is."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        yield path
        return
    fd = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


def python_stacks() -> list[dict[str, Any]]:
    """Every thread's stack, innermost frame first (py-spy's order), without locals."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = [
            {"name": fs.name, "filename": fs.filename, "line": fs.lineno}
            for fs in reversed(traceback.extract_stack(frame))
        ]
        out.append({"thread_id": ident, "thread_name": names.get(ident, "?"), "frames": frames})
    return out


def flight_recorder_json() -> tuple[bytes | None, str | None]:
    """(trace, why not): NCCL's dump where this build has one, else the generic flight recorder."""
    if "torch.distributed" not in sys.modules:  # never import torch into a process that did not
        return None, "torch.distributed is not imported in this process"
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None, "torch.distributed is not initialised in this process"
        from torch._C import _distributed_c10d as c10d
    except Exception as exc:
        return None, f"torch.distributed unavailable: {exc!r}"
    errors = []
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = fn(includeCollectives=True, onlyActive=False)
        except Exception as exc:
            errors.append(f"{name}: {exc!r}")
            continue
        if data:
            return bytes(data), None
        errors.append(f"{name}: empty trace (TORCH_FR_BUFFER_SIZE unset?)")
    return None, "; ".join(errors) or "this torch build has no flight recorder"


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def frame(kind: str, data: bytes) -> bytes:
    return f"{kind} {len(data)}\n".encode() + data


def answer(rank: int) -> Iterator[bytes]:
    """The frames of one answer: stacks first (cheap, and what the daemon needs most), then the trace."""
    stacks = {"pid": os.getpid(), "rank": rank, "threads": python_stacks()}
    yield frame("stacks", json.dumps(stacks).encode())
    fr, why_not = flight_recorder_json()
    if fr is not None:
        yield frame("fr", fr)
    else:
        yield frame("fr_err", (why_not or "").encode())
    yield frame("done", b"")


def read_request(conn: socket.socket) -> str | None:
    """The token of a well-formed ``dump <token>\n`` request, else None."""
    pending = b""
    while b"\n" not in pending:
        chunk = conn.recv(MAX_REQUEST)
        if not chunk:
            return None
        pending += chunk
        if len(pending) > MAX_REQUEST:
            return None
    parts = pending.split(b"\n", 1)[0].decode("ascii", "replace").split()
    if len(parts) == 2 and parts[0] == "dump" and _TOKEN.match(parts[1]):
        return parts[1]
    return None


class DumpResponder:
    def __init__(self, job_dir: str, rank: int) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.path = ctl_path(job_dir, rank)
        self._uid = os.geteuid()
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            # a socket or FIFO an earlier run of this rank left; the job dir is ours (checked), so only we
            # could have put anything here
            if stat.S_ISSOCK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
                os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with socket_address(self.path) as address:
                self._sock.bind(address)
            os.chmod(self.path, SOCKET_MODE)
            self._sock.listen(8)
        except BaseException:
            self._sock.close()
            raise
        self._inode = os.lstat(self.path).st_ino
        # a fork (DataLoader workers) must not keep the listening socket: requests would queue unanswered
        # there after this process is gone
        os.register_at_fork(after_in_child=self._drop_in_child)
        self._thread = threading.Thread(target=self._serve, name="rankwatch-dump-responder", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.close)

    def close(self) -> None:
        """Remove our socket (only ours: a restarted rank may have bound a new one under the same name)."""
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        with contextlib.suppress(OSError):
            self._sock.close()

    def _drop_in_child(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def allowed(self, uid: int) -> bool:
        return uid in (0, self._uid)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with contextlib.suppress(Exception), conn:
                self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        _, uid, _ = peer_cred(conn)
        if not self.allowed(uid):
            return
        if read_request(conn) is None:
            return
        for part in answer(self.rank):
            conn.sendall(part)


def install_faulthandler(job_dir: str, rank: int) -> None:
    """SIGUSR2 dumps all threads to ``rank-<g>.faulthandler`` even when the GIL is held; only if unused."""
    try:
        if signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
            return
        path = os.path.join(job_dir, f"rank-{rank}.faulthandler")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        stream = os.fdopen(fd, "w")
        faulthandler.register(signal.SIGUSR2, file=stream, all_threads=True, chain=False)
        _keep.append(stream)
    except (OSError, ValueError, RuntimeError):
        pass


_keep: list[Any] = []
