"""The hook's counters: steps and Python-level collective counts and ops (ranks behind, odd ops), and the phase
of ranks when nobody waits. Pure; findings are data (``report.findings`` puts them in words)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..engine import Finding
from ..facts import Count, Rung
from ..live_facts import COLLECTIVE_SEQ, STEP, count_facts, is_waiting
from ..ranks import majority, outside_majority
from ..schema import COLLECTIVE_MISMATCH, HANG
from ..snapshot import EXITED, STEP_PHASE_ORDER, RankView
from .behind import behind_of
from .names import COUNTERS, WAITING

STEP_PLACE = "step_place"  # a counter too: the phase's place in the step (``snapshot.STEP_PHASE_ORDER``)


def _confidence(behind: Sequence[object], live: Sequence[RankView]) -> str:
    return "high" if len(behind) < len(live) / 2 else "medium"


def rule_behind(live: Sequence[RankView]) -> Finding | None:
    """Ranks at the lowest step, else at the lowest Python-level collective count (``rules.behind`` over the
    hook's ``Count`` facts, ``live_facts.count_facts``); with
    every rank waiting, a majority "behind" means the few ahead entered a collective the others never
    issue, and a few behind that wait on peers skipped the one the others are in."""
    by_step = set(behind_of(count_facts(live, STEP), STEP))
    if by_step:
        behind = [v for v in live if v.rank in by_step]
        return Finding(COUNTERS, HANG, sorted(by_step), Rung.COUNTERS, _confidence(behind, live), {
            "shape": "behind", "by": "step", "low": min(v.step for v in live), "high": max(v.step for v in live),
            "phase": behind[0].phase})
    by_seq = set(behind_of(count_facts(live, COLLECTIVE_SEQ), COLLECTIVE_SEQ))
    if not by_seq:
        return None
    top_seq = max(v.coll_seq for v in live)
    behind = [v for v in live if v.rank in by_seq]
    ahead = [v for v in live if v.coll_seq == top_seq]
    data = {"by": "collective_seq", "op": ahead[0].coll_op,
            "behind": sorted(by_seq), "ahead": sorted(v.rank for v in ahead),
            "phases": sorted({v.phase or "idle" for v in behind})}
    if len(behind) > len(live) / 2 and all(is_waiting(v) for v in live):
        # most ranks "behind" yet every rank waits: the few ahead entered a collective the others never
        # issue (a rank-conditional barrier); the others wait in one Python counters cannot see (DDP)
        return Finding(COUNTERS, COLLECTIVE_MISMATCH, sorted(v.rank for v in ahead), Rung.COUNTERS, "medium",
                       {**data, "shape": "extra_collective", "seq": top_seq})
    if (
        len(behind) < len(live) / 2
        and all(v.waiting is True and not v.in_collective for v in behind)
        and all(v.in_collective for v in live if v.rank not in by_seq)
    ):
        # the few behind are not computing: their stacks wait on peers in a collective Python counters
        # do not see (DDP's buffer broadcast in the next forward) — they skipped the one the others are in
        return Finding(COUNTERS, COLLECTIVE_MISMATCH, sorted(by_seq), Rung.COUNTERS, "medium",
                       {**data, "shape": "skipped_collective", "seq": top_seq, "at": behind[0].coll_seq})
    return Finding(COUNTERS, HANG, sorted(by_seq), Rung.COUNTERS, _confidence(behind, live), {
        **data, "shape": "behind", "low": behind[0].coll_seq, "high": top_seq, "phase": behind[0].phase})


# shapes of ``rule_not_waiting`` that compare nobody with anybody: they never back another rung's finding
UNCOMPARED = ("shared_cause", "only_live")


def rule_not_waiting(live: Sequence[RankView], present: Sequence[RankView] = ()) -> Finding | None:
    """Nobody waits (the wait-for graph has no edge): the one rank still running while every other rank that
    answered has exited normally, else the ranks earliest in the step, else a shared cause (several ranks)."""
    busy = [v for v in live if not is_waiting(v)]
    if not busy or len(busy) != len(live):
        return None
    exited = sorted(v.rank for v in present if v.state == EXITED)
    if len(busy) == 1 and exited:
        # "every rank stuck alike" would contradict the others' normal exits: this one is simply the last
        lead = busy[0]
        return Finding(WAITING, HANG, [lead.rank], Rung.WAITING, "low",
                       {"shape": "last_running", "phase": lead.phase, "step": lead.step, "exited": exited})
    if len(busy) == 1:
        # one live rank, busy and waiting on nobody, nobody to compare it with (the others never answered or
        # are not live): it is named, weakly — "every rank stuck alike" would describe one rank as a crowd
        lead = busy[0]
        return Finding(WAITING, HANG, [lead.rank], Rung.WAITING, "low",
                       {"shape": "only_live", "phase": lead.phase, "step": lead.step})
    # the place in the step is one more counter: the ranks behind are those at its lowest (``rules.behind``)
    places = [Count(v.rank, "", STEP_PLACE, STEP_PHASE_ORDER.get(v.phase or "", 0)) for v in busy]
    earliest = set(behind_of(places, STEP_PLACE))
    if earliest:
        lead = next(v for v in busy if v.rank in earliest)
        return Finding(WAITING, HANG, sorted(earliest), Rung.WAITING, "medium",
                       {"shape": "earliest_in_step", "phase": lead.phase, "step": lead.step})
    return Finding(WAITING, HANG, sorted(v.rank for v in busy), Rung.WAITING, "low",
                   {"shape": "shared_cause", "phase": busy[0].phase, "step": busy[0].step})


def rule_collective(live: Sequence[RankView]) -> Finding | None:
    """Every live rank in a Python-level collective at the same seq but with different ops."""
    if not live or any(not v.in_collective for v in live) or len({v.coll_seq for v in live}) != 1:
        return None
    by_op: dict[str, list[int]] = defaultdict(list)
    for v in live:
        by_op[v.coll_op or "?"].append(v.rank)
    if len(by_op) < 2:
        return None
    seq, ops = live[0].coll_seq, dict(by_op)
    top_op, odd = majority(ops), outside_majority(ops)
    if top_op is None or odd is None:
        # a tie: naming every rank (or a majority of them) would be wrong, so nobody is named
        return Finding(COUNTERS, COLLECTIVE_MISMATCH, [], Rung.COUNTERS, "low",
                       {"shape": "op_tie", "seq": seq, "ops": ops})
    return Finding(COUNTERS, COLLECTIVE_MISMATCH, list(odd), Rung.COUNTERS, "high",
                   {"shape": "odd_op", "seq": seq, "ops": ops, "majority_op": top_op})
