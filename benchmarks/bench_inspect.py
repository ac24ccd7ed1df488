"""``rankwatch inspect`` on plain torchrun jobs (no rankwatch imported anywhere): time to bundle, and the
right rank per hang class.

(a) wall time of ``rankwatch inspect --pid AGENT`` (discovery, py-spy of every rank in parallel, verdict,
    bundle) on an 8-rank gloo job hung in one rank's DataLoader; target < 10 s.
(b) for each hang class of ``tests/jobs/plain_ddp.py`` and fault position: does the verdict name the
    faulting rank (and only it)? Target: >= 90 % of the classes with no hook at all.

    python benchmarks/bench_inspect.py           # 5 timing reps; classes at ranks first and last of 4
    python benchmarks/bench_inspect.py --quick   # 1 rep at 4 ranks; every class once, at the last rank of 2

Exits 1 when an inspect run failed (an exit other than 0, verdict, or 1, no ranks found): the figures of
a run whose inspect crashed mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _util import Procs, median, print_results, rankwatch_cmd, spread

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "jobs"))
import hung

CLASSES = (
    "input-hang", "compute-hang", "backward-hang", "optimizer-hang", "between-phases-hang", "stop",
    "lock-deadlock", "gil-hold", "extra-barrier", "dead",
)
FAULT_STEP = 3
HANG_TIMEOUT_S = 180.0


def one(procs: Procs, nproc: int, fault: str, rank: int, extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="rwi-") as tmp:
        marks, out = Path(tmp) / "marks", Path(tmp) / "out"
        marks.mkdir()
        # dead: torchrun reaps a dead rank and tears the group down within its monitor interval (0.1 s by
        # default); inspect meets a dead rank inside that window, here widened so the run can observe it
        cmd = hung.torchrun_cmd(nproc, f"bench-{uuid.uuid4().hex[:6]}", "--fault", fault, "--fault-rank", str(rank),
                                "--fault-step", str(FAULT_STEP), "--mark-dir", str(marks), *extra,
                                monitor_interval=3600 if fault == "dead" else 0.2)
        job = procs.start(cmd)
        try:
            hung.wait_hung(marks, nproc, fault, rank, FAULT_STEP, HANG_TIMEOUT_S, job)
            t0 = time.monotonic()
            res = procs.run(rankwatch_cmd("inspect", "--pid", str(job.pid), "--out", str(out), "--json"), timeout=120,
                            text=True)
            seconds = time.monotonic() - t0
        finally:
            hung.kill_job(job)
    verdict: dict = {}
    if res.returncode in (0, 1) and res.stdout.strip().startswith("{"):
        verdict = json.loads(res.stdout)
    named = verdict.get("initiating_ranks")
    return {"fault": fault, "rank": rank, "seconds": seconds, "rc": res.returncode, "named": named,
            "kind": verdict.get("kind"), "phase": verdict.get("phase"), "right": named == [rank],
            "bundle": bool(verdict.get("bundle")), "stderr": res.stderr[-300:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--classes", nargs="*", default=list(CLASSES), choices=CLASSES)
    p.add_argument("--timing-ranks", type=int, default=None, help="ranks of the timing job (8, quick 4)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    reps = args.reps if args.reps is not None else (1 if args.quick else 5)
    positions = ("last",) if args.quick else ("first", "last")
    # --quick proves every class still runs end to end (the test suite runs it): 2 ranks are enough for
    # a faulting rank and a waiting peer, at half the torch processes of 4 on a busy machine
    world = 2 if args.quick else 4
    # the timing job's size is the figure's point (8 ranks); a quick run's figure is not quoted, and 4 ranks
    # still run py-spy on several ranks at once at half the torch processes
    timing_ranks = args.timing_ranks or (4 if args.quick else 8)
    raw: dict = {"timing": [], "classes": []}
    with Procs() as procs:
        for _ in range(reps):
            r = one(procs, timing_ranks, "input-hang", timing_ranks - 1)
            raw["timing"].append(r)
            print(f"{timing_ranks} ranks: {r['seconds']:.2f}s rc={r['rc']} named={r['named']}", flush=True)
        for fault in args.classes:
            for pos in positions:
                rank = 0 if pos == "first" else world - 1
                r = one(procs, world, fault, rank)
                raw["classes"].append(r)
                print(f"{fault:<20} rank {rank}: named {r['named']} kind {r['kind']} phase {r['phase']} "
                      f"({'right' if r['right'] else 'WRONG'}) {r['seconds']:.2f}s", flush=True)
    secs = [r["seconds"] for r in raw["timing"] if r["bundle"]]
    runs = raw["classes"]
    right = sum(r["right"] for r in runs)
    rows = [
        f"| inspect → bundle, {timing_ranks} ranks hung in one rank's DataLoader "
        f"({len(secs)} of {reps} runs bundled) | "
        f"**{median(secs):.2f} s** ({spread(secs)}) | < 10 s | {'yes' if secs and median(secs) < 10 else 'no'} |"
        if secs else f"| inspect → bundle, {timing_ranks} ranks | no bundle | < 10 s | no |",
        f"| right rank, {len(set(r['fault'] for r in runs))} hang classes × {len(positions)} position(s), no hook | "
        f"**{right}/{len(runs)}** = {100 * right / max(1, len(runs)):.0f} % | ≥ 90 % | "
        f"{'yes' if runs and right / len(runs) >= 0.9 else 'no'} |",
    ]
    print_results(rows, raw, args.json)
    failed = [r for r in raw["timing"] + runs if r["rc"] not in (0, 1)]
    for r in failed:
        print(f"inspect exited {r['rc']} on {r['fault']} (rank {r['rank']}): {r['stderr']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
