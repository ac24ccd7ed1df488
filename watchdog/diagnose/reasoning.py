"""Evidence from logs → who started it, through the same engine as the live verdict.

Log lines become typed facts (``diagnose.log_facts`` → ``core.facts``), the fact rules decide
(``core.rules.ladder``: rankwatch's own verdict → an end by its own cause → a mismatch → the wait-for graph
→ a lone collective → behind → outside → the same collective → a launcher's report), and the finding is
put in words by ``report.findings``. What is left here is the document: each rank's entry, the lines that
back the finding (quoted from the logs) and what every other rank did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.document import Collective, Offline, RankEntry, VerdictDocument
from ..core.engine import Finding
from ..core.policy import OfflinePolicy
from ..core.ranks import fmt_ranks
from ..report.findings import words
from ..verdict import decide_facts
from . import events as ev
from . import log_facts
from .activity import activity
from .facts import Evidence, RankFacts
from .log_facts import finished as _finished
from .log_facts import is_waiting as _is_waiting
from .log_facts import primary_events

__all__ = ["DEFAULT_POLICY", "Diagnosis", "Policy", "diagnose_evidence", "fmt_ranks", "quote"]

Policy = OfflinePolicy  # the thresholds live in core.policy with the others; the old name stays
DEFAULT_POLICY = OfflinePolicy()


@dataclass
class Diagnosis:
    kind: str
    initiating_ranks: list[int]
    confidence: str
    reason: str
    next_action: str
    phase: str | None = None
    evidence: list[str] = field(default_factory=list)
    others: dict[int, str] = field(default_factory=dict)  # what every other rank was doing
    decided: bool = True
    would_decide: str = ""  # when undecided: what evidence would decide
    notes: list[str] = field(default_factory=list)
    ranks: dict[str, RankEntry] = field(default_factory=dict)
    rule: str = "none"  # which rule decided (the document's ``finding``)
    finding: Finding | None = None  # the rule's structured conclusion (what tests assert on)

    def document(self) -> VerdictDocument:
        """The typed ``rankwatch.verdict/1`` document (``source: logs``: no job, incident or detection delay)."""
        found: dict[str, Any] = {"rule": self.rule, "ranks": list(self.initiating_ranks), "data": {}}
        if self.finding is not None:
            found = self.finding.to_json()
        found["data"]["decided"] = self.decided
        return VerdictDocument(
            kind=self.kind,
            initiating_ranks=tuple(self.initiating_ranks),
            confidence=self.confidence,
            reason=self.reason,
            phase=self.phase,
            ranks=dict(self.ranks),
            evidence=tuple(self.evidence),
            finding=found,
            source="logs",
            offline=Offline(self.decided, self.next_action, self.would_decide or None, tuple(self.notes)),
        )

    def to_json(self) -> dict[str, Any]:
        return self.document().to_json()


def quote(e: ev.Event) -> str:
    if e.family == ev.RANK_SEEN:
        return f"{e.file}:0: (this rank's own log is empty of errors)"
    return f"{e.file}:{e.line}: {e.text}"


def _quoted(f: Finding, logs: Evidence) -> Finding:
    """The finding with what its words quote from the logs (rankwatch's own line; the ranks seen)."""
    if f.rule == "rankwatch_verdict":
        return f.adding(line=log_facts.rankwatch_lines(logs)[0].text)
    if f.rule == "none":
        return f.adding(seen=sorted(logs.ranks))
    return f


def _several_nodes(logs: Evidence) -> bool:
    """The log shows more than one node: lines from several hosts, or a stated world larger than every rank
    it names."""
    hosts = {e.host for f in logs.ranks.values() for e in f.first.values() if e.host}
    return len(hosts) > 1 or (bool(logs.ranks) and logs.world > max(logs.ranks) + 1)


def _local_only(f: Finding, logs: Evidence) -> Finding:
    """Ranks known only by a local rank (a ``[defaultN]`` prefix, a per-rank log path, no failure report that
    maps them) equal global ranks on one node only: on a log of several nodes the rank named may be another
    node's, so it is named at low confidence, never as a decision."""
    if not logs.local_only or not f.ranks or not _several_nodes(logs):
        return f
    return f.but(confidence="low").adding(decided=False, local_ranks_only=True)


def _backing(f: Finding, logs: Evidence, p: OfflinePolicy) -> tuple[list[str], list[str]]:
    """The lines that back a finding (quoted from the logs), and its notes."""
    facts, d = logs.ranks, f.data
    if f.rule == "rankwatch_verdict":
        return [quote(log_facts.rankwatch_lines(logs)[0])], []
    if f.rule == "exit_cause":
        if d.get("same_failure") or d.get("all_failed"):
            return [quote(evs[0]) for r in d["failed"][:4] if (evs := primary_events(facts[r], p))], []
        return [quote(e) for e in primary_events(facts[f.ranks[0]], p)[:3]], []
    if f.rule == "mismatch" and d.get("source") == "size":
        e = facts[d["noticed"][0]].first.get(ev.SIZE_MISMATCH) or log_facts.unowned_size_mismatch(logs)
        return ([quote(e)] if e is not None else []), []
    if f.rule == "wait_for":
        lead = facts.get(f.ranks[0])
        line = (lead.first.get(ev.DESYNC) or next(iter(lead.ops.values()), None)) if lead is not None else None
        return ([quote(line)] if line is not None else []), [f"decided by the wait-for graph ({d.get('source')})"]
    return [], []


def diagnose_evidence(logs: Evidence, p: Policy = DEFAULT_POLICY) -> Diagnosis:
    """The verdict of one job's logs: facts → the fact rules → the document, in words."""
    known = sorted(logs.ranks)
    facts = logs.ranks
    found = _local_only(_quoted(decide_facts(log_facts.facts_of(logs, p), p), logs), logs)
    backing, notes = _backing(found, logs, p)
    w = words(found)
    d = Diagnosis(
        kind=found.kind,
        initiating_ranks=list(found.ranks),
        confidence=found.confidence,
        reason=w.reason,
        next_action=w.next_action,
        phase=found.data.get("phase"),
        evidence=backing,
        decided=bool(found.data.get("decided", True)),
        would_decide=w.would_decide,
        notes=notes,
        rule=found.rule,
        finding=found,
    )
    d.ranks = {str(r): _rank_doc(facts[r]) for r in known}
    d.others = {r: activity(facts[r]) for r in known if r not in d.initiating_ranks}
    # back the verdict with each initiator's own lines, then a few from the others
    quoted: list[str] = list(d.evidence)
    for r in d.initiating_ranks + [r for r in known if r not in d.initiating_ranks]:
        f = facts.get(r)
        if f is None:
            continue
        told = [e for e in f.first.values() if e.family != ev.RANK_SEEN]
        mine = sorted(told, key=lambda e: (e.file, e.line))
        if r not in d.initiating_ranks:
            # one line per other rank: what it waited on, else whatever it said
            mine = [e for e in mine if e.family in ev.WAITING | ev.MISMATCH][:1] or mine[:1]
        silent = [e for e in f.first.values() if e.family == ev.RANK_SEEN and e.detail == "path"]
        if silent and not any(e.file == silent[0].file for e in told):
            mine.append(silent[0])  # its own log exists and says nothing: evidence of absence
        for e in mine[: p.evidence_per_rank]:
            q = quote(e)
            if q not in quoted:
                quoted.append(q)
    for e in logs.unattributed[:3]:
        quoted.append(quote(e))
    d.evidence = quoted[: p.max_evidence]
    d.notes.extend(w.notes)
    if found.data.get("local_ranks_only"):
        d.notes.append(
            "the log shows several nodes but names these ranks only by their local rank (per-rank log paths or "
            "[defaultN] prefixes, no failure report to map them): the rank named may be another node's, so it "
            "is a guess."
        )
    elif logs.local_only:
        d.notes.append(
            "some ranks are named by local rank only (per-rank log paths or [defaultN] prefixes, no "
            "failure report to map them): they equal global ranks only on a single-node job."
        )
    if logs.slurm_cancel is not None:
        d.notes.append(f"Slurm: {logs.slurm_cancel.detail} ({quote(logs.slurm_cancel)})")
    if logs.dump_paths:
        d.notes.append("flight-recorder dumps were written to: " + ", ".join(logs.dump_paths[:4]))
    if logs.straggler is not None:
        d.notes.append(straggler_note(logs.straggler, logs.straggler_cause))
    return d


def straggler_note(diag: ev.Event, cause: ev.Event | None) -> str:
    """rankwatch's own straggler diagnosis and its cause, read back from its summary in the log."""
    label, who, phase = [*diag.detail.split("|"), "", ""][:3]
    note = f"rankwatch's own summary ({diag.file}:{diag.line}) named a straggler: {label} — {who}"
    note += f" in {phase}" if phase else ""
    if cause is not None:
        name, _, text = cause.detail.partition("|")
        note += f"; cause: {name} — {text}"
    return note


def _rank_doc(f: RankFacts) -> RankEntry:
    e = f.exit
    state = "unknown"
    if f.has(ev.PRIMARY):
        state = "failed"
    elif _is_waiting(f):
        state = "waiting"
    elif _finished(f):
        state = "exited"
    if e is not None and e.signal:
        state = "killed" if e.signal in ("SIGKILL", "SIGTERM") else "crashed"
    elif e is not None and e.exitcode is not None:
        state = "exited"
    coll = None
    if f.nccl_timeout is not None:
        coll = Collective(f.nccl_timeout.seq, f.nccl_timeout.op or "")
    elif f.traceback is not None and f.traceback.op:
        coll = Collective(None, f.traceback.op)
    host = next((x.host for x in f.first.values() if x.host), None)
    return RankEntry(
        node=host,
        pid=e.pid if e is not None else None,
        state=state,
        phase=f.traceback.phase if f.traceback is not None else None,
        collective=coll,
        stack_top=(f.traceback.detail,) if f.traceback is not None and f.traceback.detail else (),
    )
