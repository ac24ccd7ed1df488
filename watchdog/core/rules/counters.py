"""The hook's counters: steps and Python-level collective counts and ops (ranks behind, odd ops), and the phase
of ranks when nobody waits, over the live ranks' ``Progress`` facts (``core.live_facts.progress_facts``). Pure;
findings are data (``report.findings`` puts them in words)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from ..engine import Finding
from ..facts import Count, Progress, Rung
from ..live_facts import COLLECTIVE_SEQ, STEP, count_facts, waits_on_peers
from ..ranks import majority, outside_majority
from ..schema import COLLECTIVE_MISMATCH, HANG
from ..snapshot import STEP_PHASE_ORDER
from .behind import behind_of
from .names import COUNTERS, WAITING

STEP_PLACE = "step_place"  # a counter too: the phase's place in the step (``snapshot.STEP_PHASE_ORDER``)


def _confidence(behind: Sequence[object], live: Sequence[Progress]) -> str:
    return "high" if len(behind) < len(live) / 2 else "medium"


def rule_behind(live: Sequence[Progress], fr_waiting: Collection[int] = ()) -> Finding | None:
    """Ranks at the lowest step, else at the lowest Python-level collective count (``rules.behind`` over the
    hook's ``Count`` facts, ``live_facts.count_facts``); with
    every rank waiting, a majority "behind" means the few ahead entered a collective the others never
    issue, and a few behind that wait on peers skipped the one the others are in. ``fr_waiting``: ranks the
    flight recorder shows inside a collective (a wait on peers whatever their stacks say)."""
    steps = count_facts(live, STEP)
    by_step = set(behind_of(steps, STEP))
    if by_step:
        behind = [p for p in live if p.rank in by_step]
        return Finding(COUNTERS, HANG, sorted(by_step), Rung.COUNTERS, _confidence(behind, live), {
            "shape": "behind", "by": "step", "low": min(c.value for c in steps),
            "high": max(c.value for c in steps), "phase": behind[0].phase})
    seqs = count_facts(live, COLLECTIVE_SEQ)
    by_seq = set(behind_of(seqs, COLLECTIVE_SEQ))
    if not by_seq:
        return None
    top_seq = max(c.value for c in seqs)
    behind = [p for p in live if p.rank in by_seq]
    ahead = [p for p in live if (p.seq or 0) == top_seq]
    data = {"by": "collective_seq", "op": ahead[0].op,
            "behind": sorted(by_seq), "ahead": sorted(p.rank for p in ahead),
            "phases": sorted({p.phase or "idle" for p in behind})}
    if len(behind) > len(live) / 2 and all(waits_on_peers(p) for p in live):
        # most ranks "behind" yet every rank waits: the few ahead entered a collective the others never
        # issue (a rank-conditional barrier); the others wait in one Python counters cannot see (DDP)
        return Finding(COUNTERS, COLLECTIVE_MISMATCH, sorted(p.rank for p in ahead), Rung.COUNTERS, "medium",
                       {**data, "shape": "extra_collective", "seq": top_seq})
    if (
        len(behind) < len(live) / 2
        and all((p.blocked is True or p.rank in fr_waiting) and not p.in_collective for p in behind)
        and all(p.in_collective or p.blocked is True or p.rank in fr_waiting for p in live if p.rank not in by_seq)
    ):
        # the few behind are not computing: their stacks wait on peers in a collective Python counters
        # do not see (DDP's buffer broadcast in the next forward, its gradient all_reduce) — they skipped the
        # one the others are in (or, with the others' stacks blocked too, one some of them wait in: an expert
        # all_to_all skipped while DDP's all_reduce waits, group-a2a-skip)
        return Finding(COUNTERS, COLLECTIVE_MISMATCH, sorted(by_seq), Rung.COUNTERS, "medium",
                       {**data, "shape": "skipped_collective", "seq": top_seq, "at": behind[0].seq})
    return Finding(COUNTERS, HANG, sorted(by_seq), Rung.COUNTERS, _confidence(behind, live), {
        **data, "shape": "behind", "low": behind[0].seq, "high": top_seq, "phase": behind[0].phase})


# shapes of ``rule_not_waiting`` that compare nobody with anybody: they never back another rung's finding
UNCOMPARED = ("shared_cause", "only_live")


def rule_not_waiting(live: Sequence[Progress], exited: Sequence[int] = ()) -> Finding | None:
    """Nobody waits (the wait-for graph has no edge): the one rank still running while every other rank that
    answered has exited normally (``exited``), else the ranks earliest in the step, else a shared cause
    (several ranks)."""
    busy = [p for p in live if not waits_on_peers(p)]
    if not busy or len(busy) != len(live):
        return None
    if len(busy) == 1 and exited:
        # "every rank stuck alike" would contradict the others' normal exits: this one is simply the last
        lead = busy[0]
        return Finding(WAITING, HANG, [lead.rank], Rung.WAITING, "low",
                       {"shape": "last_running", "phase": lead.phase, "step": lead.step, "exited": sorted(exited)})
    if len(busy) == 1:
        # one live rank, busy and waiting on nobody, nobody to compare it with (the others never answered or
        # are not live): it is named, weakly — "every rank stuck alike" would describe one rank as a crowd
        lead = busy[0]
        return Finding(WAITING, HANG, [lead.rank], Rung.WAITING, "low",
                       {"shape": "only_live", "phase": lead.phase, "step": lead.step})
    # the place in the step is one more counter: the ranks behind are those at its lowest (``rules.behind``)
    places = [Count(p.rank, "", STEP_PLACE, STEP_PHASE_ORDER.get(p.phase or "", 0)) for p in busy]
    earliest = set(behind_of(places, STEP_PLACE))
    if earliest:
        lead = next(p for p in busy if p.rank in earliest)
        return Finding(WAITING, HANG, sorted(earliest), Rung.WAITING, "medium",
                       {"shape": "earliest_in_step", "phase": lead.phase, "step": lead.step})
    return Finding(WAITING, HANG, sorted(p.rank for p in busy), Rung.WAITING, "low",
                   {"shape": "shared_cause", "phase": busy[0].phase, "step": busy[0].step})


def rule_collective(live: Sequence[Progress]) -> Finding | None:
    """Every live rank in a Python-level collective at the same seq but with different ops."""
    if not live or any(not p.in_collective for p in live) or len({p.seq for p in live}) != 1:
        return None
    by_op: dict[str, list[int]] = defaultdict(list)
    for p in live:
        by_op[p.op or "?"].append(p.rank)
    if len(by_op) < 2:
        return None
    seq, ops = live[0].seq, dict(by_op)
    top_op, odd = majority(ops), outside_majority(ops)
    if top_op is None or odd is None:
        # a tie: naming every rank (or a majority of them) would be wrong, so nobody is named
        return Finding(COUNTERS, COLLECTIVE_MISMATCH, [], Rung.COUNTERS, "low",
                       {"shape": "op_tie", "seq": seq, "ops": ops})
    return Finding(COUNTERS, COLLECTIVE_MISMATCH, list(odd), Rung.COUNTERS, "high",
                   {"shape": "odd_op", "seq": seq, "ops": ops, "majority_op": top_op})
