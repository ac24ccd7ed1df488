"""Real DDP bugs that are not the demo's injected faults (run under torchrun, gloo on CPU).

    --bug rank-barrier  rank R calls ``dist.barrier()`` inside the loop from step S on ("wait for rank 0's
                        logging"): the others are in backward, in DDP's gradient all-reduce
    --bug uneven-data   rank R's shard holds S batches, the others' many more: R leaves the loop, tears
                        its process group down and exits normally while its peers still need it
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bug", choices=("rank-barrier", "uneven-data"), required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--at-step", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    n = args.at_step if args.bug == "uneven-data" and rank == args.rank else args.steps
    data = TensorDataset(torch.randn(n * 8, 64), torch.randint(0, 10, (n * 8,)))
    loader = DataLoader(data, batch_size=8)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader):
        if args.bug == "rank-barrier" and rank == args.rank and step >= args.at_step:
            dist.barrier()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)
    print(f"rank {rank} finished {step + 1} steps", flush=True)
    dist.destroy_process_group()
    os._exit(0) if os.environ.get("DDP_BUGS_HARD_EXIT") else None


if __name__ == "__main__":
    main()
