"""Naming the initiating rank: a pure function from rank views to a ``rankwatch.verdict/1`` document.

The evidence is one ladder shared with offline ``diagnose``, kept as data (``core.rules.ladder.LADDER``;
its live rows are ``EVIDENCE_LADDER``), strongest first: exits (by cause, then time,
``core.failures``; early normal exits while peers are mid-step) → stopped ranks → the flight recorder
(per process group: a mismatch at one seq, ranks behind or missing; it sees DDP's gradient all-reduces,
which Python-level counters do not) → Python-level counters (steps, collective seq and ops) → waiting vs
not waiting and the phase → a stack no other rank shares → GPU activity in a communication hang → a node
that never answered. Every rung is asked; the strongest that singles ranks out decides, weaker rungs
that agree back it, weaker rungs that single out someone else lower the confidence — both stated in the
evidence. A majority of ranks is named only on strong evidence (an exit, a stop, the flight recorder).
Stack grouping and GPU use back or question the decision. The odd-one-out and "behind" rules are the
shared ones of ``core.ranks``, as in the flight-recorder analysis and offline ``diagnose``.

GPU: a rank named as stuck outside the collective that reads ~0 % (or is missing from NVML's samples)
while its waiting peers spin at ~100 % backs the finding; everyone at ~100 % singles nobody out (a rank
stuck *inside* a kernel reads 100 % too), so it only adds a caution line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import engine
from .document import Collective, RankEntry, VerdictDocument
from .engine import Finding
from .evidence_items import EvidenceItem
from .facts import FactSet, PriorVerdict
from .facts import Rung as FactRung
from .live_facts import exit_facts, is_waiting, live_facts, stack_groups
from .policy import VerdictPolicy
from .ranks import fmt_ranks, fold_rank_lines
from .rules import names as n
from .rules.counters import UNCOMPARED
from .rules.ladder import EDGE_LABEL, LADDER, LIVE_LADDER, REFINEMENTS, LadderRung, LiveCase
from .rules.recorder import fr_doc
from .rules.weak import Note, apply_gpu, stack_backing
from .schema import UNKNOWN, lower_confidence, raise_confidence
from .snapshot import MISSING, RUNNING, RankView

DEFAULT_VERDICT_POLICY = VerdictPolicy()

__all__ = [
    "DEFAULT_VERDICT_POLICY",
    "Verdict",
    "decide",
    "fmt_ranks",
    "fold_rank_lines",
    "is_waiting",
    "rank_entry",
    "stack_groups",
]


@dataclass(frozen=True)
class Verdict:
    """The live decision as data: what the document is made of before its words are written
    (``verdict.stage.fill_words`` returns a copy with ``reason`` and ``evidence``)."""

    job_id: str
    incident_id: str
    kind: str
    initiating_ranks: list[int]
    phase: str | None
    confidence: str
    reason: str
    detected_after_s: float
    ranks: dict[str, RankEntry]
    evidence: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # what the words are made of (``verdict.stage`` fills ``reason`` and ``evidence``); not in the JSON
    finding: Finding | None = None  # the deciding finding
    found: dict[str, Finding | None] = field(default_factory=dict)  # every rung's, by rung name
    notes: list[Note] = field(default_factory=list)  # the evidence after the finding's own, as data
    # the caller's items beside the views (capture and exchange notes, GPU devices, NCCL RAS, live stragglers):
    # data in the document's ``evidence_items``, their words the last ``evidence`` lines
    evidence_items: tuple[EvidenceItem, ...] = ()

    def document(self) -> VerdictDocument:
        """The typed ``rankwatch.verdict/1`` document every sink carries."""
        x = self.extra
        missing = x.get("missing_ranks")
        return VerdictDocument(
            kind=self.kind,
            initiating_ranks=tuple(self.initiating_ranks),
            confidence=self.confidence,
            reason=self.reason,
            job_id=self.job_id,
            incident_id=self.incident_id,
            phase=self.phase,
            detected_after_s=self.detected_after_s,
            ranks=dict(self.ranks),
            evidence=tuple(self.evidence),
            decided_by=x.get("decided_by"),
            finding=x.get("finding"),
            missing_ranks=tuple(missing) if missing is not None else None,
            follows_incident=x.get("follows_incident"),
            flight_recorder=x.get("flight_recorder"),
            evidence_items=tuple(i.to_json() for i in self.evidence_items) if self.evidence_items else None,
        )

    def to_json(self) -> dict[str, Any]:
        return self.document().to_json()


def rank_entry(v: RankView) -> RankEntry:
    return RankEntry(
        node=v.node,
        pid=v.pid,
        state=v.state,
        step=v.step,
        phase=v.phase or "idle",
        in_phase_s=round(v.in_phase_s, 3),
        collective=Collective(v.coll_seq, v.coll_op or "") if v.coll_seq else None,
        gpu_util=v.gpu_util,
        stack_top=tuple(v.stack_top),
    )


def _phase_of(views: Sequence[RankView]) -> str | None:
    phases = {v.phase or "idle" for v in views}
    return phases.pop() if len(phases) == 1 else None


EVIDENCE_LADDER = LIVE_LADDER
"""The rungs the live verdict weighs, strongest first: the live rows of the one ladder (``core.rules.ladder``)."""
# what ``decided_by`` says for a rung (the names documents and dashboards already know)
_DECIDED_BY = {r.name: r.decided_by for r in LADDER if r.decided_by}


def _names_everyone(f: Finding, present: Sequence[RankView]) -> bool:
    """Names every rank that gave evidence: no single initiator ("a shared cause")."""
    return bool(present) and {v.rank for v in present} <= set(f.ranks)


def decide(
    views: Sequence[RankView],
    *,
    job_id: str,
    incident_id: str,
    detected_after_s: float,
    fr_facts: FactSet | None = None,
    policy: VerdictPolicy = DEFAULT_VERDICT_POLICY,
    prior: PriorVerdict | None = None,
    killed: Sequence[int] = (),
) -> Verdict:
    """The verdict for one incident over every rank's view (all nodes), as data: ``reason`` and
    ``evidence`` are left empty for ``verdict.stage`` (what every caller asks) to fill from
    ``finding``, ``found`` and ``notes``.

    Every rung of ``EVIDENCE_LADDER`` is asked; the strongest rung that names a rank decides, weaker ones
    that agree back it and weaker ones that single out someone else lower the confidence (both noted). A
    majority of ranks is named only on strong evidence. ``fr_facts`` (the flight recorder's facts,
    ``core.fr_facts``, from ``evidence.flight_recorder``) are what its rungs read; the views become facts
    in ``core.live_facts``. ``prior``/``killed``: the job was already decided and rankwatch killed
    ``killed`` for it (exits that follow are that kill's consequences, ``engine.after_kill``). ``finding``
    in the document is the structured conclusion (rule, ranks, strength, data).
    """
    views = sorted(views, key=lambda v: v.rank)
    missing = [v for v in views if v.state == MISSING]
    present = [v for v in views if v.state != MISSING]
    live = [v for v in present if v.state == RUNNING]
    case = LiveCase(views, present, live, fr_facts, policy, exit_facts(present, policy.exit_order_tolerance_s))
    found = _findings(case, prior, killed)
    notes: list[Note] = []
    finding = _conclude(found, case, missing, notes)
    if finding.ranks and finding.kind in ("hang", "collective_mismatch") and finding.rule != n.STACKS:
        note, agrees = stack_backing(case.seen().stacks, len(present), finding.ranks)
        if note is not None:
            notes.append(note)
        if agrees is False and finding.confidence == "high":
            finding = finding.but(confidence="medium")
    if missing:
        notes.append(("missing", {"ranks": [v.rank for v in missing]}))
    named = set(finding.ranks)
    chosen = [v for v in views if v.rank in named]
    return Verdict(
        job_id=job_id,
        incident_id=incident_id,
        kind=finding.kind,
        initiating_ranks=list(finding.ranks),
        phase=_phase_of(chosen) if chosen else None,
        confidence=finding.confidence,
        reason="",
        detected_after_s=detected_after_s,
        ranks={str(v.rank): rank_entry(v) for v in views},
        extra=_extra(finding, found, missing, case),
        finding=finding,
        found=found,
        notes=notes,
    )


def _findings(case: LiveCase, prior: PriorVerdict | None, killed: Sequence[int]) -> dict[str, Finding | None]:
    """What every rung of the ladder found, by rung name (each finding's ``rule`` set to it); the weaker
    rungs are asked only when no own exit, stop or shared failure already decides. An exit set aside as
    a consequence of a mismatch stays as ``exits_aborted`` (no rung: its words are quoted)."""
    ends = case.ends
    found: dict[str, Finding | None] = {}
    for r in LIVE_LADDER:
        if r.first and r.live is not None and (f := r.live(case)) is not None:
            found[r.name] = f.but(rule=r.name)
        elif r.first:
            found[r.name] = None
    for refine in REFINEMENTS:
        found = refine(found, ends)
    # an own exit or a stop decides and is never weighed: the graph and the weaker rungs are not needed ...
    decisive = any((f := found.get(r.name)) is not None and f.ranks for r in LIVE_LADDER if r.decisive)
    # ... and so does the same error on every rank, which names nobody (the job's own failure)
    # (wherever a refinement put it: exits that are all consequences still say so)
    labels = {r.label for r in LIVE_LADDER if r.decisive}
    decisive = decisive or any((f := found.get(r.name)) is not None and bool(f.data.get("same_failure"))
                               for r in LIVE_LADDER if r.label in labels)
    if prior is not None or not decisive:
        case.facts = live_facts(
            case.views, case.fr, exit_tolerance_s=case.policy.exit_order_tolerance_s,
            in_motion_s=case.policy.in_motion_s, prior=prior, killed=killed,
            ended=ends.ended,
        )
        for r in LIVE_LADDER:
            if r.live is not None and not r.first and (r.after_decision or not decisive):
                f = r.live(case)
                found[r.name] = f.but(rule=r.name) if f is not None else None
    return found


def _conclude(
    found: Mapping[str, Finding | None],
    case: LiveCase,
    missing: Sequence[RankView],
    notes: list[Note],
) -> Finding:
    """The deciding finding: the strongest rung that singles ranks out, weighed against the weaker ones;
    a finding naming nobody (or everyone) only when none does; else ``unknown``."""
    present = case.present
    ladder = [r for r in EVIDENCE_LADDER if found.get(r.name) is not None]
    singling = [r for r in ladder if (f := found[r.name]) is not None and f.ranks and not _names_everyone(f, present)]
    rung = singling[0] if singling else (ladder[0] if ladder else None)
    finding = found[rung.name] if rung is not None else None
    if finding is not None and rung is not None and not rung.final:
        # the stopped or dead cannot be second-guessed; everything else is weighed against the weaker rungs
        finding = _weigh(finding, rung, found, present, notes)
        gpu_use = case.seen().gpu if case.live else []
        finding, gpu = apply_gpu(finding, gpu_use, {v.rank for v in case.live} if gpu_use else set(), case.policy)
        if gpu is not None:
            notes.append(gpu)
    if finding is None and missing:
        return Finding("", UNKNOWN, sorted(v.rank for v in missing), FactRung.SILENCE, "low",
                       {"shape": "no_answer", "node": missing[0].node})
    if finding is None:
        return Finding("", UNKNOWN, [], FactRung.SILENCE, "low", {"shape": "nothing"})
    return finding


def _extra(
    finding: Finding,
    found: Mapping[str, Finding | None],
    missing: Sequence[RankView],
    case: LiveCase,
) -> dict[str, Any]:
    """The verdict document's own fields: which rung decided, the structured finding, the flight
    recorder's role."""
    decided_by = _DECIDED_BY.get(finding.rule, finding.rule) or "none"
    if finding.rule == engine.WAIT_FOR:
        decided_by = _wait_for_label(finding, found)
    extra: dict[str, Any] = {
        "decided_by": decided_by,
        "finding": _finding_doc(finding, decided_by),
        "missing_ranks": [v.rank for v in missing],
    }
    if finding.rule == engine.AFTER_KILL:
        extra["follows_incident"] = finding.data.get("follows_incident")
    if case.fr is not None:
        fr_role = "decided" if decided_by == n.FLIGHT_RECORDER else _fr_role(
            found.get(n.FLIGHT_RECORDER) or found.get(n.FR_BEHIND), finding)
        extra["flight_recorder"] = {**fr_doc(case.fr, case.fr_rows()), "role": fr_role}
    return extra


def _finding_doc(finding: Finding, decided_by: str) -> dict[str, Any]:
    """The structured finding of the document, with what weighing added (``backed_by``, ``questioned_by``,
    ``gpu``): the engine's own strength, else the ladder name that decided."""
    doc = finding.to_json()
    if finding.rule not in (engine.WAIT_FOR, engine.AFTER_KILL):
        doc["rule"], doc["strength"] = finding.rule or "none", decided_by
    return doc


def _wait_for_label(f: Finding, found: Mapping[str, Finding | None]) -> str:
    """The ladder name of the strongest evidence a wait-for finding rests on: its edges', or a rung that lends
    its name (``LadderRung.lends_label``) when it names the same ranks (the flight recorder's, then the
    counters')."""
    if f.kind == "comm_hang" or f.data.get("peer_ended"):
        return n.MISSING_NODE  # the sinks are a node that never answered (gone, when its peers saw it close)
    if f.kind == "stopped_rank":
        return n.STOPPED
    label = EDGE_LABEL.get(f.data.get("edge_strength", FactRung.WAITING), n.WAITING)
    for r in LADDER:
        other = found.get(r.name)
        if not r.lends_label or other is None or set(other.ranks) != set(f.ranks):
            continue
        if label in (n.WAITING, n.COUNTERS):
            return r.lends_label if label == n.WAITING or r.lends_label == n.FLIGHT_RECORDER else label
    return label


def _fr_role(fr: Finding | None, finding: Finding) -> str:
    if fr is None or not fr.ranks:
        return "none"
    return "backed" if set(fr.ranks) == set(finding.ranks) else "disagreed"


def _weigh(
    finding: Finding, rung: LadderRung, found: Mapping[str, Finding | None], present: Sequence[RankView],
    notes: list[Note],
) -> Finding:
    """Back or question the decision with every weaker rung (each a ``weighed`` note); refuse to blame a
    majority on weak evidence. Returns the weighed finding (the rung's own is left as it was)."""
    chosen = set(finding.ranks)
    below = list(EVIDENCE_LADDER)[[r.name for r in EVIDENCE_LADDER].index(rung.name) + 1 :]
    # ranks the graph shows waiting for a named peer: a weaker rung that names them beside the sinks (a TP
    # peer waiting in its own collective has a stack nobody else shares) says nothing against the sinks
    graph = finding.data if rung.name == n.WAIT_FOR else {}
    named_waiters = set(graph.get("waiters", ())) - set(graph.get("via_anyone", ()))
    confidence, backed_by, questioned_by = finding.confidence, [], []
    for r in below:
        other = found.get(r.name)
        if other is None or not other.ranks or _names_everyone(other, present):
            continue
        if r.name in rung.subsumes and set(other.ranks) != chosen:
            continue
        if other.data.get("shape") in UNCOMPARED:
            continue  # "every live rank stuck alike" (or the only one) singles nobody out: not backing
        about = {"rung": r.name, "ranks": list(other.ranks)}
        if (extra := set(other.ranks) - chosen) and extra <= named_waiters and chosen <= set(other.ranks):
            notes.append(("weighed", {**about, "how": "named_waiters", "waiters": sorted(extra)}))
        elif set(other.ranks) == chosen:
            backed_by.append(r.name)
            notes.append(("weighed", {**about, "how": "agrees"}))
            if r.backs:
                confidence = raise_confidence(confidence)
        elif set(other.ranks) <= set(finding.data.get("aborted_receivers", ())):
            # the receivers gloo aborted: their ends, which the deciding finding explains, are all it read
            notes.append(("weighed", {**about, "how": "consequence"}))
        elif len(other.ranks) < len(present) / 2:
            questioned_by.append(r.name)
            notes.append(("weighed", {**about, "how": "instead"}))
            confidence = lower_confidence(confidence)
        else:
            notes.append(("weighed", {**about, "how": "majority"}))
    data: dict[str, Any] = {}
    if backed_by:
        data["backed_by"] = [*finding.data.get("backed_by", ()), *backed_by]
    if questioned_by:
        data["questioned_by"] = [*finding.data.get("questioned_by", ()), *questioned_by]
    if not rung.strong and finding.ranks and len(finding.ranks) > len(present) / 2:
        confidence = "low"
        data["majority_on_weak_evidence"] = True
        notes.append(("weak_majority", {"rung": rung.name, "named": len(finding.ranks), "of": len(present)}))
    return finding.adding(**data).but(confidence=confidence)
