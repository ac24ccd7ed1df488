"""PyTorch Lightning (``lightning``) on CPU/gloo with its DDP strategy, under rankwatch's zero-code hook:

    rankwatch run --stall-timeout 5 -- --nproc-per-node 2 examples/works_with/train_lightning.py
    RW_FAULT=compute-hang RW_FAULT_RANK=0 RW_FAULT_STEP=3 rankwatch run …   (rank 0 spins in forward)

Under torchrun Lightning finds the torchelastic environment and starts no processes of its own; with
automatic optimization ``training_step`` runs inside ``optimizer.step(closure)``, so the hook sees forward
and backward nested in the optimizer phase and names the innermost. Faults: ``faults.py``.
"""

from __future__ import annotations

import os

import lightning as L
import torch
from faults import FaultyData, fault_in_forward, injector
from torch import nn
from torch.utils.data import DataLoader


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    inj = injector()
    model = Regressor()
    fault_in_forward(model.net, inj)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy="ddp",
        max_steps=int(os.environ.get("RW_STEPS", "40")),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(FaultyData(inj, batch_size=8), batch_size=8))


if __name__ == "__main__":
    main()
