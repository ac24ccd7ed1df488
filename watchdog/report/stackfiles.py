"""A rank's stack as its bundle holds it: the file a person opens and the first frame of their own code.

The bundle's ``stacks/rank-<g>.json`` keeps full paths (the verdict's ``stack_top`` keeps basenames only),
so this is where library frames (threading, torch, rankwatch) can be told from the user's. The frames came
from the training process: every name is cleaned and bounded before it is shown.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any

from ..core.stacks import Frame, user_frame
from ..core.text import NAME, clean

MAX_STACK_JSON_BYTES = 8 << 20  # a deep stack of every thread with locals stays far below this


@dataclass(frozen=True)
class RankStack:
    rank: int
    text_path: str | None  # the bundle's stacks/rank-<g>.txt, when it is there
    frames: tuple[Frame, ...]  # the training thread's frames, innermost first

    def user_frame_text(self) -> str | None:
        f = user_frame(self.frames)
        if f is None:
            return None
        path = f.filename
        with contextlib.suppress(ValueError):  # under the current directory: as the user typed it
            rel = os.path.relpath(path)
            path = rel if not rel.startswith("..") else path
        return f"{clean(f.name, NAME)} ({clean(path, 256)}:{f.line})"


def _main_thread(doc: dict[str, Any]) -> list[dict[str, Any]]:
    threads = [t for t in doc.get("threads") or [] if isinstance(t, dict)]
    pid = doc.get("pid")
    main = next((t for t in threads if t.get("os_thread_id") == pid), None) or next(
        (t for t in threads if t.get("thread_name") == "MainThread"), None
    )
    frames = (main or {}).get("frames")
    return [f for f in frames if isinstance(f, dict)] if isinstance(frames, list) else []


def read_rank_stack(bundle_dir: str, rank: int) -> RankStack:
    """The rank's stack from a bundle; empty when this node did not capture it (another node's rank)."""
    stacks = os.path.join(bundle_dir, "stacks")
    text_path: str | None = os.path.join(stacks, f"rank-{rank}.txt")
    if text_path is not None and not os.path.isfile(text_path):
        text_path = None
    frames: list[Frame] = []
    try:
        with open(os.path.join(stacks, f"rank-{rank}.json"), "rb") as fh:
            doc = json.loads(fh.read(MAX_STACK_JSON_BYTES))
        if isinstance(doc, dict):
            for f in _main_thread(doc):
                line = f.get("line")
                frames.append(
                    Frame(str(f.get("name")), str(f.get("filename")), line if isinstance(line, int) else 0)
                )
    except (OSError, ValueError):
        pass
    return RankStack(rank, text_path, tuple(frames))
