"""Classes outside the suite (issue 44 item 5): faults nobody designed the verdict around, in a plain DDP loop
(an MLP, batches from a ``DataLoader`` in the rank's own process, a metrics ``all_gather`` per step, then the
shared logging ``all_reduce``); ``--groups`` adds an expert layer routed by ``all_to_all_single`` inside pairs
of ranks ``{i, i + world/2}`` (across the nodes of a 2 x 2 job).

==========================  ================================================================================
scenario                    what ``--fault-rank`` does at ``--fault-step``
==========================  ================================================================================
fifo-read                   its dataset reads the step's sample from a named pipe whose producer never
                            started: blocked in ``open()`` inside ``DataLoader.__next__``
regex-backtrack             after the step, a log filter's regex backtracks catastrophically on one line:
                            busy in C with the GIL held, no Python frame moves
exit-zero                   ``os._exit(0)`` in forward (a library's "clean" exit on a condition): gone
                            silently with exit code 0, mid-training
alloc-oom                   forward asks the CPU allocator for 4 TiB (a corrupt sequence length): the
                            allocator's RuntimeError ends the rank
cgroup-oom                  moves itself into a memory cgroup limited to 64 MiB more than it has, then
                            allocates 1 GiB: the kernel's OOM killer SIGKILLs it (root and a writable
                            memory cgroup hierarchy needed; elsewhere it never fires)
event-in-backward           a gradient hook waits on a ``threading.Event`` that a callback of a future
                            nobody completes would set: blocked (no CPU) in backward
del-deadlock                forward updates a cache under its lock; the allocation runs the cyclic garbage
                            collector, whose ``__del__`` of a dropped handle takes the same lock: the thread
                            deadlocks on itself inside gc
debug-pause                 an optimizer step post-hook left in for debugging sleeps (``time.sleep``) for a
                            day on one rank
gather-shape                its metrics tensor has one element more than the others' in the step's
                            ``all_gather``: mismatched shapes in one collective
group-a2a-skip              (``--groups``) skips its pair's expert ``all_to_all_single`` once (no tokens
                            routed: an "optimisation"), goes on to DDP's all_reduce; its pair waits in the
                            all_to_all
==========================  ================================================================================
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
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
BATCH = 16
SCENARIOS = (
    "fifo-read",
    "regex-backtrack",
    "exit-zero",
    "alloc-oom",
    "cgroup-oom",
    "event-in-backward",
    "del-deadlock",
    "debug-pause",
    "gather-shape",
    "group-a2a-skip",
    "none",
)
# a log filter written as (a|aa)+: on a line of 60 'a's and no match it tries every split (fib(60) ~ 1.5e12)
LOG_FILTER = re.compile(r"^(a|aa)+$")
CACHE_LOCK = threading.Lock()  # a cache's lock (not re-entrant), also taken by its handles' finalizers
STATE = {"rank": -1, "step": -1}


class Stream(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """One synthetic batch per index; fifo-read: batch ``fifo_at`` comes from a named pipe nobody writes."""

    def __init__(self, n: int, seed: int, fifo_at: int | None) -> None:
        self.n, self.seed, self.fifo_at = n, seed, fifo_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.fifo_at:
            path = os.path.join(tempfile.mkdtemp(prefix="stream-"), "shard.pipe")
            os.mkfifo(path)  # the producer that should feed it never started
            _common.mark("fifo-read", STATE["rank"], i)
            with open(path, "rb") as f:  # blocks in open(): no writer
                f.read()
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, 1, generator=g)


class Handle:
    """A cache handle in a reference cycle (only the cyclic collector frees it); its finalizer takes the
    cache's lock."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        with CACHE_LOCK:
            pass


def oom_in_cgroup(rank: int, step: int) -> None:
    """Into a fresh memory cgroup (v1 or v2) limited to 64 MiB above nothing, then allocate and touch 1 GiB:
    the kernel's OOM killer SIGKILLs this process. A helper outside the cgroup removes it afterwards."""
    v1, v2 = "/sys/fs/cgroup/memory", "/sys/fs/cgroup"
    base = v1 if os.path.isdir(v1) else v2
    cg = os.path.join(base, f"rankwatch-oom-{os.getpid()}")
    try:
        os.mkdir(cg)
    except OSError:
        return  # no writable memory cgroup here: the fault does not fire (the runner scores nothing)
    limit = "memory.limit_in_bytes" if base == v1 else "memory.max"
    with open(os.path.join(cg, limit), "w") as f:
        f.write(str(64 << 20))
    swap = os.path.join(cg, "memory.memsw.limit_in_bytes" if base == v1 else "memory.swap.max")
    if os.path.exists(swap):
        with contextlib.suppress(OSError), open(swap, "w") as f:
            f.write(str(64 << 20) if base == v1 else "0")
    # removes the cgroup once this process is gone (own session: not killed with the rank's group)
    subprocess.Popen(
        [sys.executable, "-c", "import os,sys,time\nwhile os.path.exists(f'/proc/{sys.argv[1]}'): time.sleep(0.1)\n"
         "time.sleep(0.5); os.rmdir(sys.argv[2])", str(os.getpid()), cg],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    _common.mark("cgroup-oom", rank, step)
    torch.ones(1 << 28)  # 1 GiB of float32, every page touched


class MLP(nn.Module):
    def __init__(self, args) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.a = nn.Linear(HIDDEN, HIDDEN)
        self.b = nn.Linear(HIDDEN, 1)
        self.args = args
        self.fault = False  # set for the fault step on the fault rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        a, rank, step = self.args, STATE["rank"], STATE["step"]
        if self.fault and a.scenario == "exit-zero":
            _common.mark("exit-zero", rank, step)
            os._exit(0)
        if self.fault and a.scenario == "alloc-oom":
            _common.mark("alloc-oom", rank, step)
            torch.empty(1 << 42, dtype=torch.uint8)  # "DefaultCPUAllocator: can't allocate memory"
        if self.fault and a.scenario == "cgroup-oom":
            oom_in_cgroup(rank, step)
        if self.fault and a.scenario == "del-deadlock":
            Handle()  # dropped at once; a cycle: it waits for the collector
            _common.mark("del-deadlock", rank, step)
            with CACHE_LOCK:
                cache = [[j] for j in range(10_000)]  # allocations that run the collector (gen 0)
                gc.collect()  # (if they did not already)
                del cache
        return self.b(h)


def main() -> int:
    p = _common.parser(__doc__, SCENARIOS)
    p.add_argument("--groups", action="store_true", help="an expert layer routed within pairs {i, i + world/2}")
    args = p.parse_args()
    rank, world = _common.init(args)
    STATE["rank"] = rank
    faulty = rank == args.fault_rank
    pairs = [dist.new_group([i, i + world // 2]) for i in range(world // 2)] if args.groups else []
    pair = pairs[rank % (world // 2)] if pairs else None
    expert = nn.Linear(HIDDEN, HIDDEN)  # this rank's expert (local, not averaged)
    model = MLP(args)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD([*ddp.parameters(), *expert.parameters()], lr=1e-3)
    fifo_at = args.fault_step if faulty and args.scenario == "fifo-read" else None
    loader = iter(torch.utils.data.DataLoader(Stream(args.steps, rank, fifo_at), batch_size=None, num_workers=0))
    never = torch.futures.Future()  # a future nobody completes (a gradient-compression / upload callback)
    released = threading.Event()
    never.then(lambda _f: released.set())

    def waits_for_callback(grad: torch.Tensor) -> torch.Tensor:
        if STATE["step"] == args.fault_step:
            _common.mark("event-in-backward", rank, STATE["step"])
            released.wait()
        return grad

    if faulty and args.scenario == "event-in-backward":
        model.a.weight.register_hook(waits_for_callback)
    if faulty and args.scenario == "debug-pause":

        def pause(_opt, _args, _kwargs) -> None:  # type: ignore[no-untyped-def]
            if STATE["step"] == args.fault_step:
                _common.mark("debug-pause", rank, STATE["step"])
                time.sleep(24 * 3600)

        opt.register_step_post_hook(pause)

    def step(i: int) -> torch.Tensor:
        STATE["step"] = i
        at_fault = faulty and i == args.fault_step
        model.fault = at_fault
        x, y = next(loader)
        if pair is not None:  # dispatch to the pair's experts and back (one all_to_all each way, in one call)
            routed = torch.empty_like(x)
            if at_fault and args.scenario == "group-a2a-skip":
                _common.mark("group-a2a-skip", rank, i)
                routed.zero_()  # "nothing routed this step": skips the collective its pair is in
            else:
                dist.all_to_all_single(routed, x.contiguous(), group=pair)
            x = x + expert(routed)
        return _common.optimize(opt, nn.functional.mse_loss(ddp(x), y))

    def after(i: int) -> None:
        at_fault = faulty and i == args.fault_step
        metrics = torch.tensor([float(i), 1.0])
        if at_fault and args.scenario == "gather-shape":
            _common.mark("gather-shape", rank, i)
            metrics = torch.tensor([float(i), 1.0, 0.0])  # a metric only this rank added
        gathered = [torch.empty_like(metrics) for _ in range(world)]
        dist.all_gather(gathered, metrics)
        if at_fault and args.scenario == "regex-backtrack":
            _common.mark("regex-backtrack", rank, i)
            LOG_FILTER.match("a" * 60 + "!")

    return _common.run_steps(args, step, after)


if __name__ == "__main__":
    raise SystemExit(main())
