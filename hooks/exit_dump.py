"""The flight recorder written at a rank's end: when its script ends with an exception (the crash mark's moment)
or when it is sent SIGTERM (torchrun stopping the survivors of a failed rank).

Why: a collective mismatch ends a whole job within a fraction of a second. gloo aborts the rank that receives a
message of the wrong size (SIGABRT: no mark, no dump), its peers raise "Connection reset by peer", and torchrun,
which looks at its workers every 0.1 s, SIGTERMs the rest — all before the daemon's next poll (0.5 s), so no
responder is ever asked. What each rank issued (op, sizes, dtypes at each sequence number) lives only in its
flight recorder; written here as the process ends, the incident reads it for the ranks that are gone
(``rankwatch.watchdog.evidence.capture.exit_dumps``) and the collective-mismatch check can name the odd one.

Where: ``<job dir>/dumps/exit-<pid>/rank-<g>.fr.json``, torch's own JSON dump (the one the responder sends),
written whole or not at all (``files.atomic_write_in``). The pid in the name: a restarted rank's dump is never
read for its predecessor. The job's dump clean-up (the daemon's ``remove_dumps``, ``rankwatch run``'s end) removes
it with the rest of the job's files.

Never at a cost to the exit: the dump runs on a thread of its own, joined for at most ``ExitDumpPolicy.deadline_s``
(then abandoned: a daemon thread does not hold up the interpreter's exit); every error is swallowed. SIGTERM keeps
its meaning: the handler dumps, puts the default action back and sends SIGTERM again, so the rank still dies by
that signal. The handler is installed only where SIGTERM had the default action (a job's own handler stays, and
one the job installs later replaces it); it is run by a watcher thread woken through ``signal.set_wakeup_fd``,
because a training thread blocked in a collective (a C++ wait) never runs a Python signal handler. A process
forked from the rank (a DataLoader worker) drops all of it at the fork. One limit: a rank whose training thread
holds the GIL inside a C call cannot run any Python, so SIGTERM then waits for the launcher's SIGKILL, as SIGINT
always has there.

Standard library only: this module runs inside training processes (torch is used only where already imported).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from dataclasses import dataclass

from .files import atomic_write_in
from .responder import flight_recorder_json

DUMPS_DIR = "dumps"


@dataclass(frozen=True)
class ExitDumpPolicy:
    # torch writes a 2000-entry gloo trace in about 10 ms; an ending rank must not wait long for it (torchrun
    # SIGKILLs 30 s after its SIGTERM, rankwatch's --on-stall kill 5 s after), and the dump is only evidence
    deadline_s: float = 2.0
    # the daemon refuses a larger dump (evidence.fr_dump.MAX_DUMP_BYTES); writing it would only fill /dev/shm
    max_bytes: int = 64 << 20


POLICY = ExitDumpPolicy()


def exit_dir(pid: int) -> str:
    """The dir under ``dumps/`` that holds what process ``pid`` wrote at its end."""
    return f"exit-{pid}"


def dump_name(rank: int) -> str:
    return f"rank-{rank}.fr.json"


class _State:
    """Where this rank dumps, and whether it did; one lock orders the exception path, the signal handler and
    the watcher thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.job_dir: str | None = None
        self.rank = -1
        self.pid = -1
        self.done = False
        self.busy_thread: int | None = None  # the thread dumping right now
        self.term_pending = False  # SIGTERM came while this thread was dumping: die once the dump is written
        self.pipe: tuple[int, int] | None = None


_state = _State()


ENV = "RANKWATCH_EXIT_DUMP"
"""``0``: no dump at the end at all; ``exception``: only on an exception (SIGTERM keeps its default action — for a
job whose teardown must never wait on a training thread that holds the GIL in C); unset or anything else: both."""


def arm(job_dir: str, rank: int, policy: ExitDumpPolicy = POLICY) -> None:
    """Dump at this process's end from now on: on an exception (``dump_now``, called by the crash mark) and on
    SIGTERM where its action is the default (``ENV`` turns either off). Never raises."""
    try:
        mode = os.environ.get(ENV, "").strip().lower()
        if mode == "0":
            return
        _state.job_dir, _state.rank, _state.pid = job_dir, rank, os.getpid()
        os.register_at_fork(after_in_child=_disarm_in_child)
        if mode != "exception":
            _install_sigterm(policy)
    except Exception:
        pass


def dump_now(policy: ExitDumpPolicy = POLICY) -> bool:
    """Write this rank's flight recorder once, within ``policy.deadline_s``; True when it is written (now or
    before). Never raises. Waits for a dump another thread is writing; returns at once when called again on the
    thread that is writing (a signal handler run in the middle of it)."""
    st = _state
    if st.job_dir is None or st.pid != os.getpid():
        return False
    me = threading.get_ident()
    if st.busy_thread == me:
        return False
    if not st.lock.acquire(timeout=policy.deadline_s):
        return False
    try:
        if st.done:
            return True
        st.busy_thread = me
        try:
            st.done = _write(st.job_dir, st.rank, st.pid, policy)
        finally:
            st.busy_thread = None
        return st.done
    except Exception:
        return False
    finally:
        st.lock.release()
        if st.term_pending:
            _die_by_sigterm()


def _write(job_dir: str, rank: int, pid: int, policy: ExitDumpPolicy) -> bool:
    """torch's dump on a thread of its own (a C++ call that may block), then written whole or not at all."""
    got: list[bytes | None] = [None]

    def take() -> None:
        with contextlib.suppress(Exception):
            got[0] = flight_recorder_json()[0]

    t = threading.Thread(target=take, name="rankwatch-exit-dump", daemon=True)
    t.start()
    t.join(policy.deadline_s)
    data = got[0]
    if t.is_alive() or not data or len(data) > policy.max_bytes:
        return False
    dumps = os.path.join(job_dir, DUMPS_DIR)
    mine = os.path.join(dumps, exit_dir(pid))
    for d in (dumps, mine):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)
    atomic_write_in(mine, dump_name(rank), data)
    return True


def _on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM, on the training thread (when it runs Python): dump, then die by SIGTERM. A dump this thread is
    writing right now finishes first (``dump_now`` dies when it is done)."""
    if _state.busy_thread == threading.get_ident():
        _state.term_pending = True
        return
    dump_now()
    _die_by_sigterm()


def _die_by_sigterm() -> None:
    """Put SIGTERM's default action back and send it again: the rank ends as it would have without rankwatch
    (killed by SIGTERM, the exit status its launcher reports). From any thread: ``signal.signal`` may be called
    only on the main one, so elsewhere libc's ``signal`` sets the process-wide action."""
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
            libc.signal.restype = ctypes.c_void_p
            libc.signal(int(signal.SIGTERM), None)  # SIG_DFL
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm(policy: ExitDumpPolicy) -> None:
    """The handler and its watcher, only on the main thread and only where SIGTERM's action is the default and
    nobody set a wakeup fd (asyncio's: left alone, and then no handler either)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        return
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
        return
    os.set_blocking(r, True)
    _state.pipe = (r, w)
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Thread(target=_watch, args=(r,), name="rankwatch-sigterm", daemon=True).start()


def _watch(fd: int) -> None:
    """Woken by every signal Python handles (the wakeup fd gets each one's number): on SIGTERM, while the handler
    is still ours, dump and die — the training thread may be blocked in C++ and never run the handler itself."""
    while True:
        try:
            data = os.read(fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if (int(signal.SIGTERM) in data and _state.pid == os.getpid()
                and signal.getsignal(signal.SIGTERM) is _on_sigterm):
            dump_now()
            _die_by_sigterm()


def _disarm_in_child() -> None:
    """A fork of the rank (a DataLoader worker) is no rank: its signals must not reach the rank's watcher
    through the inherited pipe, nor its own SIGTERM run the rank's handler."""
    st = _state
    st.job_dir = None
    with contextlib.suppress(Exception):
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if st.pipe is not None:
        with contextlib.suppress(Exception):
            previous = signal.set_wakeup_fd(-1)
            if previous not in (-1, st.pipe[1]):
                signal.set_wakeup_fd(previous)  # someone else's, set after ours: theirs to keep
        for fd in st.pipe:
            with contextlib.suppress(OSError):
                os.close(fd)
        st.pipe = None
