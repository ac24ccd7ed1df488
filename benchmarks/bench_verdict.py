"""Cost of the verdict (`watchdog.verdict.decide`, a pure function) over many synthetic ranks.

Builds RankViews for a few realistic hang shapes at 64, 1,024 and 8,192 ranks (8 ranks per node) and
times `decide(...)` in-process: the median of repeated calls, plus µs per rank so super-linear growth
shows as a rising per-rank cost. Each result is checked (kind and initiating ranks) so a shape that no
longer exercises the intended rule is noticed rather than timed.

Shapes:
  dataloader   one rank stuck in the dataloader, the rest blocked in DDP's backward sync (stack signatures)
  dead_rank    one rank killed (no normal-exit mark) while the rest wait in an all_reduce
  mismatch     every rank in collective #N, one called all_gather while the others called all_reduce
  comm_hang    every rank in the same all_reduce (no single initiator)
  all_stuck    worst case: every rank stuck in the dataloader (shared cause: every rank is an initiator)
  split_op     worst case: collective mismatch with no majority (half all_reduce, half all_gather): no
               rank named

    python benchmarks/bench_verdict.py            # 64, 1024, 8192 ranks
    python benchmarks/bench_verdict.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rankwatch.watchdog.core.evidence_items import Line
from rankwatch.watchdog.core.snapshot import DEAD, RUNNING, RankView
from rankwatch.watchdog.verdict import decide

RANKS_PER_NODE = 8
SIZES = (64, 1024, 8192)
TARGET_MS = 1000.0  # the verdict must not be the slow part of a 1 s leader latency budget

WAIT_STACK = (
    "torch/distributed/distributed_c10d.py:2501 in all_reduce",
    "torch/nn/parallel/distributed.py:1582 in _sync_buffers",
    "torch/autograd/graph.py:768 in _engine_run_backward",
    "train.py:88 in train_step",
    "train.py:131 in main",
)
LOADER_STACK = (
    "torch/utils/data/dataloader.py:1294 in _get_data",
    "torch/utils/data/dataloader.py:1436 in _next_data",
    "train.py:79 in train_step",
    "train.py:131 in main",
)


def sig(stack: tuple[str, ...]) -> str:
    return hashlib.sha1("|".join(stack).encode()).hexdigest()[:12]  # an id, not security


def base(rank: int, **kw: object) -> RankView:
    fields: dict[str, object] = {
        "rank": rank,
        "node": f"node{rank // RANKS_PER_NODE:04d}",
        "pid": 10_000 + rank,
        "state": RUNNING,
        "step": 1234,
        "phase": "backward",
        "in_phase_s": 181.2,
        "since_progress_s": 181.2,
        "coll_seq": 4936,
        "coll_done": 4936,
        "coll_op": "all_reduce",
        "gpu_util": 100.0,
        "stack_top": WAIT_STACK,
        "stack_signature": sig(WAIT_STACK),
        "waiting": True,
    }
    fields.update(kw)
    return RankView(**fields)  # type: ignore[arg-type]


def shape_dataloader(n: int) -> tuple[list[RankView], str, list[int]]:
    bad = n // 2 + 3
    views = [
        base(r, phase="dataloader", stack_top=LOADER_STACK, stack_signature=sig(LOADER_STACK), waiting=False,
             gpu_util=0.0)
        if r == bad
        else base(r)
        for r in range(n)
    ]
    return views, "hang", [bad]


def shape_dead(n: int) -> tuple[list[RankView], str, list[int]]:
    bad = n - 5
    views = [
        base(r, state=DEAD, exit_age_s=12.5, exit_order=0, phase="forward", coll_seq=4936, coll_done=4936,
             stack_top=(), stack_signature=None, waiting=None, gpu_util=None)
        if r == bad
        else base(r, coll_seq=4937, phase="collective")
        for r in range(n)
    ]
    return views, "dead_rank", [bad]


def shape_mismatch(n: int) -> tuple[list[RankView], str, list[int]]:
    bad = 7
    views = [base(r, coll_seq=4937, phase="collective", coll_op="all_gather" if r == bad else "all_reduce")
             for r in range(n)]
    return views, "collective_mismatch", [bad]


def shape_comm_hang(n: int) -> tuple[list[RankView], str, list[int]]:
    return [base(r, coll_seq=4937, phase="collective") for r in range(n)], "comm_hang", []


def shape_all_stuck(n: int) -> tuple[list[RankView], str, list[int]]:
    views = [base(r, phase="dataloader", stack_top=LOADER_STACK, stack_signature=sig(LOADER_STACK), waiting=False)
             for r in range(n)]
    return views, "hang", list(range(n))


def shape_split_op(n: int) -> tuple[list[RankView], str, list[int]]:
    views = [base(r, coll_seq=4937, phase="collective", coll_op="all_gather" if r % 2 else "all_reduce")
             for r in range(n)]
    # no majority op: the mismatch is certain, who deviated is not, so no rank is named (naming half the
    # job would be a guess; the verdict says so)
    return views, "collective_mismatch", []


SHAPES: dict[str, Callable[[int], tuple[list[RankView], str, list[int]]]] = {
    "dataloader": shape_dataloader,
    "dead_rank": shape_dead,
    "mismatch": shape_mismatch,
    "comm_hang": shape_comm_hang,
    "all_stuck": shape_all_stuck,
    "split_op": shape_split_op,
}


def time_decide(views: list[RankView], repeats: int, budget_s: float) -> list[float]:
    """Seconds per call; stops early once ``budget_s`` is spent (at least 3 calls)."""
    out: list[float] = []
    t_end = time.perf_counter() + budget_s
    gc.collect()
    for i in range(repeats):
        t0 = time.perf_counter()
        decide(views, job_id="bench", incident_id="inc-1", detected_after_s=181.2, extra_evidence=(Line("bench"),))
        out.append(time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > t_end:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, 3 s per case at most")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    repeats, budget = (9, 3.0) if args.quick else (args.repeats, 10.0)

    rows = []
    for shape in args.shapes:
        for n in args.sizes:
            views, kind, initiators = SHAPES[shape](n)
            v = decide(views, job_id="bench", incident_id="inc-1", detected_after_s=181.2)
            ok = v.kind == kind and v.initiating_ranks == initiators
            times = time_decide(views, repeats, budget)
            med = statistics.median(times)
            row = {
                "shape": shape,
                "ranks": n,
                "median_ms": round(med * 1e3, 3),
                "min_ms": round(min(times) * 1e3, 3),
                "max_ms": round(max(times) * 1e3, 3),
                "us_per_rank": round(med * 1e6 / n, 2),
                "runs": len(times),
                "verdict": f"{v.kind} {v.initiating_ranks if len(v.initiating_ranks) <= 4 else '[all]'}",
                "as_expected": ok,
                "target_met": med * 1e3 <= TARGET_MS,
            }
            rows.append(row)
            print(
                f"{shape:<11} {n:>6} ranks  median {row['median_ms']:>9.3f} ms  "
                f"({row['min_ms']:.3f}–{row['max_ms']:.3f}, {len(times)} runs)  "
                f"{row['us_per_rank']:>7.2f} µs/rank  {row['verdict']}{'' if ok else '  UNEXPECTED'}",
                flush=True,
            )
    # growth: per-rank cost at the largest size over the smallest (≈1 for linear, ≫1 for quadratic)
    print("\nper-rank cost growth, largest/smallest size:")
    for shape in args.shapes:
        rs = [r for r in rows if r["shape"] == shape]
        lo, hi = rs[0], rs[-1]
        print(f"  {shape:<11} ×{hi['us_per_rank'] / lo['us_per_rank']:.1f} ({lo['ranks']}→{hi['ranks']} ranks)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["as_expected"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
