"""The flight recorder's own findings for the ladder, over its facts (``core.fr_facts``): a mismatch at one
(pg, seq), else the ranks behind in a process group (``rules.behind`` over its ``entered`` counts: at the
group's lowest count; ranks in between wait). Pure; findings are data (``report.findings`` puts them in words)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine import Finding
from ..facts import FR_ENTERED, FR_ENTRY, FactSet, Progress, Rung
from ..fr_facts import ENTERED
from ..live_facts import mismatch_facts
from ..ranks import behind as ranks_behind
from ..ranks import outside_majority
from ..schema import COLLECTIVE_MISMATCH, HANG, lower_confidence
from .behind import counts_by_group
from .mismatch import rule_mismatch
from .names import FLIGHT_RECORDER as FR
from .names import FR_BEHIND


@dataclass(frozen=True)
class Behind:
    """One rank behind in one process group, as the recorder's facts say: its highest entered ``seq``
    against the furthest member's ``top_seq`` (``top_op`` its op); ``waiting``: its newest collective is
    still in flight although a peer got past it — it waits for a peer (data relayed through a ring or
    tree), it is not the one that never arrived."""

    pg: str
    rank: int
    seq: int
    top_seq: int
    top_op: str | None
    waiting: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"pg": self.pg, "rank": self.rank, "seq": self.seq, "top_seq": self.top_seq, "top_op": self.top_op,
                "waiting": self.waiting}


def fr_behind(fr: FactSet) -> list[Behind]:
    """The ranks behind in each group of the recorder (the one "behind" rule over its ``entered`` counts), in
    the groups' order."""
    values = counts_by_group(fr.counts, ENTERED)
    behind = {g: rs for g, vals in values.items() if g is not None and (rs := ranks_behind(vals))}
    if not behind:
        return []
    top = {g: max(values[g].values()) for g in behind}
    wanted = {(g, r) for g, rs in behind.items() for r in rs}
    in_flight = {(w.group, w.rank, w.seq) for w in fr.waits
                 if (w.group, w.rank) in wanted and w.source == FR_ENTRY and w.seq is not None}
    ops: dict[str, str] = {}  # group → the op the first member at its top seq entered
    for i in fr.in_op:
        if i.source == FR_ENTERED and i.group in top and i.seq == top[i.group]:
            ops.setdefault(i.group, i.op)
    return [Behind(g, r, values[g][r], top[g], ops.get(g), waiting=(g, r, values[g][r]) in in_flight)
            for g, rs in behind.items() for r in rs]


def mismatches(fr: FactSet) -> dict[tuple[str | None, int | None], tuple[str, dict[str, tuple[int, ...]]]]:
    """Per (group, seq) where the recorder's members disagree: on what — op, size or dtype — and each
    variant's ranks, in the order the analysis found them."""
    out: dict[tuple[str | None, int | None], tuple[str, dict[str, tuple[int, ...]]]] = {}
    for i in fr.in_op:
        if i.source == FR_ENTRY:
            _, variants = out.setdefault((i.group, i.seq), (i.aspect or "", {}))
            variants[i.op] = (*variants.get(i.op, ()), i.rank)
    return out


def untraced(
    fr: FactSet, group: str | None, variants: Mapping[str, Sequence[int]], world: Collection[int] = ()
) -> list[int]:
    """The members of ``group`` with no entry in ``variants``: what they issued at that seq is unknown (a rank gloo
    aborted, one killed before it dumped). Members by the group's ``pg_config``; the world group's are every rank
    of the job (``world``: gloo's dumps key the world group's config by no name), else the ranks it traced."""
    seen = {r for rs in variants.values() for r in rs}
    pg = next((g for g in fr.groups if g.name == group), None)
    default = pg is not None and pg.default and bool(world)
    members = set(fr.ranks) if pg is None else set(pg.declared or (world if default else pg.members))
    return sorted(members - seen)


def _mismatch_finding(found: Finding, fr: FactSet, covered: bool, world: Collection[int] = ()) -> Finding:
    """The shared rule's mismatch (``rules.mismatch``), with the recorder's variants the words quote. Its
    confidence drops a step where the live ranks are not all traced, and where the members nobody traced could
    tie or outnumber the majority (2 against 1 with one member unknown): the odd rank is then the likeliest,
    not the certain one."""
    d = found.data
    aspect, variants = mismatches(fr)[(d["group"], d["seq"])]
    data = {**d, "mismatch": aspect, "pg": d["group"], "seq": d["seq"], "variants": variants}
    if not found.ranks:
        # a tie: nobody is named (naming every rank, or a majority, would be wrong)
        return Finding(FR, COLLECTIVE_MISMATCH, [], Rung.FLIGHT_RECORDER, "low", {**data, "shape": "fr_mismatch_tie"})
    unknown = untraced(fr, d["group"], variants, world)
    runner_up = max(len(rs) for op, rs in variants.items() if op != d["majority_op"])
    outvoted = len(d["majority"]) <= runner_up + len(unknown)
    confidence = found.confidence
    if not covered or outvoted:
        confidence = lower_confidence(confidence)
    return Finding(FR, COLLECTIVE_MISMATCH, list(found.ranks), Rung.FLIGHT_RECORDER, confidence,
                   {**data, "shape": "fr_mismatch", "untraced": unknown})


def behind_detail(behind: Sequence[Behind], ranks: Sequence[int]) -> list[dict[str, Any]]:
    """Per rank behind, its widest gap (``seq`` against the others' ``top_seq`` in ``pg``): what the words
    say of it."""
    out: list[dict[str, Any]] = []
    for r in ranks:
        mine = [b for b in behind if b.rank == r]
        if mine:
            b = max(mine, key=lambda b: b.top_seq - b.seq)
            out.append({"rank": r, "pg": b.pg, "seq": b.seq, "top_seq": b.top_seq, "top_op": b.top_op})
    return out


def wait_cycle(fr: FactSet, rows: Sequence[Behind], behind: Sequence[int]) -> bool:
    """Every rank behind (two or more) has a collective in flight in a group it is not behind in, waiting
    only for other ranks behind: they wait for each other, so none of them is simply late."""
    if len(behind) < 2:
        return False
    named, behind_in = set(behind), {(b.rank, b.pg) for b in rows}
    waiting = {w.rank for w in fr.waits
               if w.source == FR_ENTRY and w.rank in named and w.on and (w.rank, w.group) not in behind_in
               and w.on <= named - {w.rank}}
    return named <= waiting


def rule_fr(fr: FactSet, live: Sequence[Progress], rows: Sequence[Behind] | None = None,
            world: Collection[int] = ()) -> Finding | None:
    """What the flight recorder says on its own, over its facts and where the live ranks are: a mismatch at
    one (pg, seq), else the ranks behind (``rows``: ``fr_behind``'s, where the caller made them already).
    ``world``: every rank of the job, the world group's members where its dumps do not list them.

    It sees every collective of every process group, DDP's gradient all-reduces included, which the
    Python-level counters do not; so it outranks them (the evidence ladder)."""
    live_ranks = {p.rank for p in live}
    covered = live_ranks <= set(fr.ranks)
    # the one mismatch rule (``rules.mismatch``), over the recorder's entries where members disagree. A rank gone
    # since its dump (written as it ended, ``hooks.exit_dump``, or captured before it died) says what it issued
    # as much as a live one: often the whole job has ended before anyone is captured (gloo aborts the receiver
    # of a wrong-sized message, its peers lose the connection, torchrun stops the rest)
    witnesses = live_ranks | set(fr.ranks)
    mismatch = rule_mismatch(FactSet(ranks=tuple(sorted(witnesses)), in_op=mismatch_facts(fr, witnesses)))
    if mismatch is not None and mismatch.ranks:
        return _mismatch_finding(mismatch, fr, covered, world)
    if not live:
        return None
    rows = fr_behind(fr) if rows is None else rows
    behind = sorted({b.rank for b in rows} & live_ranks)
    if not behind:
        # a mismatch tie names nobody; still the best account of the stall when nothing else explains it
        return _mismatch_finding(mismatch, fr, covered, world) if mismatch is not None else None
    relaying = {b.rank for b in rows if b.waiting}
    arrived_never = [r for r in behind if r not in relaying]
    if arrived_never and len(arrived_never) < len(behind):
        behind = arrived_never  # of the ranks behind, the ones with nothing in flight started it
    data = {"behind": behind, "detail": behind_detail(rows, behind), "covers": list(fr.ranks), "covered": covered}
    if wait_cycle(fr, rows, behind):
        # each rank behind is itself in flight, in another group, waiting for another rank behind: a wait cycle
        # across groups (one rank skipped a collective of one group and went on to the next group's). The
        # counts cannot tell which one skipped; the recorder names nobody and the weaker rungs decide
        return Finding(FR, HANG, [], Rung.FLIGHT_RECORDER, "low", {**data, "shape": "fr_wait_cycle"})
    if not arrived_never and not covered:
        # every rank behind is itself blocked in a collective a peer got past (the root of a broadcast the
        # stuck rank never received): the rank that never arrived is among those the recorder does not cover
        return Finding(FR, HANG, [], Rung.FLIGHT_RECORDER, "low",
                       {**data, "shape": "fr_behind_uncovered", "uncovered": sorted(live_ranks - set(fr.ranks))})
    behind_set = set(behind)
    lead = next(p for p in live if p.rank in behind_set)
    confidence = "high" if covered and len(behind) < len(live) / 2 else "medium"
    return Finding(FR, HANG, behind, Rung.FLIGHT_RECORDER, confidence, {
        **data, "shape": "fr_behind", "lead": lead.rank, "phase": lead.phase, "step": lead.step,
        "others": sorted(live_ranks - set(behind))})


def fr_doc(fr: FactSet, rows: Sequence[Behind] | None = None) -> dict[str, Any]:
    """The verdict document's ``flight_recorder`` section (without its ``role``): the ranks covered, the ranks
    behind (``rows``: ``fr_behind``'s, where made already), the collectives some members never joined, the
    mismatches."""
    return {
        "ranks": list(fr.ranks),
        "behind": [b.to_json() for b in (fr_behind(fr) if rows is None else rows)],
        "missing": [{"pg": m.group, "seq": m.seq, "op": m.op, "joined": list(m.joined), "missing": list(m.missing)}
                    for m in fr.unjoined],
        "mismatches": [{"pg": group, "seq": seq, "kind": aspect, "odd_ranks": list(outside_majority(variants) or ()),
                        "variants": {k: list(v) for k, v in variants.items()}}
                       for (group, seq), (aspect, variants) in mismatches(fr).items()],
    }


def split_behind(found: Mapping[str, Finding | None], facts: FactSet) -> dict[str, Finding | None]:
    """The recorder's finding is a mismatch (its own rung) or ranks behind in a group (``fr_behind``, a rung
    below the wait-for graph, which already reads the same per-group counts): split it by what it is."""
    fr = found.get(FR)
    if fr is None or fr.kind == COLLECTIVE_MISMATCH:
        return dict(found)
    return {**found, FR: None, FR_BEHIND: fr.but(rule=FR_BEHIND)}
