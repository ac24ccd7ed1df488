"""Input pipeline timing: how long producing a batch (fetch + collate) takes, where it happens.

Without workers the training thread produces its own batches: the ``dataloader`` phase of a
``_SingleProcessDataLoaderIter`` is booked as production time too (the phase's own clock reads, no
syscall). With workers, each DataLoader worker process times its own ``fetcher.fetch`` and adds the
result to its slot of the rank's record (``RecordLayout.input_slots``, one [ns, batches] pair per
worker, written by that worker only); the training thread sums the slots at step end — plain memory
reads, no syscall, no lock. The worker finds the record through a picklable ``worker_init_fn`` wrapper
(works with fork, spawn and forkserver), which calls the script's own ``worker_init_fn`` afterwards. A
worker that cannot open the record trains on unwatched.

Why: with workers, time in ``dataloader`` on the training thread is only the wait for the pipeline, and
which rank waits there (rather than in ``grad_sync``) is an accident of phase. The pipeline's own time
tells an input-bound job (every rank's pipeline slow) from an input straggler (one rank's).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

from .record import INPUT_SLOTS, RECORD_SIZE, RecordLayout
from .tracker import Tracker

_SLOTS_OFFSET = RecordLayout.input_slots.offset
_worker_slot: Any = None  # this worker process's [ns, batches] pair in the record (ctypes array)


class WorkerTiming:
    """``worker_init_fn`` that attaches a DataLoader worker to its rank's record, then runs the script's own."""

    def __init__(self, path: str, inode: int, slot: int, user_fn: Callable[[int], None] | None) -> None:
        self.path = path
        self.inode = inode
        self.slot = slot
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        try:
            _attach(self.path, self.inode, (self.slot + worker_id) % INPUT_SLOTS)
        except Exception:
            pass  # timing is optional; the worker itself must never fail over it
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _attach(path: str, inode: int, slot: int) -> None:
    global _worker_slot
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_ino != inode or st.st_size < RECORD_SIZE:
            return  # not the record this rank writes (replaced under us): stay unattached
        mapping = mmap.mmap(fd, RECORD_SIZE)
    finally:
        os.close(fd)
    _worker_slot = (ctypes.c_uint64 * 2).from_buffer(mapping, _SLOTS_OFFSET + 16 * slot)
    _patch_fetchers()


def _patch_fetchers() -> None:
    """Time every ``fetch`` (index → dataset items → collate) in this worker process, once."""
    from torch.utils.data._utils import fetch

    for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
        original = cls.fetch
        if getattr(original, "__rankwatch_wrapped__", None) is not None:
            continue

        def timed(self: Any, index: Any, _original: Callable[..., Any] = original) -> Any:
            t0 = time.monotonic_ns()
            out = _original(self, index)
            slot = _worker_slot
            if slot is not None:
                slot[0] += time.monotonic_ns() - t0
                slot[1] += 1
            return out

        timed.__rankwatch_wrapped__ = original  # type: ignore[attr-defined]
        cls.fetch = timed  # type: ignore[method-assign]


def install(tracker: Tracker, dl: Any) -> None:
    """Hand DataLoader workers their record slots. Batches made on the training thread (no workers) are
    timed by the ``__next__`` wrapper itself (``instrument._wrap_next``): with no workers the
    ``dataloader`` phase *is* the batch's production, and its two clock reads serve both."""
    multi = dl._MultiProcessingDataLoaderIter
    init = multi.__init__
    path = tracker._writer.path
    try:
        inode = os.stat(path).st_ino
    except OSError:
        return  # no record to point workers at: main-process timing only

    @functools.wraps(init)
    def timed_init(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        user_fn = loader.worker_init_fn
        wrapped = False
        if tracker.enabled and tracker.on_thread() and not isinstance(user_fn, WorkerTiming):
            try:
                slot = tracker.input_worker_slots(max(0, int(loader.num_workers)))
                loader.worker_init_fn = WorkerTiming(path, inode, slot, user_fn)
                wrapped = True
            except Exception:
                wrapped = False
        try:
            init(self, loader, *args, **kwargs)
        finally:
            if wrapped:
                loader.worker_init_fn = user_fn  # the script sees its own function again

    timed_init.__rankwatch_wrapped__ = init  # type: ignore[attr-defined]
    multi.__init__ = timed_init
