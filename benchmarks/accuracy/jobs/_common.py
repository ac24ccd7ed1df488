"""What every fault job of the v3 classes shares: the command line, process-group start-up, the fault mark.

The jobs are small gloo/CPU programs, one file per parallelism layout (``pipeline.py``, ``tensor_data.py``,
``experts.py``, ``loop.py``), run by ``benchmarks/accuracy/run.py`` under ``rankwatch run`` + torchrun.
Marks go through ``examples/fault_injection.mark`` (one JSON line in ``$RW_FAULT_LOG``), so the runner
times fault → verdict exactly as it does for the model faults.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "examples"))

import fault_injection  # noqa: E402  (examples/, beside the demo models)

mark = fault_injection.mark
spin_forever = fault_injection.spin_forever
block_forever = fault_injection.block_forever


def parser(doc: str | None, scenarios: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--scenario", choices=scenarios, required=True)
    p.add_argument("--fault-rank", type=int, required=True)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--pg-timeout-s", type=float, default=60.0, help="init_process_group(timeout=...)")
    p.add_argument(
        "--step-sleep-ms", type=float, default=20.0, help="idle time per step (keeps 8 ranks on 2 cores sane)"
    )
    return p


def init(args: argparse.Namespace) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "-1"))


def optimize(opt: Any, loss: Any) -> Any:
    """One optimizer step on ``loss`` (zero the gradients, backward, step); returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss


def run_steps(
    args: argparse.Namespace, step: Callable[[int], Any], after: Callable[[int], None] | None = None,
    log_reduce: bool = True,
) -> int:
    """The loop every job shares: ``step(i)`` does the layout's forward, backward and optimizer step and
    returns its loss; the loss is all-reduced over the world for logging (a world collective every step, in
    every layout), then ``after(i)`` (a checkpoint) and the idle time per step. Ends in a barrier and
    destroys the group, so a healthy job exits 0 on every rank. ``log_reduce=False``: no logging all_reduce (a
    job whose only collective is ``after``'s)."""
    import torch
    import torch.distributed as dist

    loss_sum = torch.zeros(1)
    for i in range(args.steps):
        loss = step(i)
        if log_reduce:
            loss_sum.copy_(loss.detach().reshape(-1)[:1])
            dist.all_reduce(loss_sum)
        if after is not None:
            after(i)
        if args.step_sleep_ms:
            time.sleep(args.step_sleep_ms / 1000.0)
    dist.barrier()
    dist.destroy_process_group()
    return 0
