"""Fault injection shared by the example models (``ddp_demo.py``, ``transformer_demo.py``; not a rankwatch module).

One ``Injector`` per rank. A model calls it at fixed points of its loop; the fault fires on
``fault_rank`` at ``fault_step`` (or from it on, for the faults that persist):

    inj = Injector.from_args(args, rank)
    inj.attach(model, optimizer)          # forward pre-hook, gradient hook, optimizer pre-hook
    for step in range(steps):
        inj.at_step_start(step)           # dead-rank, stopped-rank
        batch = next(batches)             # the dataset / collate calls inj.in_data(batch_no)
        ... forward / backward / optimizer (hooks fire inside) ...
        inj.metrics_all_reduce(step, t)   # the loop's explicit collective: extra, skipped, mismatched
        inj.after_step(step)              # between-phases hang, checkpoint that never returns

The scenarios, where each fires and what it does, and the answer rankwatch should give for each, are in
``fault_catalogue.py`` beside this file (``python examples/fault_catalogue.py`` prints them); ``FAULTS`` and
``STRAGGLERS`` below are read from it, and ``Injector`` refuses a scenario it does not list.

Why ``PyDLL`` for the GIL: ``ctypes.CDLL`` *releases* the GIL around every foreign call, so
``CDLL(None).sleep(1000)`` is, for the interpreter, the same as ``time.sleep`` — other Python threads
(the hook's dump responder) keep running. ``ctypes.PyDLL`` keeps the GIL for the call, as a C extension
that does not release it does (a regex's catastrophic backtracking is the pure-Python way to get the
same effect: ``re`` never releases the GIL). Nothing Python-level runs in that process while it sleeps.

Each fault appends one JSON line ``{"fault", "rank", "step", "t", "pid"}`` (``t``: ``time.time()``, just
before it fires) to ``$RW_FAULT_LOG`` when that is set, so a harness can time fault → verdict.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

try:
    import fault_catalogue
except ImportError:  # imported from elsewhere: the catalogue lives beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fault_catalogue

# Faults this module implements for every model (the catalogue's scenarios of this file): the faults, then the
# slow ranks. ``ddp_demo.py`` keeps its own code for the ones it had before this module existed (input-hang,
# compute-hang, dead-rank, stopped-rank, collective-mismatch, the stragglers) and uses the injector for the others.
_OURS = tuple(name for name, s in fault_catalogue.SCENARIOS.items() if s.program == fault_catalogue.INJECTOR)
FAULTS = tuple(name for name in _OURS if not fault_catalogue.demo_fault(name).straggler)
STRAGGLERS = tuple(name for name in _OURS if fault_catalogue.demo_fault(name).straggler)
NO_FAULT = "balanced"  # the models' run with nothing injected
NEW_IN_THIS_MODULE = (
    "backward-hang",
    "optimizer-hang",
    "between-phases-hang",
    "exception",
    "extra-collective",
    "extra-barrier",
    "skipped-collective",
    "uneven-data",
    "gil-hold",
    "lock-deadlock",
    "checkpoint-hang",
)

try:  # declared phases when rankwatch is installed; the examples run without it too
    from rankwatch.hooks import phase as _rw_phase
except ImportError:  # pragma: no cover
    _rw_phase = None


def declared_phase(name: str, budget_s: float) -> contextlib.AbstractContextManager[None]:
    return _rw_phase(name, budget_s=budget_s) if _rw_phase else contextlib.nullcontext()


def mark(fault: str, rank: int, step: int) -> None:
    """Note the moment a fault fires in ``$RW_FAULT_LOG`` (one JSON line, one ``write``)."""
    path = os.environ.get("RW_FAULT_LOG")
    if not path:
        return
    line = json.dumps({"fault": fault, "rank": rank, "step": step, "t": time.time(), "pid": os.getpid()}) + "\n"
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def spin_forever() -> None:
    """A compute hang: Python bytecode that never finishes (the GIL is released between bytecodes)."""
    x = 1.0
    while True:
        x = x * 1.0000001 % 7.0


def block_forever() -> None:
    threading.Event().wait()


def hold_gil_forever() -> None:
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole foreign call (CDLL releases it)
    libc.sleep.argtypes = [ctypes.c_uint]
    while True:
        libc.sleep(1_000_000)


def self_deadlock() -> None:
    lock = threading.Lock()  # not an RLock: the second acquire by the same thread waits forever
    with lock, lock:
        pass


def write_to_unread_fifo() -> None:
    """Open a FIFO for writing that nobody opens for reading: ``open()`` blocks forever (in the kernel)."""
    d = tempfile.mkdtemp(prefix="rw-fifo-")
    path = os.path.join(d, "checkpoint.pt")
    os.mkfifo(path, 0o600)
    with open(path, "wb") as f:  # never returns
        f.write(b"state")


def extra_work(n: int, size: int = 256) -> None:
    import torch

    m = torch.ones(size, size)
    for _ in range(n):
        m = torch.mm(m, m).clamp_(max=1.0)


class Injector:
    def __init__(
        self,
        scenario: str | None,
        rank: int,
        fault_rank: int,
        fault_step: int,
        *,
        straggler_rank: int | None = None,
        checkpoint_budget_s: float = 1.0,
        extra_matmuls: int = 40,
    ) -> None:
        if scenario not in (None, NO_FAULT, *FAULTS, *STRAGGLERS):
            raise ValueError(f"unknown scenario {scenario!r}: fault_catalogue.py lists {', '.join(_OURS)}")
        self.scenario = scenario
        self.rank = rank
        self.fault_rank = fault_rank
        self.fault_step = fault_step
        self.straggler_rank = fault_rank if straggler_rank is None else straggler_rank
        self.checkpoint_budget_s = checkpoint_budget_s
        self.extra_matmuls = extra_matmuls
        self.step = 0
        self.faulty = rank == fault_rank

    @classmethod
    def from_args(cls, args: Any, rank: int, scenarios: tuple[str, ...] | None = None) -> Injector:
        """From a parsed command line with ``scenario``, ``fault_rank``, ``fault_step`` (and optionally
        ``straggler_rank``, ``checkpoint_budget_s``, ``compute_extra_matmuls``). With ``scenarios``, the
        injector only acts for those (the others are the model's own)."""
        scenario = args.scenario if scenarios is None or args.scenario in scenarios else None
        return cls(
            scenario,
            rank,
            args.fault_rank,
            args.fault_step,
            straggler_rank=getattr(args, "straggler_rank", None),
            checkpoint_budget_s=getattr(args, "checkpoint_budget_s", 1.0),
            extra_matmuls=getattr(args, "compute_extra_matmuls", 40),
        )

    def now(self, scenario: str, step: int | None = None) -> bool:
        """This rank, this scenario, the fault step (the step this injector was last told, by default)."""
        return self.scenario == scenario and self.faulty and (self.step if step is None else step) == self.fault_step

    # -- loop points --------------------------------------------------------------------------------
    def attach(self, model: Any, optimizer: Any) -> None:
        """Hooks inside forward (a pre-hook on ``model``), backward (a hook on the gradient of the first
        parameter) and the optimizer step (a step pre-hook)."""
        if self.scenario is None:
            return
        model.register_forward_pre_hook(lambda _m, _a: self.in_forward())
        first = next(p for p in model.parameters() if p.requires_grad)
        first.register_hook(self._grad_hook)
        optimizer.register_step_pre_hook(lambda *_a: self.in_optimizer())

    def at_step_start(self, step: int) -> None:
        self.step = step
        if self.now("dead-rank"):
            mark("dead-rank", self.rank, step)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.now("stopped-rank"):
            mark("stopped-rank", self.rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)

    def data_len(self, default: int, batch_size: int = 1) -> int:
        """The dataset's length on this rank: ``fault_step`` batches for uneven-data's rank."""
        if self.scenario == "uneven-data" and self.faulty:
            return self.fault_step * batch_size
        return default

    def data_exhausted(self, step: int) -> None:
        if self.scenario == "uneven-data" and self.faulty:
            mark("uneven-data", self.rank, step)

    def in_data(self, batch_no: int) -> None:
        """Called while batch ``batch_no`` is produced (main process or DataLoader worker)."""
        if self.scenario == "input-hang" and self.faulty and batch_no >= self.fault_step:
            mark("input-hang", self.rank, batch_no)
            block_forever()
        if self.now("gil-hold", batch_no):
            mark("gil-hold", self.rank, batch_no)
            hold_gil_forever()

    def in_forward(self) -> None:
        if self.now("compute-hang"):
            mark("compute-hang", self.rank, self.step)
            spin_forever()
        if self.now("exception"):
            mark("exception", self.rank, self.step)
            raise RuntimeError(f"injected fault: exception in forward on rank {self.rank} at step {self.step}")
        if self.now("lock-deadlock"):
            mark("lock-deadlock", self.rank, self.step)
            self_deadlock()

    def _grad_hook(self, grad: Any) -> Any:
        if self.now("backward-hang"):
            mark("backward-hang", self.rank, self.step)
            spin_forever()
        return grad

    def in_optimizer(self) -> None:
        if self.now("optimizer-hang"):
            mark("optimizer-hang", self.rank, self.step)
            spin_forever()
        if self.scenario == "compute-straggler" and self.rank == self.straggler_rank:
            extra_work(self.extra_matmuls)

    def metrics_all_reduce(self, step: int, tensor: Any) -> None:
        """The loop's explicit collective (a metrics all-reduce), with this rank's collective faults."""
        import torch
        import torch.distributed as dist

        if self.now("skipped-collective", step):
            mark("skipped-collective", self.rank, step)
            return  # the others call it; this rank does not
        if self.scenario == "collective-mismatch" and self.faulty and step >= self.fault_step:
            if step == self.fault_step:
                mark("collective-mismatch", self.rank, step)
            gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, tensor)
            return
        dist.all_reduce(tensor)
        if self.now("extra-collective", step):
            mark("extra-collective", self.rank, step)
            dist.all_reduce(torch.zeros_like(tensor))  # only this rank calls it
        if self.now("extra-barrier", step):
            mark("extra-barrier", self.rank, step)
            dist.barrier()  # only this rank calls it

    def after_step(self, step: int) -> None:
        """After the optimizer and the metrics collective, before the next batch."""
        if self.now("between-phases-hang", step):
            mark("between-phases-hang", self.rank, step)
            block_forever()
        if self.now("checkpoint-hang", step):
            with declared_phase("checkpoint", self.checkpoint_budget_s):
                mark("checkpoint-hang", self.rank, step)
                write_to_unread_fifo()
