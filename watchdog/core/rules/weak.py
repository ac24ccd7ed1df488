"""The weakest evidence, over facts: stacks no other rank shares (``SameStack``), and GPU use (``GpuUse``;
both made by ``core.live_facts``). Pure; findings and notes are data (``report.findings`` puts them in words)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..engine import Finding
from ..facts import FactSet, GpuUse, Rung, SameStack
from ..policy import VerdictPolicy
from ..ranks import outside_majority
from ..schema import COMM_HANG, HANG, raise_confidence
from .names import GPU, STACKS
from .waits import rule_same_collective as facts_same_collective

Note = tuple[str, dict[str, Any]]
"""A line of the verdict's evidence as data: what it says and its values (``report.findings.note_words``)."""


def stack_backing(
    stacks: Sequence[SameStack], present: int, initiators: Sequence[int]
) -> tuple[Note | None, bool | None]:
    """Does stack grouping agree (``present``: how many ranks answered)? (note, agreement) — None when stacks
    cannot tell."""
    if len(stacks) < 2:
        return None, None
    chosen = set(initiators)
    for s in stacks:
        if set(s.ranks) == chosen and len(s.ranks) < present / 2 + 0.01:
            return ("stacks_agree", {"ranks": list(s.ranks)}), True
    majority = stacks[0].ranks
    if chosen & set(majority) and len(majority) > 1:
        return ("stacks_disagree", {"ranks": sorted(chosen & set(majority))}), False
    return None, None


def rule_stacks(facts: FactSet) -> Finding | None:
    """The ranks outside the largest stack equivalence class, when they are a minority of ``facts.ranks``."""
    if len(facts.stacks) < 2:
        return None
    odd = outside_majority({s.signature: s.ranks for s in facts.stacks})
    if odd is None or len(odd) >= len(facts.ranks) / 2:
        return None
    return Finding(STACKS, HANG, list(odd), Rung.STACKS, "low", {"shape": "odd_stack"})


def rule_same_collective(inside: FactSet, gpu: Sequence[GpuUse], policy: VerdictPolicy) -> Finding | None:
    """Every live rank (``inside.ranks``) in the same Python-level collective (``inside``: the hook's
    ``IN_COLLECTIVE`` waits and ``counters`` calls, ``core.live_facts.in_collective_facts``): only outside
    evidence (GPU use) singles one out."""
    if not inside.ranks:
        return None
    # the one rule (``rules.waits.rule_same_collective``)
    shared = facts_same_collective(inside)
    if shared is None or shared.data["same"] is None:
        return None  # not every rank in one call: other rungs decide
    data = {"seq": inside.waits[0].seq, "op": inside.waits[0].op}
    idle = [g for g in gpu if g.util is not None and g.util <= policy.gpu_idle_pct]
    busy = [g for g in gpu if g.util is not None and g.util >= policy.gpu_busy_pct]
    absent = [g for g in gpu if g.missing]
    odd_gpu = absent or (idle if idle and busy and len(idle) < len(busy) else [])
    if odd_gpu:
        return Finding(GPU, COMM_HANG, sorted(g.rank for g in odd_gpu), Rung.GPU, "medium", {**data, "shape": "no_gpu"})
    return Finding(GPU, COMM_HANG, [], Rung.GPU, "low", {**data, "shape": "same_collective"})


def apply_gpu(finding: Finding, gpu: Sequence[GpuUse], live: Collection[int],
              policy: VerdictPolicy) -> tuple[Finding, Note | None]:
    """Back a hang finding with GPU use (``gpu``: what NVML read of the ``live`` ranks); never single a rank
    out on high utilisation alone. Returns the finding with what GPU use says (``data["gpu"]``, the confidence
    it raises) and that as a note for the evidence."""
    if finding.kind != HANG or not finding.ranks or not gpu:
        return finding, None
    initiators = set(finding.ranks)
    chosen = [r for r in sorted(live) if r in initiators]
    if not chosen:
        return finding, None
    use = {g.rank: g for g in gpu}
    read = [r for r in sorted(use) if r not in initiators and r in live]

    def _gpu_idle(r: int) -> bool:
        g = use.get(r)
        return g is not None and (g.missing or (g.util is not None and g.util <= policy.gpu_idle_pct))

    def _gpu_busy(r: int) -> bool:
        g = use.get(r)
        return g is not None and g.util is not None and g.util >= policy.gpu_busy_pct

    data = {"chosen": chosen, "busy_pct": policy.gpu_busy_pct}
    if read and all(_gpu_idle(r) for r in chosen) and all(_gpu_busy(r) for r in read):
        return (finding.adding(gpu="agrees").but(confidence=raise_confidence(finding.confidence)),
                ("gpu_agrees", {**data, "read": read}))
    if all(_gpu_busy(r) for r in live):
        return finding.adding(gpu="singles_nobody_out"), ("gpu_singles_nobody_out", data)
    if read and all(_gpu_busy(r) for r in chosen) and any(_gpu_idle(r) for r in read):
        idle = [r for r in read if _gpu_idle(r)]
        return finding.adding(gpu="disagrees"), ("gpu_disagrees", {**data, "idle": idle})
    return finding, None
