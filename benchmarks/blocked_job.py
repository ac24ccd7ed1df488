"""A gloo job whose ranks all block: rank ``world-1`` waits forever outside any collective, the others
block in an all_reduce waiting for it. Used by bench_capture.py under ``torchrun -m rankwatch.hooks``.
A few warm-up all_reduces first, so the flight recorder holds entries. Never exits on its own."""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=1))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1024)
    for _ in range(5):
        dist.all_reduce(t)
    if rank == world - 1:
        threading.Event().wait()  # the culprit: never joins the next collective
    dist.all_reduce(t)


if __name__ == "__main__":
    main()
