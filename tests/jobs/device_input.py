"""A small DDP job (gloo, CPU) whose input is read from a block device, one ``--chunk-kb`` read per sample
with O_DIRECT (no page cache: every read reaches the device, as a dataset larger than memory does).

    torchrun --nproc-per-node 2 tests/jobs/device_input.py --device /dev/loopN --steps 200

Rankwatch runs it (``rankwatch run``); what is slowed from outside (a cgroup's I/O limit on one rank) is the
test's business, not the job's.
"""

from __future__ import annotations

import argparse
import mmap
import os

import torch
from ddp_loop import train
from torch.utils.data import Dataset


class DeviceData(Dataset):
    def __init__(self, device: str, chunk: int) -> None:
        self.device, self.chunk = device, chunk
        self.fd = -1
        self.buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
        self.blocks = 0

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fd < 0:
            self.fd = os.open(self.device, os.O_RDONLY | os.O_DIRECT)
            self.blocks = max(1, os.lseek(self.fd, 0, os.SEEK_END) // self.chunk)
        os.preadv(self.fd, [self.buf], (i % self.blocks) * self.chunk)
        x = torch.frombuffer(self.buf, dtype=torch.uint8, count=32).float()
        return x, torch.tensor(i % 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--chunk-kb", type=int, default=64)
    args = p.parse_args()
    train(lambda: DeviceData(args.device, args.chunk_kb * 1024), args.steps)


if __name__ == "__main__":
    main()
