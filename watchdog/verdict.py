"""Naming the initiating rank: a pure function from rank views to a ``rankwatch.verdict/1`` document.

Rules, strongest first (DESIGN.md), each backed by stack grouping:
1. ranks that died (no normal-exit mark) or crashed, earliest exit first; then stopped ranks;
2. ranks behind the others: fewer completed steps, then fewer collectives entered;
3. at the same step and collective count, the minority that is *not* waiting (not in a collective, not
   in DDP's gradient sync inside backward, stack not blocked in a wait) started it; among ranks that are
   not waiting, the one earliest in the step's phase order is behind;
4. everyone in the same collective number with different ops: collective mismatch, odd ranks named;
5. everyone in the same collective: communication hang, no single initiator unless GPU evidence or a
   missing node singles one out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .snapshot import CRASHED, GONE_STATES, MISSING, PHASE_ORDER, RUNNING, STOPPED, RankView

SCHEMA = "rankwatch.verdict/1"
KINDS = ("hang", "dead_rank", "stopped_rank", "collective_mismatch", "comm_hang", "unknown")
# two exits closer than this (seconds) are not ordered with confidence
EXIT_ORDER_TOLERANCE_S = 0.05
# GPU utilisation (%) that counts as idle vs busy when singling out a rank during a comm hang
GPU_IDLE_PCT = 5.0
GPU_BUSY_PCT = 50.0


@dataclass
class Verdict:
    job_id: str
    incident_id: str
    kind: str
    initiating_ranks: list[int]
    phase: str | None
    confidence: str
    reason: str
    detected_after_s: float
    ranks: dict[str, dict[str, Any]]
    evidence: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "job_id": self.job_id,
            "incident_id": self.incident_id,
            "kind": self.kind,
            "initiating_ranks": self.initiating_ranks,
            "phase": self.phase,
            "confidence": self.confidence,
            "reason": self.reason,
            "detected_after_s": round(self.detected_after_s, 3),
            "ranks": self.ranks,
            "evidence": self.evidence,
        }
        doc.update(self.extra)
        return doc


def phase_kind(phase: str | None) -> str:
    """What a phase says about the cause, in the words an on-call engineer uses."""
    if phase == "dataloader":
        return "input"
    if phase in ("forward", "backward", "optimizer"):
        return "compute"
    if phase == "collective":
        return "communication"
    if phase in (None, "idle"):
        return "between phases"
    return f"declared phase '{phase}'"


def fmt_ranks(ranks: Iterable[int]) -> str:
    items = sorted(ranks)
    return ("rank " if len(items) == 1 else "ranks ") + ", ".join(str(r) for r in items)


def rank_entry(v: RankView) -> dict[str, Any]:
    return {
        "node": v.node,
        "pid": v.pid,
        "state": v.state,
        "step": v.step,
        "phase": v.phase or "idle",
        "in_phase_s": round(v.in_phase_s, 3),
        "collective": {"seq": v.coll_seq, "op": v.coll_op or ""} if v.coll_seq else None,
        "gpu_util": v.gpu_util,
        "stack_top": list(v.stack_top),
    }


def is_waiting(v: RankView) -> bool:
    """Blocked on peers: in a Python collective, a stack blocked in a wait, or DDP's sync in backward."""
    if v.in_collective or v.waiting:
        return True
    return v.waiting is None and v.phase == "backward"


def stack_groups(views: Sequence[RankView]) -> list[tuple[str, list[int]]]:
    """Ranks grouped by stack signature, largest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for v in views:
        if v.stack_signature:
            groups[v.stack_signature].append(v.rank)
    return sorted(((sig, sorted(r)) for sig, r in groups.items()), key=lambda g: (-len(g[1]), g[1][0]))


def _stack_backing(views: Sequence[RankView], initiators: Sequence[int]) -> tuple[str | None, bool | None]:
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


def _phase_of(views: Sequence[RankView]) -> str | None:
    phases = {v.phase or "idle" for v in views}
    return phases.pop() if len(phases) == 1 else None


@dataclass
class _Finding:
    kind: str
    initiators: list[int]
    confidence: str
    reason: str
    evidence: list[str] = field(default_factory=list)


def _rule_gone(views: Sequence[RankView]) -> _Finding | None:
    gone = [v for v in views if v.state in GONE_STATES]
    if not gone:
        return None
    # larger exit age = exited earlier; node-local order breaks ties within a node
    ordered = sorted(gone, key=lambda v: (-(v.exit_age_s or 0.0), v.exit_order if v.exit_order is not None else 0))
    first = ordered[0]
    firsts = [first]
    for v in ordered[1:]:
        if (first.exit_age_s or 0.0) - (v.exit_age_s or 0.0) < EXIT_ORDER_TOLERANCE_S and v.node != first.node:
            firsts.append(v)
    how = "exited with an error" if first.state == CRASHED else "died (killed, no normal-exit mark)"
    evidence = [
        f"rank {v.rank} {v.state} {v.exit_age_s or 0.0:.2f}s ago in phase {v.phase or 'idle'} at step {v.step}"
        for v in ordered
    ]
    if len(gone) > 1:
        evidence.append(f"exit order: {' → '.join(str(v.rank) for v in ordered)}")
    confidence = "high" if len(firsts) == 1 else "medium"
    return _Finding(
        "dead_rank",
        sorted(v.rank for v in firsts),
        confidence,
        f"{fmt_ranks(v.rank for v in firsts)} {how} first, in {phase_kind(first.phase)} "
        f"({first.phase or 'idle'}) at step {first.step}"
        + (f"; {len(gone) - len(firsts)} other rank(s) exited after it" if len(gone) > len(firsts) else ""),
        evidence,
    )


def _rule_stopped(views: Sequence[RankView]) -> _Finding | None:
    stopped = [v for v in views if v.state == STOPPED]
    if not stopped:
        return None
    first = stopped[0]
    return _Finding(
        "stopped_rank",
        sorted(v.rank for v in stopped),
        "high",
        f"{fmt_ranks(v.rank for v in stopped)} is stopped (SIGSTOP or a debugger) in phase "
        f"{first.phase or 'idle'} at step {first.step}; the others wait for it",
        [f"rank {v.rank} process state T (stopped)" for v in stopped],
    )


def _minority(groups: dict[Any, list[RankView]]) -> list[RankView] | None:
    """Ranks of the smallest group when one group is strictly smallest and not everyone."""
    if len(groups) < 2:
        return None
    sizes = sorted(len(g) for g in groups.values())
    if sizes[0] == sizes[1]:
        return None
    return min(groups.values(), key=len)


def _rule_behind(live: Sequence[RankView]) -> _Finding | None:
    top_step = max(v.step for v in live)
    low_step = min(v.step for v in live)
    if low_step < top_step:
        behind = [v for v in live if v.step == low_step]
        return _Finding(
            "hang",
            sorted(v.rank for v in behind),
            "high" if len(behind) < len(live) / 2 else "medium",
            f"{fmt_ranks(v.rank for v in behind)} is stuck at step {low_step} in "
            f"{phase_kind(behind[0].phase)} ({behind[0].phase or 'idle'}) while the others reached step {top_step}",
            [f"rank {v.rank}: step {v.step}, phase {v.phase or 'idle'}" for v in live],
        )
    top_seq = max(v.coll_seq for v in live)
    low_seq = min(v.coll_seq for v in live)
    if low_seq < top_seq:
        behind = [v for v in live if v.coll_seq == low_seq]
        ahead = [v for v in live if v.coll_seq == top_seq]
        return _Finding(
            "hang",
            sorted(v.rank for v in behind),
            "high" if len(behind) < len(live) / 2 else "medium",
            f"{fmt_ranks(v.rank for v in behind)} is stuck in {phase_kind(behind[0].phase)} "
            f"({behind[0].phase or 'idle'}) before collective #{top_seq} ({ahead[0].coll_op}) that "
            f"{fmt_ranks(v.rank for v in ahead)} already entered",
            [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op or ''}, phase {v.phase or 'idle'}" for v in live],
        )
    return None


def _rule_not_waiting(live: Sequence[RankView]) -> _Finding | None:
    waiting = [v for v in live if is_waiting(v)]
    busy = [v for v in live if not is_waiting(v)]
    if waiting and busy:
        # among the ranks that are not waiting, the one earliest in the step is behind the rest
        ordered = sorted(busy, key=lambda v: PHASE_ORDER.get(v.phase or "", 0))
        culprits = busy
        if len(busy) > 1:
            by_phase: dict[str | None, list[RankView]] = defaultdict(list)
            for v in busy:
                by_phase[v.phase].append(v)
            odd = _minority(by_phase)
            culprits = odd if odd is not None else [ordered[0]] if len(by_phase) > 1 else busy
        confidence = "high" if len(busy) < len(waiting) else "medium"
        lead = culprits[0]
        return _Finding(
            "hang",
            sorted(v.rank for v in culprits),
            confidence,
            f"{fmt_ranks(v.rank for v in culprits)} is stuck in {phase_kind(lead.phase)} "
            f"({lead.phase or 'idle'}) at step {lead.step} for {lead.in_phase_s:.1f}s while "
            f"{fmt_ranks(v.rank for v in waiting)} wait for it in "
            f"{', '.join(sorted({w.phase or 'idle' for w in waiting}))}",
            [f"rank {v.rank}: {'waiting' if is_waiting(v) else 'not waiting'} in {v.phase or 'idle'}" for v in live],
        )
    if busy and not waiting:
        by_order: dict[int, list[RankView]] = defaultdict(list)
        for v in busy:
            by_order[PHASE_ORDER.get(v.phase or "", 0)].append(v)
        if len(by_order) > 1:
            earliest = by_order[min(by_order)]
            lead = earliest[0]
            return _Finding(
                "hang",
                sorted(v.rank for v in earliest),
                "medium",
                f"{fmt_ranks(v.rank for v in earliest)} is stuck earliest in the step, in "
                f"{phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step}",
                [f"rank {v.rank}: phase {v.phase or 'idle'}" for v in live],
            )
        lead = busy[0]
        return _Finding(
            "hang",
            sorted(v.rank for v in busy),
            "low",
            f"every rank is stuck in {phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step}: "
            "a shared cause (filesystem, data service, host) rather than one rank",
            [],
        )
    return None


def _rule_collective(live: Sequence[RankView]) -> _Finding | None:
    by_op: dict[str, list[RankView]] = defaultdict(list)
    for v in live:
        by_op[v.coll_op or "?"].append(v)
    seq = live[0].coll_seq
    if len(by_op) > 1:
        odd = _minority(by_op)
        ops = ", ".join(f"{op} on {fmt_ranks(v.rank for v in vs)}" for op, vs in sorted(by_op.items()))
        if odd is None:
            return _Finding(
                "collective_mismatch",
                sorted(v.rank for v in live),
                "low",
                f"collective #{seq} differs across ranks ({ops}); no majority says which side is wrong",
                [],
            )
        return _Finding(
            "collective_mismatch",
            sorted(v.rank for v in odd),
            "high",
            f"collective mismatch at collective #{seq}: {fmt_ranks(v.rank for v in odd)} called "
            f"{odd[0].coll_op} while the others called {max(by_op.items(), key=lambda kv: len(kv[1]))[0]}",
            [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op}" for v in live],
        )
    op = live[0].coll_op
    # the same collective everywhere: only outside evidence singles a rank out
    idle = [v for v in live if v.gpu_util is not None and v.gpu_util <= GPU_IDLE_PCT]
    busy = [v for v in live if v.gpu_util is not None and v.gpu_util >= GPU_BUSY_PCT]
    absent = [v for v in live if v.gpu_missing]
    odd_gpu = absent or (idle if idle and busy and len(idle) < len(busy) else [])
    if odd_gpu:
        return _Finding(
            "comm_hang",
            sorted(v.rank for v in odd_gpu),
            "medium",
            f"every rank is in collective #{seq} ({op}) but {fmt_ranks(v.rank for v in odd_gpu)} shows no GPU "
            "activity while its peers spin in the collective kernel",
            [f"rank {v.rank}: gpu {v.gpu_util}%{' (missing from samples)' if v.gpu_missing else ''}" for v in live],
        )
    return _Finding(
        "comm_hang",
        [],
        "low",
        f"every rank is waiting in the same collective #{seq} ({op}): a communication hang (network, NCCL) "
        "with no single initiating rank",
        [],
    )


def decide(
    views: Sequence[RankView],
    *,
    job_id: str,
    incident_id: str,
    detected_after_s: float,
    extra_evidence: Sequence[str] = (),
) -> Verdict:
    """The verdict for one incident over every rank's view (all nodes)."""
    views = sorted(views, key=lambda v: v.rank)
    missing = [v for v in views if v.state == MISSING]
    present = [v for v in views if v.state != MISSING]
    live = [v for v in present if v.state == RUNNING]
    finding = _rule_gone(present) or _rule_stopped(present)
    if finding is None and live:
        finding = _rule_behind(live)
        if finding is None:
            in_coll = [v for v in live if v.in_collective]
            finding = _rule_collective(live) if len(in_coll) == len(live) else _rule_not_waiting(live)
    if finding is None and missing:
        finding = _Finding(
            "unknown",
            sorted(v.rank for v in missing),
            "low",
            f"no evidence from {fmt_ranks(v.rank for v in missing)} (node {missing[0].node} did not answer); "
            "a node that never answers is the likeliest cause",
            [],
        )
    if finding is None:
        finding = _Finding("unknown", [], "low", "no rule singled out a rank", [])
    evidence = list(finding.evidence)
    if finding.initiators and finding.kind in ("hang", "collective_mismatch"):
        line, agrees = _stack_backing(present, finding.initiators)
        if line:
            evidence.append(line)
        if agrees is False and finding.confidence == "high":
            finding.confidence = "medium"
    if missing:
        evidence.append(f"missing evidence from {fmt_ranks(v.rank for v in missing)}")
    evidence.extend(extra_evidence)
    chosen = [v for v in views if v.rank in set(finding.initiators)]
    return Verdict(
        job_id=job_id,
        incident_id=incident_id,
        kind=finding.kind,
        initiating_ranks=finding.initiators,
        phase=_phase_of(chosen) if chosen else None,
        confidence=finding.confidence,
        reason=finding.reason,
        detected_after_s=detected_after_s,
        ranks={str(v.rank): rank_entry(v) for v in views},
        evidence=evidence,
    )


def counts_by(views: Sequence[RankView], key: str) -> Counter[Any]:
    return Counter(getattr(v, key) for v in views)
