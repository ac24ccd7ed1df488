"""DDP gradient-bucket timing: split ``backward`` into this rank's own work and ``grad_sync`` (the wait).

Under ``DistributedDataParallel`` a rank's ``backward`` is its own gradient compute *plus* the wait for
the gradient all-reduce, which cannot finish before the slowest rank has produced its gradients. So a
rank whose extra work is inside backward (a slow gradient hook) looks exactly like the ranks waiting
for it. To tell them apart this module registers a DDP communication hook that notes when each
gradient bucket becomes ready on this rank, then does exactly what DDP does without a hook (mirror of
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``: divide the bucket's
flattened gradient by the process group's size, all-reduce it asynchronously with the *unwrapped*
``distributed_c10d.all_reduce`` so rankwatch's own collective timing does not count it). DDP launches
buckets strictly in index order, so the last hook call of a backward is the moment all of this rank's
gradients were ready. At backward exit (on the training thread) the tracker moves the tail
``backward end - last bucket ready`` from ``backward`` into ``grad_sync``; the phases still add up to
the step.

Registration, chosen to never change behaviour:

* ``DistributedDataParallel.__init__`` is wrapped thinly to remember the instance; the hook is
  registered lazily at the *first backward* on the training thread, the latest safe point (after the
  usual place where scripts register their own hook). It is not registered when a hook is already there
  (the user's, DDP's mixed-precision hook, a built-in hook: the reducer refuses a second one and the
  error is caught), with the compiled-autograd Python reducer (it calls hooks with a different bucket
  type), with sparse gradients, or under ``join(divide_by_initial_world_size=False)`` (DDP then divides
  by the number of ranks not yet joined, which a Python hook cannot know). Timing is then simply
  absent for that model; ``backward`` stays whole.
* If the script registers its own hook *after* ours (after the first backward), the reducer would
  raise. ``register_comm_hook`` is wrapped so the user's hook runs inside ours instead, with every
  Python-side effect of the original call kept (checks, logging name, ``_comm_hooks``). A late
  ``_register_builtin_comm_hook(ALLREDUCE)`` keeps ours (identical maths); ``FP16_COMPRESS`` runs
  ``default_hooks.fp16_compress_hook``, its documented Python equivalent.
* Remaining difference: if ``join(divide_by_initial_world_size=False)`` is entered only after the first
  backward, gradients are divided by the full group size while ranks have joined (documented gap).

The comm hook may run on an autograd thread (CUDA). It only stores an int (``ready_ns``): no shm
write, no lock. Everything that touches the record happens at backward exit on the training thread.

CUDA caveat: the hook is called when autograd has finished the bucket *on the CPU side* (its kernels
are queued, not necessarily done). When the GPU lags the CPU, the GPU time of the last gradients falls
into ``grad_sync`` on every rank, and extra GPU work of a straggler inside backward can appear as its
``grad_sync`` rather than its ``backward``. CPU-side slowness (Python hooks, host syncs) is split right.

``RANKWATCH_DDP_TIMING=0`` turns all of this off. Any internal error disables the timing (with one
warning); the all-reduce itself keeps running as DDP's default would.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from .record import NO_PHASE
from .tracker import Tracker

_c10d: Any = None  # torch.distributed.distributed_c10d, bound by install() (this module imports no torch)
_active: DDPTiming | None = None

ENV = "RANKWATCH_DDP_TIMING"
GRAD_SYNC = "grad_sync"
_now = time.monotonic_ns


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class _HookState:
    """State passed to the comm hook: the timing object, DDP's process group, an optional delegate."""

    __slots__ = ("delegate", "process_group", "timing")

    def __init__(self, timing: DDPTiming, process_group: Any) -> None:
        self.timing = timing
        self.process_group = process_group
        # (state, hook) of a hook the script registered after ours: it replaces the default all-reduce
        self.delegate: tuple[Any, Callable[..., Any]] | None = None


def _allreduce_mean(process_group: Any, tensor: Any) -> Any:
    """``default_hooks._allreduce_fut`` with the unwrapped c10d all_reduce."""
    c10d = _c10d
    group = process_group if process_group is not None else c10d.group.WORLD
    tensor.div_(group.size())
    return c10d.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def comm_hook(state: _HookState, bucket: Any) -> Any:
    """Note when this bucket is ready on this rank, then reduce it as DDP's default (or the delegate) would."""
    state.timing.ready_ns = _now()
    delegate = state.delegate
    if delegate is not None:
        return delegate[1](delegate[0], bucket)
    return _allreduce_mean(state.process_group, bucket.buffer())


class DDPTiming:
    """Per-process bucket timing. ``begin()``/``split_ns()`` are called around backward by instrument.py."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.enabled = True
        # latest bucket-ready time of the running backward (0: none yet); written by the comm hook
        self.ready_ns = 0
        self.grad_sync_slot = NO_PHASE
        self._pending: list[weakref.ReferenceType[Any]] = []
        self.states: weakref.WeakKeyDictionary[Any, _HookState] = weakref.WeakKeyDictionary()
        self.skipped: list[str] = []  # why a model got no timing (for tests and debugging)

    def _fail(self, exc: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            warnings.warn(
                f"rankwatch: DDP bucket timing disabled after an error: {exc!r}", RuntimeWarning, stacklevel=3
            )

    # -- called from the wrapped DDP.__init__ (any thread) -----------------------------------------
    def constructed(self, ddp: Any) -> None:
        try:
            if self.enabled:
                self._pending.append(weakref.ref(ddp))
        except Exception as exc:
            self._fail(exc)

    # -- called around torch.autograd.backward ----------------------------------------------------
    def begin(self) -> None:
        """Before a backward: register on models built since the last one; forget the previous backward."""
        self.ready_ns = 0
        if self._pending and self.enabled:
            try:
                if not self.tracker.enabled or not self.tracker.on_thread():
                    return
                pending, self._pending = self._pending, []
                for ref in pending:
                    ddp = ref()
                    if ddp is not None:
                        self._register(ddp)
            except Exception as exc:
                self._fail(exc)

    def split_ns(self) -> int:
        """When this rank's last gradient bucket of the backward just ended became ready (0: unknown)."""
        return self.ready_ns if self.enabled else 0

    # -- registration -----------------------------------------------------------------------------
    def _skip_reason(self, ddp: Any) -> str | None:
        if getattr(ddp, "_use_python_reducer", False):
            return "compiled-autograd python reducer"
        if getattr(ddp, "mixed_precision", None) is not None:
            return "DDP mixed precision registers its own hook"
        if getattr(ddp, "_comm_hooks", None):
            return "the script registered a comm hook"
        if getattr(ddp, "_divide_by_initial_world_size", True) is False:
            return "join(divide_by_initial_world_size=False)"
        if getattr(ddp, "reducer", None) is None:
            return "no reducer"
        module = getattr(ddp, "module", None)
        if module is not None and any(getattr(m, "sparse", False) is True for m in module.modules()):
            return "sparse gradients"
        return None

    def _register(self, ddp: Any) -> None:
        import torch.distributed as dist

        reason = self._skip_reason(ddp)
        if reason is None:
            state = _HookState(self, getattr(ddp, "process_group", None))
            try:
                # straight to the reducer: DDP's Python side (logging name, _comm_hooks) stays as without us
                dist._register_comm_hook(ddp.reducer, state, comm_hook)
            except RuntimeError as exc:  # a hook is already registered (e.g. a built-in one)
                reason = f"reducer refused the hook: {exc}"
            else:
                self.states[ddp] = state
                if self.grad_sync_slot < 0:
                    self.grad_sync_slot = self.tracker.slot(GRAD_SYNC)
                return
        self.skipped.append(reason)

    # -- late registrations by the script ----------------------------------------------------------
    def late_hook(self, ddp: Any, state: Any, hook: Callable[..., Any]) -> bool:
        """The script registers a hook after ours: run it inside ours. False when ours is not on ``ddp``."""
        ours = self.states.get(ddp)
        if ours is None:
            return False
        ours.delegate = (state, hook)
        return True


def active() -> DDPTiming | None:
    """The process's timing object once installed (tests and benchmarks look at ``states``)."""
    return _active


def install(tracker: Tracker) -> DDPTiming | None:
    """Wrap DDP's constructor and hook registration; None when switched off or DDP is unavailable."""
    if not enabled_by_env():
        return None
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.nn.parallel import DistributedDataParallel as DDP
    except Exception:
        return None
    global _c10d, _active
    if getattr(DDP.__init__, "__rankwatch_wrapped__", None) is not None:
        return None
    from torch.distributed import distributed_c10d

    _c10d = distributed_c10d
    timing = _active = DDPTiming(tracker)
    orig_init = DDP.__init__
    orig_register = DDP.register_comm_hook
    orig_builtin = getattr(DDP, "_register_builtin_comm_hook", None)

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        timing.constructed(self)

    @functools.wraps(orig_register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        if self not in timing.states:
            return orig_register(self, state, hook)
        try:
            # keeps every Python-side effect (checks, logging name, _comm_hooks); the reducer then refuses
            orig_register(self, state, hook)
        except RuntimeError:
            hooks = getattr(self, "_comm_hooks", None)
            if not (hooks and hooks[-1][0] is hook and timing.late_hook(self, state, hook)):
                raise
        return None

    __init__.__rankwatch_wrapped__ = orig_init  # type: ignore[attr-defined]
    register_comm_hook.__rankwatch_wrapped__ = orig_register  # type: ignore[attr-defined]
    DDP.__init__ = __init__  # type: ignore[method-assign]
    DDP.register_comm_hook = register_comm_hook  # type: ignore[method-assign]

    if orig_builtin is not None:

        @functools.wraps(orig_builtin)
        def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> Any:
            if self not in timing.states:
                return orig_builtin(self, comm_hook_type)
            name = getattr(comm_hook_type, "name", str(comm_hook_type))
            if name == "ALLREDUCE":  # what our hook already does
                return None
            if name == "FP16_COMPRESS":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

                timing.late_hook(self, getattr(self, "process_group", None), fp16_compress_hook)
                return None
            return orig_builtin(self, comm_hook_type)

        _register_builtin_comm_hook.__rankwatch_wrapped__ = orig_builtin  # type: ignore[attr-defined]
        DDP._register_builtin_comm_hook = _register_builtin_comm_hook  # type: ignore[method-assign]
    return timing
