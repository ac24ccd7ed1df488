"""A one-rank job the test paces with files, for `rankwatch run` beside other jobs and optional parts that fail.

    torchrun --nproc-per-node 1 -m rankwatch.hooks tests/procs/gated_job.py --gate PATH \
        [--pause-at N --resume PATH]

Steps (a short declared phase each) until the file ``--gate`` exists, then ends with exit 0. ``--pause-at
N``: at step N it stops making progress (a stall) until the file ``--resume`` exists, then goes on (a job
that recovers). No torch work: what these tests look at is the run around the job, not the job.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import rankwatch.hooks as rw


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gate", required=True, type=Path)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--resume", type=Path, default=None)
    a = p.parse_args()
    print("job started", flush=True)
    step = 0
    while not a.gate.exists():
        with rw.phase("work"):
            time.sleep(0.05)  # the job's own pace, not a wait for the test
            if step == a.pause_at and a.resume is not None:
                print("job paused", flush=True)
                while not a.resume.exists():
                    time.sleep(0.05)
                print("job resumed", flush=True)
        rw.step()
        step += 1
    print(f"job done after {step} steps", flush=True)


if __name__ == "__main__":
    main()
