"""Exits and stops over facts (``Progress``, ``Ended``; live ``core.live_facts.exit_facts``): who ended by its
own cause (by cause, then time), most ranks finished while a few are inside a step, gloo's abort of the
receiver of a mismatched collective (a consequence of the mismatch), every exit a consequence. Pure;
findings are data, put in words by ``report.findings``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from ..engine import Finding
from ..facts import FactSet, Progress, Rung
from ..live_facts import early_leavers, inside_step
from ..policy import VerdictPolicy
from ..ranks import outside_majority
from ..schema import COLLECTIVE_MISMATCH, DEAD_RANK, HANG, STOPPED_RANK
from ..snapshot import DEAD, GONE_STATES
from .ended import rule_exit_order, rule_same_failure
from .names import EXITS, EXITS_ABORTED, EXITS_CONSEQUENCE, FLIGHT_RECORDER
from .names import STOPPED as STOPPED_RULE

Found = Mapping[str, Finding | None]
"""Every rung's finding by rung name, as the live verdict collects them; the refinements below return a new
one and change none."""


def rule_finished_but_one(facts: FactSet) -> Finding | None:
    """Most ranks finished and exited normally while a few are still inside a step: those few did something
    the others never did (an extra collective or barrier after the loop), not the majority "leaving early".
    Over ``Progress`` facts (live: every rank that answered; offline: ranks whose lines say where they are)."""
    n = len(facts.ranks)
    stuck = sorted((p for p in facts.progress if inside_step(p)), key=lambda p: p.rank)
    if not stuck or len(stuck) >= n / 2:
        return None
    early = early_leavers(facts.progress)
    if len(early) <= n / 2:
        return None
    lead = stuck[0]
    in_coll = all(p.in_collective or p.phase == "collective" for p in stuck)
    kind = COLLECTIVE_MISMATCH if in_coll else DEAD_RANK if lead.how in GONE_STATES else HANG
    return Finding(EXITS, kind, [p.rank for p in stuck], Rung.EXIT_CAUSE, "medium", {
        "shape": "finished_but_one",
        "stuck": [p.rank for p in stuck],
        "finished": sorted(p.rank for p in early),
        "seq": lead.seq if in_coll else None,
        "op": lead.op if in_coll else None,
        "phase": lead.phase,
        "step": lead.step,
    })


def _same_failure_everywhere(facts: FactSet) -> Finding | None:
    """The shared rule (``rules.ended.rule_same_failure``) over the ends: a dead-rank incident that names
    nobody."""
    same = rule_same_failure(facts)
    if same is None:
        return None
    lead = next(e for e in facts.ended if e.rank == facts.ranks[0])
    steps = sorted({p.step or 0 for p in facts.progress})
    # that nobody is to blame is certain: every rank ended alike
    return Finding(EXITS, DEAD_RANK, [], Rung.EXIT_CAUSE, "high", {
        "shape": "same_failure", "same_failure": True, "cause": lead.cause, "failed": same.data["failed"],
        "lead": lead.rank, "phase": lead.phase, "steps": [steps[0], steps[-1]]})


def rule_gone(facts: FactSet, policy: VerdictPolicy) -> Finding | None:
    """Who ended first by its own cause, over the exit facts (``core.live_facts.exit_facts``): most ranks
    finished while a few are still inside a step (``rule_finished_but_one``), the same failure everywhere,
    else the one exit-ordering rule (``rules.ended.rule_exit_order``: cause before time, then exit age;
    node-local order breaks ties within a node)."""
    if (finished := rule_finished_but_one(facts)) is not None:
        return finished
    if not facts.ended:
        return None
    if (same := _same_failure_everywhere(facts)) is not None:
        return same
    found = rule_exit_order(facts, policy.exit_order_tolerance_s)
    return found.but(rule=EXITS) if found is not None else None


def rule_stopped(facts: FactSet) -> Finding | None:
    """Stopped ranks wait for nobody and hold everyone else: they decide (high), whatever the others do."""
    stopped = sorted(facts.stopped, key=lambda s: s.rank)
    if not stopped:
        return None
    return Finding(STOPPED_RULE, STOPPED_RANK, [s.rank for s in stopped], Rung.STOPPED, "high",
                   {"shape": "stopped", "phase": stopped[0].phase, "step": stopped[0].step})


def _aborted(exits: Finding, facts: FactSet, phases: tuple[str, ...]) -> list[Progress] | None:
    """The ranks the exit finding names, when every one was killed without any mark (``DEAD``) in one of
    ``phases``: what gloo's abort of a mismatched collective's receiver looks like."""
    named = set(exits.ranks)
    dead = [p for p in facts.progress if p.rank in named]
    if not dead or any(p.how != DEAD or p.phase not in phases for p in dead):
        return None
    return dead


def abort_on_mismatch(found: Found, facts: FactSet) -> dict[str, Finding | None]:
    """A rank killed without any mark inside a collective, while the flight recorder shows a mismatch at one
    seq: the death is gloo aborting the *receiver* of a mismatched collective (size or op), not its cause —
    the mismatch decides, and names the rank that sent it. The set-aside exit stays as ``exits_aborted``.
    Over the exit facts (``Progress``); offline the log says it itself (``diagnose.log_facts.enforce_aborted``:
    gloo's size enforcement beside the receiver's SIGABRT)."""
    exits, fr = found.get(EXITS), found.get(FLIGHT_RECORDER)
    if exits is None or fr is None or fr.kind != COLLECTIVE_MISMATCH or not fr.ranks:
        return dict(found)
    dead = _aborted(exits, facts, ("collective", "backward"))
    if dead is None or {p.rank for p in dead} & set(fr.ranks):
        return dict(found)  # the rank that died issued the odd collective itself (its dump says so): its end decides
    # gloo's abort: a consequence, not a cause
    return {**found, FLIGHT_RECORDER: fr.adding(aborted_receivers=sorted(p.rank for p in dead)),
            EXITS: None, EXITS_ABORTED: exits}


def abort_with_odd_counts(found: Found, facts: FactSet) -> dict[str, Finding | None]:
    """No flight recorder that names anyone (every rank died before capture, or too few dumped for a
    majority: the receiver died and its peer crashed), but the first death is a rank killed without any
    mark inside a collective while the ranks' Python-level collective counts (``Progress.seq``) disagree:
    gloo aborted the receiver of a mismatched collective. The rank whose count is the odd one out sent it."""
    exits, fr = found.get(EXITS), found.get(FLIGHT_RECORDER)
    if exits is None or (fr is not None and fr.ranks):
        return dict(found)
    dead = _aborted(exits, facts, ("collective",))
    if dead is None:
        return dict(found)
    by_seq: dict[int, list[int]] = defaultdict(list)
    for p in facts.progress:
        by_seq[p.seq or 0].append(p.rank)
    odd = outside_majority(by_seq)
    # the odd ranks were communicating too: counts that differ while a rank still computes are just lag
    odd_set = set(odd or ())
    if odd is None or any(p.phase not in ("collective", "backward") for p in facts.progress if p.rank in odd_set):
        return dict(found)
    return {**found, EXITS_ABORTED: exits, EXITS: Finding(EXITS, COLLECTIVE_MISMATCH, list(odd), Rung.EXIT_CAUSE,
                                                          "medium", {
        "shape": "abort_with_odd_counts", "aborted_receivers": sorted(p.rank for p in dead),
        "counts": {seq: sorted(rs) for seq, rs in by_seq.items()},
        "fr_mismatch_tie": fr is not None and fr.kind == COLLECTIVE_MISMATCH})}


def split_consequence(found: Found, facts: FactSet) -> dict[str, Finding | None]:
    """A dead-rank exit finding while no end is the rank's own (every exit a consequence): the sinks of the
    wait-for graph are the better account, if any; the exit finding is weighed below them as
    ``exits_consequence``."""
    exits = found.get(EXITS)
    if exits is not None and exits.kind == DEAD_RANK and not any(e.own for e in facts.ended):
        return {**found, EXITS: None, EXITS_CONSEQUENCE: exits.but(rule=EXITS_CONSEQUENCE)}
    return dict(found)
