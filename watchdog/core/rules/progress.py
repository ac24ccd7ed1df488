"""Progress over facts: who reached which collective number, and who was in none.

A lone collective: ranks that timed out in a collective while the majority was in none (finished the run,
or — told by the store — had completed every NCCL work it enqueued) entered a collective nobody else issued
(an extra / rank-conditional collective, one more batch). If those others are known to have reached that
collective's number, the lone ranks arrived late instead (behind, low confidence). The other way round — a
minority finished while the majority timed out — the minority left early (uneven data, an early return).

Behind: the rank(s) whose last enqueued collective is the lowest (``rules.behind`` over ``Count`` facts, the
rule the live counters and the flight recorder use). SeqNums count per process group: never compared across
groups; numbers of no stated group only when close (``OfflinePolicy.unknown_pg_max_gap``). Pure; words in
``report.findings``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import Finding
from ..facts import Count, FactSet, Rung
from ..policy import OfflinePolicy
from ..ranks import outside_majority
from ..schema import COLLECTIVE_MISMATCH, DEAD_RANK, HANG
from .behind import behind_of, counts_by_group

LONE_COLLECTIVE = "lone_collective"
BEHIND = "behind"


def _last(facts: FactSet, ranks: list[int]) -> int | None:
    vals = [x.value for x in facts.counts if x.counter == "last" and x.rank in ranks]
    return max(vals) if vals else None


def rule_lone_collective(facts: FactSet) -> Finding | None:
    """Ranks in a collective against ranks in none (finished, or idle when the store told them)."""
    known = list(facts.ranks)
    fin = sorted({x.rank for x in facts.finished})
    idle = sorted({t.rank for t in facts.told if t.pending is False})
    inside_set = facts.inside()
    inside = [r for r in known if r in inside_set]
    out = sorted(set(fin) | set(idle))
    if not inside or not out:
        return None
    odd = outside_majority({"in a collective": inside, "in none": out})
    silent = [r for r in known if r not in inside_set and r not in out]
    if odd is None and fin and not idle:
        # the others all ended badly (waited / lost a peer, or stopped non-zero while waiting silently):
        # the few that exited 0 among them left while they still needed them
        rest = [r for r in known if r not in out]
        waiting = facts.waiting()
        nonzero = {x.rank for x in facts.exited if x.signal is not None or (x.exitcode or 0) != 0}
        if all(r in waiting or r in nonzero for r in rest):
            odd = outside_majority({"still needed": rest, "in none": out})
    if odd is None:
        return None
    n, reached = _last(facts, inside), _last(facts, out)
    done = max((t.completed or 0 for t in facts.told if t.pending is False), default=None)
    data = {"phase": "collective", "inside": inside, "finished": fin, "idle": idle, "idle_completed": done,
            "silent": silent, "seq": n, "reached": reached}
    if list(odd) == inside:
        if n is not None and reached is not None and n <= reached:
            # the others got past this number and left without waiting for it: it arrived late
            return Finding(LONE_COLLECTIVE, HANG, inside, Rung.COUNTERS, "low", {**data, "shape": "late"})
        return Finding(LONE_COLLECTIVE, COLLECTIVE_MISMATCH, inside, Rung.COUNTERS, "low" if silent else "medium",
                       {**data, "shape": "lone"})
    if not fin or set(odd) - set(fin):
        return None  # an idle minority (told, no work pending) is for the behind / outside rules
    return Finding(LONE_COLLECTIVE, DEAD_RANK, list(odd), Rung.COUNTERS, "medium",
                   {**data, "phase": None, "shape": "left_early"})


def one_group(counts: Sequence[Count], counter: str, policy: OfflinePolicy) -> tuple[str | None, dict[int, int]]:
    """The process group whose ``counter`` values are compared, and its values (a rank's last line counts).
    Of several known groups the one most ranks report is kept; numbers of no stated group (the old
    "[Rank N]" prefix every group printed alike) only when they lie close
    (``OfflinePolicy.unknown_pg_max_gap``)."""
    last = {c.rank: c for c in counts if c.counter == counter}
    groups = counts_by_group(last.values(), counter)
    known = {pg: vs for pg, vs in groups.items() if pg is not None}
    if known:
        pg, best = max(known.items(), key=lambda kv: len(kv[1]))
        return (pg, best) if len(best) > 1 else (pg, {})
    vals = groups.get(None, {})
    if vals and max(vals.values()) - min(vals.values()) > policy.unknown_pg_max_gap:
        return None, {}
    return None, vals


def rule_behind(facts: FactSet, policy: OfflinePolicy) -> Finding | None:
    """One process group's SeqNums: the ranks behind (``rules.behind``, the rule the live counters and the
    flight recorder ask), or the few ahead when most share the low number."""
    key: dict[int, int] = {}
    how = ""
    group: str | None = None
    # the PG status's last enqueued, else the watchdog's number at the timeout, else one rank's timeout
    # number against another's status (torch without the PG status line)
    for source in ("enqueued", "timeout", "last"):
        pg, vals = one_group(facts.counts, source, policy)
        if len(set(vals.values())) > 1:
            key, how, group = vals, source, pg
            break
    if not key:
        return None
    low, high = min(key.values()), max(key.values())
    behind = list(behind_of([Count(r, group, how, v) for r, v in key.items()], how, group))
    ahead = sorted(r for r, v in key.items() if v != low)
    data = {"source": how, "low": low, "high": high, "behind": behind, "ahead": ahead}
    if len(behind) > len(ahead) and len(key) > 2:
        # most ranks agree on the low number: the few ahead ran extra collectives (a mismatch)
        return Finding(BEHIND, COLLECTIVE_MISMATCH, ahead, Rung.COUNTERS, "medium",
                       {**data, "phase": "collective", "shape": "ahead"})
    return Finding(BEHIND, HANG, behind, Rung.COUNTERS, "high", {**data, "shape": "behind"})
