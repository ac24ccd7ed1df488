"""Faults for the works-with examples, read from the environment so each script keeps its framework's own
command line (not a rankwatch module; the faults themselves are ``examples/fault_injection.py``'s):

    RW_FAULT=input-hang|compute-hang|dead-rank|exception|…   (unset: train normally)
    RW_FAULT_RANK=1    the rank that misbehaves (global rank)
    RW_FAULT_STEP=3    the batch (input faults) or training forward call (the others) at which it fires
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fault_injection import Injector


def injector() -> Injector:
    rank = int(os.environ.get("RANK", "0"))
    return Injector(os.environ.get("RW_FAULT") or None, rank, int(os.environ.get("RW_FAULT_RANK", "1")),
                    int(os.environ.get("RW_FAULT_STEP", "3")))


class FaultyData(Dataset):
    """``n`` random (features, target) pairs; counts the items this process loaded so an input fault fires
    at a batch number (a DistributedSampler hands out shuffled indices, so the index says nothing)."""

    def __init__(self, inj: Injector, n: int = 4096, dim: int = 16, batch_size: int = 8) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=gen)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.inj, self.batch_size, self.loaded = inj, batch_size, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.inj.in_data(self.loaded // self.batch_size)
        self.loaded += 1
        return self.x[index], self.y[index]


def fault_in_forward(module: torch.nn.Module, inj: Injector) -> None:
    """Forward faults (compute-hang, exception, lock-deadlock) at the ``RW_FAULT_STEP``-th training forward."""
    calls = [0]

    def pre_hook(_module: Any, _args: Any) -> None:
        if module.training:
            inj.step = calls[0]
            calls[0] += 1
            inj.at_step_start(inj.step)  # dead-rank, stopped-rank
            inj.in_forward()

    module.register_forward_pre_hook(pre_hook)
