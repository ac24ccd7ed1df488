"""Rank-set rules and rank text shared by every path that names ranks: the live verdict
(``core.verdict``), the flight-recorder analysis (``evidence.flight_recorder``) and the offline log
diagnosis (``diagnose.reasoning``). Pure: no I/O, no imports beyond the standard library.

One rule for "the odd ones out" and one way to write a set of ranks, so the three paths give the same
answer in the same words for the same split.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

MAX_RANK = 10_000_000
"""A rank number above this in text is no rank (a stray number, not a job's)."""

NO_RANK = "no rank"
"""What ``fmt_ranks`` writes for an empty set."""


def majority(groups: Mapping[K, Collection[int]]) -> K | None:
    """The key of the strictly largest group, or None when there are fewer than 2 non-empty groups or
    the largest size is shared (e.g. 4/4, 1/1/1/1): then no group is the majority."""
    sized = [(len(rs), k) for k, rs in groups.items() if len(rs)]
    if len(sized) < 2:
        return None
    sized.sort(key=lambda sk: sk[0], reverse=True)
    if sized[0][0] == sized[1][0]:
        return None
    return sized[0][1]


def outside_majority(groups: Mapping[K, Collection[int]]) -> tuple[int, ...] | None:
    """Every rank outside the strictly largest group, sorted: the odd ones out.

    ``groups`` maps what the ranks did (an op, a phase, a signature) → the ranks that did it; empty
    groups are ignored. Returns None when there is nothing to single out: fewer than 2 non-empty groups
    (everyone agrees) or a tie for the largest group (no majority says which side is wrong). When it
    returns a tuple it is never empty. 5/2/1 → the 3 ranks of the two small groups; 5/1/1 → 2 ranks;
    7/1 → 1 rank; 4/4 and 1/1/1/1 → None.
    """
    top = majority(groups)
    if top is None:
        return None
    top_ranks = set(groups[top])
    return tuple(sorted({r for k, rs in groups.items() if k != top for r in rs} - top_ranks))


def behind(values: Mapping[int, int]) -> tuple[int, ...]:
    """What "behind" means, everywhere: the ranks at the lowest count of one counter (a step, a collective
    sequence number) within one process group, sorted, when that count is below the highest; () when all
    counts are equal or there are none. Ranks in between are waiters (they got further and wait for the
    ones below), not the ranks holding the job back. The live counters rule, the flight recorder's
    per-group progress (``core.fr_analysis``) and offline SeqNums (``rules.progress``) all ask this;
    callers pass one counter of one group (SeqNums of different groups are never compared)."""
    if not values:
        return ()
    low, high = min(values.values()), max(values.values())
    if low == high:
        return ()
    return tuple(sorted(r for r, v in values.items() if v == low))


def first_by_time(items: Iterable[T], key: Callable[[T], float], tolerance: float) -> list[T]:
    """The earliest items: every item whose time ``key(item)`` is within ``tolerance`` (inclusive) of the
    earliest one, in time order (ties keep the input order, so a caller can pre-sort for a tie-break).
    Times closer than the tolerance are not ordered with confidence, so they stay together. [] when
    ``items`` is empty."""
    ordered = sorted(items, key=key)
    if not ordered:
        return []
    t0 = key(ordered[0])
    return [x for x in ordered if key(x) - t0 <= tolerance]


def ranks_verb(ranks: Iterable[int], singular: str, plural: str) -> str:
    """``fmt_ranks`` with its verb agreeing: 'rank 0 waits', 'ranks 0, 1 wait'."""
    items = set(ranks)
    return f"{fmt_ranks(items)} {singular if len(items) == 1 else plural}"


def fmt_ranks(ranks: Iterable[int]) -> str:
    """A set of ranks as text, the one format every report uses: 'rank 3', 'ranks 0, 1, 3', runs of 3 or
    more folded for big jobs: 'ranks 0–2046, 2048' (en dash). Duplicates are dropped, order is numeric;
    an empty set is 'no rank'."""
    items = sorted(set(ranks))
    if not items:
        return NO_RANK
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{items[i]}–{items[j]}")
        else:
            parts.extend(str(r) for r in items[i : j + 1])
        i = j + 1
    return ("rank " if len(items) == 1 else "ranks ") + ", ".join(parts)


_RANK_LINE = re.compile(r"^rank (\d+): (.*)$")


def fold_rank_lines(lines: Sequence[str]) -> list[str]:
    """'rank N: text' lines that share their text become one 'ranks a–b, c: text' line (``fmt_ranks``), in
    first-seen order, so evidence stays readable (and small) for thousands of ranks. Other lines pass
    through unchanged and in place."""
    groups: dict[str, list[int]] = {}
    order: list[tuple[str, str]] = []
    for line in lines:
        m = _RANK_LINE.match(line)
        if m is None:
            order.append(("line", line))
            continue
        text = m.group(2)
        if text not in groups:
            groups[text] = []
            order.append(("group", text))
        groups[text].append(int(m.group(1)))
    return [item if kind == "line" else f"{fmt_ranks(groups[item])}: {item}" for kind, item in order]


def rank_list(text: str, limit: int = 65_536) -> list[int]:
    """"0, 2-4" or "ranks 0–2, 5" (the desync report's and ``fmt_ranks``' forms) as ranks, bounded."""
    out: list[int] = []
    for part in text.replace("ranks", "").replace("rank", "").replace("–", "-").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            continue
        start, end = int(lo), int(hi) if hi else int(lo)
        if end < start or end > MAX_RANK or end - start + len(out) > limit:
            continue
        out.extend(range(start, end + 1))
    return out
