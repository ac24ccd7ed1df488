"""Evidence items (``core.evidence_items``) in words: one phrase per kind, the lines the verdict document's
``evidence`` always carried. ``verdict.stage`` renders them; ``rankwatch status`` phrases its live stragglers
here too. Pure."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..core import evidence_items as ei
from ..core.ranks import fmt_ranks

Phrase = Callable[[Any], str]


def _decided_locally(i: ei.DecidedLocally) -> str:
    if i.why == ei.STORE_UNREACHABLE:
        return f"local only: store unreachable ({i.error})"
    if i.why == ei.EVIDENCE_UNPUBLISHED:
        return f"local only: could not publish evidence ({i.error})"
    if i.why == ei.LEADER_REJECTED:
        return "local: no valid verdict from the leader in time (the value under verdict/ was rejected)"
    if i.why == ei.LEADER_SILENT:
        return "local: the leader gave no verdict in time (leader node down or its daemon restarted)"
    if i.why in (ei.HELD_AS, ei.HELD_MISSING):
        about = (f"it holds this node's evidence as {i.held[:32]}" if i.why == ei.HELD_AS
                 else f"it holds {fmt_ranks(i.ranks)} as never answered")
        return f"local: the leader decided without this node's evidence ({about}); this node holds its own ranks"
    if i.why == ei.REFUSED_UNAUTHENTICATED:
        return (f"local: refused the leader's unauthenticated verdict, it names {fmt_ranks(i.ranks)} as initiating "
                "but this node sees it making progress")
    return f"local: {i.why}"


_NODE_WHY = {
    ei.DELETED_AFTER_SEEN: "its evidence was deleted after it was seen",
    ei.OVER_READ_BUDGET: "the store held more than one look may read before its snapshot",
    ei.KEY_EMPTY_NODE_ALIVE: "its daemon publishes on but its evidence is not in the store (deleted)",
}


def _node_evidence(i: ei.NodeEvidence) -> str:
    why = i.error if i.why == ei.REJECTED else _NODE_WHY.get(i.why, i.why)
    what = f"node {i.node}: evidence {i.held} ({why})"
    if not i.judged:
        return f"{what}; its ranks are not judged here (tampering is no evidence about them)"
    snapshot = "last authenticated snapshot" if i.authenticated else "last snapshot"
    return f"{what}; its {fmt_ranks(i.judged)} judged on its {snapshot}"


def _no_evidence(i: ei.NoEvidenceFrom) -> str:
    where = f" (node(s) {', '.join(i.silent_nodes)} did not answer)" if i.silent_nodes else " (never seen)"
    return f"no evidence from {fmt_ranks(i.ranks)}{where}"


def _users(ranks: ei.Ranks) -> str:
    return f" (rank {', '.join(str(r) for r in ranks)})" if ranks else ""


def _xid(i: ei.GpuXid) -> str:
    meaning = ei.XID_MEANING.get(i.xid)
    return (f"GPU {i.device}{_users(i.ranks)}: XID {i.xid}" + (f" ({meaning})" if meaning else "")
            + f" {i.age_s:.1f}s after the watchdog started")


def _remap(i: ei.GpuRemap) -> str:
    what = "row remapping failed (the GPU needs service)" if i.failed else \
        "row remap pending (takes effect after a GPU reset)"
    return f"GPU {i.device}{_users(i.ranks)}: {what}"


_RAS_MISSING_RANK = {"dead": "considered dead", "incomplete": "reachable but not reporting this communicator",
                     "unresponsive": "did not respond"}


def ras_text(f: ei.RasFinding) -> str:
    """One NCCL RAS finding as RAS tells it (the evidence line adds ``NCCL RAS: ``)."""
    if f.comm is None:  # the job's processes, not one communicator's
        if f.what == "dead":
            return f"process {f.pid} on {f.host} considered dead by RAS"
        if f.what == "incomplete":
            return f"no communicator data from process {f.pid} on {f.host} (GPU {f.gpus})"
        if f.what == "timeout":
            return f"RAS hit {f.count} timeout(s) collecting data"
    comm = f"comm {f.name}"
    if f.what in _RAS_MISSING_RANK and f.ranks:
        pid = f" (pid {f.pid} on {f.host})" if f.pid is not None else ""
        return f"{comm}: rank {f.ranks[0]}{pid} {_RAS_MISSING_RANK[f.what]}"
    if f.what == "error":
        return f"{comm}: rank {f.ranks[0] if f.ranks else '?'} reported {f.error}"
    if f.what == "lagging":
        who = f"rank(s) {list(f.ranks)}" if f.ranks else f"{f.n_ranks} rank(s)"
        tail = " — unchanged since the previous query" if f.frozen else ""
        return f"{comm}: {who} at {f.op} #{f.count}, others at #{f.top}{tail}"
    if f.what == "stuck":
        return f"{comm}: collective counts did not move between two RAS queries"
    return f"{comm}: {f.what}"


def straggler_line(s: ei.StragglerBefore) -> str:
    """One live straggler, as ``rankwatch status`` shows it and an incident's evidence quotes it."""
    when = time.strftime("%H:%M:%SZ", time.gmtime(s.since_unix))
    since = f"since step {s.since_step}, " if s.since_step >= 0 else ""
    where = f" in {s.phase}" if s.phase != "all" else ""
    cause = f"; {s.cause_text}" if s.cause_text else ""
    return (f"{fmt_ranks([s.rank])}: {s.label}{where} — {since}first seen {when} ({max(0.0, s.ago_s):.0f} s ago): "
            f"{s.why}{cause}")


_WORDS: dict[str, Phrase] = {
    ei.Line.KIND: lambda i: i.line,
    ei.FrNote.KIND: lambda i: f"flight recorder: {i.note}",
    ei.DecidedLocally.KIND: _decided_locally,
    ei.NodeEvidence.KIND: _node_evidence,
    ei.UnauthenticatedExchange.KIND: lambda _i: (
        "the nodes' exchange was unauthenticated (no --store-secret-file): any process that reaches the store "
        "could have written or removed what other nodes said"),
    ei.NoEvidenceFrom.KIND: _no_evidence,
    ei.NotJudged.KIND: lambda i: (f"{fmt_ranks(i.ranks)} not judged: the store was tampered with, so silence is "
                                  "no evidence about them"),
    ei.PipelineFailed.KIND: lambda i: f"incident pipeline failed: {i.error_type}: {i.error}"[:300],
    ei.GpuXid.KIND: _xid,
    ei.GpuXidsOlder.KIND: lambda i: f"{i.count} older XID event(s) not listed",
    ei.GpuEcc.KIND: lambda i: f"GPU {i.device}{_users(i.ranks)}: {i.count} uncorrected ECC error(s) since driver load",
    ei.GpuRemap.KIND: _remap,
    ei.RasFinding.KIND: lambda i: f"NCCL RAS: {ras_text(i)}",
    ei.StragglerBefore.KIND: lambda i: f"before the stall, {straggler_line(i)}",
}


def evidence_words(item: ei.EvidenceItem) -> str:
    """The evidence line of one item."""
    phrase = _WORDS.get(item.KIND)
    return phrase(item) if phrase is not None else item.KIND.replace("_", " ")
