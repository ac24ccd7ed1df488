"""Stacks as evidence: which frames matter, a stable signature for grouping ranks, "blocked on peers?".

Pure functions over frames (py-spy's or the responder's), shared by the live pipeline and reports.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass

# the hook's own frames (found without importing the hook, which would pull in its responder)
_HOOK_SPEC = importlib.util.find_spec("rankwatch.hooks")
_HOOK_DIR = os.path.abspath(next(iter(_HOOK_SPEC.submodule_search_locations or ()), "")) if _HOOK_SPEC else ""
# frames that only say "rankwatch/runpy launched this": dropped from signatures and stack tops
_NOISE_FILES = ("<frozen runpy>", "runpy.py", "c10d_logger.py")
_PEER_WAIT_DIRS = ("torch/distributed/", "torch/nn/parallel/distributed.py")
_AMBIGUOUS_DIRS = ("torch/autograd/",)
# the watchdog's own package (a rank's stack never runs it, but a dump of the watchdog would)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where library code lives: a frame there is not where the user's code stands
_LIBRARY_MARKS = ("/site-packages/", "/dist-packages/", "/lib/python3", "/lib64/python3")


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    line: int

    def short(self) -> str:
        return f"{self.name} ({os.path.basename(self.filename)}:{self.line})"


def meaningful(frames: Sequence[Frame]) -> list[Frame]:
    return [
        f
        for f in frames
        if not f.filename.startswith(_HOOK_DIR) and not f.filename.endswith(_NOISE_FILES) and f.filename != "<string>"
    ]


def signature(frames: Sequence[Frame], depth: int) -> str | None:
    """Stable id of a stack (function + file, no line numbers) for grouping ranks."""
    useful = meaningful(frames)[:depth]
    if not useful:
        return None
    text = "|".join(f"{f.name}@{os.path.basename(f.filename)}" for f in useful)
    return hashlib.sha1(text.encode()).hexdigest()[:12]  # noqa: S324 - an id, not security


def stack_top(frames: Sequence[Frame], n: int) -> tuple[str, ...]:
    return tuple(f.short() for f in meaningful(frames)[:n])


def is_user_frame(frame: Frame) -> bool:
    """A frame of the user's own code: not the standard library (threading, queue, selectors…), not an
    installed package (torch, numpy…), not rankwatch, not a frozen or synthetic module."""
    path = frame.filename.replace(os.sep, "/")
    if not path or path.startswith("<") or path == "<string>":
        return False
    if (_HOOK_DIR and frame.filename.startswith(_HOOK_DIR)) or frame.filename.startswith(_OWN_DIR):
        return False
    return not any(mark in path for mark in _LIBRARY_MARKS)


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame of the user's code: where a person starts reading a stuck rank's stack
    (``SlowCollate.__call__ (train.py:111)``, not ``Condition.wait (threading.py:327)``)."""
    return next((f for f in frames if is_user_frame(f)), None)


def waiting_on_peers(frames: Sequence[Frame]) -> bool | None:
    """True: blocked in a torch.distributed call; None: cannot tell (autograd may be DDP's sync)."""
    useful = meaningful(frames)
    if not useful:
        return None
    top = useful[0].filename.replace(os.sep, "/")
    if any(d in top for d in _PEER_WAIT_DIRS):
        return True
    if any(d in top for d in _AMBIGUOUS_DIRS):
        return None
    return False
