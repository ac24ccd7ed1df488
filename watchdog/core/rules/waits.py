"""Waits over facts, through the engine's wait-for graph (``core.engine.blame``).

``wait_for``: the sinks of the graph PyTorch's desync report draws (every other rank waits for the lagging
ones), else the one NCCL's per-op counts draw (a member waits for those whose last op is below its own).
``outside``: ranks whose lines show them waiting for someone they cannot name wait for *anyone* that
waits for nobody — the ranks that printed no wait are the sinks. ``same_collective``: every rank waits,
nobody is a sink: a communication hang, no initiator
(live asks it too, ``rules.weak``, and adds GPU use). Pure; words in ``report.findings``.
"""

from __future__ import annotations

from ..engine import Finding, blame
from ..facts import (
    DESYNC_REPORT,
    IN_OP_CALLS,
    NAMED_IN_MESSAGE,
    NCCL_OP_COUNTS,
    PEER_GONE,
    STORE_KEYS,
    FactSet,
    Rung,
    Silent,
    Waits,
)
from ..schema import COMM_HANG, DEAD_RANK, HANG

WAIT_FOR = "wait_for"
OUTSIDE = "outside"
SAME_COLLECTIVE = "same_collective"
NAMING_SOURCES = (DESYNC_REPORT, NAMED_IN_MESSAGE, NCCL_OP_COUNTS, STORE_KEYS)
"""The sources whose waits name their targets, in the order ``wait_for`` asks them (each has its words in
``report.findings``): torch's desync report, a message naming whom it waited for, NCCL op counts, store keys."""


def rule_wait_for(facts: FactSet) -> Finding | None:
    for source in NAMING_SOURCES:
        waits = [w for w in facts.waits if w.source == source]
        if not waits:
            continue
        found = blame(FactSet(ranks=facts.ranks, waits=waits))
        if found is None or not found.ranks:
            continue
        lead = next((i for i in facts.in_op if i.source == DESYNC_REPORT and i.rank == found.ranks[0]), None)
        # the desync report is torch's own analysis of every rank's trace in the store
        # (and a monitored barrier's report is the monitor's own list of who never arrived)
        confidence = "high" if source in (DESYNC_REPORT, NAMED_IN_MESSAGE) and found.confidence != "low" else "medium"
        return Finding(WAIT_FOR, HANG, list(found.ranks), found.strength, confidence, {
            **found.data, "source": source, "lagging": lead.op if lead is not None else None,
            "phase": "collective" if lead is not None and "joined" in lead.op else None})
    return None


def waiting_graph(facts: FactSet, waiting: set[int]) -> FactSet:
    """Ranks whose lines show them waiting on a peer (a timeout, a lost peer) wait for someone they cannot
    name; a rank that printed no such line is silent about it: the candidate the waiters wait for."""
    out = FactSet(ranks=facts.ranks)
    out.waits = [Waits(r, None, "", None, None, Rung.WAITING) for r in facts.ranks if r in waiting]
    out.silent = [Silent(r) for r in facts.ranks if r not in waiting]
    return out


def rule_outside(facts: FactSet) -> Finding | None:
    """The ranks the waiters' unnamed waits reach. Ranks known to exist that left no line at all
    (``facts.unseen``: a whole node killed at once) are candidates as good as a silent one that printed: they
    only ever take a naming away (undecided), never make one — an excerpt often shows only some ranks.
    Undecided too when there are as many candidates as waiters, or when every waiter lost a peer that went
    away and each candidate ended by SIGTERM (the launcher's teardown and an outside kill end alike, and a rank
    that exited 0 is in no launcher report)."""
    waiting = facts.inside()
    found = blame(waiting_graph(facts, waiting))
    outside = list(found.ranks) if found is not None else []
    if not waiting or not outside:
        return None
    inside = sorted(waiting)
    told = sorted({t.rank for t in facts.told} & set(outside))
    gone = {w.rank for w in facts.waits if w.source == PEER_GONE}
    peer_only = all(r in gone for r in inside)
    data = {"waiting": inside, "told": told, "peer_only": peer_only, "unseen": list(facts.unseen)}
    first = {x.rank for x in facts.exited if x.root_cause and x.signal != "SIGTERM"} & set(outside)
    if len(outside) >= len(inside) and len(first) == 1 and not facts.unseen and not told:
        # as many silent ranks as waiters, but the launcher says which silent one ended first (mpirun's "the
        # first process to do so") and every rank that printed waited on a peer: the one that left is the one
        # they lost
        return Finding(OUTSIDE, DEAD_RANK, sorted(first), Rung.WAITING, "medium",
                       {**data, "peer_only": True, "launcher_first": True})
    if len(outside) >= len(inside) or facts.unseen:
        # any of the silent ranks could be the one that never arrived
        silent = sorted({*outside, *facts.unseen})
        return Finding(OUTSIDE, HANG, [], Rung.WAITING, "low", {**data, "decided": False, "silent": silent})
    stopped = sorted({x.rank for x in facts.exited if x.signal == "SIGTERM"} & set(outside))
    if peer_only and stopped == sorted(outside):
        # every waiter lost a peer that went away, and each silent one ended by SIGTERM: an outside kill (a
        # preemption) and the launcher's teardown of a rank that only waited end alike, and a rank that exited 0
        # is in no launcher report at all (issue 44 item 5, exit-zero at the highest rank): a guess, never a naming
        return Finding(OUTSIDE, DEAD_RANK, [], Rung.WAITING, "low",
                       {**data, "decided": False, "silent": stopped, "stopped": stopped})
    return Finding(OUTSIDE, DEAD_RANK if peer_only else HANG, outside, Rung.WAITING, "medium", data)


def rule_same_collective(facts: FactSet) -> Finding | None:
    waiting = facts.inside()
    if not waiting or len(waiting) != len(facts.ranks):
        return None
    stacks = [i for i in facts.in_op if i.source in IN_OP_CALLS]
    ops, sites = {i.op for i in stacks}, {i.site for i in stacks}
    same = {"op": next(iter(ops)), "site": next(iter(sites))} if len(ops) == 1 and len(sites) == 1 else None
    return Finding(SAME_COLLECTIVE, COMM_HANG, [], Rung.WAITING, "low",
                   {"decided": False, "phase": "collective", "waiting": sorted(waiting), "same": same})
