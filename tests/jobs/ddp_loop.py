"""The training loop the input-bound test jobs share (``device_input.py``, ``working_set.py``): a small DDP
model (gloo, CPU) fed one sample per step by the job's own dataset, so what differs between them is only where
the input comes from."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset


def train(make_dataset: Callable[[], Dataset], steps: int) -> None:
    """``make_dataset``: called with no argument once the process group is up (a dataset may need the rank)."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(make_dataset(), batch_size=1, num_workers=0)
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
