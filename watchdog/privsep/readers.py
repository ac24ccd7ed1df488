"""Running requests as a job's owner: the root daemon never parses what a job wrote (DESIGN "Trust model").

A root daemon forks, before it starts any thread, one *zygote*: a single-threaded process that keeps
nothing but its socket and an fd of the py-spy binary. For every job owner it forks a *reader* (a worker)
that drops to the owner's uid and gid (no supplementary groups, no capabilities, not dumpable, tty
signals ignored) and answers typed requests over a socketpair (``privsep.frames``) with the handlers
registered from above (``privsep.registry``: ``observe`` reads job dirs, ``evidence`` runs captures).
Whatever a user plants, their reader can read only what they could, and its answers are validated before
the daemon believes them. A reader that hangs or dies (its user may SIGSTOP or kill it) costs one request
deadline of its owner's poll; its jobs' ranks are then ``unreadable`` until it is respawned.

An unprivileged daemon (tests, ``rankwatch run``) runs the very same handlers in-process
(``LocalChannel``): there is no other uid it could read as.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pwd
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

import structlog

from ..core.policy import ReaderPolicy
from .frames import WireError, recv_frame, send_frame, w_int
from .registry import Worker, close_quietly, handler_modules

log = structlog.get_logger("rankwatch.reader")


class ReaderError(Exception):
    """The reader could not answer (gone, late, refused, malformed): the caller's data is unreadable."""


def pyspy_available() -> str | None:
    """py-spy next to this Python first (a venv's bin is not on systemd's PATH), then on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if sys.executable and os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def pyspy_path() -> str | None:
    """py-spy as ``pyspy_available`` finds it; a pyenv shim there (a script under /root another user
    could not run) is replaced by the binary beside the real interpreter, when there is one."""
    exe = pyspy_available()
    if exe is not None:
        with contextlib.suppress(OSError), open(exe, "rb") as f:
            if b"libexec/pyenv" in f.read(1024):
                real = os.path.join(os.path.dirname(os.path.realpath(sys.executable)), "py-spy")
                if os.path.isfile(real) and os.access(real, os.X_OK):
                    return real
    return exe


def local_worker(policy: ReaderPolicy | None = None) -> Worker:
    """A worker in this process, as this process's user (py-spy looked up at each use)."""
    return Worker(policy or ReaderPolicy(), None, fixed_pyspy=False, find_pyspy=pyspy_path)


# -- root side ---------------------------------------------------------------------------------------
class Channel(Protocol):
    def call(self, req: dict[str, Any], fds: tuple[int, ...] = (), timeout_s: float | None = None) -> dict[str, Any]:
        ...

    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...


class LocalChannel:
    """The handlers in-process (an unprivileged daemon: the owner is this very uid)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self.alive = True

    def call(self, req: dict[str, Any], fds: tuple[int, ...] = (), timeout_s: float | None = None) -> dict[str, Any]:
        # the handler keeps the fds it is given: hand it duplicates, the caller keeps its own
        mine = [os.dup(fd) for fd in fds]
        with self._lock:
            out = self.worker.handle(req, mine)
        if out.get("error") is not None and not isinstance(out["error"], str):
            raise ReaderError("malformed answer")
        return out

    def close(self) -> None:
        self.alive = False


class ChildChannel:
    """A reader child over a socketpair; every call under a deadline, every answer checked."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, policy: ReaderPolicy) -> None:
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.policy = policy
        self._lock = threading.Lock()
        self.alive = True

    def call(self, req: dict[str, Any], fds: tuple[int, ...] = (), timeout_s: float | None = None) -> dict[str, Any]:
        with self._lock:
            if not self.alive:
                raise ReaderError("reader gone")
            deadline = time.monotonic() + (timeout_s or self.policy.request_timeout_s)
            try:
                send_frame(self.sock, req, fds)
                out, got = recv_frame(self.sock, deadline)
            except (WireError, OSError) as exc:
                self._fail(f"{req.get('op')}: {exc}")
                raise ReaderError(f"reader of uid {self.uid}: {exc}") from None
            for fd in got:  # a reader never sends fds back: whatever came is closed
                close_quietly(fd)
            if out.get("error") is not None and not isinstance(out["error"], str):
                raise ReaderError("malformed answer")
            return out

    def _fail(self, why: str) -> None:
        log.warning("reader_written_off", uid=self.uid, pid=self.pid, why=why[:200])
        self.close()

    def close(self) -> None:
        """Closing the socket ends the reader (it exits on EOF, or when its user lets it run again). It is
        never signalled: the zygote's children are reaped by the kernel, so its pid may be anyone's by now."""
        if self.alive:
            self.alive = False
            with contextlib.suppress(OSError):
                self.sock.close()


# -- the owner's side ---------------------------------------------------------------------------------
def _libc_prctl(option: int, arg: int) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4


def _become(uid: int, gid: int) -> None:
    """Drop to uid/gid for good (saved ids too, so nothing can be regained), without supplementary groups.
    From root to another uid the kernel clears every capability and the dumpable flag (so its user can
    neither ptrace it nor read its memory); both are set explicitly as well."""
    if os.geteuid() == 0 and uid != 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _libc_prctl(PR_SET_DUMPABLE, 0)
    _libc_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _quiet_signals() -> None:
    # a terminal's ^C / ^\ / ^Z, a SIGHUP: the reader ends when its socket closes, not on those
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def _serve(sock: socket.socket, worker: Worker) -> None:
    while True:
        try:
            req, fds = recv_frame(sock)
        except WireError:
            return
        out = worker.handle(req, fds)
        try:
            send_frame(sock, out)
        except (WireError, OSError):
            return


def _close_fds_except(keep: Iterable[int]) -> None:
    keep = sorted(set(keep))
    lo = 3
    for fd in keep:
        if fd >= lo:
            os.closerange(lo, fd)
            lo = fd + 1
    os.closerange(lo, 1 << 16)


def _import_handlers(modules: object) -> None:
    """The modules whose handlers the root side registered, imported here (as root, before the fork: a
    reader may not be able to read this installation once it runs as a job's owner)."""
    if not isinstance(modules, list):
        return
    for name in modules:
        if isinstance(name, str) and name.startswith("rankwatch.") and name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _zygote(sock: socket.socket, pyspy_fd: int | None, policy: ReaderPolicy) -> None:
    """Fork a reader per request {uid, gid, modules}; answer with its socket end (SCM_RIGHTS) and pid."""
    _quiet_signals()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # readers are reaped by the kernel
    _libc_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    while True:
        try:
            req, fds = recv_frame(sock)
        except WireError:
            os._exit(0)
        for fd in fds:
            close_quietly(fd)
        try:
            uid, gid = w_int(req.get("uid"), 0, 1 << 31), w_int(req.get("gid"), 0, 1 << 31)
        except WireError:
            send_frame(sock, {"error": "bad spawn request"})
            continue
        _import_handlers(req.get("modules"))
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            try:
                sock.close()
                theirs.close()
                _become(uid, gid)
                if os.geteuid() != uid:
                    os._exit(3)
                _close_fds_except([mine.fileno(), *([pyspy_fd] if pyspy_fd is not None else [])])
                pyspy = f"/proc/self/fd/{pyspy_fd}" if pyspy_fd is not None else None
                _serve(mine, Worker(policy, pyspy))
            except BaseException as exc:  # said on the daemon's stderr; the root side sees the socket close
                with contextlib.suppress(Exception):
                    os.write(2, f"rankwatch reader of uid {uid}: {type(exc).__name__}: {exc}\n"[:500].encode())
            finally:
                os._exit(0)
        mine.close()
        try:
            send_frame(sock, {"pid": pid}, (theirs.fileno(),))
        finally:
            theirs.close()


def _preload() -> None:
    """Import, as root and before the fork, the standard modules handlers use lazily: once a reader runs as
    a job's owner it may not be able to read this installation (a venv or pyenv under /root)."""
    import concurrent.futures.thread  # noqa: F401
    import encodings.ascii
    import encodings.latin_1  # noqa: F401
    import json  # noqa: F401
    import subprocess  # noqa: F401


def _owner_gid(uid: int, fallback: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return fallback


class Readers:
    """One reader per job owner, spawned by the zygote (root) or in-process (unprivileged)."""

    def __init__(self, policy: ReaderPolicy | None = None, *, privileged: bool | None = None) -> None:
        self.policy = policy or ReaderPolicy()
        self.privileged = os.geteuid() == 0 if privileged is None else privileged
        self._lock = threading.Lock()
        self._channels: dict[int, Channel] = {}
        self._down_until: dict[int, float] = {}
        self._zygote: socket.socket | None = None
        self._zygote_pid = 0
        if self.privileged:
            self._start_zygote(pyspy_path())
        else:
            self._local = LocalChannel(local_worker(self.policy))

    def _start_zygote(self, pyspy: str | None) -> None:
        _preload()
        pyspy_fd = None
        if pyspy is not None:
            # opened as root: a reader runs it through /proc/self/fd even where its user cannot traverse
            # the path (a venv under /root); executing still needs the file's own x bit for others
            with contextlib.suppress(OSError):
                pyspy_fd = os.open(pyspy, os.O_RDONLY | os.O_CLOEXEC)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                mine.close()
                if pyspy_fd is not None:
                    os.set_inheritable(pyspy_fd, True)
                _close_fds_except([theirs.fileno(), *([pyspy_fd] if pyspy_fd is not None else [])])
                _zygote(theirs, pyspy_fd, self.policy)
            finally:
                os._exit(0)
        theirs.close()
        if pyspy_fd is not None:
            os.close(pyspy_fd)
        self._zygote, self._zygote_pid = mine, pid

    def channel(self, uid: int, gid: int) -> Channel:
        """The reader of ``uid`` (spawned on first use; ReaderError while written off)."""
        if not self.privileged:
            if uid != os.geteuid():
                raise ReaderError(f"an unprivileged daemon cannot read as uid {uid}")
            return self._local
        with self._lock:
            ch = self._channels.get(uid)
            if ch is not None and ch.alive:
                return ch
            if time.monotonic() < self._down_until.get(uid, 0.0):
                raise ReaderError(f"reader of uid {uid} written off; respawned later")
            self._down_until[uid] = time.monotonic() + self.policy.respawn_backoff_s
            ch = self._spawn(uid, gid)
            self._channels[uid] = ch
            log.info("reader_started", uid=uid, pid=ch.pid)
            return ch

    def reader_pid(self, uid: int) -> int | None:
        """The pid of ``uid``'s long-lived reader while it is up (None in-process or before it started)."""
        ch = self._channels.get(uid)
        return ch.pid if isinstance(ch, ChildChannel) and ch.alive else None

    def ask(self, uid: int, gid: int, req: dict[str, Any], fds: tuple[int, ...] = (),
            timeout_s: float = 10.0) -> dict[str, Any]:
        """One request that reads or runs something as ``uid`` (py-spy, a rank's capture, a flight-recorder
        source): in a fresh one-shot reader of that user, so many run in parallel and a wedged one costs only
        itself. Unprivileged, in this process (its own authority is all it has). ReaderError when no reader
        answers in ``timeout_s``."""
        if not self.privileged:
            # stateless requests: a worker of their own, no lock (captures of many ranks stay parallel)
            out = local_worker(self.policy).handle(req, [os.dup(fd) for fd in fds])
        else:
            with self._lock:
                ch = self._spawn(uid, gid)
            try:
                out = ch.call(req, fds, timeout_s=timeout_s)
            finally:
                ch.close()
        if out.get("error") is not None and not isinstance(out["error"], str):
            raise ReaderError("malformed answer")
        return out

    def _spawn(self, uid: int, gid: int) -> ChildChannel:
        """A new reader of ``uid`` from the zygote (the caller holds ``_lock``: one exchange at a time)."""
        zyg = self._zygote
        if zyg is None:
            raise ReaderError("no zygote")
        try:
            send_frame(zyg, {"op": "spawn", "uid": uid, "gid": _owner_gid(uid, gid), "modules": handler_modules()})
            out, fds = recv_frame(zyg, time.monotonic() + 10.0)
        except WireError as exc:
            raise ReaderError(f"cannot spawn a reader for uid {uid}: {exc}") from None
        if len(fds) != 1 or not isinstance(out.get("pid"), int):
            for fd in fds:
                close_quietly(fd)
            raise ReaderError(f"cannot spawn a reader for uid {uid}: {out.get('error')}")
        return ChildChannel(socket.socket(fileno=fds[0]), out["pid"], uid, self.policy)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            if self._zygote is not None:
                with contextlib.suppress(OSError):
                    self._zygote.close()
                with contextlib.suppress(OSError):
                    os.kill(self._zygote_pid, signal.SIGKILL)
                with contextlib.suppress(OSError):
                    os.waitpid(self._zygote_pid, 0)
                self._zygote = None


_default: Readers | None = None
_default_lock = threading.Lock()


def default_readers() -> Readers:
    """The process's readers (one zygote per process), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Readers()
        return _default
