"""A small DDP job (gloo, CPU) whose every step touches a file-backed working set: each rank maps its own file
(``--ws-dir``/rank-R.bin) and reads one byte of every page of it per sample, as a dataset kept in memory does.

    torchrun --nproc-per-node 2 tests/jobs/working_set.py --ws-dir DIR --steps 200

The working set is touched only once ``DIR/go`` exists: a page is charged to the memory cgroup of the process
that first faults it in, and stays charged there when the process moves, so the test puts the ranks in their
groups first and then says go. What is slowed from outside (a memory limit below one rank's working set) is the
test's business, not the job's.
"""

from __future__ import annotations

import argparse
import mmap
import os

import torch
import torch.distributed as dist
from ddp_loop import train
from torch.utils.data import Dataset

PAGE = mmap.PAGESIZE


class WorkingSet(Dataset):
    def __init__(self, ws_dir: str, rank: int) -> None:
        self.path, self.go = os.path.join(ws_dir, f"rank-{rank}.bin"), os.path.join(ws_dir, "go")
        self.map: mmap.mmap | None = None

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = 0
        if self.map is None and os.path.exists(self.go):
            with open(self.path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        if self.map is not None:
            m = self.map
            for off in range(0, len(m), PAGE):
                acc += m[off]
        x = torch.full((32,), float(acc % 7))
        return x, torch.tensor(i % 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ws-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    train(lambda: WorkingSet(args.ws_dir, dist.get_rank()), args.steps)


if __name__ == "__main__":
    main()
