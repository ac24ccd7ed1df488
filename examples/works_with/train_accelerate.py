"""A plain training loop with Hugging Face ``accelerate`` on CPU/gloo, under rankwatch's zero-code hook:

    rankwatch run --stall-timeout 5 -- --nproc-per-node 2 examples/works_with/train_accelerate.py
    RW_FAULT=compute-hang RW_FAULT_RANK=1 RW_FAULT_STEP=3 rankwatch run …   (rank 1 spins in forward)

``Accelerator.prepare`` wraps the model in DDP and shards the DataLoader; ``accelerator.backward`` calls
``loss.backward()``; the hook sees all of it without a line of rankwatch here. Faults: ``faults.py``.
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from faults import FaultyData, fault_in_forward, injector
from torch import nn
from torch.utils.data import DataLoader


def main() -> None:
    accelerator = Accelerator(cpu=True)
    inj = injector()
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    fault_in_forward(model, inj)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(FaultyData(inj, batch_size=8), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps = int(os.environ.get("RW_STEPS", "40"))
    model.train()
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()


if __name__ == "__main__":
    main()
