"""A wait cycle of sends and recvs with one new edge (issue 44 item 5, pp-wrong-peer): the rank whose send/recv
names a peer it never exchanged with before is the one whose schedule is wrong. Pure; over facts (``Waits`` of
source ``P2P_PEER`` and ``KnownPeers``, the hook's record, ``core.live_facts``); words in ``report.live_words``.

A pipeline's stages exchange with the same peers every step (the stage before and after them). When one stage
posts a recv from (or a send to) a stage it never exchanged with, nobody answers it and the stages around it
block on one another in a ring: every rank waits, the wait-for graph has no sink (``core.waitgraph``: a cycle
names nobody). Of the cycle's edges, the one to a peer its waiter never completed a send/recv with is the wrong
one, when every other edge goes to a peer its waiter had exchanged with. Anything else (several new edges, a
waiter whose peers are not known, one that never exchanged with anyone yet: the first step) names nobody here.
"""

from __future__ import annotations

from ..engine import Finding
from ..facts import P2P_PEER, FactSet, Rung
from ..schema import COLLECTIVE_MISMATCH
from .names import WRONG_PEER


def _cycles(edges: dict[int, int]) -> list[list[int]]:
    """The cycles of a graph of out-degree one (each waiter waits for one peer), each in wait order."""
    found: list[list[int]] = []
    state: dict[int, int] = {}  # rank → the start of the walk that first reached it
    for start in edges:
        r, path = start, []
        while r in edges and r not in state:
            state[r] = start
            path.append(r)
            r = edges[r]
        if r in state and state[r] == start and r in path:
            found.append(path[path.index(r):])
    return found


def rule_wrong_peer(facts: FactSet) -> Finding | None:
    """The waiter of the one new edge in a cycle of send/recv waits, as a schedule mismatch; None otherwise.
    High confidence when every rank waits (the cycle is the hang); medium beside a busy, silent or stopped rank
    (what the job waits for may be there: the wait-for graph names it first)."""
    edges: dict[int, int] = {}
    ops: dict[int, str] = {}
    for w in facts.waits:
        if w.source == P2P_PEER and w.on is not None and len(w.on) == 1:
            (edges[w.rank],) = w.on
            ops[w.rank] = w.op or ""
    known = {k.rank: k.peers for k in facts.peers}
    named: list[tuple[int, list[int]]] = []
    for cycle in _cycles(edges):
        if len(cycle) < 2:
            continue
        peers = [known.get(r) for r in cycle]
        if any(p is None for p in peers):
            return None  # a waiter whose earlier peers are not known: any edge could be new
        new = [r for r, p in zip(cycle, peers, strict=True) if p is not None and edges[r] not in p]
        if len(new) != 1 or not known[new[0]]:
            return None  # several new edges (or a first exchange): nothing tells which one is wrong
        named.append((new[0], cycle))
    if len(named) != 1:
        return None
    rank, cycle = named[0]
    waiting = {w.rank for w in facts.waits}
    ended = {e.rank for e in facts.ended}
    all_waiting = not (facts.busy or facts.silent or facts.stopped) and set(facts.ranks) <= waiting | ended
    confidence = "high" if all_waiting else "medium"
    prior = known[rank] or frozenset()
    return Finding(WRONG_PEER, COLLECTIVE_MISMATCH, [rank], Rung.COUNTERS, confidence, {
        "shape": "wrong_peer", "op": ops[rank], "peer": edges[rank], "known": sorted(prior),
        "cycle": [{"rank": r, "op": ops[r], "peer": edges[r]} for r in cycle], "phase": "collective",
        "all_waiting": all_waiting})
