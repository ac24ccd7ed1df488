"""A plain DDP training loop (an MLP, synthetic data, a logging ``all_reduce`` per step) with the faults
of the v3 classes that are about *when and where* a rank stops rather than the parallel layout:

==========================  ================================================================================
scenario                    what ``--fault-rank`` does at ``--fault-step``
==========================  ================================================================================
forward-hang                spins in forward (with ``--pg-timeout-s 8`` under a 30 s stall timeout the
                            healthy ranks' gloo timeouts fire first and they exit); ``--also-ranks`` spin
                            too (several hung ranks, e.g. on two nodes)
node-signal                 marks "ready" and goes on: the runner then kills or freezes a whole node
pre-init-hang               (before any step) blocks before ``init_process_group``; the others wait in it
checkpoint-declared         a long checkpoint (``--checkpoint-s``) inside ``phase("checkpoint", budget_s=…)``,
                            then every rank meets in ``dist.barrier()``: within its budget, no incident
checkpoint-undeclared       the same checkpoint without declaring it: the others wait in the barrier
child-hang                  waits on a child process that never exits (``subprocess.run`` of a hung helper)
compile-graph-break         ``DDP(torch.compile(model))``; the forward has a graph break, and the Python
                            code run at the break blocks on that rank
slow-step                   from ``--fault-step`` on, every forward also spins ``--slow-share`` (0.3) of the
                            rank's own median step time before the fault: 30 % slower every step, never
                            stuck (a straggler; the job finishes)
monitored-barrier          no DDP: every step ends in ``dist.monitored_barrier(timeout=--barrier-timeout-s,
                            wait_all_ranks=True)`` (the job's only collective); the fault rank spins in
                            forward: rank 0 raises "Ranks N failed to pass monitoredBarrier" and exits first,
                            the others lose rank 0 and exit; the spinning rank is the one holding the job
helper-thread-dies          batches come from a prefetch thread through a queue; at ``--fault-step`` the fault
                            rank's thread raises (its traceback goes to stderr) and the training loop waits
                            on ``queue.get()`` forever: not in ``DataLoader.__next__``, phase ``idle``
worker-died                 batches come from a DataLoader with one worker process; at ``--fault-step`` the fault
                            rank's worker ends with ``os._exit(1)`` (a native crash, the OOM killer): the rank
                            raises "DataLoader worker ... exited unexpectedly"
preempted                   at ``--fault-step`` the fault rank gets SIGTERM from outside the job (a preemption,
                            an operator's kill): no exception of its own, exit by signal
first-step-hang             blocks at the top of step 0 (before any step completed), while the others wait
                            in their first collective: a hang before the first step
==========================  ================================================================================
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import _common
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HIDDEN = 64
SCENARIOS = (
    "forward-hang",
    "node-signal",
    "pre-init-hang",
    "checkpoint-declared",
    "checkpoint-undeclared",
    "child-hang",
    "compile-graph-break",
    "slow-step",
    "monitored-barrier",
    "first-step-hang",
    "helper-thread-dies",
    "worker-died",
    "preempted",
    "none",
)

try:
    from rankwatch.hooks import phase as rw_phase
except ImportError:  # pragma: no cover
    rw_phase = None

STATE = {"step": 0, "rank": -1}


def at_graph_break(args) -> None:  # type: ignore[no-untyped-def]
    """Plain Python that dynamo cannot trace (it runs between the two compiled graphs)."""
    if args.scenario == "compile-graph-break" and STATE["rank"] == args.fault_rank and STATE["step"] == args.fault_step:
        _common.mark("compile-graph-break", STATE["rank"], STATE["step"])
        _common.block_forever()


class MLP(nn.Module):
    def __init__(self, args) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, 1)
        self.args = args
        self.spin = False
        self.slow_s = 0.0  # slow-step: extra busy time per forward


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        if self.args.scenario == "compile-graph-break":
            torch._dynamo.graph_break()
            at_graph_break(self.args)
        while self.spin:  # forward-hang
            h = h * 1.0
        if self.slow_s:  # slow-step: busy, not stuck (a CPU-bound extra in the rank's own forward)
            end = time.perf_counter() + self.slow_s
            with torch.no_grad():  # outside autograd: recorded ops would move the extra work into backward
                while time.perf_counter() < end:
                    torch.mul(h, 1.0)
        return self.b(h)


def save_checkpoint(model: nn.Module, seconds: float) -> None:
    """A slow checkpoint: the state written in small pieces to slow storage, ``seconds`` in all."""
    fd, path = tempfile.mkstemp(prefix="ckpt-")
    blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    pieces = max(1, int(seconds / 0.25))
    with os.fdopen(fd, "wb") as f:
        for i in range(pieces):
            f.write(blob[i * len(blob) // pieces : (i + 1) * len(blob) // pieces])
            f.flush()
            time.sleep(seconds / pieces)
    os.unlink(path)


def hung_child() -> None:
    """A helper process (an eval, a tokenizer, a ``git`` call…) that never exits; the rank waits for it."""
    subprocess.run([sys.executable, "-c", "import threading; threading.Event().wait()"], check=False)


def prefetcher(args, gen: torch.Generator, faulty: bool) -> queue.Queue:  # type: ignore[no-untyped-def,type-arg]
    """A producer thread that prepares each step's batch ahead (helper-thread-dies: it raises at the fault step
    on the fault rank; the consumer then waits forever)."""
    q: queue.Queue = queue.Queue(maxsize=2)  # type: ignore[type-arg]

    def produce() -> None:
        for j in itertools.count():
            if faulty and j == args.fault_step:
                _common.mark("helper-thread-dies", STATE["rank"], j)
                raise RuntimeError(f"corrupt record in shard {j} (prefetch thread)")
            q.put((torch.randn(16, HIDDEN, generator=gen), torch.randn(16, 1, generator=gen)))

    threading.Thread(target=produce, name="prefetch", daemon=True).start()
    return q


class Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """worker-died: one synthetic batch per index, made in a DataLoader worker process; on the fault rank the
    worker that makes batch ``fault_step`` dies without a word."""

    def __init__(self, n: int, seed: int, die_at: int | None) -> None:
        self.n, self.seed, self.die_at = n, seed, die_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.die_at:
            _common.mark("worker-died", STATE["rank"], i)
            os._exit(1)
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randn(16, HIDDEN, generator=g), torch.randn(16, 1, generator=g)


def main() -> int:
    p = _common.parser(__doc__, SCENARIOS)
    p.add_argument("--checkpoint-s", type=float, default=12.0)
    p.add_argument("--checkpoint-budget-s", type=float, default=60.0)
    p.add_argument("--also-ranks", type=int, nargs="*", default=[], help="forward-hang: more ranks that hang")
    p.add_argument("--slow-share", type=float, default=0.3, help="slow-step: extra time per step, share of a step")
    p.add_argument("--barrier-timeout-s", type=float, default=2.0, help="monitored-barrier: the barrier's timeout")
    args = p.parse_args()
    env_rank = _common.rank_from_env()
    if args.scenario == "pre-init-hang" and env_rank == args.fault_rank:
        _common.mark("pre-init-hang", env_rank, 0)
        _common.block_forever()
    rank, _world = _common.init(args)
    STATE["rank"] = rank
    model = MLP(args)
    if args.scenario == "compile-graph-break":
        model = torch.compile(model, backend=os.environ.get("RW_COMPILE_BACKEND", "inductor"))  # type: ignore[assignment]
    barrier_job = args.scenario == "monitored-barrier"
    ddp = model if barrier_job else DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    faulty = rank == args.fault_rank or (args.scenario == "forward-hang" and rank in args.also_ranks)
    batches = prefetcher(args, gen, faulty) if args.scenario == "helper-thread-dies" else None
    if args.scenario == "worker-died":
        data = Batches(args.steps, rank, args.fault_step if faulty else None)
        loader = iter(torch.utils.data.DataLoader(data, batch_size=None, num_workers=1, prefetch_factor=1))
    starts: list[float] = []  # slow-step: each step's start, to calibrate the extra on the rank's own steps

    def step(i: int) -> torch.Tensor:
        STATE["step"] = i
        starts.append(time.perf_counter())
        at_fault = faulty and i == args.fault_step
        if faulty and i == 0 and args.scenario == "first-step-hang":  # step 0 whatever --fault-step says
            _common.mark("first-step-hang", rank, i)
            _common.block_forever()
        if at_fault and args.scenario in ("forward-hang", "monitored-barrier"):
            _common.mark(args.scenario, rank, i)
            (model._orig_mod if hasattr(model, "_orig_mod") else model).spin = True
        if at_fault and args.scenario == "slow-step":
            durations = sorted(b - a for a, b in itertools.pairwise(starts))
            model.slow_s = args.slow_share * (durations[len(durations) // 2] if durations else 0.02)
            _common.mark("slow-step", rank, i)
        if at_fault and args.scenario == "node-signal":
            _common.mark("ready", rank, i)
        if at_fault and args.scenario == "child-hang":
            _common.mark("child-hang", rank, i)
            hung_child()
        if at_fault and args.scenario == "preempted":
            _common.mark("preempted", rank, i)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the signal ends the process (default SIGTERM handler)
        if batches is not None:
            x, y = batches.get()  # helper-thread-dies: waits forever once the producer died
        elif args.scenario == "worker-died":
            x, y = next(loader)
        else:
            x, y = torch.randn(16, HIDDEN, generator=gen), torch.randn(16, 1, generator=gen)
        return _common.optimize(opt, nn.functional.mse_loss(ddp(x), y))

    def after(i: int) -> None:
        if i == args.fault_step and args.scenario in ("checkpoint-declared", "checkpoint-undeclared"):
            if faulty:  # one rank saves (rank-0-only checkpoints are the common case), the others wait
                declared = args.scenario == "checkpoint-declared" and rw_phase is not None
                with (
                    rw_phase("checkpoint", budget_s=args.checkpoint_budget_s) if declared else contextlib.nullcontext()
                ):
                    _common.mark(args.scenario, rank, i)
                    save_checkpoint(model, args.checkpoint_s)
            dist.barrier()
        if barrier_job:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=args.barrier_timeout_s), wait_all_ranks=True)

    return _common.run_steps(args, step, after, log_reduce=not barrier_job)

if __name__ == "__main__":
    raise SystemExit(main())
