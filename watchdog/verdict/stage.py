"""The verdict stage: the one place a decision is entered. Live, ``decide`` — ``core.verdict.decide`` (data,
weighed over the registry of rungs) with its ``reason`` and ``evidence`` written in words
(``report.findings``) — is what every live caller asks (the incident pipeline, ``rankwatch inspect``, the
cross-node exchange, benchmarks); offline, ``decide_facts`` is the same registry's first rung that
concludes over a log's facts (``diagnose``). The rules in ``core`` hand over only structured findings;
the words come from ``report``; nothing decides anywhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..core.engine import Finding
from ..core.evidence_items import EvidenceItem
from ..core.facts import FactSet, PriorVerdict
from ..core.policy import OfflinePolicy, VerdictPolicy
from ..core.ranks import fold_rank_lines
from ..core.rules.ladder import decide as decide_ladder
from ..core.snapshot import RankView
from ..core.verdict import DEFAULT_VERDICT_POLICY, Verdict
from ..core.verdict import decide as decide_data
from ..report.evidence_words import evidence_words
from ..report.findings import words
from ..report.live_words import LiveContext, note_words


def fill_words(verdict: Verdict, views: Sequence[RankView], extra_evidence: Sequence[EvidenceItem] = (), *,
               steps_known: bool = True) -> Verdict:
    """Write the verdict's reason and evidence from its finding and notes; ``extra_evidence`` (the items the
    caller holds beside the views: capture and exchange notes, the flight recorder's per-group lines, GPU
    devices, NCCL RAS, live stragglers) follows them, each in its words (``report.evidence_words``).
    ``steps_known``: False where no record gave step counters (``inspect``): the reason names no step."""
    items = tuple(extra_evidence)
    if verdict.finding is None:  # nothing decided, nothing to say (as before the items)
        return verdict
    ctx = LiveContext(sorted(views, key=lambda v: v.rank), verdict.found, steps_known)
    said = words(verdict.finding, ctx)
    lines = [*said.evidence, *(note_words(n, ctx) for n in verdict.notes), *(evidence_words(i) for i in items)]
    return replace(verdict, reason=said.reason, evidence=fold_rank_lines(lines), evidence_items=items)


def decide(
    views: Sequence[RankView],
    *,
    job_id: str,
    incident_id: str,
    detected_after_s: float,
    extra_evidence: Sequence[EvidenceItem] = (),
    fr_facts: FactSet | None = None,
    policy: VerdictPolicy = DEFAULT_VERDICT_POLICY,
    prior: PriorVerdict | None = None,
    killed: Sequence[int] = (),
    steps_known: bool = True,
) -> Verdict:
    """``core.verdict.decide`` in words: the verdict document every sink (bundle, alert, console) reads."""
    verdict = decide_data(views, job_id=job_id, incident_id=incident_id, detected_after_s=detected_after_s,
                          fr_facts=fr_facts, policy=policy, prior=prior, killed=killed)
    return fill_words(verdict, views, extra_evidence, steps_known=steps_known)


def decide_facts(facts: FactSet, policy: OfflinePolicy) -> Finding:
    """Offline: the first rung of the registry that concludes over a log's facts (``core.rules.ladder``)."""
    return decide_ladder(facts, policy)
