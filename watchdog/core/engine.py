"""The one engine: facts → wait-for graph → sinks = initiators, as a structured ``Finding``.

The live verdict (``core.verdict.decide``) and the offline diagnosis (``diagnose.reasoning``) both turn
their sources into a ``FactSet`` (``core.live_facts``, ``diagnose.log_facts``) and ask ``blame``. Findings
are data (rule, ranks, strength, data) — every live rung returns this type too; ``report.findings`` turns
them into words.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import schema
from .facts import Busy, FactSet, PriorVerdict, Rung
from .ranks import outside_majority
from .snapshot import STEP_PHASE_ORDER
from .waitgraph import build, sinks

# rule names (the ``rule`` of a Finding; tests and reports key on them)
WAIT_FOR = "wait_for"  # sinks of the wait-for graph
AFTER_KILL = "after_kill"  # exits that follow rankwatch's own kill of an earlier incident's ranks


@dataclass(frozen=True)
class Finding:
    """One rule's conclusion: which ranks, how strong, and the data a renderer needs. Frozen: weighing,
    naming a rung and adding data make a new one (``but``, ``adding``), so a rung's own finding is never
    changed by what another rung or the weighing concluded."""

    rule: str
    kind: str
    ranks: list[int]
    strength: Rung
    confidence: str
    data: Mapping[str, Any] = field(default_factory=dict)

    def but(self, **changes: Any) -> Finding:
        """This finding with ``changes`` (``rule``, ``confidence``, ...)."""
        return replace(self, **changes)

    def adding(self, **data: Any) -> Finding:
        """This finding with ``data`` added to (or replacing keys of) its data."""
        return replace(self, data={**self.data, **data})

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "ranks": list(self.ranks),
            "strength": self.strength.label,
            "data": jsonable(self.data),
        }


MAX_LISTED_RANKS = 64
"""Rank sets in a finding's data up to this size are lists; larger ones are ``{"count", "first"}`` (the
first ones, in order): the document crosses the store for every node, and the ranks table and
``initiating_ranks`` already hold every rank."""


def jsonable(v: Any) -> Any:
    """Finding data as JSON: rank sets as sorted lists (large ones bounded), rungs by name, keys as
    strings."""
    if isinstance(v, frozenset | set | tuple | list):
        if all(type(x) is int for x in v):
            ranks = sorted(v) if isinstance(v, frozenset | set) else list(v)  # a list keeps its order
            return ranks if len(ranks) <= MAX_LISTED_RANKS else {"count": len(ranks), "first": ranks[:MAX_LISTED_RANKS]}
        return [jsonable(x) for x in v]
    if isinstance(v, Rung):
        return v.label
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    return v


def after_kill(facts: FactSet) -> Finding | None:
    """rankwatch already decided this job and killed its ranks: what ends now (peers that lost the killed
    ranks, ranks torchrun tears down) follows that kill. Nobody new is blamed: the earlier initiators are."""
    prior = facts.prior
    if prior is None or not prior.killed or not facts.ended:
        return None
    killed = {k.rank for k in facts.killed}
    fresh_own = [e.rank for e in facts.ended if e.own and e.rank not in killed and e.cause]
    if fresh_own:
        return None  # a rank that failed by its own stated cause is news, whatever came before
    if any(e.pid is not None and prior.pids.get(e.rank, e.pid) != e.pid for e in facts.ended):
        return None  # another process than the one decided (torchrun restarted the workers): a new run
    ended = sorted({e.rank for e in facts.ended})
    return Finding(
        AFTER_KILL,
        schema.DEAD_RANK,
        list(prior.ranks),
        Rung.EXIT_CAUSE,
        "high",
        {"follows_incident": prior.incident_id, "ended": ended, "killed": sorted(killed)},
    )


def blame(facts: FactSet) -> Finding | None:
    """The sinks of the wait-for graph, named when at least one rank waits and not everyone is a sink."""
    graph = build(facts)
    found = sinks(graph)
    if not found.waiters or not found.sinks:
        return None
    top = max(found.sinks.values())
    chosen = sorted(r for r, s in found.sinks.items() if s == top)
    busy = {b.rank: b for b in facts.busy}
    silent = {s.rank for s in facts.silent}
    if silent and chosen and all(r in silent or (r in busy and busy[r].moving) for r in found.sinks):
        # the live ranks waited for were all caught mid-step (``VerdictPolicy.in_motion_s``) while part of the
        # job never answered: their waits are the step's ordinary ones, the silent ranks what holds it
        top, chosen = Rung.SILENCE, sorted(silent & set(found.sinks)) or sorted(silent)
        found = replace(found, sinks={**found.sinks, **dict.fromkeys(chosen, Rung.SILENCE)})
    if chosen and all(r in busy for r in chosen) and len(chosen) > 1:
        chosen = _refine_by_phase([busy[r] for r in chosen])
    chosen = _still_in_step(facts, chosen)
    present = set(facts.ranks) - silent
    if present and present <= set(chosen):
        return None  # names every rank that gave evidence: a shared cause, not a sink
    kind = _kind_of(facts, chosen)
    edge_strength = max(
        [s for per in graph.edges.values() for s in per.values()] + list(graph.anyone.values()), default=Rung.WAITING
    )
    known_edges = bool(found.waiters - found.via_anyone)  # some waiter said whom it waits for
    strength = top if top >= Rung.STOPPED else max(top, edge_strength)
    confidence = "high" if len(chosen) < len(found.waiters) else "medium"
    if chosen and set(chosen) <= silent:
        confidence = "medium"  # silence is the weakest evidence: a node can be slow to answer
    if len(chosen) > len(facts.ranks) / 2:
        confidence = "low"
    return Finding(
        WAIT_FOR,
        kind,
        chosen,
        strength,
        confidence,
        {
            "sinks": {r: found.sinks[r] for r in chosen},
            "waiters": found.waiters,
            "via_anyone": found.via_anyone,
            "known_edges": known_edges,
            "edge_strength": edge_strength,
            "phases": {r: busy[r].phase for r in chosen if r in busy},
            "silent_nodes": sorted({s.node for s in facts.silent if s.node and s.rank in chosen}),
            "peer_ended": sorted(e.rank for e in facts.ended if e.peer_ended) if set(chosen) <= silent else [],
        },
    )


def _kind_of(facts: FactSet, chosen: list[int]) -> str:
    ranks = set(chosen)
    if ranks & {e.rank for e in facts.ended if e.own}:
        return schema.DEAD_RANK
    if ranks & {s.rank for s in facts.stopped}:
        return schema.STOPPED_RANK
    if ranks <= {s.rank for s in facts.silent}:
        # a survivor's connection closed or reset by its peer: the silent node's processes are gone (dead),
        # not hanging or cut off (a frozen or unreachable node gives timeouts, never a closed connection)
        return schema.DEAD_RANK if any(e.peer_ended for e in facts.ended) else schema.COMM_HANG
    return schema.HANG


def _still_in_step(facts: FactSet, chosen: list[int]) -> list[int]:
    """Several ended sinks (ranks a report named, then torn down by the launcher): those whose record was in a
    stage of the step had not reached what the report waited in; one between phases had (late, under load: a
    monitored barrier names every rank not there by its timeout). All or none in a stage: the report stands."""
    if len(chosen) < 2:
        return chosen
    phase_of = {e.rank: e.phase for e in facts.ended}
    if not all(r in phase_of for r in chosen):
        return chosen
    staged = [r for r in chosen if STEP_PHASE_ORDER.get(phase_of[r] or "", 0) > 0]
    return staged if staged else chosen


def _refine_by_phase(busy: list[Busy]) -> list[int]:
    """Several ranks wait for nobody: the odd phase out, else the one earliest in the step."""
    by_phase: dict[str | None, list[int]] = defaultdict(list)
    for b in busy:
        by_phase[b.phase].append(b.rank)
    if len(by_phase) < 2:
        return sorted(b.rank for b in busy)
    odd = outside_majority(by_phase)
    if odd is not None:
        return list(odd)
    earliest = min(by_phase, key=lambda p: STEP_PHASE_ORDER.get(p or "", 0))
    return sorted(by_phase[earliest])



def prior_verdict(verdicts: Sequence[Mapping[str, Any]], *, killed: bool) -> PriorVerdict | None:
    """The job's last verdict as a fact for the next incident, when rankwatch kills on a stall (``killed``):
    exits that follow that kill are its consequences (``after_kill``). None without a kill or a verdict."""
    if not killed or not verdicts:
        return None
    last = verdicts[-1]
    ranks = last.get("initiating_ranks")
    if not isinstance(ranks, list) or not ranks or any(type(r) is not int for r in ranks):
        return None
    table = last.get("ranks")
    pids: dict[int, int] = {}
    if isinstance(table, Mapping):
        for key, entry in list(table.items())[:65_536]:
            pid = entry.get("pid") if isinstance(entry, Mapping) else None
            if isinstance(key, str) and key.isdigit() and type(pid) is int:
                pids[int(key)] = pid
    return PriorVerdict(str(last.get("incident_id") or "")[:128], tuple(ranks[:4096]), killed=True, pids=pids)
