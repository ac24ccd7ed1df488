"""What sampling the ranks' host signals costs the watchdog per poll (issue 41: at most 0.5 % of a core for
8 ranks at the default poll interval).

Starts ``--ranks`` processes with ``--threads`` threads each (a gloo/DDP rank has 10-30: its own, torch's
intra-op pool, gloo's, the DataLoader's pin-memory thread), then times what one poll's sample costs the
daemon: the reader's ``signals`` request (every rank's threads' schedstat, status, stat, cgroup and its
cgroup files) and the host's /proc/pressure. CPU time of this process (``time.process_time``), the
median over ``--polls`` polls, as a share of one core at ``--interval`` seconds per poll.

    python benchmarks/bench_signals.py            # 8 ranks × 24 threads, 400 polls
    python benchmarks/bench_signals.py --quick    # 2 ranks, 20 polls (smoke run)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from rankwatch.watchdog.core.policy import ReaderPolicy
from rankwatch.watchdog.observe.signals import read_host
from rankwatch.watchdog.privsep.registry import Worker

CHILD = """
import sys, threading, time
n = int(sys.argv[1])
for _ in range(n - 1):
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=24)
    ap.add_argument("--polls", type=int, default=400)
    ap.add_argument("--interval", type=float, default=0.5, help="the daemon's poll interval (s)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="FILE", help="write the result here too")
    args = ap.parse_args()
    if args.quick:
        args.ranks, args.polls = 2, 20
    kids = [subprocess.Popen([sys.executable, "-c", CHILD, str(args.threads)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True) for _ in range(args.ranks)]
    try:
        for k in kids:
            assert k.stdout is not None and k.stdout.readline().strip() == "ready"
        core = Worker(ReaderPolicy(), None)
        pids = [k.pid for k in kids]
        costs = []
        for _ in range(args.polls):
            c0 = time.process_time()
            out = core.handle({"op": "signals", "pids": pids}, [])
            read_host()
            costs.append(time.process_time() - c0)
        assert all(out["ranks"][str(p)] is not None for p in pids), out
        per_poll = statistics.median(costs)
        share = 100 * per_poll / args.interval
        doc = {"ranks": args.ranks, "threads_per_rank": args.threads, "polls": args.polls,
               "cpu_per_poll_ms": round(1e3 * per_poll, 3), "cpu_per_poll_ms_p90": round(
                   1e3 * sorted(costs)[int(0.9 * len(costs))], 3),
               "interval_s": args.interval, "core_percent": round(share, 3), "target_percent": 0.5,
               "ok": share <= 0.5}
        print(json.dumps(doc))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f)
        return 0 if args.quick or doc["ok"] else 1
    finally:
        for k in kids:
            k.kill()
            k.wait()


if __name__ == "__main__":
    sys.exit(main())
