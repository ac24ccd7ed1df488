"""Naming the initiating rank: a pure function from rank views to a ``rankwatch.verdict/1`` document.

The evidence is a ladder, kept as data (``EVIDENCE_LADDER``), strongest first: exits (by cause, then time,
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

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .failures import CONSEQUENCE, INITIATING, crash_role
from .fr_analysis import Mismatch, MissingCollective
from .policy import VerdictPolicy
from .ranks import behind as ranks_behind
from .ranks import first_by_time, fmt_ranks, fold_rank_lines, majority, outside_majority, ranks_verb
from .schema import VERDICT_SCHEMA, lower_confidence, raise_confidence
from .snapshot import CRASHED, DEAD, EXITED, GONE_STATES, MISSING, RUNNING, STEP_PHASE_ORDER, STOPPED, RankView

DEFAULT_VERDICT_POLICY = VerdictPolicy()

__all__ = [
    "DEFAULT_VERDICT_POLICY",
    "FrBehind",
    "FrHints",
    "Verdict",
    "decide",
    "fmt_ranks",
    "fold_rank_lines",
    "is_waiting",
    "phase_kind",
    "rank_entry",
    "stack_groups",
]


@dataclass(frozen=True)
class FrBehind:
    """One rank's progress in one process group, when it entered fewer collectives than another member."""

    pg: str
    rank: int
    seq: int  # highest collective seq this rank entered (-1: none)
    top_seq: int  # highest seq any member entered
    top_op: str | None  # op of that collective, as the furthest rank recorded it
    # its newest collective is still in flight although another member got past it: it waits for a peer
    # (data relayed through a ring or tree), it is not the one that never arrived
    waiting: bool = False


@dataclass(frozen=True)
class FrHints:
    """What the flight recorder says, reduced to what the verdict uses (built by ``evidence.fr_evidence``).

    Kept here rather than in ``evidence`` so the verdict stays a pure function over plain data.
    """

    ranks: tuple[int, ...]  # ranks whose dump was analysed; conclusions cover only these
    behind: tuple[FrBehind, ...] = ()
    missing: tuple[MissingCollective, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def behind_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({b.rank for b in self.behind} | {r for m in self.missing for r in m.missing}))

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "behind": [
                {"pg": b.pg, "rank": b.rank, "seq": b.seq, "top_seq": b.top_seq, "top_op": b.top_op,
                 "waiting": b.waiting}
                for b in self.behind
            ],
            "missing": [
                {"pg": m.pg, "seq": m.seq, "op": m.op, "joined": list(m.joined), "missing": list(m.missing)}
                for m in self.missing
            ],
            "mismatches": [
                {
                    "pg": m.pg,
                    "seq": m.seq,
                    "kind": m.kind,
                    "odd_ranks": list(m.odd_ranks),
                    "variants": {k: list(v) for k, v in m.variants.items()},
                }
                for m in self.mismatches
            ],
        }


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
            "schema": VERDICT_SCHEMA,
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
    rule: str = ""  # the EVIDENCE_LADDER rung that produced it


def exit_roles(gone: Sequence[RankView], tolerance_s: float) -> dict[int, str]:
    """Initiating or consequence, per gone rank (``core.failures``).

    A crash is judged by its exception (a communication error is a peer's fault). A rank killed without
    any mark is initiating unless another rank *of its node* ended clearly (beyond the tolerance) before
    it: then it is the launcher tearing the node's workers down after that first failure.
    """
    roles: dict[int, str] = {}
    for v in gone:
        if v.state == EXITED:  # only early leavers get here (``left_early``): their peers still needed them
            roles[v.rank] = INITIATING
            continue
        if v.state == CRASHED:
            roles[v.rank] = crash_role(v.exit_cause)
            continue
        age = v.exit_age_s or 0.0
        # clearly earlier: a launcher notices a failure at its next monitor tick, so its teardown comes
        # after the tolerance; a kill and a peer's crash milliseconds apart are a tie, decided by cause
        earlier = any(
            o.node_key == v.node_key and o is not v and (o.exit_age_s or 0.0) - age > tolerance_s for o in gone
        )
        roles[v.rank] = CONSEQUENCE if earlier else INITIATING
    return roles


def left_early(v: RankView, views: Sequence[RankView]) -> bool:
    """A normal exit while a peer that did not exit was still inside a step at least as far along: the peer
    still needed it (uneven data — its shard ran out —, an early ``return``, a rank-conditional ``break``)."""
    return v.state == EXITED and any(
        o.state != EXITED and o.state in (RUNNING, STOPPED, *GONE_STATES) and o.phase not in (None, "idle")
        and o.step >= v.step
        for o in views
    )


def _rule_finished_but_one(views: Sequence[RankView], early: Sequence[RankView]) -> _Finding | None:
    """Most ranks finished and exited normally while a few are still inside a step: those few did something
    the others never did (an extra collective or barrier after the loop), not the majority "leaving early"."""
    # still inside a step — alive, or ended by what the others' leaving did to it (a connection error)
    stuck = [v for v in views if v.state != EXITED and v.state in (RUNNING, STOPPED, *GONE_STATES)
             and v.phase not in (None, "idle")]
    if len(early) <= len(views) / 2 or not stuck or len(stuck) >= len(views) / 2:
        return None
    lead = stuck[0]
    in_coll = all(v.in_collective or v.phase == "collective" for v in stuck)
    what = f"collective #{lead.coll_seq} ({lead.coll_op})" if in_coll and lead.coll_op else f"{lead.phase}"
    kind = "collective_mismatch" if in_coll else "dead_rank" if lead.state in GONE_STATES else "hang"
    return _Finding(
        kind,
        sorted(v.rank for v in stuck),
        "medium",
        f"{fmt_ranks(v.rank for v in stuck)} is still in {what} at step {lead.step} after "
        f"{fmt_ranks(v.rank for v in early)} finished and exited normally: it issued what no other rank did",
        [f"rank {v.rank}: {v.state} at step {v.step}, phase {v.phase or 'idle'}" for v in views],
    )


def _same_failure_everywhere(views: Sequence[RankView]) -> _Finding | None:
    """Every rank crashed with the same error (a SyntaxError, a bad config): the job's own failure, which
    no rank started — whichever exited a millisecond first is named by nobody."""
    causes = {v.exit_cause for v in views if v.state == CRASHED}
    if len(views) < 2 or any(v.state != CRASHED for v in views) or len(causes) != 1 or not next(iter(causes)):
        return None
    cause, first = next(iter(causes)), views[0]
    steps = sorted({v.step for v in views})
    at = f"at step {steps[0]}" if len(steps) == 1 else f"at steps {steps[0]}–{steps[-1]}"
    return _Finding(
        "dead_rank",
        [],
        "high",
        f"every rank ({len(views)}) exited with the same error ({cause}) {at}: a failure of the job itself "
        "(its code, data or environment), not of one rank",
        [f"{fmt_ranks(v.rank for v in views)} exited with: {cause}", f"phase of rank {first.rank}: "
         f"{first.phase or 'idle'}"],
    )


def _rule_gone(views: Sequence[RankView], policy: VerdictPolicy) -> _Finding | None:
    early = [v for v in views if left_early(v, views)]
    if (finished := _rule_finished_but_one(views, early)) is not None:
        return finished
    gone = [v for v in views if v.state in GONE_STATES] + early
    if not gone:
        return None
    if (same := _same_failure_everywhere(views)) is not None:
        return same
    # larger exit age = exited earlier; node-local order breaks ties within a node
    ordered = sorted(gone, key=lambda v: (-(v.exit_age_s or 0.0), v.exit_order if v.exit_order is not None else 0))
    roles = exit_roles(gone, policy.exit_order_tolerance_s)
    # cause before time: an initiating exit, however late it was seen, beats a consequence seen earlier
    candidates = [v for v in ordered if roles[v.rank] == INITIATING] or ordered
    first = candidates[0]
    # exits within the tolerance are not ordered across nodes; within a node the exit order is exact
    near = first_by_time(candidates, key=lambda v: -(v.exit_age_s or 0.0), tolerance=policy.exit_order_tolerance_s)
    firsts = [first, *(v for v in near if v is not first and v.node_key != first.node_key)]
    how = {
        CRASHED: "exited with an error",
        EXITED: "left early — exited normally while its peers were still mid-step (uneven data: give every rank "
        "the same number of batches or wrap the loop in DDP's join(); or an early return)",
    }.get(first.state, "died (killed, no normal-exit mark)")

    def line(v: RankView) -> str:
        cause = f" ({v.exit_cause})" if v.state == CRASHED and v.exit_cause else ""
        return (
            f"rank {v.rank} {v.state} {v.exit_age_s or 0.0:.2f}s ago in phase {v.phase or 'idle'} at step "
            f"{v.step}{cause}: {roles[v.rank]}"
        )

    evidence = [line(v) for v in ordered]
    if len(gone) > 1:
        evidence.append(f"exit order: {' → '.join(str(v.rank) for v in ordered)}")
    consequences = [v.rank for v in ordered if roles[v.rank] == CONSEQUENCE]
    if consequences and candidates[0] is not ordered[0]:
        evidence.append(
            f"{fmt_ranks(consequences)} ended with communication errors or were torn down after a peer's "
            "failure: consequences, even where seen first"
        )
    unverified = [v.rank for v in firsts if not v.verified]
    if unverified:
        evidence.append(
            f"{fmt_ranks(unverified)} ended before rankwatch first saw its process: its exit time is when "
            "rankwatch noticed, and who it was rests on its record alone"
        )
    all_consequences = not any(roles[v.rank] == INITIATING for v in gone)
    confidence = "high" if len(firsts) == 1 and not all_consequences else "medium"
    if unverified and confidence == "high":
        confidence = "medium"
    if all_consequences:
        evidence.append("every rank that ended reports a consequence (communication error): the cause may lie outside")
        confidence = "low" if len(gone) > 1 else confidence
    return _Finding(
        "dead_rank",
        sorted(v.rank for v in firsts),
        confidence,
        f"{fmt_ranks(v.rank for v in firsts)} {how} first, in {phase_kind(first.phase)} "
        f"({first.phase or 'idle'}) at step {first.step}"
        + (f" ({first.exit_cause})" if first.state == CRASHED and first.exit_cause else "")
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


def _odd_views(groups: dict[Any, list[RankView]]) -> list[RankView] | None:
    """The views of every rank outside the strictly largest group (``ranks.outside_majority``)."""
    odd = outside_majority({k: [v.rank for v in vs] for k, vs in groups.items()})
    if odd is None:
        return None
    chosen = set(odd)
    return sorted((v for vs in groups.values() for v in vs if v.rank in chosen), key=lambda v: v.rank)


def _rule_behind(live: Sequence[RankView]) -> _Finding | None:
    top_step = max(v.step for v in live)
    low_step = min(v.step for v in live)
    by_step = set(ranks_behind({v.rank: v.step for v in live}))
    if by_step:
        behind = [v for v in live if v.rank in by_step]
        return _Finding(
            "hang",
            sorted(v.rank for v in behind),
            "high" if len(behind) < len(live) / 2 else "medium",
            f"{fmt_ranks(v.rank for v in behind)} is stuck at step {low_step} in "
            f"{phase_kind(behind[0].phase)} ({behind[0].phase or 'idle'}) while the others reached step {top_step}",
            [f"rank {v.rank}: step {v.step}, phase {v.phase or 'idle'}" for v in live],
        )
    top_seq = max(v.coll_seq for v in live)
    by_seq = set(ranks_behind({v.rank: v.coll_seq for v in live}))
    if by_seq:
        behind = [v for v in live if v.rank in by_seq]
        ahead = [v for v in live if v.coll_seq == top_seq]
        if len(behind) > len(live) / 2 and all(is_waiting(v) for v in live):
            # most ranks "behind" yet every rank waits: the few ahead entered a collective the others never
            # issue (a rank-conditional barrier); the others wait in one Python counters cannot see (DDP)
            return _Finding(
                "collective_mismatch",
                sorted(v.rank for v in ahead),
                "medium",
                f"{fmt_ranks(v.rank for v in ahead)} entered collective #{top_seq} ({ahead[0].coll_op}) that "
                f"{fmt_ranks(v.rank for v in behind)} never issue: they wait in "
                f"{', '.join(sorted({v.phase or 'idle' for v in behind}))} (a collective Python-level counters do "
                "not see, such as DDP's gradient all-reduce) — a collective only some ranks call",
                [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op or ''}, phase {v.phase or 'idle'}" for v in live],
            )
        if (
            len(behind) < len(live) / 2
            and all(v.waiting is True and not v.in_collective for v in behind)
            and all(v.in_collective for v in live if v.rank not in by_seq)
        ):
            # the few behind are not computing: their stacks wait on peers in a collective Python counters
            # do not see (DDP's buffer broadcast in the next forward) — they skipped the one the others are in
            return _Finding(
                "collective_mismatch",
                sorted(v.rank for v in behind),
                "medium",
                f"{fmt_ranks(v.rank for v in behind)} issued fewer Python-level collectives than the others "
                f"(#{behind[0].coll_seq} against #{top_seq}) yet waits on its peers in "
                f"{', '.join(sorted({v.phase or 'idle' for v in behind}))}: it skipped collective #{top_seq} "
                f"({ahead[0].coll_op}) that {fmt_ranks(v.rank for v in ahead)} wait in, and is inside one they "
                "never issue",
                [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op or ''}, phase {v.phase or 'idle'}, "
                 f"{'waiting' if is_waiting(v) else 'not waiting'}" for v in live],
            )
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
        ordered = sorted(busy, key=lambda v: STEP_PHASE_ORDER.get(v.phase or "", 0))
        culprits = busy
        if len(busy) > 1:
            by_phase: dict[str | None, list[RankView]] = defaultdict(list)
            for v in busy:
                by_phase[v.phase].append(v)
            odd = _odd_views(by_phase)
            culprits = odd if odd is not None else [ordered[0]] if len(by_phase) > 1 else busy
        confidence = "high" if len(busy) < len(waiting) else "medium"
        lead = culprits[0]
        return _Finding(
            "hang",
            sorted(v.rank for v in culprits),
            confidence,
            f"{ranks_verb((v.rank for v in culprits), 'is', 'are')} stuck in {phase_kind(lead.phase)} "
            f"({lead.phase or 'idle'}) at step {lead.step} for {lead.in_phase_s:.1f}s while "
            f"{ranks_verb((v.rank for v in waiting), 'waits', 'wait')} for it in "
            f"{', '.join(sorted({w.phase or 'idle' for w in waiting}))}",
            [f"rank {v.rank}: {'waiting' if is_waiting(v) else 'not waiting'} in {v.phase or 'idle'}" for v in live],
        )
    if busy and not waiting:
        by_order: dict[int, list[RankView]] = defaultdict(list)
        for v in busy:
            by_order[STEP_PHASE_ORDER.get(v.phase or "", 0)].append(v)
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
    """Every live rank in a Python-level collective at the same seq but with different ops."""
    if not live or any(not v.in_collective for v in live) or len({v.coll_seq for v in live}) != 1:
        return None
    by_op: dict[str, list[RankView]] = defaultdict(list)
    for v in live:
        by_op[v.coll_op or "?"].append(v)
    seq = live[0].coll_seq
    if len(by_op) > 1:
        by_op_ranks = {op: [v.rank for v in vs] for op, vs in by_op.items()}
        top_op = majority(by_op_ranks)
        odd = outside_majority(by_op_ranks)
        ops = ", ".join(f"{op} on {fmt_ranks(rs)}" for op, rs in sorted(by_op_ranks.items()))
        if top_op is None or odd is None:
            # a tie: naming every rank (or a majority of them) would be wrong, so nobody is named
            return _Finding(
                "collective_mismatch",
                [],
                "low",
                f"collective #{seq} differs across ranks ({ops}); no majority says which side is wrong",
                [],
            )
        odd_ops = sorted(op for op in by_op_ranks if op != top_op)
        odd_desc = (
            odd_ops[0] if len(odd_ops) == 1 else ", ".join(f"{op} ({fmt_ranks(by_op_ranks[op])})" for op in odd_ops)
        )
        return _Finding(
            "collective_mismatch",
            list(odd),
            "high",
            f"collective mismatch at collective #{seq}: {fmt_ranks(odd)} called {odd_desc} while the others "
            f"({fmt_ranks(by_op_ranks[top_op])}) called {top_op}",
            [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op}" for v in live],
        )
    return None


def _rule_same_collective(live: Sequence[RankView], policy: VerdictPolicy) -> _Finding | None:
    """Every live rank in the same collective: only outside evidence (GPU) singles one out."""
    if not live or any(not v.in_collective for v in live) or len({v.coll_op for v in live}) != 1:
        return None
    seq, op = live[0].coll_seq, live[0].coll_op
    idle = [v for v in live if v.gpu_util is not None and v.gpu_util <= policy.gpu_idle_pct]
    busy = [v for v in live if v.gpu_util is not None and v.gpu_util >= policy.gpu_busy_pct]
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


def _fr_mismatch_finding(mm: Mismatch, covered: bool, live: Sequence[RankView]) -> _Finding:
    evidence = [
        f"flight recorder: {fmt_ranks(rs)} entered collective #{mm.seq} as {d}" for d, rs in mm.variants.items()
    ]
    evidence += [f"rank {v.rank}: python-level collective #{v.coll_seq} {v.coll_op or ''}" for v in live]
    top_desc = majority(mm.variants)
    if not mm.odd_ranks or top_desc is None:
        # a tie: nobody is named (naming every rank, or a majority, would be wrong)
        return _Finding(
            "collective_mismatch",
            [],
            "low",
            f"flight recorder shows a {mm.kind} mismatch at collective #{mm.seq} of process group {mm.pg}; "
            "no majority says which side is wrong",
            evidence,
            rule="fr",
        )
    odd_desc = "; ".join(d for d, rs in mm.variants.items() if d != top_desc)
    return _Finding(
        "collective_mismatch",
        list(mm.odd_ranks),
        "high" if covered else "medium",
        f"collective mismatch ({mm.kind}) at collective #{mm.seq} of process group {mm.pg}, seen in the flight "
        f"recorder: {fmt_ranks(mm.odd_ranks)} entered it as {odd_desc} while {fmt_ranks(mm.variants[top_desc])} "
        f"entered it as {top_desc}",
        evidence,
        rule="fr",
    )


def _fr_behind_text(hints: FrHints, ranks: Sequence[int]) -> str:
    """'rank 1 entered collective #5 of pg 0, others #6 (all_reduce)' for the widest gap of each rank."""
    parts = []
    for r in ranks:
        mine = [b for b in hints.behind if b.rank == r]
        if mine:
            b = max(mine, key=lambda b: b.top_seq - b.seq)
            parts.append(
                f"rank {r} entered collective #{b.seq} of pg {b.pg} while others entered #{b.top_seq}"
                + (f" ({b.top_op})" if b.top_op else "")
            )
            continue
        m = next((m for m in hints.missing if r in m.missing), None)
        if m is not None:
            parts.append(f"rank {r} never joined collective #{m.seq} ({m.op}) of pg {m.pg}")
    return "; ".join(parts)


def _rule_fr(hints: FrHints, live: Sequence[RankView]) -> _Finding | None:
    """What the flight recorder says on its own: a mismatch at one (pg, seq), else ranks behind or missing.

    It sees every collective of every process group, DDP's gradient all-reduces included, which the
    Python-level counters do not; so it outranks them (the evidence ladder)."""
    if not live:
        return None
    live_ranks = {v.rank for v in live}
    covered = live_ranks <= set(hints.ranks)
    mismatches = [m for m in hints.mismatches if set(m.odd_ranks) <= live_ranks]
    decisive = next((m for m in mismatches if m.odd_ranks), None)
    if decisive is not None:
        return _fr_mismatch_finding(decisive, covered, live)
    behind = [r for r in hints.behind_ranks if r in live_ranks]
    if not behind:
        # a mismatch tie names nobody; still the best account of the stall when nothing else explains it
        return _fr_mismatch_finding(mismatches[0], covered, live) if mismatches else None
    relaying = {b.rank for b in hints.behind if b.waiting}
    arrived_never = [r for r in behind if r not in relaying]
    if arrived_never and len(arrived_never) < len(behind):
        behind = arrived_never  # of the ranks behind, the ones with nothing in flight started it
    elif not arrived_never and not covered:
        # every rank behind is itself blocked in a collective a peer got past (the root of a broadcast the
        # stuck rank never received): the rank that never arrived is among those the recorder does not cover
        uncovered = sorted(live_ranks - set(hints.ranks))
        detail = _fr_behind_text(hints, behind)
        return _Finding(
            "hang",
            [],
            "low",
            f"{fmt_ranks(behind)} waits in a collective its peers got past ({detail}); the rank that never "
            f"arrived is among {fmt_ranks(uncovered)}, which the flight recorder does not cover",
            [f"flight recorder: {detail}; {fmt_ranks(behind)} still in flight (waiting)",
             f"flight recorder covers only {fmt_ranks(hints.ranks)}"],
            rule="fr",
        )
    detail = _fr_behind_text(hints, behind)
    chosen_views = [v for v in live if v.rank in set(behind)]
    lead = chosen_views[0]
    others = sorted(live_ranks - set(behind))
    confidence = "high" if covered and len(behind) < len(live) / 2 else "medium"
    reason = (
        f"{fmt_ranks(behind)} is behind in the flight recorder ({detail}); "
        f"it is in {phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step}"
        + (f" while {ranks_verb(others, 'waits', 'wait')} for it" if others else "")
    )
    evidence = [f"flight recorder: {detail}"]
    if not covered:
        evidence.append(f"flight recorder covers only {fmt_ranks(hints.ranks)}")
    return _Finding("hang", behind, confidence, reason, evidence, rule="fr")


def _apply_gpu(finding: _Finding, live: Sequence[RankView], policy: VerdictPolicy) -> None:
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
    elif all(_gpu_busy(v) for v in live):
        finding.evidence.append(
            f"GPU singles nobody out: every rank reads ≥{policy.gpu_busy_pct:.0f} % (ranks spinning in a collective "
            "kernel and a rank stuck inside a kernel look alike)"
        )
    elif read and all(_gpu_busy(v) for v in chosen) and any(_gpu_idle(v) for v in read):
        finding.evidence.append(
            f"GPU does not back this: {fmt_ranks(v.rank for v in chosen)} busy on the GPU while "
            f"{fmt_ranks(v.rank for v in read if _gpu_idle(v))} idle"
        )


@dataclass(frozen=True)
class Rung:
    """One kind of evidence; stronger rungs decide, weaker ones back or question the decision."""

    name: str
    what: str
    strong: bool  # may name a majority of ranks


EVIDENCE_LADDER: tuple[Rung, ...] = (
    Rung("exits", "own-failure exits, by cause then time; early normal exits while peers are mid-step", True),
    Rung("stopped", "ranks stopped by SIGSTOP or a debugger", True),
    Rung("flight_recorder", "per process group: a mismatch (op/size/dtype) at one seq; ranks behind or missing", True),
    Rung("counters", "Python-level steps and collective sequence numbers and ops: ranks behind, odd ops", False),
    Rung("waiting", "the minority that is not waiting for peers, and its phase", False),
    Rung("stacks", "a stack no other rank shares", False),
    Rung("gpu", "every rank in one collective, one with no GPU activity", False),
    Rung("missing_node", "every rank here in one collective while a node never answered", False),
)
"""The evidence ladder, strongest first (README "How the initiating rank is named")."""


def _rule_stacks(present: Sequence[RankView]) -> _Finding | None:
    groups = stack_groups(present)
    if len(groups) < 2:
        return None
    odd = outside_majority(dict(groups))
    if odd is None or len(odd) >= len(present) / 2:
        return None
    return _Finding(
        "hang",
        list(odd),
        "low",
        f"{fmt_ranks(odd)} has a stack the other ranks do not share; no other evidence singles a rank out",
        [],
    )


def _rule_missing_node(live: Sequence[RankView], missing: Sequence[RankView]) -> _Finding | None:
    if not missing or not live or any(not v.in_collective for v in live):
        return None
    nodes = sorted({v.node for v in missing})
    return _Finding(
        "comm_hang",
        sorted(v.rank for v in missing),
        "medium",
        f"every rank that answered waits in collective #{live[0].coll_seq} ({live[0].coll_op}) while node(s) "
        f"{', '.join(nodes)} never answered: {fmt_ranks(v.rank for v in missing)} are the likeliest cause",
        [],
    )


def _names_everyone(f: _Finding, present: Sequence[RankView]) -> bool:
    """Names every rank that gave evidence: no single initiator ("a shared cause")."""
    return bool(present) and {v.rank for v in present} <= set(f.initiators)


def decide(
    views: Sequence[RankView],
    *,
    job_id: str,
    incident_id: str,
    detected_after_s: float,
    extra_evidence: Sequence[str] = (),
    fr_hints: FrHints | None = None,
    policy: VerdictPolicy = DEFAULT_VERDICT_POLICY,
) -> Verdict:
    """The verdict for one incident over every rank's view (all nodes).

    Every rung of ``EVIDENCE_LADDER`` is asked; the strongest rung that names a rank decides, weaker ones
    that agree back it and weaker ones that single out someone else lower the confidence (both said in
    ``evidence``). A majority of ranks is named only on strong evidence. ``fr_hints`` (from
    ``evidence.flight_recorder``) are the flight-recorder rung; they appear under ``flight_recorder``.
    """
    views = sorted(views, key=lambda v: v.rank)
    missing = [v for v in views if v.state == MISSING]
    present = [v for v in views if v.state != MISSING]
    live = [v for v in present if v.state == RUNNING]
    found: dict[str, _Finding | None] = {
        "exits": _rule_gone(present, policy),
        "stopped": _rule_stopped(present),
        "flight_recorder": _rule_fr(fr_hints, live) if fr_hints is not None else None,
        "counters": (_rule_behind(live) or _rule_collective(live)) if live else None,
        "waiting": _rule_not_waiting(live) if live and not all(v.in_collective for v in live) else None,
        "stacks": _rule_stacks(present),
        "gpu": _rule_same_collective(live, policy),
        "missing_node": _rule_missing_node(live, missing),
    }
    for name, f in found.items():
        if f is not None:
            f.rule = name
    _abort_on_mismatch(found, present)
    _abort_with_odd_counts(found, present)
    # the strongest rung that singles ranks out decides; a finding naming nobody (or everyone) only when none does
    ladder = [r for r in EVIDENCE_LADDER if found[r.name] is not None]
    singling = [
        r for r in ladder if (f := found[r.name]) is not None and f.initiators and not _names_everyone(f, present)
    ]
    rung = singling[0] if singling else (ladder[0] if ladder else None)
    finding = found[rung.name] if rung is not None else None
    if finding is not None and rung is not None and rung.name not in ("exits", "stopped"):
        # the stopped or dead cannot be second-guessed; everything else is weighed against the weaker rungs
        _weigh(finding, rung, found, present)
        _apply_gpu(finding, live, policy)
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
    if finding.initiators and finding.kind in ("hang", "collective_mismatch") and finding.rule != "stacks":
        line, agrees = _stack_backing(present, finding.initiators)
        if line:
            evidence.append(line)
        if agrees is False and finding.confidence == "high":
            finding.confidence = "medium"
    if missing:
        evidence.append(f"missing evidence from {fmt_ranks(v.rank for v in missing)}")
    evidence.extend(extra_evidence)
    initiator_set = set(finding.initiators)
    chosen = [v for v in views if v.rank in initiator_set]
    extra: dict[str, Any] = {"decided_by": finding.rule or "none"}
    if fr_hints is not None:
        fr_role = "decided" if finding.rule == "flight_recorder" else _fr_role(found["flight_recorder"], finding)
        extra["flight_recorder"] = {**fr_hints.to_json(), "role": fr_role}
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
        evidence=fold_rank_lines(evidence),
        extra=extra,
    )


def _abort_on_mismatch(found: dict[str, _Finding | None], present: Sequence[RankView]) -> None:
    """A rank killed without any mark inside a collective, while the flight recorder shows a mismatch at one
    seq: the death is gloo aborting the *receiver* of a mismatched collective (size or op), not its cause —
    the mismatch decides, and names the rank that sent it."""
    exits, fr = found.get("exits"), found.get("flight_recorder")
    if exits is None or fr is None or fr.kind != "collective_mismatch" or not fr.initiators:
        return
    dead = [v for v in present if v.rank in set(exits.initiators)]
    if not dead or any(v.state != DEAD or v.phase not in ("collective", "backward") for v in dead):
        return
    fr.evidence.append(
        f"{fmt_ranks(v.rank for v in dead)} died without an exit mark inside a collective: gloo aborts a rank "
        f"that receives a mismatched collective — a consequence of the mismatch ({exits.reason})"
    )
    found["exits"] = None


def _abort_with_odd_counts(found: dict[str, _Finding | None], present: Sequence[RankView]) -> None:
    """No flight recorder that names anyone (every rank died before capture, or too few dumped for a
    majority: the receiver died and its peer crashed), but the first death is a rank killed without any
    mark inside a collective while the ranks' Python-level collective counts disagree: gloo aborted the
    receiver of a mismatched collective. The rank whose count is the odd one out sent it."""
    exits, fr = found.get("exits"), found.get("flight_recorder")
    if exits is None or (fr is not None and fr.initiators):
        return
    dead = [v for v in present if v.rank in set(exits.initiators)]
    if not dead or any(v.state != DEAD or v.phase != "collective" for v in dead):
        return
    by_seq: dict[int, list[int]] = defaultdict(list)
    for v in present:
        by_seq[v.coll_seq].append(v.rank)
    odd = outside_majority(by_seq)
    # the odd ranks were communicating too: counts that differ while a rank still computes are just lag
    if odd is None or any(v.phase not in ("collective", "backward") for v in present if v.rank in set(odd)):
        return
    counts = "; ".join(f"{fmt_ranks(rs)} at collective #{seq}" for seq, rs in sorted(by_seq.items()))
    found["exits"] = _Finding(
        "collective_mismatch",
        list(odd),
        "medium",
        f"{fmt_ranks(odd)} issued a different number of collectives than the others ({counts}); "
        f"{fmt_ranks(v.rank for v in dead)} then died without an exit mark inside a collective — gloo aborts "
        "the rank that receives a mismatched collective",
        [
            *exits.evidence,
            f"python-level collective counts: {counts}",
            *([f"the flight recorder agrees there is a mismatch but names nobody: {fr.reason}"]
              if fr is not None and fr.kind == "collective_mismatch" else []),
        ],
        rule="exits",
    )


def _fr_role(fr: _Finding | None, finding: _Finding) -> str:
    if fr is None or not fr.initiators:
        return "none"
    return "backed" if set(fr.initiators) == set(finding.initiators) else "disagreed"


def _weigh(finding: _Finding, rung: Rung, found: Mapping[str, _Finding | None], present: Sequence[RankView]) -> None:
    """Back or question the decision with every weaker rung; refuse to blame a majority on weak evidence."""
    chosen = set(finding.initiators)
    below = list(EVIDENCE_LADDER)[[r.name for r in EVIDENCE_LADDER].index(rung.name) + 1 :]
    for r in below:
        other = found.get(r.name)
        if other is None or not other.initiators or _names_everyone(other, present):
            continue
        if set(other.initiators) == chosen:
            finding.evidence.append(f"{r.name.replace('_', ' ')} agrees: {other.reason}")
            if r.name in ("flight_recorder", "counters", "waiting"):
                finding.confidence = raise_confidence(finding.confidence)
        elif len(other.initiators) < len(present) / 2:
            finding.evidence.append(
                f"{r.name.replace('_', ' ')} (weaker evidence) names {fmt_ranks(other.initiators)} instead: "
                f"{other.reason}"
            )
            finding.confidence = lower_confidence(finding.confidence)
        else:
            finding.evidence.append(
                f"{r.name.replace('_', ' ')} (weaker evidence) names {fmt_ranks(other.initiators)}, a majority: "
                "explained by the stronger evidence above"
            )
    if not rung.strong and finding.initiators and len(finding.initiators) > len(present) / 2:
        finding.confidence = "low"
        finding.evidence.append(
            f"naming {len(finding.initiators)} of {len(present)} ranks on {rung.name.replace('_', ' ')} evidence "
            "alone: a majority is only blamed on strong evidence (an exit, a stop, the flight recorder)"
        )
