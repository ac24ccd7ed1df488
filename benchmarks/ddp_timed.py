"""The demo's balanced DDP loop (examples/ddp_demo.py, same model, data and collectives) with a timer.

Used by bench_hook.py, run under torchrun with or without ``-m rankwatch.hooks``. Rank 0 prints one
JSON line: the mean and the median step time over the steps after ``--warmup`` (the slowest rank's,
via a final all_reduce MAX outside the timed window), and the CPU time per step of the training thread
and of the whole process (mean over ranks). examples/ddp_demo.py is not edited: this imports its pieces.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import itertools

import torch
import torch.distributed as dist
from ddp_demo import Model, SlowCollate, SyntheticData, parse_args
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader


def main() -> int:
    argv = sys.argv[1:]
    warmup = 20
    if "--warmup" in argv:
        i = argv.index("--warmup")
        warmup = int(argv[i + 1])
        del argv[i : i + 2]
    traceml = "--traceml" in argv  # bench_hook.py's TraceML arm: its step context around each step
    if traceml:
        argv.remove("--traceml")
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    traced: Any = contextlib.nullcontext
    if traceml:  # before any DataLoader iterator exists, as TraceML's own demo does
        import traceml_ai

        traceml_ai.init(mode="auto")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Model(args.hidden, args.layers))
    if traceml:
        traced = functools.partial(traceml_ai.trace_step, ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    loader = DataLoader(
        SyntheticData(args, rank), batch_size=args.batch_size, num_workers=0, collate_fn=SlowCollate(args, rank, [0])
    )
    batches = iter(loader)
    loss_sum = torch.zeros(1)
    t0 = 0.0
    marks = []
    for step in range(args.steps):
        if step >= warmup:
            marks.append(time.perf_counter())
        if step == warmup:
            t0 = marks[0]
            c0, p0 = time.thread_time(), time.process_time()
        x, y = next(batches)
        with traced():
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        loss_sum.copy_(loss.detach())
        dist.all_reduce(loss_sum)
        if args.step_sleep_ms:
            time.sleep(args.step_sleep_ms / 1000.0)
    end = time.perf_counter()
    c1, p1 = time.thread_time(), time.process_time()
    marks.append(end)
    durations = sorted(b - a for a, b in itertools.pairwise(marks))
    # mean over the window, and the median step (robust to the moments a shared core was taken away)
    per_step = torch.tensor([(end - t0) / (args.steps - warmup), durations[len(durations) // 2]], dtype=torch.float64)
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
    # CPU time per step, averaged over ranks: the training thread's, and the whole process's (gloo and
    # autograd threads too). Less sensitive than wall time to other jobs taking the shared cores.
    n = args.steps - warmup
    cpu = torch.tensor([(c1 - c0) / n, (p1 - p0) / n], dtype=torch.float64)
    dist.all_reduce(cpu)
    if rank == 0:
        mean, med = per_step.tolist()
        thread_cpu, proc_cpu = (cpu / dist.get_world_size()).tolist()
        print(
            json.dumps(
                {
                    "step_ms": mean * 1e3,
                    "median_step_ms": med * 1e3,
                    "thread_cpu_ms": thread_cpu * 1e3,
                    "process_cpu_ms": proc_cpu * 1e3,
                    "steps": n,
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
