"""The flight recorder as facts: what ``core.fr_analysis`` found across the ranks' dumps, as the typed facts
of ``core.facts`` the live rungs read (as ``diagnose.log_facts`` does for logs). Pure.

One ``FactSet`` per analysis, its ``ranks`` the ranks whose dump held entries (conclusions cover only these):
- ``Count(rank, group, "entered", seq)``: each member's highest collective seq entered, per group whose seqs
  are comparable — what "behind" is read from (``rules.behind``; ``rules.recorder.fr_behind``);
- ``Waits(source="flight_recorder")``: a member with its newest collective N in flight waits for the traced
  members that have not entered N (one shared set per N; ``core.live_facts`` adds the members nobody
  traced), one with a send/recv in flight for its peers (None: unnamed), one in a group of incomparable seqs
  for someone it cannot name;
- ``InOp(source="flight_recorder")`` per rank at each (group, seq) where members disagree (``aspect``: op,
  size or dtype; ``op``: what its entry says of it), ``InOp(source="fr_entered")`` the op of each member's
  newest entered collective;
- ``ProcessGroup`` per group (members, declared members, default, comparable) and ``Unjoined`` per collective
  some members never reached (the verdict document's ``missing``).
"""

from __future__ import annotations

from .facts import FR_ENTERED, FR_ENTRY, Count, FactSet, InOp, ProcessGroup, Rung, Unjoined, Waits
from .fr_analysis import FrAnalysis, PgAnalysis

ENTERED = "entered"
"""The recorder's counter: a member's highest collective seq entered in one group."""

P2P = "p2p"
"""The op of a recorder's wait on a send/recv peer (its ``Waits.seq`` is None)."""


def fr_facts(analysis: FrAnalysis) -> FactSet:
    """Every group's progress, waits, mismatches and unjoined collectives as facts (``ranks``: the ranks
    whose dump held entries)."""
    facts = FactSet(ranks=tuple(r for r in analysis.ranks if r not in analysis.empty_ranks))
    for g in analysis.groups:
        _group_facts(g, facts)
    return facts


def _group_facts(g: PgAnalysis, facts: FactSet) -> None:
    facts.groups.append(ProcessGroup(g.name, g.members, g.declared, g.desc == "default_pg", g.comparable))
    progress = g.progress
    if g.comparable:
        facts.counts.extend(Count(r, g.name, ENTERED, progress[r].entered) for r in g.members)
    facts.in_op.extend(InOp(r, p.entered_op, FR_ENTERED, seq=p.entered, group=g.name)
                       for r, p in progress.items() if p.entered_op)
    for mm in g.mismatches:
        facts.in_op.extend(InOp(r, desc, FR_ENTRY, seq=mm.seq, group=g.name, aspect=mm.kind)
                           for desc, ranks in mm.variants.items() for r in ranks)
    facts.unjoined.extend(Unjoined(m.pg, m.seq, m.op, m.joined, m.missing) for m in g.missing)
    shared: dict[int, frozenset[int]] = {}
    for r in g.members:
        p = progress[r]
        # its newest entered collective not finished (an older one still open is gloo's lazy retiring)
        if not (p.in_flight and max(p.in_flight) >= p.entered):
            if r in g.p2p_in_flight:  # a send waits for its receiver, a recv for its sender
                facts.waits.append(Waits(r, g.p2p_peers.get(r), g.name, None, P2P, Rung.FLIGHT_RECORDER, FR_ENTRY))
            continue
        n = p.entered
        if not g.comparable:
            facts.waits.append(Waits(r, None, g.name, n, None, Rung.FLIGHT_RECORDER, FR_ENTRY))
            continue
        targets = shared.get(n)
        if targets is None:
            targets = shared[n] = frozenset(m for m in g.members if progress[m].entered < n)
        facts.waits.append(Waits(r, targets, g.name, n, None, Rung.FLIGHT_RECORDER, FR_ENTRY))
