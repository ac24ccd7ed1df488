"""Automatic phase points for an unmodified training script.

Global PyTorch hooks where they exist (module forward, optimizer step), thin wrappers otherwise
(DataLoader ``__next__``, ``torch.autograd.backward``, Python-level ``torch.distributed`` collectives,
``DistributedDataParallel`` construction for the backward/grad_sync split of ``ddp_timing.py``).
Wrappers call the original first-class function and never alter arguments or results.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

from . import ddp_timing
from .ddp_timing import DDPTiming
from .record import CANONICAL_PHASES
from .tracker import Tracker

DATALOADER, FORWARD, BACKWARD, OPTIMIZER = (CANONICAL_PHASES.index(p) for p in CANONICAL_PHASES[:4])

# Python-level collectives wrapped in ``torch.distributed``. Internal calls between them go through
# ``distributed_c10d``'s own globals, which stay unwrapped, so nothing is counted twice.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
)

_installed = False


def _wrap_phase(fn: Callable[..., Any], tracker: Tracker, slot: int) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracker.enter(slot)
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.exit(slot)

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_collective(fn: Callable[..., Any], tracker: Tracker, op: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tracker.collective_enter(op)
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.collective_exit()

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_backward(fn: Callable[..., Any], tracker: Tracker, timing: DDPTiming | None) -> Callable[..., Any]:
    """``backward``; with DDP timing, the tail after this rank's backward graph was done (waiting for
    the gradient all-reduce, i.e. for the peers) is booked as ``grad_sync``."""
    if timing is None:
        return _wrap_phase(fn, tracker, BACKWARD)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        split = timing.begin(args[0] if args else kwargs.get("tensors"))
        tracker.enter(BACKWARD)
        try:
            return fn(*args, **kwargs)
        finally:
            tracker.exit(BACKWARD, timing.end() if split else 0, timing.grad_sync_slot)

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def install(tracker: Tracker) -> None:
    """Install every automatic point once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch
    import torch.nn.modules.module as module_mod
    import torch.utils.data.dataloader as dl

    # GPU time per phase on CUDA ranks (None on CPU-only builds and machines: nothing is recorded)
    if os.environ.get("RANKWATCH_CUDA_EVENTS", "1") != "0":
        from .cuda_timing import EventPool

        tracker.attach_gpu_timing(EventPool.create())

    # DataLoader: every iterator class inherits __next__ from the base iterator.
    base_iter = dl._BaseDataLoaderIter
    base_iter.__next__ = _wrap_phase(base_iter.__next__, tracker, DATALOADER)  # type: ignore[method-assign]

    # Forward: only the outermost module call counts (a DDP wrapper, or the bare model).
    depth = [0]

    def pre_hook(module: Any, args: Any) -> None:
        depth[0] += 1
        if depth[0] == 1:
            tracker.enter(FORWARD)

    def post_hook(module: Any, args: Any, output: Any) -> None:
        depth[0] -= 1
        if depth[0] <= 0:
            depth[0] = 0
            tracker.exit(FORWARD)

    module_mod.register_module_forward_pre_hook(pre_hook)
    module_mod.register_module_forward_hook(post_hook, always_call=True)

    # Backward: Tensor.backward delegates to torch.autograd.backward, so wrapping the latter covers both.
    # DDP timing (ddp_timing.py) splits the wait for the gradient all-reduce off into grad_sync.
    try:
        timing = ddp_timing.install(tracker)
    except Exception as exc:
        timing = None
        warnings.warn(f"rankwatch: DDP backward timing unavailable: {exc!r}", RuntimeWarning, stacklevel=2)
    torch.autograd.backward = _wrap_backward(torch.autograd.backward, tracker, timing)

    # Optimizer: global pre/post step hooks; the post hook closes the step.
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def opt_pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracker.enter(OPTIMIZER)

    def opt_post(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracker.exit(OPTIMIZER)
        tracker.step(explicit=False)

    register_optimizer_step_pre_hook(opt_pre)
    register_optimizer_step_post_hook(opt_post)

    # Collectives called from Python.
    import torch.distributed as dist

    if dist.is_available():
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and not hasattr(fn, "__rankwatch_wrapped__"):
                setattr(dist, name, _wrap_collective(fn, tracker, name))
