"""Exits and stops: who ended by its own cause (by cause, then time), early normal exits, and gloo's abort of the
receiver of a mismatched collective (a consequence of the mismatch). Pure; findings are data, put in words
by ``report.findings``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..engine import Finding
from ..facts import FactSet, Rung
from ..live_facts import ended_facts, left_early
from ..policy import VerdictPolicy
from ..ranks import outside_majority
from ..schema import COLLECTIVE_MISMATCH, DEAD_RANK, HANG, STOPPED_RANK
from ..snapshot import DEAD, EXITED, GONE_STATES, RUNNING, STOPPED, RankView
from .ended import rule_exit_order, rule_same_failure

EXITS = "exits"
STOPPED_RULE = "stopped"


def _rule_finished_but_one(views: Sequence[RankView], early: Sequence[RankView]) -> Finding | None:
    """Most ranks finished and exited normally while a few are still inside a step: those few did something
    the others never did (an extra collective or barrier after the loop), not the majority "leaving early"."""
    # still inside a step — alive, or ended by what the others' leaving did to it (a connection error)
    stuck = [v for v in views if v.state != EXITED and v.state in (RUNNING, STOPPED, *GONE_STATES)
             and v.phase not in (None, "idle")]
    if len(early) <= len(views) / 2 or not stuck or len(stuck) >= len(views) / 2:
        return None
    lead = stuck[0]
    in_coll = all(v.in_collective or v.phase == "collective" for v in stuck)
    kind = COLLECTIVE_MISMATCH if in_coll else DEAD_RANK if lead.state in GONE_STATES else HANG
    return Finding(EXITS, kind, sorted(v.rank for v in stuck), Rung.EXIT_CAUSE, "medium", {
        "shape": "finished_but_one",
        "stuck": sorted(v.rank for v in stuck),
        "finished": sorted(v.rank for v in early),
        "seq": lead.coll_seq if in_coll else None,
        "op": lead.coll_op if in_coll else None,
        "phase": lead.phase,
        "step": lead.step,
    })


def _same_failure_everywhere(views: Sequence[RankView], facts: FactSet) -> Finding | None:
    """The shared rule (``rules.ended.rule_same_failure``) over the views' ends: a dead-rank incident that
    names nobody."""
    same = rule_same_failure(facts)
    if same is None:
        return None
    steps = sorted({v.step for v in views})
    # that nobody is to blame is certain: every rank ended alike
    return Finding(EXITS, DEAD_RANK, [], Rung.EXIT_CAUSE, "high", {
        "shape": "same_failure", "same_failure": True, "cause": views[0].exit_cause, "failed": same.data["failed"],
        "lead": views[0].rank, "phase": views[0].phase, "steps": [steps[0], steps[-1]]})


def rule_gone(views: Sequence[RankView], policy: VerdictPolicy) -> Finding | None:
    """Who ended first by its own cause: most ranks finished while a few are still inside a step
    (``_rule_finished_but_one``), the same failure everywhere, else the one exit-ordering rule
    (``rules.ended.rule_exit_order``: cause before time, then exit age; node-local order breaks ties within
    a node) over the views' ``Ended`` facts (``core.live_facts.ended_facts``)."""
    early = [v for v in views if left_early(v, views)]
    if (finished := _rule_finished_but_one(views, early)) is not None:
        return finished
    if not early and not any(v.state in GONE_STATES for v in views):
        return None
    facts = FactSet(ranks=tuple(v.rank for v in views), ended=ended_facts(views, policy.exit_order_tolerance_s))
    if (same := _same_failure_everywhere(views, facts)) is not None:
        return same
    found = rule_exit_order(facts, policy.exit_order_tolerance_s)
    if found is not None:
        found.rule = EXITS
    return found


def rule_stopped(views: Sequence[RankView]) -> Finding | None:
    stopped = [v for v in views if v.state == STOPPED]
    if not stopped:
        return None
    return Finding(STOPPED_RULE, STOPPED_RANK, sorted(v.rank for v in stopped), Rung.STOPPED, "high",
                   {"shape": "stopped", "phase": stopped[0].phase, "step": stopped[0].step})


def abort_on_mismatch(found: dict[str, Finding | None], present: Sequence[RankView]) -> None:
    """A rank killed without any mark inside a collective, while the flight recorder shows a mismatch at one
    seq: the death is gloo aborting the *receiver* of a mismatched collective (size or op), not its cause —
    the mismatch decides, and names the rank that sent it. The set-aside exit stays as ``exits_aborted``."""
    exits, fr = found.get("exits"), found.get("flight_recorder")
    if exits is None or fr is None or fr.kind != COLLECTIVE_MISMATCH or not fr.ranks:
        return
    named = set(exits.ranks)
    dead = [v for v in present if v.rank in named]
    if not dead or any(v.state != DEAD or v.phase not in ("collective", "backward") for v in dead):
        return
    fr.data["aborted_receivers"] = sorted(v.rank for v in dead)  # gloo's abort: a consequence, not a cause
    found["exits"], found["exits_aborted"] = None, exits


def abort_with_odd_counts(found: dict[str, Finding | None], present: Sequence[RankView]) -> None:
    """No flight recorder that names anyone (every rank died before capture, or too few dumped for a
    majority: the receiver died and its peer crashed), but the first death is a rank killed without any
    mark inside a collective while the ranks' Python-level collective counts disagree: gloo aborted the
    receiver of a mismatched collective. The rank whose count is the odd one out sent it."""
    exits, fr = found.get("exits"), found.get("flight_recorder")
    if exits is None or (fr is not None and fr.ranks):
        return
    named = set(exits.ranks)
    dead = [v for v in present if v.rank in named]
    if not dead or any(v.state != DEAD or v.phase != "collective" for v in dead):
        return
    by_seq: dict[int, list[int]] = defaultdict(list)
    for v in present:
        by_seq[v.coll_seq].append(v.rank)
    odd = outside_majority(by_seq)
    # the odd ranks were communicating too: counts that differ while a rank still computes are just lag
    odd_set = set(odd or ())
    if odd is None or any(v.phase not in ("collective", "backward") for v in present if v.rank in odd_set):
        return
    found["exits_aborted"] = exits
    found["exits"] = Finding(EXITS, COLLECTIVE_MISMATCH, list(odd), Rung.EXIT_CAUSE, "medium", {
        "shape": "abort_with_odd_counts", "aborted_receivers": sorted(v.rank for v in dead),
        "counts": {seq: sorted(rs) for seq, rs in by_seq.items()},
        "fr_mismatch_tie": fr is not None and fr.kind == COLLECTIVE_MISMATCH})
