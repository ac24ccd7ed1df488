"""The flight recorder's own findings for the ladder: a mismatch at one (pg, seq), ranks behind or missing. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import Finding
from ..facts import FactSet
from ..fr_hints import FrHints
from ..live_facts import mismatch_facts
from ..ranks import fmt_ranks, ranks_verb
from ..render import phase_kind
from ..schema import lower_confidence
from ..snapshot import RankView
from .finding import RuleFinding
from .mismatch import rule_mismatch


def _fr_mismatch_finding(found: Finding, hints: FrHints, covered: bool, live: Sequence[RankView]) -> RuleFinding:
    """The shared rule's mismatch (``rules.mismatch``) in the live verdict's words."""
    d = found.data
    mm = next(m for m in hints.mismatches if (m.pg, m.seq) == (d["group"], d["seq"]))
    evidence = [
        f"flight recorder: {fmt_ranks(rs)} entered collective #{mm.seq} as {desc}" for desc, rs in mm.variants.items()
    ]
    evidence += [f"rank {v.rank}: python-level collective #{v.coll_seq} {v.coll_op or ''}" for v in live]
    if not found.ranks:
        # a tie: nobody is named (naming every rank, or a majority, would be wrong)
        return RuleFinding(
            "collective_mismatch",
            [],
            "low",
            f"flight recorder shows a {mm.kind} mismatch at collective #{mm.seq} of process group {mm.pg}; "
            "no majority says which side is wrong",
            evidence,
            rule="fr",
        )
    top_desc = d["majority_op"]
    return RuleFinding(
        "collective_mismatch",
        list(found.ranks),
        found.confidence if covered else lower_confidence(found.confidence),
        f"collective mismatch ({mm.kind}) at collective #{mm.seq} of process group {mm.pg}, seen in the flight "
        f"recorder: {fmt_ranks(found.ranks)} entered it as {'; '.join(x for x in mm.variants if x != top_desc)} while "
        f"{fmt_ranks(mm.variants[top_desc])} entered it as {top_desc}",
        evidence,
        rule="fr",
    )


def _fr_behind_text(hints: FrHints, ranks: Sequence[int]) -> str:
    """'rank 1 entered collective #5 of pg 0, others #6 (all_reduce)' for the widest gap of each rank."""
    parts = []
    for r in ranks:
        mine = [b for b in hints.behind if b.rank == r]
        if mine:
            b = max(mine, key=lambda b: b.top_seq - b.seq)
            parts.append(
                f"rank {r} entered collective #{b.seq} of pg {b.pg} while others entered #{b.top_seq}"
                + (f" ({b.top_op})" if b.top_op else "")
            )
            continue
        m = next((m for m in hints.missing if r in m.missing), None)
        if m is not None:
            parts.append(f"rank {r} never joined collective #{m.seq} ({m.op}) of pg {m.pg}")
    return "; ".join(parts)


def rule_fr(hints: FrHints, live: Sequence[RankView]) -> RuleFinding | None:
    """What the flight recorder says on its own: a mismatch at one (pg, seq), else ranks behind or missing.

    It sees every collective of every process group, DDP's gradient all-reduces included, which the
    Python-level counters do not; so it outranks them (the evidence ladder)."""
    if not live:
        return None
    live_ranks = {v.rank for v in live}
    covered = live_ranks <= set(hints.ranks)
    # the one mismatch rule (``rules.mismatch``), over the recorder's entries as facts
    mismatch = rule_mismatch(FactSet(ranks=tuple(sorted(live_ranks)), in_op=mismatch_facts(hints, live_ranks)))
    if mismatch is not None and mismatch.ranks:
        return _fr_mismatch_finding(mismatch, hints, covered, live)
    behind = [r for r in hints.behind_ranks if r in live_ranks]
    if not behind:
        # a mismatch tie names nobody; still the best account of the stall when nothing else explains it
        return _fr_mismatch_finding(mismatch, hints, covered, live) if mismatch is not None else None
    relaying = {b.rank for b in hints.behind if b.waiting}
    arrived_never = [r for r in behind if r not in relaying]
    if arrived_never and len(arrived_never) < len(behind):
        behind = arrived_never  # of the ranks behind, the ones with nothing in flight started it
    elif not arrived_never and not covered:
        # every rank behind is itself blocked in a collective a peer got past (the root of a broadcast the
        # stuck rank never received): the rank that never arrived is among those the recorder does not cover
        uncovered = sorted(live_ranks - set(hints.ranks))
        detail = _fr_behind_text(hints, behind)
        return RuleFinding(
            "hang",
            [],
            "low",
            f"{fmt_ranks(behind)} waits in a collective its peers got past ({detail}); the rank that never "
            f"arrived is among {fmt_ranks(uncovered)}, which the flight recorder does not cover",
            [f"flight recorder: {detail}; {fmt_ranks(behind)} still in flight (waiting)",
             f"flight recorder covers only {fmt_ranks(hints.ranks)}"],
            rule="fr",
        )
    detail = _fr_behind_text(hints, behind)
    chosen_views = [v for v in live if v.rank in set(behind)]
    lead = chosen_views[0]
    others = sorted(live_ranks - set(behind))
    confidence = "high" if covered and len(behind) < len(live) / 2 else "medium"
    reason = (
        f"{fmt_ranks(behind)} is behind in the flight recorder ({detail}); "
        f"it is in {phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step}"
        + (f" while {ranks_verb(others, 'waits', 'wait')} for it" if others else "")
    )
    evidence = [f"flight recorder: {detail}"]
    if not covered:
        evidence.append(f"flight recorder covers only {fmt_ranks(hints.ranks)}")
    return RuleFinding("hang", behind, confidence, reason, evidence, rule="fr")
