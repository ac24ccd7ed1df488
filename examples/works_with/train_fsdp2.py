"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU/gloo, under rankwatch's zero-code hook:

    rankwatch run --stall-timeout 5 -- --nproc-per-node 2 examples/works_with/train_fsdp2.py
    RW_FAULT=input-hang RW_FAULT_RANK=1 RW_FAULT_STEP=3 rankwatch run …   (rank 1's dataset blocks at batch 3)

Each block and the root are sharded: parameters are all-gathered before each block's forward and
gradients reduce-scattered in backward, from C++ (the hook's Python-level collective counters do not see
them; the flight recorder does). Faults: ``faults.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from faults import FaultyData, fault_in_forward, injector
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    dist.init_process_group("gloo")
    inj = injector()
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)), nn.Linear(16, 1))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    fault_in_forward(model, inj)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = FaultyData(inj, batch_size=8)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data))
    steps = int(os.environ.get("RW_STEPS", "40"))
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
