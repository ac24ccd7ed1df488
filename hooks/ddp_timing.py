"""DDP backward timing: split ``backward`` into this rank's own work and ``grad_sync`` (the wait).

Under ``DistributedDataParallel`` a rank's ``backward`` is its own gradient compute *plus* the wait for
the gradient all-reduce, which cannot finish before the slowest rank has produced its gradients. So a
rank whose extra work is inside backward (a slow gradient hook) looks exactly like the ranks waiting
for it. To tell them apart this module notes the moment the autograd graph of the backward has
finished computing on this rank, i.e. when its last gradient (hence last bucket) was ready; at backward
exit (on the training thread) the tracker moves the tail ``backward end - graph done`` from ``backward``
into ``grad_sync``. The phases still add up to the step.

Mechanism: an autograd *engine callback*. At backward entry the ``torch.autograd.backward`` wrapper
(instrument.py) puts a pre-hook on the root tensor's ``grad_fn``; the root node runs first, and the
pre-hook queues ``stamp`` with ``Variable._execution_engine.queue_callback``. Final callbacks run FIFO
once the graph task has finished computing. DDP's reducer queues its own finalize callback (which waits
for the bucket all-reduces and copies the averaged gradients back) only when its last bucket becomes
ready, i.e. later than ours, so ``stamp`` runs before the wait. The pre-hook is removed at backward
exit (``retain_graph``). Cost: two Python calls per backward, independent of the number of buckets; no
communication hook, so user, built-in and mixed-precision comm hooks and ``join()`` are untouched.

Only backward passes through a DDP model are split: ``DistributedDataParallel.__init__`` is wrapped
thinly to put a forward pre-hook on each instance; a forward that will all-reduce in its backward
(grad enabled, not under ``no_sync()``, C++ reducer) arms the next backward on the training thread.
Plain models, FSDP (whose final callback also waits) and ``no_sync()`` steps keep ``backward`` whole.
Only the outermost backward is split (a reentrant one, e.g. activation checkpointing, is left alone).

The pre-hook and the callback may run on an autograd device thread (CUDA): they only store an int
(``ready_ns``) in a Python attribute, no shm write, no lock. Everything that touches the record happens
at backward exit on the training thread.

CUDA caveat: the graph is "done" when autograd finished it *on the CPU side* (its kernels are queued,
not necessarily done). When the GPU lags the CPU, the GPU time of the last gradients falls into
``grad_sync`` on every rank, and extra GPU work of a straggler inside backward can appear as its
``grad_sync`` rather than its ``backward``. CPU-side slowness (Python hooks, host syncs) is split right.

``RANKWATCH_DDP_TIMING=0`` turns all of this off. Any internal error disables the timing (with one
warning, from the training thread); training never sees an exception from here.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from typing import Any

from .record import NO_PHASE
from .tracker import Tracker

_active: DDPTiming | None = None

ENV = "RANKWATCH_DDP_TIMING"
GRAD_SYNC = "grad_sync"
_now = time.monotonic_ns


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class DDPTiming:
    """Per-process backward timing. ``begin()``/``end()`` are called around backward by instrument.py."""

    def __init__(self, tracker: Tracker, queue_callback: Any) -> None:
        self.tracker = tracker
        self.enabled = True
        self._queue_callback = queue_callback  # Variable._execution_engine.queue_callback
        # end of the running backward's graph (0: not yet); written by stamp(), possibly on another thread
        self.ready_ns = 0
        self.grad_sync_slot = NO_PHASE
        self.armed = False  # a DDP forward that will all-reduce ran since the last backward
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()  # DDP instances seen (tests, debugging)
        self.split_count = 0  # backward passes split so far (tests, debugging)
        self._depth = 0  # backward nesting on the training thread
        self._handle: Any = None  # the root pre-hook of the running backward
        self._error: BaseException | None = None  # raised on an autograd thread, reported at exit

    def _fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"rankwatch: DDP backward timing disabled after an error: {exc!r}", RuntimeWarning, stacklevel=3
            )

    # -- called from the wrapped DDP.__init__ (any thread) -----------------------------------------
    def constructed(self, ddp: Any) -> None:
        try:
            if self.enabled:
                ddp.register_forward_pre_hook(self._forward_pre)
                self.models.add(ddp)
        except Exception as exc:
            self._fail(exc)

    def _forward_pre(self, ddp: Any, args: Any) -> None:
        # DDP's own condition for reducer.prepare_for_backward(); the compiled-autograd Python reducer
        # queues its wait differently and is left alone
        try:
            if (
                self.enabled
                and ddp.require_backward_grad_sync
                and _grad_enabled()
                and not getattr(ddp, "_use_python_reducer", False)
            ):
                self.armed = True
        except Exception as exc:
            self._error = exc

    # -- engine side (autograd thread: attributes only) -------------------------------------------
    def _stamp(self) -> None:
        self.ready_ns = _now()

    def _root_prehook(self, grad_outputs: Any) -> None:
        try:
            self._queue_callback(self._stamp)
        except Exception as exc:
            self._error = exc

    # -- called around torch.autograd.backward ----------------------------------------------------
    def begin(self, tensors: Any) -> bool:
        """Before a backward. True when ``end()`` must be called after it (on the training thread)."""
        try:
            if not self.enabled or not self.tracker.on_thread():
                return False
            self._depth += 1
        except Exception as exc:
            self._fail(exc)
            return False
        if self._depth > 1 or not self.armed:  # reentrant backward, or not through a DDP model
            return True
        self.armed = False
        try:
            if not self.tracker.enabled:
                return True
            if isinstance(tensors, (list, tuple)):
                tensors = tensors[0] if tensors else None
            grad_fn = getattr(tensors, "grad_fn", None)
            if grad_fn is None:
                return True
            if self.grad_sync_slot < 0:
                self.grad_sync_slot = self.tracker.slot(GRAD_SYNC)
            self.ready_ns = 0
            self._handle = grad_fn.register_prehook(self._root_prehook)
        except Exception as exc:
            self._fail(exc)
        return True

    def end(self) -> int:
        """After a backward for which ``begin()`` returned True: the split time (0: no split)."""
        self._depth -= 1
        if self._depth > 0 or self._handle is None:
            return 0
        handle, self._handle = self._handle, None
        ready, self.ready_ns = self.ready_ns, 0
        try:
            handle.remove()
        except Exception as exc:
            self._fail(exc)
        if self._error is not None:
            self._fail(self._error)
        if not self.enabled or not ready:
            return 0
        self.split_count += 1
        return ready


def _grad_enabled() -> bool:
    global _grad_enabled
    import torch

    # bound once: the forward pre-hook asks on every DDP forward (an import statement per call is ~0.2 µs)
    _grad_enabled = torch.is_grad_enabled
    return bool(torch.is_grad_enabled())


def active() -> DDPTiming | None:
    """The process's timing object once installed (tests and benchmarks)."""
    return _active


def install(tracker: Tracker) -> DDPTiming | None:
    """Wrap DDP's constructor; None when switched off or DDP is unavailable."""
    if not enabled_by_env():
        return None
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.autograd import Variable
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return None
    global _active
    if getattr(DDP.__init__, "__rankwatch_wrapped__", None) is not None:
        return None
    timing = _active = DDPTiming(tracker, Variable._execution_engine.queue_callback)
    orig_init = DDP.__init__

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        timing.constructed(self)

    __init__.__rankwatch_wrapped__ = orig_init  # type: ignore[attr-defined]
    DDP.__init__ = __init__  # type: ignore[method-assign]
    return timing
