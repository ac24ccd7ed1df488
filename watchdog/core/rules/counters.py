"""The hook's counters: steps and Python-level collective counts and ops (ranks behind, odd ops), and the phase
of ranks when nobody waits. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ..live_facts import is_waiting
from ..ranks import behind as ranks_behind
from ..ranks import fmt_ranks, majority, outside_majority
from ..render import phase_kind
from ..snapshot import STEP_PHASE_ORDER, RankView
from .finding import RuleFinding


def _odd_views(groups: dict[Any, list[RankView]]) -> list[RankView] | None:
    """The views of every rank outside the strictly largest group (``ranks.outside_majority``)."""
    odd = outside_majority({k: [v.rank for v in vs] for k, vs in groups.items()})
    if odd is None:
        return None
    chosen = set(odd)
    return sorted((v for vs in groups.values() for v in vs if v.rank in chosen), key=lambda v: v.rank)


def rule_behind(live: Sequence[RankView]) -> RuleFinding | None:
    top_step = max(v.step for v in live)
    low_step = min(v.step for v in live)
    by_step = set(ranks_behind({v.rank: v.step for v in live}))
    if by_step:
        behind = [v for v in live if v.rank in by_step]
        return RuleFinding(
            "hang",
            sorted(v.rank for v in behind),
            "high" if len(behind) < len(live) / 2 else "medium",
            f"{fmt_ranks(v.rank for v in behind)} is stuck at step {low_step} in "
            f"{phase_kind(behind[0].phase)} ({behind[0].phase or 'idle'}) while the others reached step {top_step}",
            [f"rank {v.rank}: step {v.step}, phase {v.phase or 'idle'}" for v in live],
            data={"shape": "behind", "by": "step", "low": low_step, "high": top_step, "phase": behind[0].phase},
        )
    top_seq = max(v.coll_seq for v in live)
    by_seq = set(ranks_behind({v.rank: v.coll_seq for v in live}))
    if by_seq:
        behind = [v for v in live if v.rank in by_seq]
        ahead = [v for v in live if v.coll_seq == top_seq]
        if len(behind) > len(live) / 2 and all(is_waiting(v) for v in live):
            # most ranks "behind" yet every rank waits: the few ahead entered a collective the others never
            # issue (a rank-conditional barrier); the others wait in one Python counters cannot see (DDP)
            return RuleFinding(
                "collective_mismatch",
                sorted(v.rank for v in ahead),
                "medium",
                f"{fmt_ranks(v.rank for v in ahead)} entered collective #{top_seq} ({ahead[0].coll_op}) that "
                f"{fmt_ranks(v.rank for v in behind)} never issue: they wait in "
                f"{', '.join(sorted({v.phase or 'idle' for v in behind}))} (a collective Python-level counters do "
                "not see, such as DDP's gradient all-reduce) — a collective only some ranks call",
                [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op or ''}, phase {v.phase or 'idle'}" for v in live],
                data={"shape": "extra_collective", "by": "collective_seq", "seq": top_seq, "op": ahead[0].coll_op},
            )
        if (
            len(behind) < len(live) / 2
            and all(v.waiting is True and not v.in_collective for v in behind)
            and all(v.in_collective for v in live if v.rank not in by_seq)
        ):
            # the few behind are not computing: their stacks wait on peers in a collective Python counters
            # do not see (DDP's buffer broadcast in the next forward) — they skipped the one the others are in
            return RuleFinding(
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
                data={
                    "shape": "skipped_collective",
                    "by": "collective_seq",
                    "seq": top_seq,
                    "op": ahead[0].coll_op,
                    "at": behind[0].coll_seq,
                },
            )
        return RuleFinding(
            "hang",
            sorted(v.rank for v in behind),
            "high" if len(behind) < len(live) / 2 else "medium",
            f"{fmt_ranks(v.rank for v in behind)} is stuck in {phase_kind(behind[0].phase)} "
            f"({behind[0].phase or 'idle'}) before collective #{top_seq} ({ahead[0].coll_op}) that "
            f"{fmt_ranks(v.rank for v in ahead)} already entered",
            [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op or ''}, phase {v.phase or 'idle'}" for v in live],
            data={
                "shape": "behind",
                "by": "collective_seq",
                "low": behind[0].coll_seq,
                "high": top_seq,
                "op": ahead[0].coll_op,
                "phase": behind[0].phase,
            },
        )
    return None


def rule_not_waiting(live: Sequence[RankView]) -> RuleFinding | None:
    """Nobody waits (the wait-for graph has no edge): the ranks earliest in the step, else a shared cause."""
    waiting = [v for v in live if is_waiting(v)]
    busy = [v for v in live if not is_waiting(v)]
    if busy and not waiting:
        by_order: dict[int, list[RankView]] = defaultdict(list)
        for v in busy:
            by_order[STEP_PHASE_ORDER.get(v.phase or "", 0)].append(v)
        if len(by_order) > 1:
            earliest = by_order[min(by_order)]
            lead = earliest[0]
            return RuleFinding(
                "hang",
                sorted(v.rank for v in earliest),
                "medium",
                f"{fmt_ranks(v.rank for v in earliest)} is stuck earliest in the step, in "
                f"{phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step}",
                [f"rank {v.rank}: phase {v.phase or 'idle'}" for v in live],
                data={"shape": "earliest_in_step", "phase": lead.phase},
            )
        lead = busy[0]
        return RuleFinding(
            "hang",
            sorted(v.rank for v in busy),
            "low",
            f"every rank is stuck in {phase_kind(lead.phase)} ({lead.phase or 'idle'}) at step {lead.step}: "
            "a shared cause (filesystem, data service, host) rather than one rank",
            [],
            data={"shape": "shared_cause", "phase": lead.phase},
        )
    return None


def rule_collective(live: Sequence[RankView]) -> RuleFinding | None:
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
            return RuleFinding(
                "collective_mismatch",
                [],
                "low",
                f"collective #{seq} differs across ranks ({ops}); no majority says which side is wrong",
                [],
                data={"shape": "op_tie", "seq": seq, "ops": by_op_ranks},
            )
        odd_ops = sorted(op for op in by_op_ranks if op != top_op)
        odd_desc = (
            odd_ops[0] if len(odd_ops) == 1 else ", ".join(f"{op} ({fmt_ranks(by_op_ranks[op])})" for op in odd_ops)
        )
        return RuleFinding(
            "collective_mismatch",
            list(odd),
            "high",
            f"collective mismatch at collective #{seq}: {fmt_ranks(odd)} called {odd_desc} while the others "
            f"({fmt_ranks(by_op_ranks[top_op])}) called {top_op}",
            [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op}" for v in live],
            data={"shape": "odd_op", "seq": seq, "ops": by_op_ranks, "majority_op": top_op},
        )
    return None
