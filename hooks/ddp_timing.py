"""DDP backward timing: split ``backward`` into this rank's own work and ``grad_sync`` (the wait).

Under ``DistributedDataParallel`` a rank's ``backward`` is its own gradient compute *plus* the wait for
the gradient all-reduce, which cannot finish before the slowest rank has produced its gradients. So a
rank whose extra work is inside backward (a slow gradient hook) looks exactly like the ranks waiting
for it. To tell them apart this module notes the moment the autograd graph of the backward has
finished computing on this rank, i.e. when its last gradient (hence last bucket) was ready; at backward
exit (on the training thread) the tracker moves the tail ``backward end - graph done`` from ``backward``
into ``grad_sync``. The phases still add up to the step.

Mechanism: an autograd *engine callback*, queued from a hook registered once per DDP model. When a
DDP model is constructed (its ``__init__`` is wrapped thinly), one of its parameters gets a
post-accumulate-grad hook. During a backward that will all-reduce, that hook queues ``stamp`` with
``Variable._execution_engine.queue_callback``; final callbacks run FIFO once the graph task has finished
computing. DDP's reducer queues its own finalize callback (which waits for the bucket all-reduces and
copies the averaged gradients back) only when its last bucket becomes ready, from its post hook on a
gradient accumulator; a tensor's post-accumulate-grad hooks run inside ``AccumulateGrad`` before the
node's post hooks, so even when our parameter is the last one ready, ``stamp`` is queued first and runs
before the wait. Cost per backward: the one hook call and the callback, independent of the number of
buckets; nothing is registered or removed per step; no communication hook, so user, built-in and
mixed-precision comm hooks and ``join()`` are untouched.

Only backward passes through a DDP model that will all-reduce are split: the hook reads DDP's own
``require_forward_param_sync``, which DDP's forward sets when it prepared the reducer for a backward
(grad enabled, not under ``no_sync()``) and clears otherwise. The compiled-autograd Python reducer
(which queues its wait differently) gets no hook. Plain models, FSDP (whose final callback also waits)
and ``no_sync()`` steps keep ``backward`` whole. Only the outermost backward is split (a reentrant one,
e.g. activation checkpointing, is left alone); a step whose hooked parameter got no gradient (unused
with ``find_unused_parameters``) keeps its backward whole.

The hook and the callback may run on an autograd device thread (CUDA): they only store fields of this
object (``waiting``, ``ready_ns``: C fields of ``_fastpath.PhaseState`` where built, and the hook and the
callback are C too), no shm write, no lock. Everything that touches the record
happens at backward exit on the training thread.

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
import warnings
import weakref
from typing import Any

from .record import NO_PHASE
from .tracker import PhaseState, Tracker

try:
    from ._fastpath import GradReady
except ImportError:  # not built: the Python hook below
    GradReady = None  # type: ignore[assignment, misc]

_active: DDPTiming | None = None

ENV = "RANKWATCH_DDP_TIMING"
GRAD_SYNC = "grad_sync"


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _py_grad_ready(timing: DDPTiming, ref: Any, queue: Any) -> Any:
    """The parameter's hook (a weak reference: the hook never keeps its model alive); ``_fastpath.GradReady``
    is the same in C, used where it was built."""
    stamp = timing._stamp

    def accumulated(param: Any) -> None:
        # only the outermost backward, once, and only when DDP's forward prepared this backward's all-reduce
        if timing.waiting and timing.depth == 1:
            try:
                ddp = ref()
                if ddp is not None and ddp.require_forward_param_sync:
                    timing.waiting = False
                    queue(stamp)
            except Exception as exc:
                timing._error = exc

    return accumulated


class DDPTiming(PhaseState):
    """Per-process backward timing. ``begin()``/``end()`` are called around backward by instrument.py. Its
    state is ``PhaseState``'s fields where the C core was built (the C backward wrapper and hook read them
    directly)."""

    def __init__(self, tracker: Tracker, queue_callback: Any) -> None:
        self.tracker = tracker
        self.enabled = True
        self._queue_callback = queue_callback  # Variable._execution_engine.queue_callback
        # end of the running backward's graph (0: not yet); written by _stamp(), possibly on another thread
        self.ready_ns = 0
        # the outermost backward on the training thread is running and has not queued its stamp yet
        self.waiting = False
        self.grad_sync_slot = NO_PHASE
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()  # DDP instances seen (tests, debugging)
        self.split_count = 0  # backward passes split so far (tests, debugging)
        self.depth = 0  # backward nesting on the training thread
        self._error: BaseException | None = None  # raised on an autograd thread, reported at exit

    def _fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"rankwatch: DDP backward timing disabled after an error: {exc!r}", RuntimeWarning, stacklevel=3
            )

    # -- called from the wrapped DDP.__init__ (any thread) -----------------------------------------
    def constructed(self, ddp: Any) -> None:
        """One post-accumulate-grad hook on the model's last trainable parameter, for its lifetime."""
        try:
            if not self.enabled or getattr(ddp, "_use_python_reducer", False):
                return
            param = None
            ignored = getattr(ddp, "parameters_to_ignore", ())  # DDP never all-reduces these: no signal
            for name, p in ddp.module.named_parameters():
                if p.requires_grad and name not in ignored:
                    param = p
            if param is None:
                return
            if self.grad_sync_slot < 0 and self.tracker.on_thread():
                self.grad_sync_slot = self.tracker.slot(GRAD_SYNC)
            param.register_post_accumulate_grad_hook(self._accumulated_hook(weakref.ref(ddp)))
            self.models.add(ddp)
        except Exception as exc:
            self._fail(exc)

    # -- engine side (autograd thread: attributes only) -------------------------------------------
    def _accumulated_hook(self, ref: Any) -> Any:
        if GradReady is not None:  # built: this is a _fastpath.PhaseState
            return GradReady(self, ref, self._queue_callback)
        return _py_grad_ready(self, ref, self._queue_callback)

    # -- called around torch.autograd.backward on the training thread ------------------------------
    def begin(self) -> None:
        """Before a backward (on the tracker's thread); ``end()`` must follow it."""
        self.depth = depth = self.depth + 1
        if depth == 1:
            self.ready_ns = 0
            self.waiting = self.enabled

    def end(self) -> int:
        """After a backward: the split time (0: no split)."""
        self.depth = depth = self.depth - 1
        if depth:
            return 0
        self.waiting = False
        ready = self.ready_ns
        if self._error is not None:
            self._fail(self._error)
            return 0
        if not ready or not self.enabled:
            return 0
        self.ready_ns = 0
        self.split_count += 1
        return ready


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
