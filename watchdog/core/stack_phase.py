"""The phase of a step read from a Python stack, for ranks that run without the hook (``rankwatch inspect``).

The hook knows the phase because it wraps the DataLoader, the outermost forward, backward and the optimizer
step. Without it the same boundaries are visible as library frames on the stack: the innermost of them
says what the rank was doing when it stopped moving — user code called *from* a DataLoader fetch is input,
a gradient hook called from the autograd engine is backward, a module's forward is forward, a
``torch.distributed`` call is a collective. No library frame at all is the training loop itself, between
phases (``idle``, as the hook names it). Pure: frames in, a canonical phase name and the wait site out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from .stacks import Frame, meaningful

# (path fragment, function names or None for any) → phase; checked innermost frame first
_MARKERS: tuple[tuple[str, frozenset[str] | None, str], ...] = (
    ("torch/distributed/", None, "collective"),
    ("torch/utils/data/", None, "dataloader"),
    ("torch/optim/", None, "optimizer"),
    ("torch/autograd/", None, "backward"),
    ("torch/_tensor.py", frozenset({"backward"}), "backward"),
    ("torch/nn/parallel/distributed.py", frozenset({"forward", "_run_ddp_forward", "_pre_forward"}), "forward"),
    ("torch/nn/modules/module.py", frozenset({"_call_impl", "_wrapped_call_impl", "__call__"}), "forward"),
)
# torch.distributed internals that are not a collective the user called (rendezvous helpers, logging)
_NOT_COLLECTIVE = ("c10d_logger.py", "/elastic/", "rendezvous")


@dataclass(frozen=True)
class StackPhase:
    phase: str  # dataloader | forward | backward | optimizer | collective | idle
    op: str | None = None  # the torch.distributed function it waits in (all_reduce, barrier, …)


def phase_from_frames(frames: Sequence[Frame]) -> StackPhase:
    """The innermost library boundary on the stack (frames innermost first, as py-spy gives them)."""
    for f in meaningful(frames):
        path = f.filename.replace(os.sep, "/")
        name = f.name.rsplit(".", 1)[-1]  # py-spy names methods with their class (Module._call_impl)
        for fragment, names, phase in _MARKERS:
            if fragment not in path or (names is not None and name not in names):
                continue
            if phase == "collective":
                if any(x in path for x in _NOT_COLLECTIVE):
                    continue
                return StackPhase(phase, _collective_op(frames))
            return StackPhase(phase)
    return StackPhase("idle")


def _collective_op(frames: Sequence[Frame]) -> str | None:
    """The outermost ``torch.distributed`` function: the call the training code made (``all_reduce``),
    not the helpers it went through (``wrapper``, ``_wait``)."""
    ops = [f.name.rsplit(".", 1)[-1] for f in frames if "torch/distributed/" in f.filename.replace(os.sep, "/")]
    named = [n for n in ops if not n.startswith("_") and n not in ("wrapper", "wait", "inner")]
    chosen = named or ops
    return chosen[-1] if chosen else None
