"""A synchronous job with exactly paced phases (sleeps), for summary tests that need known timings.

    torchrun --nproc-per-node 2 -m rankwatch.hooks tests/procs/paced_job.py --scenario S [--steps N]

Every step: dataloader, forward, optimizer of ``--phase-ms`` each, then a gloo all_reduce (the
ranks wait for the slowest). ``rank-wide``: rank 1 takes ``--extra-ms`` longer in *every* phase (each
below the straggler threshold, together above it). ``checkpoint``: rank 0 runs a declared
``checkpoint`` phase of ``--checkpoint-s`` once, at step 5.
"""

from __future__ import annotations

import argparse
import time

import rankwatch.hooks as rw
import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("balanced", "rank-wide", "checkpoint"), default="balanced")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--phase-ms", type=float, default=6.0)
    p.add_argument("--extra-ms", type=float, default=3.0)
    p.add_argument("--checkpoint-s", type=float, default=3.0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = a.extra_ms / 1e3 if a.scenario == "rank-wide" and rank == 1 else 0.0
    t = torch.zeros(1)
    for s in range(a.steps):
        for name in ("dataloader", "forward", "optimizer"):  # no backward: without DDP it counts as a wait
            with rw.phase(name):
                time.sleep(a.phase_ms / 1e3 + slow)
        if a.scenario == "checkpoint" and rank == 0 and s == 5:
            with rw.phase("checkpoint", budget_s=60):
                time.sleep(a.checkpoint_s)
        dist.all_reduce(t)
        rw.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
