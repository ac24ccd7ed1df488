"""Behind: the one rule over ``Count`` facts (rank, process group, counter, value) that every path asks — the
hook's step and collective counters (``rules.counters``), the flight recorder's per-group progress
(``core.fr_analysis``) and offline SeqNums (``rules.progress``).

Within one process group and one counter, the ranks at the lowest value, when it is below the highest
(``core.ranks.behind``); counts of different groups or counters are never compared. Ranks in between are
waiters. Pure; imports only facts and rank sets (``core.fr_analysis`` asks it).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..facts import Count
from ..ranks import behind as ranks_behind


def counts_by_group(counts: Iterable[Count], counter: str) -> dict[str | None, dict[int, int]]:
    """One counter's values per process group: group → rank → value (a rank counted twice: its last)."""
    out: dict[str | None, dict[int, int]] = {}
    for c in counts:
        if c.counter == counter:
            out.setdefault(c.group, {})[c.rank] = c.value
    return out


def behind_in(counts: Iterable[Count], counter: str) -> dict[str | None, tuple[int, ...]]:
    """Per process group, the ranks behind by ``counter`` (at its lowest value, below the highest; () when
    every member is level)."""
    return {g: ranks_behind(vals) for g, vals in counts_by_group(counts, counter).items()}


def behind_of(counts: Iterable[Count], counter: str, group: str | None = "") -> tuple[int, ...]:
    """The ranks behind by ``counter`` in one ``group``."""
    return behind_in(counts, counter).get(group, ())
