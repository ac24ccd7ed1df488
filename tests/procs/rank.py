"""A rank without torch: the real hook API writing a real record, for daemon tests that need many processes.

    RANKWATCH_SHM_DIR=... RANKWATCH_JOB_ID=... RANK=r WORLD_SIZE=n LOCAL_RANK=r LOCAL_WORLD_SIZE=n \
        python tests/procs/rank.py [--stall-after STEPS] [--children N] [--step-s S]

Steps every ``--step-s`` seconds (dataloader → forward → backward → optimizer); after ``--stall-after``
steps it stops making progress inside ``forward``; with ``--steps`` it exits normally after that
many. ``--children`` forks that many workers that ignore
SIGTERM and block forever, like DataLoader workers stuck in ``collate``. Prints "ready <pid>" once its
record exists.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import rankwatch.hooks as rw


def worker() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stall-after", type=int, default=-1)
    p.add_argument("--children", type=int, default=0)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=-1, help="exit normally after this many steps")
    args = p.parse_args()
    if not rw.init():
        sys.exit("rankwatch hook did not start")
    for _ in range(args.children):
        if os.fork() == 0:
            worker()
    print(f"ready {os.getpid()}", flush=True)
    step = 0
    while True:
        for name in ("dataloader", "forward", "backward", "optimizer"):
            with rw.phase(name):
                if name == "forward" and step == args.stall_after:
                    while True:
                        time.sleep(60)
                time.sleep(args.step_s / 4)
        rw.step()
        step += 1
        if step == args.steps:
            return


if __name__ == "__main__":
    main()
