"""A small DDP training loop with injectable slowness and faults, for demos, tests and benchmarks.

Runs on CPU/gloo (CUDA/NCCL when present). Launch under torchrun, optionally through rankwatch:

    torchrun --nproc-per-node 4 -m rankwatch.hooks examples/ddp_demo.py --scenario input-hang --fault-rank 2

Slow scenarios: balanced, input-straggler (sleep in collate on ``--straggler-rank``; with
``--input-every N`` only on every Nth batch: periodic slow storage), input-bound (the same sleep in
collate on every rank: the pipeline, not a rank, is the bottleneck; use ``--num-workers``),
compute-straggler (extra matmuls in the optimizer step), backward-straggler (extra matmuls in a
gradient hook). Faults, at ``--fault-step``
on ``--fault-rank``: input-hang (the dataset blocks forever), compute-hang (infinite loop in forward),
dead-rank (SIGKILL itself), stopped-rank (SIGSTOP itself), collective-mismatch (calls a different
collective than the others). More faults from ``fault_injection.py`` (shared with ``transformer_demo.py``):
backward-hang, optimizer-hang, between-phases-hang, exception, extra-collective, extra-barrier,
skipped-collective, uneven-data, gil-hold, lock-deadlock, checkpoint-hang (see that module's table).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

try:
    import fault_injection
except ImportError:  # imported from elsewhere: the module lives beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fault_injection

# the scenarios of fault_catalogue.py: this model's own slow ones, then the injector's (both models have them)
SCENARIOS = (
    fault_injection.NO_FAULT,
    *(name for name, s in fault_injection.fault_catalogue.SCENARIOS.items()
      if s.program == fault_injection.fault_catalogue.DDP_DEMO),
    *fault_injection.STRAGGLERS,
    *fault_injection.FAULTS,
)

try:  # declared phases when rankwatch is installed; the demo runs without it too
    from rankwatch.hooks import phase as rw_phase
except ImportError:  # pragma: no cover
    rw_phase = None


def declared_phase(name: str, budget_s: float) -> contextlib.AbstractContextManager[None]:
    return rw_phase(name, budget_s=budget_s) if rw_phase else contextlib.nullcontext()


class SyntheticData(Dataset):
    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.args = args
        self.rank = rank
        self.gen = torch.Generator().manual_seed(rank)

    def __len__(self) -> int:
        a = self.args
        if a.scenario == "uneven-data" and self.rank == a.fault_rank:
            return a.fault_step * a.batch_size  # this rank's data runs out at --fault-step
        return 1 << 30

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(self.args.hidden, generator=self.gen), torch.randn(1, generator=self.gen)


class SlowCollate:
    def __init__(
        self,
        args: argparse.Namespace,
        rank: int,
        step_ref: list[int],
        injector: fault_injection.Injector | None = None,
    ) -> None:
        self.args = args
        self.rank = rank
        self.step_ref = step_ref
        self.injector = injector
        self.calls = 0  # batches this process collated (per worker with --num-workers)

    def __call__(self, batch):  # type: ignore[no-untyped-def]
        a = self.args
        step = self.step_ref[0]
        self.calls += 1
        slow_batch = self.calls % a.input_every == 0
        if slow_batch and (
            a.scenario == "input-bound" or (self.rank == a.straggler_rank and a.scenario == "input-straggler")
        ):
            time.sleep(a.input_sleep_ms / 1000.0)
        elif slow_batch and self.rank == a.straggler_rank and a.straggle_ms:
            time.sleep(a.straggle_ms / 1000.0)  # a slow loader before a fault (any scenario)
        if self.rank == a.fault_rank and a.scenario == "input-hang" and step >= a.fault_step:
            fault_injection.mark(a.scenario, self.rank, step)
            threading.Event().wait()  # a dataloader that never returns
        if self.injector is not None:
            self.injector.in_data(step)
        return torch.utils.data.default_collate(batch)


class Model(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)])
        self.head = nn.Linear(hidden, 1)
        self.hang = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while self.hang:  # an infinite loop in forward (a compute hang on the CPU side)
            x = x * 1.0
        return self.head(self.body(x))


def extra_work(n: int, size: int = 256) -> None:
    m = torch.ones(size, size)
    for _ in range(n):
        m = torch.mm(m, m).clamp_(max=1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=SCENARIOS, default="balanced")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--straggler-rank", type=int, default=1)
    p.add_argument("--fault-rank", type=int, default=None, help="rank that faults (default: --straggler-rank)")
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--input-sleep-ms", type=float, default=30.0)
    p.add_argument("--input-every", type=int, default=1, help="input scenarios: sleep on every Nth batch only")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--straggle-ms", type=float, default=0.0,
                   help="any scenario: --straggler-rank's collate sleeps this long too (a straggler that then faults)")
    p.add_argument("--compute-extra-matmuls", type=int, default=40)
    p.add_argument("--first-step-sleep-s", type=float, default=0.0, help="slow first step on every rank")
    p.add_argument("--checkpoint-every", type=int, default=0, help="declared 'checkpoint' phase every N steps")
    p.add_argument("--checkpoint-s", type=float, default=0.0, help="how long each checkpoint takes")
    p.add_argument(
        "--checkpoint-budget-s",
        type=float,
        default=60.0,
        help="budget of the declared 'checkpoint' phase (--checkpoint-every, and checkpoint-hang's checkpoint)",
    )
    p.add_argument("--step-sleep-ms", type=float, default=0.0, help="idle time per step (logging etc.)")
    p.add_argument("--pg-timeout-s", type=float, default=600.0, help="process group timeout")
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--traceml", action="store_true",
                   help="also trace each step with TraceML (traceml-ai), for benchmarks/bench_traceml.py")
    args = p.parse_args(argv)
    if args.fault_rank is None:
        args.fault_rank = args.straggler_rank
    if args.input_every < 1 or args.num_workers < 0:
        p.error("--input-every must be >= 1 and --num-workers >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s)
    )
    rank = dist.get_rank()
    if args.traceml:  # before any DataLoader iterator exists, as TraceML's own demo does
        import traceml_ai

        traceml_ai.init(mode="auto")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = Model(args.hidden, args.layers).to(device)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    step_ref = [0]
    # the faults this file had before fault_injection.py keep their own code below
    inj = fault_injection.Injector.from_args(args, rank, scenarios=fault_injection.NEW_IN_THIS_MODULE)
    inj.attach(model, opt)
    loader = DataLoader(
        SyntheticData(args, rank),
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        collate_fn=SlowCollate(args, rank, step_ref, inj),
    )
    straggler = rank == args.straggler_rank
    if args.scenario == "backward-straggler" and straggler:
        # a slow gradient hook: the rank's own extra work inside backward
        model.head.weight.register_hook(lambda g: (extra_work(args.compute_extra_matmuls), g)[1])
    if args.scenario == "compute-straggler" and straggler:
        # extra work inside the optimizer step (e.g. an expensive norm/clip on one rank)
        opt.register_step_pre_hook(lambda *a: extra_work(args.compute_extra_matmuls))
    faulty = rank == args.fault_rank
    batches = iter(loader)
    loss_sum = torch.zeros(1, device=device)
    traced: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
    if args.traceml:  # the side-by-side comparison: TraceML's step context, its loader wait outside it
        traced = functools.partial(traceml_ai.trace_step, model)
    ran_out = False
    for step in range(args.steps):
        step_ref[0] = step
        if step == 0 and args.first_step_sleep_s > 0:
            time.sleep(args.first_step_sleep_s)
        if faulty and step == args.fault_step:
            if args.scenario in ("dead-rank", "stopped-rank", "compute-hang"):
                fault_injection.mark(args.scenario, rank, step)
            if args.scenario == "dead-rank":
                os.kill(os.getpid(), signal.SIGKILL)
            elif args.scenario == "stopped-rank":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif args.scenario == "compute-hang":
                model.hang = True
        inj.at_step_start(step)
        try:
            x, y = next(batches)
        except StopIteration:  # uneven-data: this rank's loader ran out
            inj.data_exhausted(step)
            ran_out = True
            break
        with traced():
            x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        # a metrics all-reduce from Python, as many loops do for logging
        loss_sum.copy_(loss.detach())
        if args.scenario == "collective-mismatch" and faulty and step >= args.fault_step:
            if step == args.fault_step:
                fault_injection.mark(args.scenario, rank, step)
            gathered = [torch.zeros_like(loss_sum) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, loss_sum)
        else:
            inj.metrics_all_reduce(step, loss_sum)  # a plain all_reduce unless a collective fault says otherwise
        inj.after_step(step)
        if args.checkpoint_every and step % args.checkpoint_every == args.checkpoint_every - 1:
            with declared_phase("checkpoint", args.checkpoint_budget_s):
                time.sleep(args.checkpoint_s)
        if args.step_sleep_ms:
            time.sleep(args.step_sleep_ms / 1000.0)
        if args.log_every and rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss_sum.item() / dist.get_world_size():.4f}", flush=True)
    if ran_out:  # leaves early and exits normally, as a loop over a shorter dataset does
        dist.destroy_process_group()
        return 0
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
