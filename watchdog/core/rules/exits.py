"""Exits and stops: who ended by its own cause (by cause, then time), early normal exits, and gloo's abort of the
receiver of a mismatched collective (a consequence of the mismatch). Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..facts import FactSet
from ..failures import CONSEQUENCE, INITIATING
from ..live_facts import ended_facts, exit_roles, left_early
from ..policy import VerdictPolicy
from ..ranks import fmt_ranks, outside_majority
from ..render import phase_kind
from ..snapshot import CRASHED, DEAD, EXITED, GONE_STATES, RUNNING, STOPPED, RankView
from .ended import earliest_ends, rule_same_failure
from .finding import RuleFinding


def _rule_finished_but_one(views: Sequence[RankView], early: Sequence[RankView]) -> RuleFinding | None:
    """Most ranks finished and exited normally while a few are still inside a step: those few did something
    the others never did (an extra collective or barrier after the loop), not the majority "leaving early"."""
    # still inside a step — alive, or ended by what the others' leaving did to it (a connection error)
    stuck = [v for v in views if v.state != EXITED and v.state in (RUNNING, STOPPED, *GONE_STATES)
             and v.phase not in (None, "idle")]
    if len(early) <= len(views) / 2 or not stuck or len(stuck) >= len(views) / 2:
        return None
    lead = stuck[0]
    in_coll = all(v.in_collective or v.phase == "collective" for v in stuck)
    what = f"collective #{lead.coll_seq} ({lead.coll_op})" if in_coll and lead.coll_op else f"{lead.phase}"
    kind = "collective_mismatch" if in_coll else "dead_rank" if lead.state in GONE_STATES else "hang"
    return RuleFinding(
        kind,
        sorted(v.rank for v in stuck),
        "medium",
        f"{fmt_ranks(v.rank for v in stuck)} is still in {what} at step {lead.step} after "
        f"{fmt_ranks(v.rank for v in early)} finished and exited normally: it issued what no other rank did",
        [f"rank {v.rank}: {v.state} at step {v.step}, phase {v.phase or 'idle'}" for v in views],
        data={
            "shape": "finished_but_one",
            "stuck": sorted(v.rank for v in stuck),
            "finished": sorted(v.rank for v in early),
            "seq": lead.coll_seq if in_coll else None,
            "op": lead.coll_op if in_coll else None,
            "phase": lead.phase,
        },
    )


def _same_failure_everywhere(views: Sequence[RankView], policy: VerdictPolicy) -> RuleFinding | None:
    """The shared rule (``rules.ended.rule_same_failure``) over the views' ends, in the live verdict's words."""
    facts = FactSet(ranks=tuple(v.rank for v in views), ended=ended_facts(views, policy.exit_order_tolerance_s))
    same = rule_same_failure(facts)
    if same is None:
        return None
    cause, first = views[0].exit_cause, views[0]
    steps = sorted({v.step for v in views})
    at = f"at step {steps[0]}" if len(steps) == 1 else f"at steps {steps[0]}–{steps[-1]}"
    return RuleFinding(
        "dead_rank",
        [],
        "high",  # that nobody is to blame is certain: every rank ended alike
        f"every rank ({len(views)}) exited with the same error ({cause}) {at}: a failure of the job itself "
        "(its code, data or environment), not of one rank",
        [f"{fmt_ranks(v.rank for v in views)} exited with: {cause}", f"phase of rank {first.rank}: "
         f"{first.phase or 'idle'}"],
        data={"same_failure": True, "cause": cause, "failed": same.data["failed"]},
    )


def rule_gone(views: Sequence[RankView], policy: VerdictPolicy) -> RuleFinding | None:
    early = [v for v in views if left_early(v, views)]
    if (finished := _rule_finished_but_one(views, early)) is not None:
        return finished
    gone = [v for v in views if v.state in GONE_STATES] + early
    if not gone:
        return None
    if (same := _same_failure_everywhere(views, policy)) is not None:
        return same
    # larger exit age = exited earlier; node-local order breaks ties within a node
    ordered = sorted(gone, key=lambda v: (-(v.exit_age_s or 0.0), v.exit_order if v.exit_order is not None else 0))
    roles = exit_roles(gone, policy.exit_order_tolerance_s)
    # cause before time: an initiating exit, however late it was seen, beats a consequence seen earlier
    candidates = [v for v in ordered if roles[v.rank] == INITIATING] or ordered
    first = candidates[0]
    # exits within the tolerance are not ordered across nodes; within a node the exit order is exact
    firsts = earliest_ends(candidates, at=lambda v: -(v.exit_age_s or 0.0), tolerance=policy.exit_order_tolerance_s,
                           node=lambda v: v.node_key)
    how = {
        CRASHED: "exited with an error",
        EXITED: "left early — exited normally while its peers were still mid-step (uneven data: give every rank "
        "the same number of batches or wrap the loop in DDP's join(); or an early return)",
    }.get(first.state, "died (killed, no normal-exit mark)")

    def line(v: RankView) -> str:
        cause = f" ({v.exit_cause})" if v.state == CRASHED and v.exit_cause else ""
        return (
            f"rank {v.rank} {v.state} {v.exit_age_s or 0.0:.2f}s ago in phase {v.phase or 'idle'} at step "
            f"{v.step}{cause}: {roles[v.rank]}"
        )

    evidence = [line(v) for v in ordered]
    if len(gone) > 1:
        evidence.append(f"exit order: {' → '.join(str(v.rank) for v in ordered)}")
    consequences = [v.rank for v in ordered if roles[v.rank] == CONSEQUENCE]
    if consequences and candidates[0] is not ordered[0]:
        evidence.append(
            f"{fmt_ranks(consequences)} ended with communication errors or were torn down after a peer's "
            "failure: consequences, even where seen first"
        )
    unverified = [v.rank for v in firsts if not v.verified]
    if unverified:
        evidence.append(
            f"{fmt_ranks(unverified)} ended before rankwatch first saw its process: its exit time is when "
            "rankwatch noticed, and who it was rests on its record alone"
        )
    all_consequences = not any(roles[v.rank] == INITIATING for v in gone)
    confidence = "high" if len(firsts) == 1 and not all_consequences else "medium"
    if unverified and confidence == "high":
        confidence = "medium"
    if all_consequences:
        evidence.append("every rank that ended reports a consequence (communication error): the cause may lie outside")
        confidence = "low" if len(gone) > 1 else confidence
    return RuleFinding(
        "dead_rank",
        sorted(v.rank for v in firsts),
        confidence,
        f"{fmt_ranks(v.rank for v in firsts)} {how} first, in {phase_kind(first.phase)} "
        f"({first.phase or 'idle'}) at step {first.step}"
        + (f" ({first.exit_cause})" if first.state == CRASHED and first.exit_cause else "")
        + (f"; {len(gone) - len(firsts)} other rank(s) exited after it" if len(gone) > len(firsts) else ""),
        evidence,
        data={
            "shape": "first_exit",
            "how": first.state,
            "cause": first.exit_cause,
            "exit_order": [v.rank for v in ordered],
            "roles": {v.rank: roles[v.rank] for v in ordered},
            "all_consequences": all_consequences,
            "unverified": unverified,
        },
    )


def rule_stopped(views: Sequence[RankView]) -> RuleFinding | None:
    stopped = [v for v in views if v.state == STOPPED]
    if not stopped:
        return None
    first = stopped[0]
    return RuleFinding(
        "stopped_rank",
        sorted(v.rank for v in stopped),
        "high",
        f"{fmt_ranks(v.rank for v in stopped)} is stopped (SIGSTOP or a debugger) in phase "
        f"{first.phase or 'idle'} at step {first.step}; the others wait for it",
        [f"rank {v.rank} process state T (stopped)" for v in stopped],
        data={"shape": "stopped", "phase": first.phase},
    )


def abort_on_mismatch(found: dict[str, RuleFinding | None], present: Sequence[RankView]) -> None:
    """A rank killed without any mark inside a collective, while the flight recorder shows a mismatch at one
    seq: the death is gloo aborting the *receiver* of a mismatched collective (size or op), not its cause —
    the mismatch decides, and names the rank that sent it."""
    exits, fr = found.get("exits"), found.get("flight_recorder")
    if exits is None or fr is None or fr.kind != "collective_mismatch" or not fr.initiators:
        return
    dead = [v for v in present if v.rank in set(exits.initiators)]
    if not dead or any(v.state != DEAD or v.phase not in ("collective", "backward") for v in dead):
        return
    fr.evidence.append(
        f"{fmt_ranks(v.rank for v in dead)} died without an exit mark inside a collective: gloo aborts a rank "
        f"that receives a mismatched collective — a consequence of the mismatch ({exits.reason})"
    )
    fr.data["aborted_receivers"] = sorted(v.rank for v in dead)  # gloo's abort: a consequence, not a cause
    found["exits"] = None


def abort_with_odd_counts(found: dict[str, RuleFinding | None], present: Sequence[RankView]) -> None:
    """No flight recorder that names anyone (every rank died before capture, or too few dumped for a
    majority: the receiver died and its peer crashed), but the first death is a rank killed without any
    mark inside a collective while the ranks' Python-level collective counts disagree: gloo aborted the
    receiver of a mismatched collective. The rank whose count is the odd one out sent it."""
    exits, fr = found.get("exits"), found.get("flight_recorder")
    if exits is None or (fr is not None and fr.initiators):
        return
    dead = [v for v in present if v.rank in set(exits.initiators)]
    if not dead or any(v.state != DEAD or v.phase != "collective" for v in dead):
        return
    by_seq: dict[int, list[int]] = defaultdict(list)
    for v in present:
        by_seq[v.coll_seq].append(v.rank)
    odd = outside_majority(by_seq)
    # the odd ranks were communicating too: counts that differ while a rank still computes are just lag
    if odd is None or any(v.phase not in ("collective", "backward") for v in present if v.rank in set(odd)):
        return
    counts = "; ".join(f"{fmt_ranks(rs)} at collective #{seq}" for seq, rs in sorted(by_seq.items()))
    found["exits"] = RuleFinding(
        "collective_mismatch",
        list(odd),
        "medium",
        f"{fmt_ranks(odd)} issued a different number of collectives than the others ({counts}); "
        f"{fmt_ranks(v.rank for v in dead)} then died without an exit mark inside a collective — gloo aborts "
        "the rank that receives a mismatched collective",
        [
            *exits.evidence,
            f"python-level collective counts: {counts}",
            *([f"the flight recorder agrees there is a mismatch but names nobody: {fr.reason}"]
              if fr is not None and fr.kind == "collective_mismatch" else []),
        ],
        rule="exits",
        data={"shape": "abort_with_odd_counts", "aborted_receivers": sorted(v.rank for v in dead),
              "counts": {seq: sorted(rs) for seq, rs in by_seq.items()},
              "fr_mismatch_tie": fr is not None and fr.kind == "collective_mismatch"},
    )
