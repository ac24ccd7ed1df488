"""The weakest evidence: stacks no other rank shares, and GPU activity. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..facts import IN_COLLECTIVE, FactSet, InOp, Rung, Waits
from ..policy import VerdictPolicy
from ..ranks import fmt_ranks, outside_majority
from ..schema import raise_confidence
from ..snapshot import RankView
from .finding import RuleFinding
from .waits import rule_same_collective as facts_same_collective


def stack_groups(views: Sequence[RankView]) -> list[tuple[str, list[int]]]:
    """Ranks grouped by stack signature, largest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for v in views:
        if v.stack_signature:
            groups[v.stack_signature].append(v.rank)
    return sorted(((sig, sorted(r)) for sig, r in groups.items()), key=lambda g: (-len(g[1]), g[1][0]))


def stack_backing(views: Sequence[RankView], initiators: Sequence[int]) -> tuple[str | None, bool | None]:
    """Does stack grouping agree? (evidence line, agreement) — None when stacks cannot tell."""
    groups = stack_groups(views)
    if len(groups) < 2:
        return None, None
    chosen = set(initiators)
    for _sig, ranks in groups:
        if set(ranks) == chosen and len(ranks) < len(views) / 2 + 0.01:
            return f"stack grouping agrees: {fmt_ranks(ranks)} has a stack no other rank shares", True
    majority = groups[0][1]
    if chosen & set(majority) and len(majority) > 1:
        return f"stack grouping disagrees: {fmt_ranks(chosen & set(majority))} share the majority stack", False
    return None, None


def rule_stacks(present: Sequence[RankView]) -> RuleFinding | None:
    groups = stack_groups(present)
    if len(groups) < 2:
        return None
    odd = outside_majority(dict(groups))
    if odd is None or len(odd) >= len(present) / 2:
        return None
    return RuleFinding(
        "hang",
        list(odd),
        "low",
        f"{fmt_ranks(odd)} has a stack the other ranks do not share; no other evidence singles a rank out",
        [],
    )


def rule_same_collective(live: Sequence[RankView], policy: VerdictPolicy) -> RuleFinding | None:
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
    seq, op = live[0].coll_seq, live[0].coll_op
    idle = [v for v in live if v.gpu_util is not None and v.gpu_util <= policy.gpu_idle_pct]
    busy = [v for v in live if v.gpu_util is not None and v.gpu_util >= policy.gpu_busy_pct]
    absent = [v for v in live if v.gpu_missing]
    odd_gpu = absent or (idle if idle and busy and len(idle) < len(busy) else [])
    if odd_gpu:
        return RuleFinding(
            "comm_hang",
            sorted(v.rank for v in odd_gpu),
            "medium",
            f"every rank is in collective #{seq} ({op}) but {fmt_ranks(v.rank for v in odd_gpu)} shows no GPU "
            "activity while its peers spin in the collective kernel",
            [f"rank {v.rank}: gpu {v.gpu_util}%{' (missing from samples)' if v.gpu_missing else ''}" for v in live],
        )
    return RuleFinding(
        "comm_hang",
        [],
        "low",
        f"every rank is waiting in the same collective #{seq} ({op}): a communication hang (network, NCCL) "
        "with no single initiating rank",
        [],
    )


def apply_gpu(finding: RuleFinding, live: Sequence[RankView], policy: VerdictPolicy) -> None:
    """Back a hang finding with GPU use; never single a rank out on high utilisation alone."""
    if finding.kind != "hang" or not finding.initiators:
        return
    initiators = set(finding.initiators)
    chosen = [v for v in live if v.rank in initiators]
    peers = [v for v in live if v.rank not in initiators]
    read = [v for v in peers if v.gpu_util is not None or v.gpu_missing]
    if not chosen or not any(v.gpu_util is not None or v.gpu_missing for v in live):
        return

    def pct(v: RankView) -> str:
        return "missing from NVML samples" if v.gpu_missing else f"{v.gpu_util:.0f} %"

    def _gpu_idle(v: RankView) -> bool:
        return v.gpu_missing or (v.gpu_util is not None and v.gpu_util <= policy.gpu_idle_pct)

    def _gpu_busy(v: RankView) -> bool:
        return v.gpu_util is not None and v.gpu_util >= policy.gpu_busy_pct

    if read and all(_gpu_idle(v) for v in chosen) and all(_gpu_busy(v) for v in read):
        finding.evidence.append(
            f"GPU agrees: {', '.join(f'rank {v.rank} {pct(v)}' for v in chosen)} (no kernel running: a CPU-side "
            f"stall) while {fmt_ranks(v.rank for v in read)} read ≥{policy.gpu_busy_pct:.0f} % "
            "(spinning in the collective kernel)"
        )
        finding.confidence = raise_confidence(finding.confidence)
        finding.data["gpu"] = "agrees"
    elif all(_gpu_busy(v) for v in live):
        finding.data["gpu"] = "singles_nobody_out"
        finding.evidence.append(
            f"GPU singles nobody out: every rank reads ≥{policy.gpu_busy_pct:.0f} % (ranks spinning in a collective "
            "kernel and a rank stuck inside a kernel look alike)"
        )
    elif read and all(_gpu_busy(v) for v in chosen) and any(_gpu_idle(v) for v in read):
        finding.data["gpu"] = "disagrees"
        finding.evidence.append(
            f"GPU does not back this: {fmt_ranks(v.rank for v in chosen)} busy on the GPU while "
            f"{fmt_ranks(v.rank for v in read if _gpu_idle(v))} idle"
        )
