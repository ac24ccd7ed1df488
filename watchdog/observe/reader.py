"""Per-owner readers: the root daemon never parses what a job wrote (DESIGN "Trust model").

A root daemon forks, before it starts any thread, one *zygote*: a single-threaded process that keeps
nothing but its socket and an fd of the py-spy binary. For every job owner it forks a reader that drops
to the owner's uid and gid (no supplementary groups, no capabilities, not dumpable, tty signals
ignored) and serves typed requests over a socketpair (``observe.wire``): list a job dir, open and read
records, read job.json, remove leftovers, run py-spy. The job dir itself is opened by the daemon with
``O_NOFOLLOW|O_DIRECTORY`` at discovery and handed over as an fd, so a dir swapped for a symlink later
is never followed; inside, everything goes through ``observe.jobdir``. Whatever a user plants, their
reader can read only what they could, and its answers are validated before the daemon believes them.
A reader that hangs or dies (its user may SIGSTOP or kill it) costs one request deadline; its jobs'
ranks are then ``unreadable`` until it is respawned.

An unprivileged daemon (tests, ``rankwatch run``) runs the very same request handler in-process
(``LocalReaders``): there is no other uid it could read as.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import structlog
from rankwatch.hooks.record import RecordFormatError, RecordSnapshot

from ..core.host_signals import RankCounters
from . import jobdir
from .wire import WireError, recv_frame, send_frame, snapshot_from_doc, snapshot_to_doc, w_float, w_int, w_str

log = structlog.get_logger("rankwatch.reader")


@dataclass(frozen=True)
class ReaderPolicy:
    """What one owner's reader may cost the daemon."""

    # a reader answers in microseconds; one that does not within this is stopped or wedged (its user can
    # SIGSTOP it): the poll loop loses at most this much before the reader is written off
    request_timeout_s: float = 1.0
    # a written-off reader is respawned no sooner than this, so a user killing theirs in a loop costs the
    # daemon one deadline per period, not per poll
    respawn_backoff_s: float = 10.0
    # records open per reader (each holds an fd in the reader): a job has one per local rank, a node a few
    # hundred at most; more is a flood, refused with one log line
    max_records: int = 512
    # torn reads retried per record per poll (no sleeps): a record held odd costs microseconds, not 60 ms
    torn_retries: int = 32
    # the most a py-spy dump may print (a real one of a rank is tens of KB; 100 MB would cost GBs to parse)
    pyspy_max_bytes: int = 8 << 20  # = capture.MAX_PYSPY_BYTES


class ReaderError(Exception):
    """The reader could not answer (gone, late, refused, malformed): the caller's data is unreadable."""


# -- the request handler (runs as the owner: in a reader child, or in-process) ------------------------
class ReaderCore:
    def __init__(self, policy: ReaderPolicy, pyspy: str | None, *, fixed_pyspy: bool = True) -> None:
        self.policy = policy
        self.pyspy = pyspy  # None and not fixed: looked up at each dump (in-process: PATH may change)
        self.fixed_pyspy = fixed_pyspy
        self._jobs: dict[int, int] = {}  # handle -> dir fd
        self._recs: dict[int, jobdir.AtRecordReader] = {}
        self._next = 1

    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def handle(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        op = req.get("op")
        fn = getattr(self, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
        if fn is None:
            for fd in fds:
                jobdir.close_quietly(fd)
            return {"error": f"unknown request {str(op)[:40]!r}"}
        try:
            out: dict[str, Any] = fn(req, fds)
            return out
        except (OSError, ValueError, KeyError, TypeError, WireError) as exc:
            return {"error": str(exc)[:300]}

    def _dir(self, req: dict[str, Any]) -> int:
        return self._jobs[w_int(req.get("h"))]

    def op_open_job(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != 1:
            for fd in fds:
                jobdir.close_quietly(fd)
            raise ValueError("open_job needs exactly one dir fd")
        h = self._new_id()
        self._jobs[h] = fds[0]
        return {"h": h}

    def op_close_job(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        fd = self._jobs.pop(w_int(req.get("h")), None)
        if fd is not None:
            jobdir.close_quietly(fd)
        return {}

    def op_list(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        return {"names": jobdir.list_names(self._dir(req))}

    def op_stat(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        st = jobdir.lstat_at(self._dir(req), w_str(req.get("name"), 128))
        if st is None:
            return {"missing": True}
        return {"ino": st.st_ino, "dev": st.st_dev, "uid": st.st_uid, "mode": st.st_mode, "mtime": st.st_mtime}

    def op_job_json(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        return {"info": jobdir.read_job_info(self._dir(req))}

    def op_rec_open(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        dfd, name = self._dir(req), w_str(req.get("name"), 128)
        st = jobdir.lstat_at(dfd, name)
        ident = {"ino": st.st_ino if st else 0}
        if len(self._recs) >= self.policy.max_records:
            return {**ident, "budget": True, "error": f"over {self.policy.max_records} records open for this user"}
        try:
            rec = jobdir.AtRecordReader(dfd, name, self.policy.torn_retries)
        except RecordFormatError as exc:
            return {**ident, "reject": str(exc)[:300]}
        try:
            snap = rec.read()
        except (RecordFormatError, OSError) as exc:
            rec.close()
            return {**ident, "reject": str(exc)[:300]}
        r = self._new_id()
        self._recs[r] = rec
        assert isinstance(snap, RecordSnapshot)
        return {"r": r, "ino": rec.inode, "dev": rec.dev, "uid": rec.uid, "snap": snapshot_to_doc(snap)}

    def op_rec_read(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        rec = self._recs[w_int(req.get("r"))]
        since = req.get("since", -1)
        since = since if isinstance(since, int) and not isinstance(since, bool) else -1
        try:
            snap = rec.read(since)
        except RecordFormatError as exc:
            return {"unreadable": str(exc)[:300]}
        assert isinstance(snap, RecordSnapshot)
        return {"snap": snapshot_to_doc(snap)}

    def op_rec_read_many(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        """Every record of a job in one exchange (a poll of 256 records is one round trip, not 256: on a loaded
        host each round trip waits for the reader to be scheduled)."""
        reads = req.get("reads")
        if not isinstance(reads, list):
            raise ValueError("reads must be a list")
        out: list[dict[str, Any]] = []
        for item in reads[: self.policy.max_records]:
            if not isinstance(item, list) or len(item) != 2:
                out.append({"error": "malformed read"})
                continue
            r, since = item
            rec = self._recs.get(r) if isinstance(r, int) else None
            if rec is None:
                out.append({"error": "no such record"})
                continue
            try:
                snap = rec.read(since if isinstance(since, int) and not isinstance(since, bool) else -1)
            except (RecordFormatError, OSError) as exc:
                out.append({"unreadable": str(exc)[:300]})
                continue
            assert isinstance(snap, RecordSnapshot)
            out.append({"snap": snapshot_to_doc(snap)})
        return {"snaps": out}

    def op_rec_replaced_many(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        rs = req.get("rs")
        if not isinstance(rs, list):
            raise ValueError("rs must be a list")
        return {"replaced": [isinstance(r, int) and r in self._recs and self._recs[r].replaced()
                             for r in rs[: self.policy.max_records]]}

    def op_rec_replaced(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        return {"replaced": self._recs[w_int(req.get("r"))].replaced()}

    def op_rec_close(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        rec = self._recs.pop(w_int(req.get("r")), None)
        if rec is not None:
            rec.close()
        return {}

    def op_remove_dumps(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        age = req.get("older_than_s", 0.0)
        return {"removed": jobdir.remove_dumps(self._dir(req), float(age) if isinstance(age, (int, float)) else 0.0)}

    def op_remove_finished(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        inodes = req.get("inodes")
        if not isinstance(inodes, list):
            raise ValueError("inodes must be a list")
        removed, empty = jobdir.remove_finished(self._dir(req), [w_int(i) for i in inodes[:100_000]])
        return {"removed": removed, "empty": empty}

    def _pyspy_exe(self) -> str | None:
        return self.pyspy if self.pyspy is not None else (None if self.fixed_pyspy else _pyspy_path())

    def _run_pyspy(self, pid: int, timeout_s: float, nonblocking: bool, include_locals: bool,
                   native: bool = False) -> tuple[Any, str | None]:
        from ..evidence.capture import run_pyspy

        return run_pyspy(self._pyspy_exe(), pid, timeout_s, nonblocking, include_locals,
                         self.policy.pyspy_max_bytes, native=native)

    def op_pyspy(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        threads, err = self._run_pyspy(w_int(req.get("pid"), 1, 1 << 22), w_float(req.get("timeout_s", 5.0)),
                                       bool(req.get("nonblocking")), bool(req.get("locals")),
                                       native=bool(req.get("native")))
        return {"threads": threads, "error": err}

    def op_capture(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """One rank's whole capture as its owner: responder asked and its answer parsed, py-spy run; the job
        dir comes as an fd (the one root opened), its socket reached through it."""
        from ..core.policy import CapturePolicy
        from ..evidence.capture import capture_as_owner

        if len(fds) != 1:
            for fd in fds:
                jobdir.close_quietly(fd)
            raise ValueError("capture needs exactly one dir fd")
        try:
            pid = w_int(req.get("pid"), 1, 1 << 22)
            policy = CapturePolicy(pyspy_timeout_s=w_float(req.get("pyspy_timeout_s")),
                                   responder_timeout_s=w_float(req.get("responder_timeout_s")),
                                   include_locals=req.get("locals") is True)
            stopped = req.get("stopped") is True
            return capture_as_owner(
                w_int(req.get("rank"), 0, 1 << 31), pid, stopped, f"/proc/self/fd/{fds[0]}",
                w_str(req.get("token"), 128), policy,
                lambda nonblocking: self._run_pyspy(pid, policy.pyspy_timeout_s, nonblocking, policy.include_locals),
            )
        finally:
            jobdir.close_quietly(fds[0])

    def op_fr_debug_server(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        """The rank's flight recorder from its torch debug server, asked and parsed as its owner."""
        from ..evidence.capture import FR_WIRE_BYTES
        from ..evidence.debug_server import fr_from_debug_server
        from ..evidence.flight_recorder import fr_wire_doc

        dump = fr_from_debug_server(w_int(req.get("pid"), 1, 1 << 22), os.geteuid())
        if dump is None:
            return {"none": True}
        if dump.body is None:
            return {"why": dump.source}
        doc, note = fr_wire_doc(dump.body, FR_WIRE_BYTES)
        return {"fr": doc, "note": note, "source": dump.source}

    def op_environ(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        """The kept rank keys of each process's environment, read and parsed as their owner (the kernel's
        ptrace read check applies to this uid: another user's process answers None)."""
        from .discover import read_environ

        pids = req.get("pids")
        if not isinstance(pids, list) or len(pids) > 4096:
            raise ValueError("pids: a list of at most 4096")
        return {"envs": {str(pid): read_environ(pid) for pid in (w_int(x, 1, 1 << 22) for x in pids)}}

    def op_signals(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        """The kernel's counters of each rank process and its cgroup (``observe.signals``), read as its owner:
        which cgroup a rank is in is the job's choice."""
        from .signals import counters_to_doc, read_ranks

        pids = req.get("pids")
        if not isinstance(pids, list) or len(pids) > self.policy.max_records:
            raise ValueError(f"pids: a list of at most {self.policy.max_records}")
        got = read_ranks([w_int(x, 1, 1 << 22) for x in pids])
        return {"ranks": {str(pid): counters_to_doc(c) if c is not None else None for pid, c in got.items()}}

    def op_fr_file(self, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
        """A flight-recorder file the job's environment names, read and parsed as its owner."""
        from ..evidence.capture import FR_WIRE_BYTES
        from ..evidence.flight_recorder import fr_wire_doc
        from ..evidence.inspect_capture import MAX_FR_FILE_BYTES, read_owned_file

        got = read_owned_file(w_str(req.get("path"), 4096), os.geteuid(), MAX_FR_FILE_BYTES)
        if isinstance(got, str):
            return {"why": got}
        if got[:1] == b"\x80":
            return {"why": "pickled (not read: unpickling runs code); analyse it with torch's fr_trace"}
        doc, note = fr_wire_doc(got, FR_WIRE_BYTES)
        return {"fr": doc, "note": note}


# -- root side ---------------------------------------------------------------------------------------
class Channel(Protocol):
    def call(self, req: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]: ...

    @property
    def alive(self) -> bool: ...

    def close(self) -> None: ...


class LocalChannel:
    """The handler in-process (an unprivileged daemon: the owner is this very uid)."""

    def __init__(self, core: ReaderCore) -> None:
        self.core = core
        self._lock = threading.Lock()
        self.alive = True

    def call(self, req: dict[str, Any], fds: tuple[int, ...] = ()) -> dict[str, Any]:
        # the core keeps the fds it is given: hand it duplicates, the caller keeps its own
        mine = [os.dup(fd) for fd in fds]
        with self._lock:
            out = self.core.handle(req, mine)
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
                jobdir.close_quietly(fd)
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


def _serve(sock: socket.socket, core: ReaderCore) -> None:
    while True:
        try:
            req, fds = recv_frame(sock)
        except WireError:
            return
        out = core.handle(req, fds)
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


def _zygote(sock: socket.socket, pyspy_fd: int | None, policy: ReaderPolicy) -> None:
    """Fork a reader per request {uid, gid}; answer with its socket end (SCM_RIGHTS) and pid."""
    _quiet_signals()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # readers are reaped by the kernel
    _libc_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    while True:
        try:
            req, fds = recv_frame(sock)
        except WireError:
            os._exit(0)
        for fd in fds:
            jobdir.close_quietly(fd)
        try:
            uid, gid = w_int(req.get("uid"), 0, 1 << 31), w_int(req.get("gid"), 0, 1 << 31)
        except WireError:
            send_frame(sock, {"error": "bad spawn request"})
            continue
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
                _serve(mine, ReaderCore(policy, pyspy))
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
    """Import, as root and before the fork, every module a reader's requests use: once it runs as a job's
    owner it may not be able to read this installation (a venv or pyenv under /root), so nothing may be
    imported lazily there."""
    import concurrent.futures.thread  # noqa: F401
    import encodings.ascii
    import encodings.latin_1  # noqa: F401
    import subprocess  # noqa: F401

    from ..core import (
        host_signals,  # noqa: F401
        policy,  # noqa: F401
    )
    from ..evidence import capture, debug_server, flight_recorder, inspect_capture  # noqa: F401
    from . import discover, signals  # noqa: F401


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
            self._start_zygote(_pyspy_path())
        else:
            self._local = LocalChannel(ReaderCore(self.policy, None, fixed_pyspy=False))

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

    def open_job(self, base_fd: int, name: str) -> JobDir:
        """Open job dir ``name`` under the base dir fd (never through a symlink) and hand it to its owner's
        reader. OSError when it is not a dir (or a symlink); ReaderError when no reader can take it."""
        fd = jobdir.open_dir(name, base_fd)
        try:
            st = os.fstat(fd)
            job = JobDir(self, fd, name, st.st_uid, st.st_gid)
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(ReaderError):
            job.attach()
        return job

    def pyspy(self, uid: int, gid: int, pid: int, timeout_s: float, nonblocking: bool,
              include_locals: bool, native: bool = False) -> tuple[Any, str | None]:
        """py-spy as the rank's owner (``ask``)."""
        if uid < 0:
            return None, "the job dir is gone: no owner to run py-spy as"
        req = {"op": "pyspy", "pid": pid, "timeout_s": timeout_s, "nonblocking": nonblocking,
               "locals": include_locals, "native": native}
        try:
            out = self.ask(uid, gid, req, timeout_s=timeout_s + 5.0)
        except ReaderError as exc:
            return None, str(exc)
        from ..evidence.capture import shape_threads

        err = out.get("error")
        threads = shape_threads(out.get("threads")) if out.get("threads") is not None else None
        return threads, err if isinstance(err, str) else None

    def environs(self, uid: int, pids: list[int]) -> dict[int, dict[str, str] | None]:
        """Each process's kept environment read by ``uid``'s reader and checked here (discovery as root);
        unreadable (no reader, late, malformed) is None for all: those processes are simply not found."""
        from .discover import checked_env

        try:
            out = self.ask(uid, uid, {"op": "environ", "pids": pids}, timeout_s=10.0)
        except ReaderError:
            return {}
        envs = out.get("envs")
        if not isinstance(envs, dict):
            return {}
        return {pid: checked_env(envs.get(str(pid))) for pid in pids}

    def ask(self, uid: int, gid: int, req: dict[str, Any], fds: tuple[int, ...] = (),
            timeout_s: float = 10.0) -> dict[str, Any]:
        """One request that reads or runs something as ``uid`` (py-spy, a rank's capture, a flight-recorder
        source): in a fresh one-shot reader of that user, so many run in parallel and a wedged one costs only
        itself. Unprivileged, in this process (its own authority is all it has). ReaderError when no reader
        answers in ``timeout_s``."""
        if not self.privileged:
            # stateless ops: a core of their own, no lock (captures of many ranks stay parallel)
            out = ReaderCore(self.policy, None, fixed_pyspy=False).handle(req, [os.dup(fd) for fd in fds])
        else:
            ch = self._one_shot(uid, gid)
            try:
                out = ch.call(req, fds, timeout_s=timeout_s)
            finally:
                ch.close()
        if out.get("error") is not None and not isinstance(out["error"], str):
            raise ReaderError("malformed answer")
        return out

    def _one_shot(self, uid: int, gid: int) -> ChildChannel:
        with self._lock:
            return self._spawn(uid, gid)

    def _spawn(self, uid: int, gid: int) -> ChildChannel:
        """A new reader of ``uid`` from the zygote (the caller holds ``_lock``: one exchange at a time)."""
        zyg = self._zygote
        if zyg is None:
            raise ReaderError("no zygote")
        try:
            send_frame(zyg, {"op": "spawn", "uid": uid, "gid": _owner_gid(uid, gid)})
            out, fds = recv_frame(zyg, time.monotonic() + 10.0)
        except WireError as exc:
            raise ReaderError(f"cannot spawn a reader for uid {uid}: {exc}") from None
        if len(fds) != 1 or not isinstance(out.get("pid"), int):
            for fd in fds:
                jobdir.close_quietly(fd)
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


def _pyspy_path() -> str | None:
    """py-spy as ``pyspy_available`` finds it; a pyenv shim there (a script under /root another user
    could not run) is replaced by the binary beside the real interpreter, when there is one."""
    from ..evidence.capture import pyspy_available

    exe = pyspy_available()
    if exe is not None:
        with contextlib.suppress(OSError), open(exe, "rb") as f:
            if b"libexec/pyenv" in f.read(1024):
                real = os.path.join(os.path.dirname(os.path.realpath(sys.executable)), "py-spy")
                if os.path.isfile(real) and os.access(real, os.X_OK):
                    return real
    return exe


@dataclass
class RecordInfo:
    """A record a reader opened: its handle, identity as the kernel gave it, and its first snapshot."""

    r: int
    ino: int
    dev: int
    uid: int
    snap: RecordSnapshot


class JobDir:
    """One job dir held by its owner's reader (root side). Every method raises ReaderError when the
    reader cannot answer; the watch then treats what it asked for as unreadable."""

    def __init__(self, readers: Readers, fd: int, name: str, uid: int, gid: int) -> None:
        self.readers = readers
        self.fd = fd  # held from discovery on: the dir, whatever its name points at later
        self.name = name
        self.uid = uid  # the dir's owner, from the kernel (fstat of the fd the daemon opened)
        self.gid = gid
        self.ch: Channel | None = None
        self.h = 0
        self.gen = 0  # bumped on every (re)attach: record handles of an older reader are void

    def attach(self) -> None:
        """Hand the dir to its owner's reader (again, after a respawn)."""
        ch = self.readers.channel(self.uid, self.gid)
        out = ch.call({"op": "open_job"}, (self.fd,))
        h = out.get("h")
        if not isinstance(h, int) or isinstance(h, bool):
            raise ReaderError(f"reader refused job dir {self.name}: {out.get('error')}")
        self.ch, self.h = ch, h
        self.gen += 1

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.ch is None or not self.ch.alive:
            self.ch = None
            self.attach()
        assert self.ch is not None
        return self.ch.call({**req, "h": self.h})

    def names(self) -> list[str]:
        out = self._call({"op": "list"}).get("names")
        if not isinstance(out, list):
            raise ReaderError("malformed listing")
        return [n for n in out if isinstance(n, str) and jobdir.SAFE_NAME.match(n)][: jobdir.MAX_NAMES]

    def job_info(self) -> dict[str, object]:
        info = self._call({"op": "job_json"}).get("info")
        if not isinstance(info, dict):
            return {}
        raw = {k: info.get(k) for k in jobdir.JOB_KEYS}
        # the same typing rule as the reader's: nothing else passes
        import json as _json

        return jobdir.job_info_from_bytes(_json.dumps({k: v for k, v in raw.items() if v is not None}).encode())

    def inode(self, name: str) -> int | None:
        out = self._call({"op": "stat", "name": name})
        ino = out.get("ino")
        return ino if isinstance(ino, int) and not isinstance(ino, bool) else None

    def open_record(self, name: str) -> RecordInfo | str:
        """The record, or why it was refused (a string)."""
        out = self._call({"op": "rec_open", "name": name})
        if "r" not in out:
            return str(out.get("reject") or out.get("error") or "refused")[:300]
        try:
            info = RecordInfo(
                r=w_int(out.get("r")), ino=w_int(out.get("ino")), dev=w_int(out.get("dev")),
                uid=w_int(out.get("uid"), 0, 1 << 32), snap=snapshot_from_doc(out.get("snap"), name),
            )
        except WireError as exc:
            raise ReaderError(f"malformed record answer: {exc}") from None
        if info.uid != self.uid:
            self.close_record(info.r)
            return f"owned by uid {info.uid}, not by the job dir's owner (uid {self.uid})"
        return info

    def read_record(self, r: int, since: int, path: str) -> RecordSnapshot:
        out = self._call({"op": "rec_read", "r": r, "since": since})
        if "unreadable" in out:
            raise RecordFormatError(str(out["unreadable"])[:300])
        if "snap" not in out:
            raise ReaderError(str(out.get("error"))[:300])
        try:
            return snapshot_from_doc(out["snap"], path)
        except WireError as exc:
            raise ReaderError(f"malformed snapshot: {exc}") from None

    def read_many(self, reads: list[tuple[int, int, str]]) -> list[RecordSnapshot | Exception]:
        """``read_record`` for many records in one exchange: per record its snapshot, or the error it would
        have raised (RecordFormatError: unreadable this poll; ReaderError: malformed). ReaderError when the
        reader cannot answer at all."""
        out = self._call({"op": "rec_read_many", "reads": [[r, since] for r, since, _ in reads]}).get("snaps")
        if not isinstance(out, list) or len(out) != len(reads):
            raise ReaderError("malformed batch answer")
        got: list[RecordSnapshot | Exception] = []
        for (_, _, path), item in zip(reads, out, strict=True):
            if not isinstance(item, dict):
                got.append(ReaderError("malformed answer"))
            elif "unreadable" in item:
                got.append(RecordFormatError(str(item["unreadable"])[:300]))
            elif "snap" not in item:
                got.append(ReaderError(str(item.get("error"))[:300]))
            else:
                try:
                    got.append(snapshot_from_doc(item["snap"], path))
                except WireError as exc:
                    got.append(ReaderError(f"malformed snapshot: {exc}"))
        return got

    def replaced_many(self, rs: list[int]) -> list[bool]:
        """``replaced`` for many records at once (all False when the reader cannot answer)."""
        try:
            out = self._call({"op": "rec_replaced_many", "rs": rs}).get("replaced")
        except ReaderError:
            return [False] * len(rs)
        if not isinstance(out, list) or len(out) != len(rs):
            return [False] * len(rs)
        return [x is True for x in out]

    def replaced(self, r: int) -> bool:
        try:
            return self._call({"op": "rec_replaced", "r": r}).get("replaced") is True
        except ReaderError:
            return False

    def close_record(self, r: int) -> None:
        with contextlib.suppress(ReaderError):
            self._call({"op": "rec_close", "r": r})

    def signals(self, pids: list[int]) -> dict[int, RankCounters]:
        """Each live rank process's host counters, read by the owner's reader and checked here; a pid it
        could not read is left out. ReaderError when the reader cannot answer."""
        from .signals import counters_from_doc

        out = self._call({"op": "signals", "pids": pids}).get("ranks")
        if not isinstance(out, dict):
            raise ReaderError("malformed signals answer")
        got: dict[int, RankCounters] = {}
        for pid in pids:
            doc = out.get(str(pid))
            if doc is None:
                continue
            try:
                got[pid] = counters_from_doc(doc)
            except WireError as exc:
                raise ReaderError(f"malformed signals answer: {exc}") from None
        return got

    def remove_dumps(self, older_than_s: float = 0.0) -> int:
        out = self._call({"op": "remove_dumps", "older_than_s": older_than_s}).get("removed")
        return out if isinstance(out, int) and not isinstance(out, bool) else 0

    def remove_finished(self, inodes: Iterable[int]) -> tuple[int, bool]:
        out = self._call({"op": "remove_finished", "inodes": list(inodes)})
        removed, empty = out.get("removed"), out.get("empty")
        return (removed if isinstance(removed, int) and not isinstance(removed, bool) else 0), empty is True

    def close(self) -> None:
        if self.ch is not None and self.ch.alive:
            with contextlib.suppress(ReaderError):
                self.ch.call({"op": "close_job", "h": self.h})
        jobdir.close_quietly(self.fd)


_default: Readers | None = None
_default_lock = threading.Lock()


def default_readers() -> Readers:
    """The process's readers (one zygote per process), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Readers()
        return _default


