"""A plain DDP training loop (an MLP, a logging ``all_reduce`` per step) with the v3 "must stay right" faults
that stay inside one rank's own process — its own code path, its own threads, its own DataLoader worker:

==========================  ================================================================================
scenario                    what ``--fault-rank`` does at ``--fault-step``
==========================  ================================================================================
eval-forever                after the step's all_reduce, runs an evaluation only it runs (``if rank == 0:
                            evaluate()``, the unwrapped model under ``no_grad``) over a streaming eval set
                            that never ends: busy, no collective; the others wait in the next step's DDP
                            all_reduce
pickle-deadlock             every rank gathers its metrics by ``dist.all_gather_object`` each step; on the
                            fault rank a background thread holds the lock the metrics object's
                            ``__getstate__`` takes: it blocks while pickling, inside ``all_gather_object``
                            before its first collective; the others wait in that call's all_gather
fork-lock                   each epoch (``--epoch-steps`` steps) forks a fresh DataLoader worker
                            (``num_workers=1``, fork); at the fault step's epoch a thread of the rank holds
                            the lock the dataset takes while the worker is forked, and lets it go after: the
                            worker's copy of the lock stays held, the worker deadlocks on its first item and
                            the rank waits in ``next()`` forever; the others wait in DDP's all_reduce
==========================  ================================================================================
"""

from __future__ import annotations

import itertools
import threading

import _common
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

HIDDEN = 64
BATCH = 16
SCENARIOS = ("eval-forever", "pickle-deadlock", "fork-lock", "none")
LOCK = threading.Lock()  # a process-wide lock: a metrics registry's, a cache's, a logging handler's


class Metrics:
    """Step metrics, gathered across ranks; pickling reads them under the registry's lock."""

    def __init__(self, step: int, loss: float) -> None:
        self.values = {"step": step, "loss": loss}

    def __getstate__(self) -> dict[str, float]:
        with LOCK:
            return dict(self.values)

    def __setstate__(self, state: dict[str, float]) -> None:
        self.values = state


class Samples(Dataset):  # type: ignore[type-arg]
    """Synthetic samples; each read goes through the process-wide lock (a shared cache, say)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with LOCK:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            return torch.randn(HIDDEN, generator=g), torch.randn(1, generator=g)


def hold_lock(release: threading.Event | None) -> None:
    """A thread of this rank takes ``LOCK`` and keeps it until ``release`` (None: for ever)."""
    taken = threading.Event()

    def holder() -> None:
        with LOCK:
            taken.set()
            (release or threading.Event()).wait()

    threading.Thread(target=holder, name="holds-lock", daemon=True).start()
    taken.wait()


def evaluate_forever(module: nn.Module, rank: int, step: int) -> None:
    """A rank-0-only evaluation over a streaming eval set that never ends (no collective in it)."""
    _common.mark("eval-forever", rank, step)
    gen = torch.Generator().manual_seed(1234)
    module.eval()
    with torch.no_grad():
        for _ in itertools.count():
            module(torch.randn(BATCH, HIDDEN, generator=gen))


def main() -> int:
    p = _common.parser(__doc__, SCENARIOS)
    p.add_argument("--epoch-steps", type=int, default=5, help="fork-lock: steps per DataLoader epoch")
    args = p.parse_args()
    rank, world = _common.init(args)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    faulty = rank == args.fault_rank
    loader = DataLoader(
        Samples(args.epoch_steps * BATCH, rank), batch_size=BATCH, num_workers=1, multiprocessing_context="fork"
    )
    batches: dict[str, object] = {}

    def next_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i % args.epoch_steps == 0:  # a new epoch: a fresh iterator forks a fresh worker
            batches.pop("it", None)
            if faulty and args.scenario == "fork-lock" and i <= args.fault_step < i + args.epoch_steps:
                release = threading.Event()
                hold_lock(release)
                batches["it"] = iter(loader)  # the worker is forked while the lock is held
                release.set()
                _common.mark("fork-lock", rank, i)
            else:
                batches["it"] = iter(loader)
        return next(batches["it"])  # type: ignore[call-overload]

    def step(i: int) -> torch.Tensor:
        if args.scenario == "fork-lock":
            x, y = next_batch(i)
        else:
            x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, 1, generator=gen)
        return _common.optimize(opt, nn.functional.mse_loss(ddp(x), y))

    def after(i: int) -> None:
        if args.scenario == "eval-forever" and faulty and i == args.fault_step:
            evaluate_forever(model, rank, i)
        if args.scenario == "pickle-deadlock":
            if faulty and i == args.fault_step:
                hold_lock(None)  # e.g. a reporter thread that took the registry's lock and waits on a socket
                _common.mark("pickle-deadlock", rank, i)
            gathered: list[object] = [None] * world
            dist.all_gather_object(gathered, Metrics(i, float(i)))

    return _common.run_steps(args, step, after)


if __name__ == "__main__":
    raise SystemExit(main())
