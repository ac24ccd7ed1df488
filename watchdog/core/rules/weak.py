"""The weakest evidence: stacks no other rank shares, and GPU activity. Pure; findings and notes are data
(``report.findings`` puts them in words)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..engine import Finding
from ..facts import IN_COLLECTIVE, FactSet, InOp, Rung, Waits
from ..policy import VerdictPolicy
from ..ranks import outside_majority
from ..schema import COMM_HANG, HANG, raise_confidence
from ..snapshot import RankView
from .names import GPU, STACKS
from .waits import rule_same_collective as facts_same_collective


def stack_groups(views: Sequence[RankView]) -> list[tuple[str, list[int]]]:
    """Ranks grouped by stack signature, largest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for v in views:
        if v.stack_signature:
            groups[v.stack_signature].append(v.rank)
    return sorted(((sig, sorted(r)) for sig, r in groups.items()), key=lambda g: (-len(g[1]), g[1][0]))


Note = tuple[str, dict[str, Any]]
"""A line of the verdict's evidence as data: what it says and its values (``report.findings.note_words``)."""


def stack_backing(views: Sequence[RankView], initiators: Sequence[int]) -> tuple[Note | None, bool | None]:
    """Does stack grouping agree? (note, agreement) — None when stacks cannot tell."""
    groups = stack_groups(views)
    if len(groups) < 2:
        return None, None
    chosen = set(initiators)
    for _sig, ranks in groups:
        if set(ranks) == chosen and len(ranks) < len(views) / 2 + 0.01:
            return ("stacks_agree", {"ranks": ranks}), True
    majority = groups[0][1]
    if chosen & set(majority) and len(majority) > 1:
        return ("stacks_disagree", {"ranks": sorted(chosen & set(majority))}), False
    return None, None


def rule_stacks(present: Sequence[RankView]) -> Finding | None:
    groups = stack_groups(present)
    if len(groups) < 2:
        return None
    odd = outside_majority(dict(groups))
    if odd is None or len(odd) >= len(present) / 2:
        return None
    return Finding(STACKS, HANG, list(odd), Rung.STACKS, "low", {"shape": "odd_stack"})


def rule_same_collective(live: Sequence[RankView], policy: VerdictPolicy) -> Finding | None:
    """Every live rank in the same collective: only outside evidence (GPU) singles one out."""
    if not live:
        return None
    # the one rule (``rules.waits.rule_same_collective``) over the hook's records as facts
    facts = FactSet(
        ranks=tuple(v.rank for v in live),
        waits=[Waits(v.rank, None, "", v.coll_seq, v.coll_op, Rung.COUNTERS, IN_COLLECTIVE) for v in live
               if v.in_collective],
        in_op=[InOp(v.rank, v.coll_op or "", "counters", seq=v.coll_seq) for v in live if v.in_collective],
    )
    shared = facts_same_collective(facts)
    if shared is None or shared.data["same"] is None:
        return None  # not every rank in one call: other rungs decide
    data = {"seq": live[0].coll_seq, "op": live[0].coll_op}
    idle = [v for v in live if v.gpu_util is not None and v.gpu_util <= policy.gpu_idle_pct]
    busy = [v for v in live if v.gpu_util is not None and v.gpu_util >= policy.gpu_busy_pct]
    absent = [v for v in live if v.gpu_missing]
    odd_gpu = absent or (idle if idle and busy and len(idle) < len(busy) else [])
    if odd_gpu:
        return Finding(GPU, COMM_HANG, sorted(v.rank for v in odd_gpu), Rung.GPU, "medium", {**data, "shape": "no_gpu"})
    return Finding(GPU, COMM_HANG, [], Rung.GPU, "low", {**data, "shape": "same_collective"})


def apply_gpu(finding: Finding, live: Sequence[RankView], policy: VerdictPolicy) -> tuple[Finding, Note | None]:
    """Back a hang finding with GPU use; never single a rank out on high utilisation alone. Returns the
    finding with what GPU use says (``data["gpu"]``, the confidence it raises) and that as a note for the
    evidence."""
    if finding.kind != HANG or not finding.ranks:
        return finding, None
    initiators = set(finding.ranks)
    chosen = [v for v in live if v.rank in initiators]
    read = [v for v in live if v.rank not in initiators and (v.gpu_util is not None or v.gpu_missing)]
    if not chosen or not any(v.gpu_util is not None or v.gpu_missing for v in live):
        return finding, None

    def _gpu_idle(v: RankView) -> bool:
        return v.gpu_missing or (v.gpu_util is not None and v.gpu_util <= policy.gpu_idle_pct)

    def _gpu_busy(v: RankView) -> bool:
        return v.gpu_util is not None and v.gpu_util >= policy.gpu_busy_pct

    data = {"chosen": [v.rank for v in chosen], "busy_pct": policy.gpu_busy_pct}
    if read and all(_gpu_idle(v) for v in chosen) and all(_gpu_busy(v) for v in read):
        return (finding.adding(gpu="agrees").but(confidence=raise_confidence(finding.confidence)),
                ("gpu_agrees", {**data, "read": [v.rank for v in read]}))
    if all(_gpu_busy(v) for v in live):
        return finding.adding(gpu="singles_nobody_out"), ("gpu_singles_nobody_out", data)
    if read and all(_gpu_busy(v) for v in chosen) and any(_gpu_idle(v) for v in read):
        idle = [v.rank for v in read if _gpu_idle(v)]
        return finding.adding(gpu="disagrees"), ("gpu_disagrees", {**data, "idle": idle})
    return finding, None
