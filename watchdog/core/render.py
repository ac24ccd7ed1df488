"""Findings of the engine (``core.engine``) in words: the one place their reason and evidence lines are
written, so rules stay data and tests assert on structures."""

from __future__ import annotations

from collections.abc import Mapping

from .engine import AFTER_KILL, WAIT_FOR, Finding
from .facts import Rung
from .phases import GRAD_SYNC, PHASE_FAMILY
from .ranks import fmt_ranks, ranks_verb
from .snapshot import RankView

_PHASE_KIND = {p: f for p, f in PHASE_FAMILY.items() if p != GRAD_SYNC}  # grad_sync: not a stuck phase


def phase_kind(phase: str | None) -> str:
    """What a phase says about the cause, in the words an on-call engineer uses."""
    if phase in _PHASE_KIND:
        return _PHASE_KIND[phase or ""]
    if phase in (None, "idle"):
        return "between phases"
    return f"declared phase '{phase}'"


_VIA = {
    Rung.FLIGHT_RECORDER: "the flight recorder (per process group: who has not entered what its peers wait in)",
    Rung.COUNTERS: "the collective counters (who has not entered the collective its peers wait in)",
    Rung.WAITING: "waiting states (ranks blocked on peers whose peer is not named)",
    Rung.STACKS: "stacks blocked in a wait",
    Rung.EXIT_CAUSE: "exits that are consequences (timeouts, lost peers)",
}


def reason(f: Finding, views: Mapping[int, RankView]) -> str:
    """The one-line reason of an engine finding."""
    who = fmt_ranks(f.ranks)
    if f.rule == AFTER_KILL:
        ended = fmt_ranks(f.data.get("ended", ()))
        return (
            f"{ended} ended after rankwatch killed the job for incident {f.data.get('follows_incident')}: "
            f"consequences of that kill, not a new failure; the initiator stays {who}"
        )
    if f.rule != WAIT_FOR:
        return f"{who}: {f.rule}"
    waiters = f.data.get("waiters", ())
    lead = views.get(f.ranks[0]) if f.ranks else None
    if f.kind == "comm_hang":
        nodes = ", ".join(f.data.get("silent_nodes") or ()) or "unknown"
        return (
            f"every rank that answered waits for {who}, on node(s) {nodes} that never answered: "
            f"{who} are the likeliest cause"
        )
    if f.kind == "stopped_rank":
        return f"{who} is stopped (SIGSTOP or a debugger); {ranks_verb(waiters, 'waits', 'wait')} for it"
    if f.kind == "dead_rank" and f.data.get("silent_nodes"):
        nodes = ", ".join(f.data["silent_nodes"])
        return (
            f"{who} on node(s) {nodes} never answered and {fmt_ranks(f.data.get('peer_ended', ()))} lost the "
            f"connection to them (closed or reset by peer): their processes are gone; "
            f"{ranks_verb(waiters, 'waits', 'wait')} for them"
        )
    if f.kind == "dead_rank":
        return f"{who} ended by its own cause; {ranks_verb(waiters, 'waits', 'wait')} for it"
    where = ""
    if lead is not None:
        where = f" in {phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step} for {lead.in_phase_s:.1f}s"
    return f"{who} waits for nobody{where} while {ranks_verb(waiters, 'waits', 'wait')} for it"


def evidence(f: Finding) -> list[str]:
    """Evidence lines of an engine finding."""
    if f.rule != WAIT_FOR:
        return []
    edge = f.data.get("edge_strength", Rung.WAITING)
    lines = [
        f"wait-for graph: {len(f.data.get('waiters', ()))} rank(s) wait; the sink(s) {fmt_ranks(f.ranks)} "
        f"wait for nobody (edges from {_VIA.get(edge, str(edge))})"
    ]
    anyone = f.data.get("via_anyone") or ()
    if anyone:
        lines.append(f"{fmt_ranks(anyone)} cannot say whom they wait for (p2p peer or timeout unknown)")
    return lines
