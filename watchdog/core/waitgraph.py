"""The wait-for graph over a ``FactSet``: who waits for whom, and the sinks every waiting rank reaches.

Edges come from ``Waits`` facts (a rank in collective C of group G waits for the members of G that have not
entered C; a rank in ``recv`` for its sender) and from consequence exits that name who they lost. A waiter
that cannot say whom it waits for (a p2p op with an unknown peer, a timeout message) waits for *anyone*
that waits for nobody. The sinks are the ranks reached that wait for nobody: alive and not waiting,
stopped, dead by their own cause, silent, or a member no source says anything about. Pure.

Cost is linear in ranks plus distinct target sets: waiters of one collective share one frozenset, whose
sinks are computed once (8,192 ranks in well under the verdict's budget).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .facts import FactSet, Rung

ANYONE = -1
"""The target of a waiter that cannot say whom it waits for: every rank that waits for nobody."""


@dataclass
class WaitGraph:
    edges: dict[int, dict[frozenset[int], Rung]] = field(default_factory=dict)  # waiter → target set → strength
    anyone: dict[int, Rung] = field(default_factory=dict)  # waiters of unknown peers → strength
    stuck: set[int] = field(default_factory=set)  # waiters whose every target already joined (empty set)
    terminal: dict[int, Rung] = field(default_factory=dict)  # ranks that wait for nobody → strength

    @property
    def waiters(self) -> set[int]:
        return set(self.edges) | set(self.anyone) | self.stuck


def build(facts: FactSet) -> WaitGraph:
    """Edges from every ``Waits`` fact and every consequence exit; a terminal rank has no out-edges."""
    g = WaitGraph(terminal=facts.terminal())
    for w in facts.waits:
        if w.rank in g.terminal:
            continue
        if w.on is None:
            g.anyone[w.rank] = max(g.anyone.get(w.rank, w.strength), w.strength)
            continue
        targets = w.on - {w.rank} if w.rank in w.on else w.on
        if not targets:
            g.stuck.add(w.rank)
            continue
        per = g.edges.setdefault(w.rank, {})
        per[targets] = max(per.get(targets, w.strength), w.strength)
    for e in facts.ended:
        if e.own or e.rank in g.terminal:
            continue
        if e.lost:
            per = g.edges.setdefault(e.rank, {})
            per[e.lost] = max(per.get(e.lost, e.strength), e.strength)
        else:
            g.anyone[e.rank] = max(g.anyone.get(e.rank, e.strength), e.strength)
    # a rank another names as the one it waited for (a monitored barrier's report), whose own end says
    # nothing of a peer (the launcher's teardown killed it after): what it waited for is unknown, what
    # waited for it is not — it is where the waits end
    named = {r for e in facts.ended if not e.own and e.lost for r in e.lost}
    for r in named:
        if r in g.anyone and r not in g.edges and r not in g.terminal:
            g.terminal[r] = g.anyone.pop(r)
    return g


@dataclass(frozen=True)
class Sinks:
    """What the graph says: the sinks reached (rank → strength of the weakest link on its best path) and
    how the waiters got there."""

    sinks: Mapping[int, Rung]
    waiters: frozenset[int]
    via_anyone: frozenset[int]  # waiters that reach a sink only through "anyone"
    cycle: frozenset[int]  # waiters that only reach each other (a wait cycle: a deadlock)
    stuck: frozenset[int]  # waiters in a collective every member they know of entered


def sinks(g: WaitGraph) -> Sinks:
    """Follow every waiter's edges to the ranks that wait for nobody.

    A target no fact mentions is itself a sink of silence strength: a member nothing was heard from cannot
    be shown to wait."""
    memo: dict[int, dict[int, Rung]] = {}
    set_memo: dict[frozenset[int], dict[int, Rung]] = {}
    visiting: set[int] = set()
    cycle: set[int] = set()

    def of_rank(r: int) -> dict[int, Rung]:
        if r in g.terminal:
            return {r: g.terminal[r]}
        if r in memo:
            return memo[r]
        if r not in g.edges and r not in g.anyone:
            if r in g.stuck:
                return {}
            return {r: Rung.SILENCE}  # nothing known about it: a member that never answered
        if r in visiting:
            cycle.add(r)
            return {}
        visiting.add(r)
        out: dict[int, Rung] = {}
        for targets, strength in g.edges.get(r, {}).items():
            _merge(out, of_set(targets), strength)
        if r in g.anyone:
            _merge(out, {ANYONE: g.anyone[r]}, g.anyone[r])
        visiting.discard(r)
        memo[r] = out
        return out

    def of_set(targets: frozenset[int]) -> dict[int, Rung]:
        hit = set_memo.get(targets)
        if hit is not None:
            return hit
        out: dict[int, Rung] = {}
        for t in targets:
            _merge(out, of_rank(t), Rung.EXIT_CAUSE)
        set_memo[targets] = out
        return out

    reached: dict[int, Rung] = {}
    via_anyone: set[int] = set()
    anyone_cap = max(g.anyone.values(), default=None)
    merged: set[int] = set()  # results already merged (waiters of one collective share one)
    for w in g.waiters:
        if w not in g.edges:
            if w in g.anyone:
                via_anyone.add(w)  # waits for anyone: folded in once below, not per waiter
            continue
        per = g.edges[w]
        if len(per) == 1 and w not in g.anyone:
            ((targets, strength),) = per.items()
            got = of_set(targets)
            key = id(got) * 16 + int(strength)
            if key in merged:
                continue
            merged.add(key)
            _merge(reached, got, strength)
            continue
        got = of_rank(w)
        if ANYONE in got and len(got) == 1:
            via_anyone.add(w)
        _merge(reached, got, Rung.EXIT_CAUSE)
    if anyone_cap is not None and via_anyone:
        _merge(reached, {ANYONE: anyone_cap}, anyone_cap)
    if ANYONE in reached:
        cap = reached.pop(ANYONE)
        for r, s in g.terminal.items():
            reached[r] = max(reached.get(r, Rung.SILENCE), min(s, cap))
    return Sinks(
        sinks=reached,
        waiters=frozenset(g.waiters),
        via_anyone=frozenset(via_anyone),
        cycle=frozenset(cycle),
        stuck=frozenset(w for w in g.stuck if w not in g.edges and w not in g.anyone),
    )


def _merge(into: dict[int, Rung], found: Mapping[int, Rung], cap: Rung) -> None:
    for r, s in found.items():
        s = min(s, cap)
        if s > into.get(r, 0):
            into[r] = s
