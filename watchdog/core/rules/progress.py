"""Progress over facts: who reached which collective number, and who was in none.

A lone collective: ranks that timed out in a collective while the majority was in none (finished the run,
or — told by the store — had completed every NCCL work it enqueued) entered a collective nobody else issued
(an extra / rank-conditional collective, one more batch). If those others are known to have reached that
collective's number, the lone ranks arrived late instead (behind, low confidence). The other way round — a
minority finished while the majority timed out — the minority left early (uneven data, an early return).

Behind: the rank(s) whose last enqueued collective is the lowest (``core.ranks.behind``, the rule the live
counters use). SeqNums count per process group: never compared across groups; numbers of no stated group
only when close (``OfflinePolicy.unknown_pg_max_gap``). Pure; words in ``report.findings``.
"""

from __future__ import annotations

from ..engine import Finding
from ..facts import FactSet, Rung
from ..policy import OfflinePolicy
from ..ranks import behind as ranks_behind
from ..ranks import outside_majority
from ..schema import COLLECTIVE_MISMATCH, DEAD_RANK, HANG

LONE_COLLECTIVE = "lone_collective"
BEHIND = "behind"


def _last(facts: FactSet, ranks: list[int]) -> int | None:
    vals = [x.seq for x in facts.reached if x.source == "last" and x.rank in ranks]
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


def one_group(values: dict[int, tuple[str | None, int]], policy: OfflinePolicy) -> dict[int, int]:
    """Sequence numbers that count in one process group. Of several known groups the one most ranks report
    is kept; numbers of no stated group (the old "[Rank N]" prefix every group printed alike) only when they
    lie close (``OfflinePolicy.unknown_pg_max_gap``)."""
    groups: dict[str | None, dict[int, int]] = {}
    for r, (pg, v) in values.items():
        groups.setdefault(pg, {})[r] = v
    known = {pg: vs for pg, vs in groups.items() if pg is not None}
    if known:
        best = max(known.values(), key=len)
        return best if len(best) > 1 else {}
    vals = groups.get(None, {})
    if vals and max(vals.values()) - min(vals.values()) > policy.unknown_pg_max_gap:
        return {}
    return vals


def rule_behind(facts: FactSet, policy: OfflinePolicy) -> Finding | None:
    key: dict[int, int] = {}
    how = ""
    # the PG status's last enqueued, else the watchdog's number at the timeout, else one rank's timeout
    # number against another's status (torch without the PG status line)
    for source in ("enqueued", "timeout", "last"):
        vals = one_group({x.rank: (x.group, x.seq) for x in facts.reached if x.source == source}, policy)
        if len(set(vals.values())) > 1:
            key, how = vals, source
            break
    if not key:
        return None
    low, high = min(key.values()), max(key.values())
    behind = list(ranks_behind(key))
    ahead = sorted(r for r, v in key.items() if v != low)
    data = {"source": how, "low": low, "high": high, "behind": behind, "ahead": ahead}
    if len(behind) > len(ahead) and len(key) > 2:
        # most ranks agree on the low number: the few ahead ran extra collectives (a mismatch)
        return Finding(BEHIND, COLLECTIVE_MISMATCH, ahead, Rung.COUNTERS, "medium",
                       {**data, "phase": "collective", "shape": "ahead"})
    return Finding(BEHIND, HANG, behind, Rung.COUNTERS, "high", {**data, "shape": "behind"})
