"""A plain DDP job (gloo, CPU) with one injected hang — no rankwatch anywhere, as an unwrapped job runs.

    torchrun --nproc-per-node 4 tests/jobs/plain_ddp.py --fault input-hang --fault-rank 2 --mark-dir DIR

At ``--fault-step`` the fault rank writes ``DIR/fault`` and faults; every rank writes ``DIR/rank-<r>.step-<s>``
as it starts step ``s`` (so a test knows the others reached the step where they will wait, without sleeping).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

FAULTS = (
    "none", "input-hang", "compute-hang", "backward-hang", "optimizer-hang", "between-phases-hang", "stop", "dead",
    "lock-deadlock", "gil-hold", "extra-barrier",
)


def mark(args: argparse.Namespace, name: str) -> None:
    if args.mark_dir:
        with open(os.path.join(args.mark_dir, name), "w") as f:
            f.write(str(os.getpid()))


def forever() -> None:
    threading.Event().wait()


class Data(Dataset):
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args, self.rank = args, rank

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        if a.fault == "dead" and self.rank != a.fault_rank and i // a.batch_size == a.fault_step:
            forever()  # the peers are busy in a slow input when their peer dies: they have not noticed yet
        if self.rank == a.fault_rank and i // a.batch_size == a.fault_step:
            if a.fault == "input-hang":
                mark(a, "fault")
                forever()
            if a.fault == "gil-hold":
                mark(a, "fault")
                ctypes.PyDLL(None).sleep(3600)  # a C call that keeps the GIL
        return torch.randn(32), torch.randint(0, 4, ()).long()


class Model(nn.Module):
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        super().__init__()
        self.args, self.rank, self.step = args, rank, 0
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        if self.rank == a.fault_rank and self.step == a.fault_step:
            if a.fault == "compute-hang":
                mark(a, "fault")
                while True:
                    x = x * 1.0
            if a.fault == "lock-deadlock":
                mark(a, "fault")
                with self.lock, self.lock:
                    pass
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", choices=FAULTS, default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--mark-dir", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    inner = Model(args, rank)
    model = DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    faulty = rank == args.fault_rank
    if faulty and args.fault == "backward-hang":
        def spin(grad: torch.Tensor) -> torch.Tensor:
            if inner.step == args.fault_step:
                mark(args, "fault")
                while True:
                    grad = grad * 1.0
            return grad
        inner.net[0].weight.register_hook(spin)
    if faulty and args.fault == "optimizer-hang":
        def pre(*_: object) -> None:
            if inner.step == args.fault_step:
                mark(args, "fault")
                while True:
                    time.sleep(0)
        opt.register_step_pre_hook(pre)
    loader = DataLoader(Data(args, rank), batch_size=args.batch_size, num_workers=args.num_workers)
    batches = iter(loader)
    for step in range(args.steps):
        inner.step = step
        mark(args, f"rank-{rank}.step-{step}")
        if faulty and step == args.fault_step:
            if args.fault == "stop":
                mark(args, "fault")
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.fault == "dead":
                mark(args, "fault")
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "extra-barrier":
                mark(args, "fault")
                dist.barrier()
        x, y = next(batches)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        metric = loss.detach().clone()
        dist.all_reduce(metric)
        if faulty and step == args.fault_step and args.fault == "between-phases-hang":
            mark(args, "fault")
            forever()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
