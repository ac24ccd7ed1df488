"""Incident bundles: written into a hidden temp dir and renamed, so a bundle is whole or absent.

Owner-only (0700 dirs, 0600 files): stacks can reveal paths and arguments of the training job.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from rankwatch.hooks.files import atomic_write, fsync_dir, write_new

from ..core.fr_trace import MAX_ENTRIES, compact_dump
from ..core.live_facts import stack_groups
from ..core.ranks import fmt_ranks
from ..core.snapshot import RankView
from ..core.text import FIELD, clean
from ..evidence.capture import RankCapture, render_text


def write_json(path: str, doc: Any) -> None:
    write_new(path, (json.dumps(doc, indent=2) + "\n").encode())


def atomic_json(path: str, doc: Any) -> None:
    """Replace one file atomically (summary files outside bundles)."""
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode())


def atomic_text(path: str, text: str) -> None:
    atomic_write(path, text.encode())


def groups_text(views: Sequence[RankView], captures: Mapping[int, RankCapture]) -> str:
    groups = stack_groups(views)
    if not groups:
        return "no stacks captured\n"
    by_rank = {v.rank: v for v in views}
    lines = [f"{len(groups)} distinct stack(s) across {sum(len(r) for _, r in groups)} rank(s)", ""]
    for sig, ranks in groups:
        lines.append(f"[{sig}] {fmt_ranks(ranks)} ({len(ranks)})")
        # frames name functions and files of the training code (and thread names it chose): cleaned
        lines.extend(f"    {clean(frame, FIELD)}" for frame in by_rank[ranks[0]].stack_top)
        lines.append("")
    no_stack = sorted(set(by_rank) - {r for _, rs in groups for r in rs})
    if no_stack:
        lines.append(f"no stack: {fmt_ranks(no_stack)}")
        for r in no_stack:
            cap = captures.get(r)
            if cap is not None and (cap.pyspy_error or cap.responder_error):
                lines.append(f"    rank {r}: {clean(cap.pyspy_error or cap.responder_error, FIELD)}")
    return "\n".join(lines) + "\n"


def write_bundle(
    incidents_dir: str,
    incident_id: str,
    verdict: Mapping[str, Any],
    summary_text: str,
    ranks_doc: Any,
    views: Sequence[RankView],
    captures: Mapping[int, RankCapture],
) -> str:
    """Write the bundle; returns its final path. Existing bundles are never overwritten."""
    os.makedirs(incidents_dir, mode=0o700, exist_ok=True)
    final = os.path.join(incidents_dir, incident_id)
    tmp = os.path.join(incidents_dir, f".tmp-{incident_id}-{uuid.uuid4().hex[:6]}")
    os.mkdir(tmp, 0o700)
    try:
        write_json(os.path.join(tmp, "verdict.json"), verdict)
        write_new(os.path.join(tmp, "summary.txt"), summary_text.encode())
        write_json(os.path.join(tmp, "ranks.json"), ranks_doc)
        stacks = os.path.join(tmp, "stacks")
        fr = os.path.join(tmp, "fr")
        os.mkdir(stacks, 0o700)
        os.mkdir(fr, 0o700)
        for v in views:
            cap = captures.get(v.rank)
            if cap is None:
                cap = RankCapture(rank=v.rank, pid=v.pid, notes=[f"no capture: rank is {v.state} on node {v.node}"])
            write_json(
                os.path.join(stacks, f"rank-{v.rank}.json"),
                {
                    "rank": v.rank,
                    "pid": v.pid,
                    "state": v.state,
                    "source": "py-spy" if cap.pyspy_threads else "responder" if cap.responder_stacks else None,
                    "threads": cap.pyspy_threads or (cap.responder_stacks or {}).get("threads") or [],
                    "errors": [e for e in (cap.pyspy_error, cap.responder_error) if e] + cap.notes,
                },
            )
            write_new(os.path.join(stacks, f"rank-{v.rank}.txt"), render_text(cap).encode())
            if cap.fr_trace is not None:
                # the trace as the owner's reader parsed it and root checked it (a dump ``load_dump`` and
                # torch's fr_trace read), never the rank's own bytes
                write_json(os.path.join(fr, f"rank-{v.rank}.json"), compact_dump(cap.fr_trace, MAX_ENTRIES))
            elif cap.fr_json:
                write_new(os.path.join(fr, f"rank-{v.rank}.json"), cap.fr_json)
        write_new(os.path.join(stacks, "groups.txt"), groups_text(views, captures).encode())
        fsync_dir(tmp)
        if os.path.exists(final):
            final = f"{final}-{uuid.uuid4().hex[:6]}"
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    return final


_TMP_BUNDLE = re.compile(r"^\.tmp-[A-Za-z0-9._-]+-[0-9a-f]{6}$")


def remove_partial_bundles(incidents_dir: str) -> int:
    """Temp dirs a killed writer left behind (``.tmp-<id>-<hex>``, never a finished bundle)."""
    removed = 0
    try:
        names = os.listdir(incidents_dir)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(incidents_dir, name)
        if _TMP_BUNDLE.match(name) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def prune_bundles(incidents_dirs: Sequence[str], keep: int | None, max_bytes: int | None = None) -> list[str]:
    """Remove all but the ``keep`` newest finished bundles across ``incidents_dirs`` (and, with ``max_bytes``,
    the older ones beyond that many bytes; the newest is always kept); returns what went.

    A finished bundle is a real directory holding a ``verdict.json``; nothing else is touched.
    """
    bundles: list[tuple[float, str]] = []
    for d in incidents_dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            if name.startswith(".") or os.path.islink(path):
                continue
            try:
                bundles.append((os.stat(os.path.join(path, "verdict.json")).st_mtime, path))
            except OSError:
                continue
    bundles.sort(reverse=True)
    gone = []
    total = 0
    for i, (_, path) in enumerate(bundles):
        if max_bytes is not None:
            total += _tree_bytes(path)
        if i == 0 or ((keep is None or i < keep) and (max_bytes is None or total <= max_bytes)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total
