"""The explicit API: ``init()``, ``phase(name, budget_s=…)``, ``step()``.

Everything here degrades to a no-op: if the shm dir is unusable the hook warns once and training goes
on untouched. Only the process that called ``init()`` records (never DataLoader workers or forks).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from types import TracebackType

from . import exit_dump
from .files import atomic_write
from .jobinfo import job_id as env_job_id
from .jobinfo import rank_identity, sanitize_job_id
from .jobinfo import shm_dir as env_shm_dir
from .record import CANONICAL_PHASES, RankIdentity, RecordWriter, record_path, write_identity
from .responder import DumpResponder, install_faulthandler
from .shmdir import ensure_job_dir
from .tracker import Tracker

_tracker: Tracker | None = None
_init_attempted = False


def current() -> Tracker | None:
    return _tracker


def _drop_in_child() -> None:
    global _tracker
    if _tracker is not None:
        _tracker.enabled = False
    _tracker = None


os.register_at_fork(after_in_child=_drop_in_child)


def _write_job_json(job_dir: str, job: str, ident: dict[str, int]) -> None:
    path = os.path.join(job_dir, "job.json")
    if os.path.exists(path):
        return
    info = {
        "schema": "rankwatch.job/1",
        "job_id": job,
        "world_size": ident["world_size"],
        "node_rank": ident["node_rank"],
        "local_world_size": ident["local_world_size"],
        "hostname": socket.gethostname(),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "master_port": os.environ.get("MASTER_PORT"),
        "created_unix": time.time(),
    }
    atomic_write(path, json.dumps(info).encode())


RECORDING_ENV = "RANKWATCH_RECORDING_PID"


def _run_path_worker() -> bool:
    """torchrun --run-path starts each rank as a multiprocessing child of its agent: a rank, unlike the
    children of a rank (dataloader workers), which inherit the recording rank's ``RECORDING_ENV``."""
    return "RANK" in os.environ and "LOCAL_RANK" in os.environ and RECORDING_ENV not in os.environ


def init(shm_dir: str | None = None, job_id: str | None = None) -> bool:
    """Create this rank's record and start recording; True when recording. Safe to call twice."""
    global _tracker, _init_attempted
    if _tracker is not None:
        return True
    if os.environ.get("RANKWATCH_DISABLE") == "1" or (
        multiprocessing.parent_process() is not None and not _run_path_worker()
    ):
        return False
    if _init_attempted:  # an earlier call failed and warned (once), or this is a fork of the recording process
        return False
    _init_attempted = True
    try:
        base = shm_dir or env_shm_dir()
        job = sanitize_job_id(job_id) if job_id else env_job_id()
        ident = rank_identity()
        # the base is shared by every user (01777, like /tmp); the job dir must be ours and 0700
        job_dir = ensure_job_dir(base, job)
        writer = RecordWriter(record_path(base, job, ident["global_rank"]))
        write_identity(
            writer,
            RankIdentity(
                pid=os.getpid(),
                hostname=socket.gethostname(),
                job_id=job,
                device=-1,
                start_ns=time.monotonic_ns(),
                **ident,
            ),
            list(CANONICAL_PHASES),
        )
        tracker = Tracker(writer)
        if ident["local_rank"] == 0:
            _write_job_json(job_dir, job, ident)
    except Exception as exc:
        warnings.warn(
            f"rankwatch: cannot create the shm record ({exc}); training continues without rankwatch",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    _tracker = tracker
    os.environ[RECORDING_ENV] = str(os.getpid())  # inherited: this rank's own children are not ranks
    atexit.register(tracker.mark_exit)
    _chain_excepthook(tracker)
    try:
        DumpResponder(job_dir, ident["global_rank"]).start()
    except Exception as exc:
        warnings.warn(f"rankwatch: dump responder unavailable ({exc})", RuntimeWarning, stacklevel=2)
    install_faulthandler(job_dir, ident["global_rank"])
    exit_dump.arm(job_dir, ident["global_rank"])
    return True


def _chain_excepthook(tracker: Tracker) -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            tracker.mark_crashed(crash_text(exc))
            exit_dump.dump_now()  # after the mark: a SIGTERM during the dump must not cost the rank its cause
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    previous_thread = threading.excepthook

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        # a helper thread (prefetch, I/O, a queue's producer) dying: the training loop that waits on it hangs
        # with no error of its own, so its exception is the cause the daemon must see
        if args.exc_type is not SystemExit and args.thread is not threading.main_thread() and args.exc_value:
            name = args.thread.name if args.thread is not None else "?"
            tracker.mark_thread_died(f"thread {name}: {crash_text(args.exc_value)}")
        previous_thread(args)

    threading.excepthook = thread_hook


def crash_text(exc: BaseException) -> str:
    """What the crash mark says: the exception's type and the start of its message."""
    return f"{type(exc).__name__}: {str(exc)[:400]}"


def mark_crashed(info: str = "") -> None:
    """The script is ending with an exception or a non-zero exit: the mark, then the flight recorder for the
    daemon to read once the rank is gone (``exit_dump``: a peer's mismatch is often told only by it)."""
    if _tracker is not None:
        _tracker.mark_crashed(info)
        exit_dump.dump_now()


class _NullPhase(contextlib.AbstractContextManager[None]):
    def __exit__(self, *exc: object) -> None:
        return None


@contextlib.contextmanager
def _tracked(tracker: Tracker, slot: int, budget_s: float) -> Iterator[None]:
    tracker.enter(slot, budget_s)
    try:
        yield
    except BaseException:
        tracker.exit(slot, failing=True)
        raise
    tracker.exit(slot)


def phase(name: str, budget_s: float = 0.0) -> contextlib.AbstractContextManager[None]:
    """Time a block as phase ``name``; ``budget_s`` tells the daemon how long it may legitimately take."""
    tracker = _tracker
    if tracker is None:
        return _NullPhase()
    slot = tracker.slot(str(name))
    return _tracked(tracker, slot, float(budget_s))


def step() -> None:
    """Mark a step boundary. Once called, the automatic (optimizer) step boundary is switched off."""
    tracker = _tracker
    if tracker is not None:
        tracker.step(explicit=True)
