"""The flight recorder's own findings for the ladder: a mismatch at one (pg, seq), else the ranks behind in a
process group (``core.ranks.behind``: at its lowest count; ranks in between wait). Pure; findings are data
(``report.findings`` puts them in words)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..engine import Finding
from ..facts import FactSet, Rung
from ..fr_hints import FrHints
from ..live_facts import mismatch_facts
from ..schema import COLLECTIVE_MISMATCH, HANG, lower_confidence
from ..snapshot import RankView
from .mismatch import rule_mismatch
from .names import FLIGHT_RECORDER as FR
from .names import FR_BEHIND


def _mismatch_finding(found: Finding, hints: FrHints, covered: bool) -> Finding:
    """The shared rule's mismatch (``rules.mismatch``), with the recorder's variants the words quote."""
    d = found.data
    mm = next(m for m in hints.mismatches if (m.pg, m.seq) == (d["group"], d["seq"]))
    data = {**d, "mismatch": mm.kind, "pg": mm.pg, "seq": mm.seq, "variants": dict(mm.variants)}
    if not found.ranks:
        # a tie: nobody is named (naming every rank, or a majority, would be wrong)
        return Finding(FR, COLLECTIVE_MISMATCH, [], Rung.FLIGHT_RECORDER, "low", {**data, "shape": "fr_mismatch_tie"})
    confidence = found.confidence if covered else lower_confidence(found.confidence)
    return Finding(FR, COLLECTIVE_MISMATCH, list(found.ranks), Rung.FLIGHT_RECORDER, confidence,
                   {**data, "shape": "fr_mismatch"})


def behind_detail(hints: FrHints, ranks: Sequence[int]) -> list[dict[str, Any]]:
    """Per rank behind, its widest gap (``seq`` against the others' ``top_seq`` in ``pg``): what the words
    say of it."""
    out: list[dict[str, Any]] = []
    for r in ranks:
        mine = [b for b in hints.behind if b.rank == r]
        if mine:
            b = max(mine, key=lambda b: b.top_seq - b.seq)
            out.append({"rank": r, "pg": b.pg, "seq": b.seq, "top_seq": b.top_seq, "top_op": b.top_op})
    return out


def rule_fr(hints: FrHints, live: Sequence[RankView]) -> Finding | None:
    """What the flight recorder says on its own: a mismatch at one (pg, seq), else the ranks behind.

    It sees every collective of every process group, DDP's gradient all-reduces included, which the
    Python-level counters do not; so it outranks them (the evidence ladder)."""
    if not live:
        return None
    live_ranks = {v.rank for v in live}
    covered = live_ranks <= set(hints.ranks)
    # the one mismatch rule (``rules.mismatch``), over the recorder's entries as facts
    mismatch = rule_mismatch(FactSet(ranks=tuple(sorted(live_ranks)), in_op=mismatch_facts(hints, live_ranks)))
    if mismatch is not None and mismatch.ranks:
        return _mismatch_finding(mismatch, hints, covered)
    behind = [r for r in hints.behind_ranks if r in live_ranks]
    if not behind:
        # a mismatch tie names nobody; still the best account of the stall when nothing else explains it
        return _mismatch_finding(mismatch, hints, covered) if mismatch is not None else None
    relaying = {b.rank for b in hints.behind if b.waiting}
    arrived_never = [r for r in behind if r not in relaying]
    if arrived_never and len(arrived_never) < len(behind):
        behind = arrived_never  # of the ranks behind, the ones with nothing in flight started it
    data = {"behind": behind, "detail": behind_detail(hints, behind), "covers": list(hints.ranks),
            "covered": covered}
    if not arrived_never and not covered:
        # every rank behind is itself blocked in a collective a peer got past (the root of a broadcast the
        # stuck rank never received): the rank that never arrived is among those the recorder does not cover
        return Finding(FR, HANG, [], Rung.FLIGHT_RECORDER, "low",
                       {**data, "shape": "fr_behind_uncovered", "uncovered": sorted(live_ranks - set(hints.ranks))})
    behind_set = set(behind)
    lead = next(v for v in live if v.rank in behind_set)
    confidence = "high" if covered and len(behind) < len(live) / 2 else "medium"
    return Finding(FR, HANG, behind, Rung.FLIGHT_RECORDER, confidence, {
        **data, "shape": "fr_behind", "lead": lead.rank, "phase": lead.phase, "step": lead.step,
        "others": sorted(live_ranks - set(behind))})


def split_behind(found: Mapping[str, Finding | None], facts: FactSet) -> dict[str, Finding | None]:
    """The recorder's finding is a mismatch (its own rung) or ranks behind in a group (``fr_behind``, a rung
    below the wait-for graph, which already reads the same per-group counts): split it by what it is."""
    fr = found.get(FR)
    if fr is None or fr.kind == COLLECTIVE_MISMATCH:
        return dict(found)
    return {**found, FR: None, FR_BEHIND: fr.but(rule=FR_BEHIND)}
