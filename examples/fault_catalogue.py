"""The fault catalogue: every fault the example models and the accuracy jobs inject, where it fires, and the
right answer. Not a rankwatch module, and plain data (no torch): the demos' ranks, the accuracy runner and the
fast tests all import it.

Read by ``examples/fault_injection.py`` (the scenarios its ``Injector`` accepts), ``benchmarks/accuracy/run.py``
(what it runs and what it scores against) and the end-to-end tests (what they assert). A fault is defined here
once; the answers say what is right from what the fault does, never from what rankwatch prints today.

Three tables:

``SCENARIOS``
    one entry per ``--scenario`` a program accepts: the program that runs it, where it fires, what it does.
    ``tests/architecture/test_fault_catalogue.py`` holds it equal to the scenarios each program's code acts on.
``FAULTS`` (and ``DDP_DEMO_FAULTS``)
    the right answer for a scenario of the example models, wherever the fault is put: ``FAULTS`` for the
    injector's scenarios, which both models run (the accuracy suite's ``--faults``), ``DDP_DEMO_FAULTS`` for
    ``ddp_demo.py``'s own slow scenarios (only the tests run them).
``CLASSES``
    a scenario of a job under ``benchmarks/accuracy/jobs/`` in one layout (nodes x ranks, fault rank, options)
    with its right answer (the accuracy suite's ``--classes``). One job scenario may have several classes.

Who started the incident (``culprit``): ``"fault-rank"`` the rank the fault is injected at (``--fault-rank``,
moving with it); ``"fault-ranks"`` that rank and ``--also-ranks``; ``"node"`` every rank of the node the runner
kills or freezes; ``"none"`` no rank (no incident is right). A ``straggler`` is slow, not stuck: no incident is
right and the run's end-of-run summary carries the answer (``kinds``: its diagnosis, ``phase``: its phase,
the culprit: its ``straggler_ranks``).

    python examples/fault_catalogue.py      # the tables, one line per entry
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Culprit = Literal["fault-rank", "fault-ranks", "node", "none"]

# the programs that inject faults (paths from the repository's root)
INJECTOR = "examples/fault_injection.py"  # both example models (ddp_demo.py, transformer_demo.py) through Injector
DDP_DEMO = "examples/ddp_demo.py"  # that model's own slow scenarios
JOBS = "benchmarks/accuracy/jobs/"  # + the job's script

# what the answers assume of the run (the accuracy runner's defaults; the 'why's speak of step 5)
STALL_TIMEOUT = "3"  # rankwatch run --stall-timeout, unless a class says otherwise
FAULT_STEP = 5  # --fault-step


@dataclass(frozen=True)
class Scenario:
    """One ``--scenario`` of one program."""

    program: str  # INJECTOR, DDP_DEMO, or JOBS + script
    fires: str  # where it fires: the phase or the loop's point
    what: str  # what it does there


def _injector(fires: str, what: str) -> Scenario:
    return Scenario(INJECTOR, fires, what)


def _job(script: str, fires: str, what: str) -> Scenario:
    return Scenario(JOBS + script, fires, what)


SCENARIOS: dict[str, Scenario] = {
    # -- examples/fault_injection.py: at --fault-step on --fault-rank (or from it on, for those that persist)
    "input-hang": _injector("data", "the dataset blocks forever (threading.Event().wait())"),
    "compute-hang": _injector("forward", "an infinite Python loop in forward"),
    "backward-hang": _injector("backward", "a gradient hook that spins forever"),
    "optimizer-hang": _injector("optimizer", "an optimizer step pre-hook that spins forever"),
    "between-phases-hang": _injector(
        "after step", "blocks after the optimizer and the metrics all_reduce, before the next batch (a stuck "
        "logging/metrics call)"
    ),
    "dead-rank": _injector("step start", "SIGKILL to itself"),
    "exception": _injector("forward", "raise RuntimeError in forward"),
    "stopped-rank": _injector("step start", "SIGSTOP to itself"),
    "extra-collective": _injector("after metrics", "one extra all_reduce only this rank calls"),
    "extra-barrier": _injector("after metrics", "if rank == r: dist.barrier()"),
    "skipped-collective": _injector("metrics", "this rank skips the metrics all_reduce once"),
    "collective-mismatch": _injector("metrics", "all_gather where the others call all_reduce"),
    "uneven-data": _injector(
        "data", "this rank's dataset has fault_step batches: its loop ends early and it exits normally (exit code 0)"
    ),
    "gil-hold": _injector("data", "a C call that holds the GIL: ctypes.PyDLL(None).sleep"),
    "lock-deadlock": _injector("forward", "a threading.Lock acquired twice by the same thread"),
    "checkpoint-hang": _injector(
        "after step", "open() of a FIFO nobody reads, for writing, inside rankwatch.hooks.phase('checkpoint', "
        "budget_s=...)"
    ),
    "compute-straggler": _injector("optimizer", "(every step, --straggler-rank) extra matmuls"),
    # -- examples/ddp_demo.py's own (slow, not stuck)
    "input-straggler": Scenario(
        DDP_DEMO, "data", "(every batch, or every --input-every'th, on --straggler-rank) a sleep in collate"
    ),
    "input-bound": Scenario(
        DDP_DEMO, "data", "the same sleep in collate on every rank: the pipeline is the bottleneck"
    ),
    "backward-straggler": Scenario(
        DDP_DEMO, "backward", "(every step, --straggler-rank) extra matmuls in a gradient hook"
    ),
    # -- benchmarks/accuracy/jobs/ (the layouts' own docstrings say more)
    "stage-spin": _job(
        "pipeline.py", "forward", "the stage spins in its forward of the first micro-batch and never sends"
    ),
    "block-before-tp": _job("tensor_data.py", "forward", "blocks (no CPU) just before its TP all_reduce"),
    "expert-spin": _job("experts.py", "forward", "the expert spins between the dispatch and the combine all_to_all"),
    "eval-forever": _job(
        "in_process.py", "after step", "after the step's all_reduce, an evaluation only it runs over an endless "
        "eval set"
    ),
    "pickle-deadlock": _job(
        "in_process.py", "collective", "pickling its metrics inside all_gather_object blocks on a lock a thread holds"
    ),
    "fork-lock": _job(
        "in_process.py", "data", "its DataLoader worker is forked while a thread holds the dataset's lock: the "
        "worker deadlocks"
    ),
    "forward-hang": _job("loop.py", "forward", "spins in forward (--also-ranks spin too)"),
    "node-signal": _job("loop.py", "step start", "marks 'ready': the runner kills or freezes a whole node"),
    "pre-init-hang": _job("loop.py", "before init", "blocks before init_process_group"),
    "checkpoint-declared": _job(
        "loop.py", "after step", "a long checkpoint inside phase('checkpoint', budget_s=...), the others in a barrier"
    ),
    "checkpoint-undeclared": _job("loop.py", "after step", "the same checkpoint, not declared"),
    "child-hang": _job("loop.py", "step start", "waits on a child process that never exits"),
    "compile-graph-break": _job("loop.py", "forward", "blocks in the Python run at a torch.compile graph break"),
    "slow-step": _job("loop.py", "forward", "(every step from --fault-step) spins --slow-share of its median step"),
    "monitored-barrier": _job(
        "loop.py", "forward", "spins in forward of a job whose steps end in monitored_barrier(wait_all_ranks=True)"
    ),
    "helper-thread-dies": _job(
        "loop.py", "data", "its prefetch thread raises; the loop waits on queue.get() forever"
    ),
    "first-step-hang": _job("loop.py", "step start", "(step 0, whatever --fault-step says) blocks forever"),
    "worker-died": _job("loop.py", "data", "its DataLoader worker process ends with os._exit(1)"),
    "preempted": _job("loop.py", "step start", "gets SIGTERM from outside the job (a preemption, an operator)"),
    # -- classes outside the suite (issue 44 item 5): nobody designed the verdict around them
    "wrong-peer": _job(
        "pipeline.py", "forward", "the stage posts its first micro-batch's recv from stage rank-2 instead of rank-1"
    ),
    "fifo-read": _job("outside.py", "data", "its dataset opens a named pipe nobody writes (blocked in open())"),
    "regex-backtrack": _job(
        "outside.py", "after step", "a log filter's regex backtracks catastrophically (the GIL held, in C)"
    ),
    "exit-zero": _job("outside.py", "forward", "os._exit(0): gone silently with exit code 0, mid-training"),
    "alloc-oom": _job("outside.py", "forward", "asks the CPU allocator for 4 TiB: RuntimeError, the rank ends"),
    "cgroup-oom": _job(
        "outside.py", "forward", "joins a memory cgroup of 64 MiB and allocates 1 GiB: the OOM killer SIGKILLs it"
    ),
    "event-in-backward": _job(
        "outside.py", "backward", "a gradient hook waits on an Event a never-completed future's callback would set"
    ),
    "del-deadlock": _job(
        "outside.py", "forward", "the collector runs a __del__ that takes the lock the thread already holds"
    ),
    "debug-pause": _job("outside.py", "optimizer", "an optimizer step post-hook sleeps for a day (a debug pause)"),
    "gather-shape": _job(
        "outside.py", "after step", "all_gather of a metrics tensor one element longer than the others'"
    ),
    "group-a2a-skip": _job(
        "outside.py", "forward", "skips its pair's all_to_all_single once (--groups) and goes on to DDP's all_reduce"
    ),
}


@dataclass(frozen=True)
class Expect:
    """The right answer for a fault of the example models, at whatever rank it is put."""

    scenario: str  # the example's --scenario (a key of SCENARIOS)
    kinds: tuple[str, ...]  # verdict kinds that are right (several: the fault is both)
    phase: str | None  # the initiator's right phase; None: no phase is meaningful, not scored
    why: str  # why this is the right answer
    offline: bool  # does the console log hold the evidence that names the rank?
    offline_why: str
    straggler: bool = False  # no incident is right; the run summary must name the rank
    # offline holds only when torchrun's failure report leaves the rank out (it had exited 0 before the
    # others failed); a rank still shutting down when torchrun's SIGTERM came is listed like the rest
    offline_if_unreported: bool = False
    culprit: Culprit = "fault-rank"
    # a straggler's right cause (``core.straggler_cause.CAUSES``): the injected extra work, spin or sleep is the
    # rank's own (``own_work``); None where no rank is slow
    cause: str | None = None

    def ranks(self, fault_rank: int | None) -> list[int]:
        """The ranks the answer names with the fault at ``fault_rank`` (a straggler's: the summary's)."""
        if self.culprit != "fault-rank":
            return []
        assert fault_rank is not None, f"{self.scenario}: the answer is the fault's rank"
        return [fault_rank]


# One table: fault → expected kind / rank (the faulting rank) / phase, with the reason.
FAULTS: dict[str, Expect] = {
    "input-hang": Expect(
        "input-hang",
        ("hang",),
        "dataloader",
        "its dataset blocks forever; the others go on to DDP's gradient all-reduce in backward and wait for it",
        False,
        "the hung rank prints nothing; --on-stall kill ends every rank with the same SIGTERM",
    ),
    "compute-hang": Expect(
        "compute-hang",
        ("hang",),
        "forward",
        "an infinite loop in forward: its own work never ends while the others wait in backward's all-reduce",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "backward-hang": Expect(
        "backward-hang",
        ("hang",),
        "backward",
        "a gradient hook spins: it is in backward computing, the others are in backward *waiting* (grad_sync)",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "optimizer-hang": Expect(
        "optimizer-hang",
        ("hang",),
        "optimizer",
        "an optimizer step pre-hook spins; the others finish their step and wait in the metrics all-reduce",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "between-phases-hang": Expect(
        "between-phases-hang",
        ("hang",),
        "idle",
        "blocks after its optimizer step and metrics all-reduce, before asking for the next batch: outside "
        "every phase (rankwatch calls that 'idle'); the others wait for it in the next step's backward",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "dead-rank": Expect(
        "dead-rank",
        ("dead_rank",),
        None,
        "SIGKILL at the top of the step; the others then lose their peer (consequences)",
        True,
        "torchrun's failure report: that rank ended by SIGKILL torchrun did not send; the others lost a peer",
    ),
    "exception": Expect(
        "exception",
        ("dead_rank",),
        "forward",
        "its own RuntimeError in forward is an initiating end (crash mark); the others' 'connection closed' "
        "errors are consequences",
        True,
        "its traceback ('injected fault') precedes the others' lost-peer errors",
    ),
    "stopped-rank": Expect(
        "stopped-rank",
        ("stopped_rank",),
        None,
        "SIGSTOP: alive, silent, holding everyone back",
        False,
        "a stopped process writes nothing",
    ),
    "extra-collective": Expect(
        "extra-collective",
        ("collective_mismatch",),
        "collective",
        "only it calls one more all_reduce: it is one collective ahead, inside a collective nobody else "
        "entered, while the others are in the next step's DDP all-reduce",
        False,
        "gloo aborts whichever rank receives a message larger than its buffer — the culprit or a peer "
        "('Received data size doesn't match'): the log shows that there is a mismatch, not who is out of step",
    ),
    "extra-barrier": Expect(
        "extra-barrier",
        ("collective_mismatch",),
        "collective",
        "only it calls dist.barrier(): it waits in a barrier that the others never enter",
        False,
        "as extra-collective",
    ),
    "skipped-collective": Expect(
        "skipped-collective",
        ("collective_mismatch",),
        None,
        "it skipped the metrics all_reduce the others are in: one Python collective behind but a step ahead "
        "(already in the next backward's DDP all-reduce); the others wait for an all_reduce it will never "
        "call. The culprit is the one whose collective sequence differs, not the majority. No phase: where it "
        "waits (next step's backward) says nothing about the fault",
        False,
        "as extra-collective",
    ),
    "collective-mismatch": Expect(
        "collective-mismatch",
        ("collective_mismatch",),
        "collective",
        "it calls all_gather where the others call all_reduce (same collective number, different op)",
        False,
        "as extra-collective",
    ),
    "uneven-data": Expect(
        "uneven-data",
        ("dead_rank", "hang"),
        None,
        "its loader runs out: it leaves the loop after fewer steps and exits normally (exit code 0) while the "
        "others still train and then wait for, or lose, it. It initiated the stall although it ended cleanly",
        True,
        "where it exited 0 before the others failed: torchrun's failure report lists every rank that ended "
        "non-zero (those it terminated included) and leaves it out, while the others lose their peer. When it "
        "was still shutting down at torchrun's SIGTERM it is listed like the rest and the log cannot tell it "
        "from a silent waiting rank: n/a",
        offline_if_unreported=True,
    ),
    "gil-hold": Expect(
        "gil-hold",
        ("hang",),
        "dataloader",
        "a C call that holds the GIL (ctypes.PyDLL sleep) while producing its batch: no Python thread of that "
        "process runs (in the transformer it is the DataLoader worker; the rank waits for it)",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "lock-deadlock": Expect(
        "lock-deadlock",
        ("hang",),
        "forward",
        "a threading.Lock acquired twice by the same thread in forward: blocked, no CPU",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "checkpoint-hang": Expect(
        "checkpoint-hang",
        ("hang",),
        "checkpoint",
        "inside phase('checkpoint', budget_s=1) it opens a FIFO nobody reads: the declared budget expires; "
        "the others wait in the next step's all-reduce",
        False,
        "nothing printed; every rank ends by the same SIGTERM",
    ),
    "slow-rank": Expect(
        "compute-straggler",
        ("COMPUTE STRAGGLER",),
        "optimizer",
        "extra matmuls in its optimizer step every step: slow, not stuck — no incident is right; the end-of-run "
        "summary must name it (straggler_ranks == [r], its own extra work is in the optimizer)",
        False,
        "the job ends normally; there is nothing to diagnose",
        straggler=True,
        cause="own_work",
    ),
}

# ddp_demo.py's own slow scenarios (the transformer has none of them): the tests' straggler jobs
DDP_DEMO_FAULTS: dict[str, Expect] = {
    "input-straggler": Expect(
        "input-straggler",
        ("INPUT STRAGGLER",),
        "dataloader",
        "its collate sleeps on every batch (or every --input-every'th): slow, not stuck — no incident is right; "
        "the summary must name it, its own extra time is in the dataloader",
        False,
        "the job ends normally; there is nothing to diagnose",
        straggler=True,
        cause="own_work",
    ),
    "backward-straggler": Expect(
        "backward-straggler",
        ("COMPUTE STRAGGLER",),
        "backward",
        "extra matmuls in a gradient hook every step: slow, not stuck — the summary must name it, its own extra "
        "work is in backward",
        False,
        "the job ends normally; there is nothing to diagnose",
        straggler=True,
        cause="own_work",
    ),
    "input-bound": Expect(
        "input-bound",
        ("INPUT-BOUND",),
        "dataloader",
        "every rank's collate sleeps as long: the input pipeline, not a rank, is the bottleneck — the summary "
        "names no rank",
        False,
        "the job ends normally; there is nothing to diagnose",
        straggler=True,
        culprit="none",
    ),
}


def demo_fault(scenario: str) -> Expect:
    """The answer for an example model's ``--scenario`` (``compute-straggler`` is the suite's ``slow-rank``)."""
    return next(e for e in (*FAULTS.values(), *DDP_DEMO_FAULTS.values()) if e.scenario == scenario)


@dataclass(frozen=True)
class Klass:
    """One fault class (issue 19): a scenario of a job under ``benchmarks/accuracy/jobs/``, its layout and the
    right answer.

    Selected with ``--classes``; each runs once at its own rank (the rank chosen where today's verdict is
    known or suspected to go wrong, e.g. a middle pipeline stage, a TP rank on the second node)."""

    script: str  # under jobs/
    args: tuple[str, ...]  # the job's own arguments ("--scenario", a key of SCENARIOS, then the layout's)
    nodes: int
    nproc: int  # ranks per node
    fault_rank: int  # --fault-rank of the job
    kinds: tuple[str, ...]  # verdict kinds that are right (ignored when no incident is right)
    phase: str | None  # the initiator's right phase; None: not scored
    why: str
    offline: bool  # does the console log hold the evidence that names truth?
    offline_why: str
    culprit: Culprit = "fault-rank"
    stall_timeout: str = STALL_TIMEOUT
    action: str | None = None  # "node-kill" / "node-freeze": done by the runner to node action_node
    action_node: int = 1
    steps: int = 400
    rw_args: tuple[str, ...] = ()  # extra `rankwatch run` options
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the job
    # where else the fault may sit (repeats rotate through fault_rank, then these); only for classes whose
    # truth is the faulting rank itself — a whole node's truth or "no incident" does not move with it
    other_ranks: tuple[int, ...] = ()
    # slow, not stuck: no incident is right and the run summary must name the faulting rank (``kinds``:
    # the summary's diagnosis, ``phase``: its phase)
    straggler: bool = False
    cause: str | None = None  # a straggler's right cause, as ``Expect.cause``
    # the initiating ranks with the fault at fault_rank, from culprit; () = no incident is right
    truth: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "truth", self.truth_at(self.fault_rank))

    @property
    def scenario(self) -> str:
        return self.args[self.args.index("--scenario") + 1]

    def truth_at(self, rank: int) -> tuple[int, ...]:
        """The initiating ranks with the fault at ``rank``."""
        if self.culprit == "fault-rank":
            return (rank,)
        if self.culprit == "fault-ranks":  # and --also-ranks, up to the next option
            rest = self.args[self.args.index("--also-ranks") + 1 :]
            also = [int(a) for a in rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]]
            return tuple(sorted({rank, *also}))
        if self.culprit == "node":
            return tuple(range(self.action_node * self.nproc, (self.action_node + 1) * self.nproc))
        return ()

    def ranks(self) -> tuple[int, ...]:
        return (self.fault_rank, *self.other_ranks)


CLASSES: dict[str, Klass] = {
    "pp": Klass(
        "pipeline.py",
        ("--scenario", "stage-spin", "--micro-batches", "4"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(2, 0, 3),
        kinds=("hang",),
        phase="forward",
        why="4 GPipe stages by send/recv + a logging all_reduce; stage 1 spins in its forward and never sends: "
        "stages 2, 3 wait in recv (directly, or behind stage 2), stage 0 in the recv of its gradient. The "
        "first and last stages issue fewer p2p ops by design: a per-group counter makes them look behind",
        offline=False,
        offline_why="the spinning stage prints nothing; --on-stall kill ends every rank with the same SIGTERM",
    ),
    "tpdp-tp4": Klass(
        "tensor_data.py",
        ("--scenario", "block-before-tp", "--tp", "4"),
        nodes=2,
        nproc=4,
        fault_rank=5,
        other_ranks=(2, 7),
        kinds=("hang",),
        phase="forward",
        why="TP groups {0-3} {4-7} (one per node), DP {0,4} {1,5} {2,6} {3,7}; rank 5 blocks before its TP "
        "all_reduce: 4, 6, 7 wait in that TP all_reduce, node 0's ranks in DDP's all_reduce for their DP "
        "peers on node 1. Only rank 5 waits for nobody",
        offline=False,
        offline_why="a blocked rank prints nothing; every rank ends by the same SIGTERM",
    ),
    "tpdp-tp2": Klass(
        "tensor_data.py",
        ("--scenario", "block-before-tp", "--tp", "2"),
        nodes=2,
        nproc=4,
        fault_rank=2,
        other_ranks=(5, 0),
        kinds=("hang",),
        phase="forward",
        why="TP groups {0,1} {2,3} {4,5} {6,7}, DP {0,2,4,6} {1,3,5,7}; rank 2 blocks before its TP all_reduce: "
        "3 waits for it in TP, the other TP groups wait in DDP's all_reduce for 2 (DP) or for 3 (DP), which "
        "waits for 2",
        offline=False,
        offline_why="as tpdp-tp4",
    ),
    "ep": Klass(
        "experts.py",
        ("--scenario", "expert-spin"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(0, 3),
        kinds=("hang",),
        phase="forward",
        why="MoE dispatch/combine by all_to_all_single; rank 2's expert spins between the two: everyone else "
        "waits in the combine all_to_all",
        offline=False,
        offline_why="nothing printed; every rank ends by the same SIGTERM",
    ),
    "pg-timeout": Klass(
        "loop.py",
        ("--scenario", "forward-hang", "--pg-timeout-s", "8"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(0, 3),
        kinds=("hang",),
        phase="forward",
        why="init_process_group(timeout=8 s) under a 30 s stall timeout: rank 2 spins in forward, the other three "
        "raise gloo's timeout in DDP's all_reduce after 8 s and exit (consequences); rank 2 is the one alive "
        "and not waiting",
        offline=True,
        offline_why="ranks 0, 1, 3 each print gloo's timeout in the all_reduce; rank 2 alone prints no error of its "
        "own",
        stall_timeout="30",
    ),
    "node-loss": Klass(
        "loop.py",
        ("--scenario", "node-signal"),
        nodes=2,
        nproc=2,
        fault_rank=2,
        culprit="node",
        kinds=("dead_rank", "hang", "node_lost", "node_down", "unknown"),
        phase=None,
        why="2 nodes x 2; at step 5 the runner SIGKILLs node 1 whole (its ranks 2, 3, its torchrun agent and its "
        "rankwatch watchdog together): ranks 0, 1 lose their peers; the silent node's ranks are the answer",
        offline=False,
        offline_why="node 1's console ends mid-run with no error; node 0 only shows lost peers (whole node gone: "
        "which of 2, 3 went first cannot be told, and nothing names them as initiators but their absence)",
        action="node-kill",
    ),
    "node-freeze": Klass(
        "loop.py",
        ("--scenario", "node-signal"),
        nodes=2,
        nproc=2,
        fault_rank=2,
        culprit="node",
        kinds=("stopped_rank",),
        phase=None,
        why="2 nodes x 2; at step 5 the runner SIGSTOPs node 1's ranks (2, 3; agent and watchdog keep running): "
        "both stopped, 0 and 1 wait for them. After --on-stall kill no second incident may blame 0 or 1, "
        "which only lost their peers",
        offline=False,
        offline_why="stopped processes write nothing; the kill ends every rank with the same SIGTERM",
        action="node-freeze",
    ),
    "pre-init": Klass(
        "loop.py",
        ("--scenario", "pre-init-hang"),
        nodes=1,
        nproc=4,
        fault_rank=3,
        other_ranks=(1, 2),
        kinds=("hang",),
        phase=None,
        why="rank 3 blocks before init_process_group; ranks 0-2 wait in it (the rendezvous store) for rank 3. "
        "--startup-timeout 30 (below the job's 60 s process-group timeout: with the default 300 s the others' "
        "store timeouts end the job first; above the ~10-20 s that 4 ranks take to import torch on 2 loaded "
        "cores: at 10 s rankwatch run stopped a job whose ranks had not started yet)",
        offline=False,
        offline_why="nothing printed before the kill",
        rw_args=("--startup-timeout", "30"),
    ),
    "pre-init-default": Klass(
        "loop.py",
        ("--scenario", "pre-init-hang"),
        nodes=1,
        nproc=4,
        fault_rank=3,
        other_ranks=(1, 2),
        kinds=("hang", "dead_rank"),
        phase=None,
        why="pre-init under the default --startup-timeout (300 s): the others' rendezvous-store waits time out "
        "first (60 s pg timeout, DistStoreError naming the key of rank 3 they waited for) and they exit; rank 3 "
        "is the one they waited for",
        offline=True,
        offline_why="each survivor's DistStoreError names the gloo rendezvous key it waited for: the faulting "
        "rank's (/default_pg/0//cpu//0/<rank>)",
    ),
    "ckpt-declared": Klass(
        "loop.py",
        ("--scenario", "checkpoint-declared", "--checkpoint-s", "12", "--checkpoint-budget-s", "60"),
        nodes=1,
        nproc=4,
        fault_rank=0,
        culprit="none",
        kinds=(),
        phase=None,
        why="rank 0 saves a 12 s checkpoint inside phase('checkpoint', budget_s=60) while ranks 1-3 wait in "
        "dist.barrier(): declared and within its budget: no incident is right, and the job finishes",
        offline=False,
        offline_why="the job ends normally",
        steps=30,
    ),
    "ckpt-undeclared": Klass(
        "loop.py",
        ("--scenario", "checkpoint-undeclared", "--checkpoint-s", "12"),
        nodes=1,
        nproc=4,
        fault_rank=0,
        other_ranks=(2, 3),
        kinds=("hang",),
        phase="idle",
        why="the same 12 s checkpoint, not declared: past the 3 s stall timeout the others wait in the barrier "
        "for rank 0, which is busy outside every phase ('idle'): rank 0 is the one holding the job",
        offline=False,
        offline_why="nothing printed before the kill",
        steps=30,
    ),
    "child-hang": Klass(
        "loop.py",
        ("--scenario", "child-hang"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("hang",),
        phase="idle",
        why="rank 1 waits (subprocess.run) on a helper process that never exits, at the top of a step; the "
        "others wait for it in DDP's all_reduce",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "compile": Klass(
        "loop.py",
        ("--scenario", "compile-graph-break"),
        nodes=1,
        nproc=4,
        fault_rank=3,
        other_ranks=(0, 1),
        kinds=("hang",),
        phase="forward",
        why="DDP(torch.compile(model)) (aot_eager); the forward has a graph break and the Python run at the break "
        "blocks on rank 3 at step 5: the others wait in DDP's all_reduce",
        offline=False,
        offline_why="nothing printed before the kill",
        # the same dynamo graphs, graph break and DDP bucketing without inductor's C++ code generation, which
        # takes minutes for 4 ranks on 2 loaded cores (runs timed out before the fault step)
        env=(("RW_COMPILE_BACKEND", "aot_eager"),),
    ),
    "node-loss-4n": Klass(
        "loop.py",
        ("--scenario", "node-signal"),
        nodes=4,
        nproc=2,
        fault_rank=4,
        culprit="node",
        kinds=("dead_rank", "hang", "node_lost", "node_down", "unknown"),
        phase=None,
        why="node-loss on 4 nodes x 2: the runner SIGKILLs node 2 whole (ranks 4, 5, its agent and its watchdog): "
        "nodes 0, 1, 3 lose their peers; the silent node's ranks are the answer",
        offline=False,
        offline_why="as node-loss",
        action="node-kill",
        action_node=2,
    ),
    "node-freeze-4n": Klass(
        "loop.py",
        ("--scenario", "node-signal"),
        nodes=4,
        nproc=2,
        fault_rank=6,
        culprit="node",
        kinds=("stopped_rank",),
        phase=None,
        why="node-freeze on 4 nodes x 2: the runner SIGSTOPs node 3's ranks (6, 7): both stopped, the other six "
        "wait for them; after --on-stall kill no second incident on any node may blame a rank of nodes 0-2",
        offline=False,
        offline_why="as node-freeze",
        action="node-freeze",
        action_node=3,
    ),
    "two-hung-2n": Klass(
        "loop.py",
        ("--scenario", "forward-hang", "--also-ranks", "2"),
        nodes=2,
        nproc=2,
        fault_rank=1,
        culprit="fault-ranks",
        kinds=("hang",),
        phase="forward",
        why="2 nodes x 2; rank 1 (node 0) and rank 2 (node 1) both spin in forward at step 5: ranks 0 and 3 wait "
        "in DDP's all_reduce; both hung ranks, one on each node, are the answer",
        offline=False,
        offline_why="nothing printed; every rank ends by the same SIGTERM",
    ),
    "two-hung-4n": Klass(
        "loop.py",
        ("--scenario", "forward-hang", "--also-ranks", "4"),
        nodes=4,
        nproc=2,
        fault_rank=3,
        culprit="fault-ranks",
        kinds=("hang",),
        phase="forward",
        why="4 nodes x 2; rank 3 (node 1) and rank 4 (node 2) both spin in forward at step 5: the other six wait "
        "in DDP's all_reduce; both hung ranks are the answer",
        offline=False,
        offline_why="nothing printed; every rank ends by the same SIGTERM",
    ),
    "hang-4n": Klass(
        "loop.py",
        ("--scenario", "forward-hang"),
        nodes=4,
        nproc=2,
        fault_rank=5,
        other_ranks=(0, 7),
        kinds=("hang",),
        phase="forward",
        why="4 nodes x 2; one rank spins in forward at step 5 (node 2, then the leader's rank 0, then the last "
        "node's rank 7): the other seven wait for it in DDP's all_reduce",
        offline=False,
        offline_why="nothing printed; every rank ends by the same SIGTERM",
    ),
    "eval-rank0": Klass(
        "in_process.py",
        ("--scenario", "eval-forever"),
        nodes=1,
        nproc=4,
        fault_rank=0,
        kinds=("hang",),
        phase=None,
        why="after step 5's all_reduce rank 0 alone evaluates (the unwrapped model under no_grad) over a streaming "
        "eval set that never ends: busy, making forward calls, no collective; ranks 1-3 wait for it in the next "
        "step's DDP all_reduce. No phase: the eval loop alternates its forward calls and its own batches, and "
        "no canonical phase names an evaluation",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "pickle-gather": Klass(
        "in_process.py",
        ("--scenario", "pickle-deadlock"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(0, 3),
        kinds=("hang",),
        phase="collective",
        why="every rank gathers its metrics with dist.all_gather_object each step; on rank 2 a background thread "
        "holds the lock the metrics object's __getstate__ takes: it blocks pickling inside all_gather_object, "
        "before that call's first collective, while the others wait inside the same call's all_gather. Every "
        "rank is 'in all_gather_object'; only rank 2 never entered its collective",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "fork-lock": Klass(
        "in_process.py",
        ("--scenario", "fork-lock"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("hang",),
        phase="dataloader",
        why="each epoch forks a DataLoader worker (num_workers=1, fork); at step 5's epoch a thread of rank 1 holds "
        "the lock the dataset takes while the worker is forked, then lets it go: the worker's copy stays held, "
        "the worker deadlocks on its first item (alive, no CPU) and rank 1 waits in next() forever; the others "
        "wait for it in DDP's all_reduce",
        offline=False,
        offline_why="nothing printed before the kill (a deadlocked worker is alive: no worker-exit error)",
    ),
    "monitored-barrier": Klass(
        "loop.py",
        ("--scenario", "monitored-barrier", "--barrier-timeout-s", "2"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(1, 3),
        kinds=("hang",),
        phase="forward",
        why="no DDP; every step ends in monitored_barrier(2 s, wait_all_ranks=True); rank 2 spins in forward: "
        "rank 0 raises 'Ranks 2 failed to pass monitoredBarrier' and exits first (before the stall timeout), "
        "the others lose rank 0; rank 0's error names whom it waited for, it is not rank 0's own failure",
        offline=True,
        offline_why="rank 0's traceback says 'Ranks 2 failed to pass monitoredBarrier'",
        stall_timeout="6",
    ),
    "helper-thread-dies": Klass(
        "loop.py",
        ("--scenario", "helper-thread-dies"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("hang",),
        phase="idle",
        why="rank 1's batches come from a prefetch thread; the thread raises at step 5 and the training loop "
        "waits on queue.get() forever (between phases: idle); the others wait for it in DDP's all_reduce. The "
        "dead thread's exception is the cause the verdict must carry",
        offline=False,
        offline_why="the thread's traceback is printed, but nothing ties it to the hang before the kill",
    ),
    "worker-died": Klass(
        "loop.py",
        ("--scenario", "worker-died"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(0, 3),
        kinds=("dead_rank",),
        phase=None,
        why="rank 2's DataLoader worker process ends with os._exit(1) at step 5 (a native crash / the OOM killer "
        "in a worker): rank 2 raises 'DataLoader worker (pid N) exited unexpectedly' and exits; the others "
        "lose it in DDP's all_reduce. A class the verdict was not built around",
        offline=True,
        offline_why="rank 2's traceback ('DataLoader worker ... exited unexpectedly') and torchrun's report",
    ),
    "preempted": Klass(
        "loop.py",
        ("--scenario", "preempted"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("dead_rank",),
        phase=None,
        why="rank 1 gets SIGTERM from outside the job at step 5 (a preemption, an operator): it dies without a "
        "word of its own; torchrun then SIGTERMs the others. The first SIGTERM is not torchrun's. A class the "
        "verdict was not built around",
        offline=False,
        offline_why="torchrun's report shows every rank ended by SIGTERM: the log cannot tell the outside kill from "
        "torchrun's teardown",
    ),
    "first-step-hang": Klass(
        "loop.py",
        ("--scenario", "first-step-hang"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("hang",),
        phase="idle",
        why="rank 1 blocks at the top of step 0 (no step completed anywhere); the others wait in DDP's first "
        "all_reduce: with --stall-timeout given the hang is reported after it, not after --startup-timeout",
        offline=False,
        offline_why="nothing printed before the kill",
        stall_timeout="6",
    ),
    "slow-30": Klass(
        "loop.py",
        ("--scenario", "slow-step", "--slow-share", "0.3"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("COMPUTE STRAGGLER",),
        phase="forward",
        why="from step 5 on the rank's forward spins 30 % of its own median step time before the fault (the "
        "others then wait for it in DDP's all_reduce every step): slow, never stuck — no incident is right, "
        "the run summary must name it (straggler_ranks == [r], COMPUTE STRAGGLER in forward)",
        offline=False,
        offline_why="the job ends normally; there is nothing to diagnose",
        steps=60,
        straggler=True,
        cause="own_work",
    ),
    # -- classes outside the suite (issue 44 item 5): jobs nobody designed the verdict around, in varied
    # layouts; right answers from what the fault does (benchmarks/README.md, "Classes outside the suite")
    "pp-wrong-peer": Klass(
        "pipeline.py",
        ("--scenario", "wrong-peer", "--micro-batches", "4"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(3,),
        kinds=("collective_mismatch", "hang"),
        phase=None,
        why="4 GPipe stages; at step 5 stage 2 posts its first recv from stage 0 instead of stage 1: stage 0 never "
        "sends to 2 (it sent to 1 and waits for its gradients), 1 waits to send to / receive from 2, 3 waits for 2 "
        "— a ring of waits whose one wrong edge is stage 2's. Stage 2's code is at fault (its peer is the wrong "
        "one); no phase: it waits in a recv like the others",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "fifo-read": Klass(
        "outside.py",
        ("--scenario", "fifo-read"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(0, 3),
        kinds=("hang",),
        phase="dataloader",
        why="rank 2's dataset opens a named pipe for its step-5 sample and no producer ever writes it: blocked in "
        "open() inside DataLoader.__next__ (no CPU); the others finish forward and wait for it in DDP's all_reduce",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "regex-backtrack": Klass(
        "outside.py",
        ("--scenario", "regex-backtrack"),
        nodes=2,
        nproc=2,
        fault_rank=1,
        other_ranks=(2,),
        kinds=("hang",),
        phase="idle",
        why="2 nodes x 2; after step 5's all_gather, rank 1's log filter backtracks catastrophically: busy in C with "
        "the GIL held (no Python frame moves, no thread of it runs), outside every phase; the others wait for it in "
        "the step's logging all_reduce",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "exit-zero": Klass(
        "outside.py",
        ("--scenario", "exit-zero"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3, 0),
        kinds=("dead_rank", "hang"),
        phase=None,
        why="rank 1 calls os._exit(0) in forward at step 5: gone with exit code 0 mid-training, no word of its own; "
        "the others lose it in DDP's all_reduce. It ended 'cleanly' but it initiated the failure",
        offline=True,
        offline_why="torchrun's failure report lists every rank that failed except rank 1 (it exited 0, before the "
        "others lost their peer, mid-run). At the highest rank (3) no line shows that it exists: that log cannot "
        "decide and nobody may be named (the suite counts it as an offline miss)",
    ),
    "alloc-oom": Klass(
        "outside.py",
        ("--scenario", "alloc-oom"),
        nodes=1,
        nproc=4,
        fault_rank=3,
        other_ranks=(0,),
        kinds=("dead_rank",),
        phase="forward",
        why="rank 3's forward asks the CPU allocator for 4 TiB at step 5: its RuntimeError ('DefaultCPUAllocator: "
        "can't allocate memory') ends it; the others then lose it in DDP's all_reduce (consequences)",
        offline=True,
        offline_why="rank 3's traceback (the allocator's error) precedes the others' lost-peer errors",
    ),
    "cgroup-oom": Klass(
        "outside.py",
        ("--scenario", "cgroup-oom"),
        nodes=1,
        nproc=4,
        fault_rank=2,
        other_ranks=(0,),
        kinds=("dead_rank",),
        phase=None,
        why="rank 2 joins a memory cgroup limited to 64 MiB and allocates 1 GiB in forward at step 5: the kernel's "
        "OOM killer SIGKILLs it (no word of its own); the others lose it in DDP's all_reduce",
        offline=True,
        offline_why="torchrun's report: rank 2 ended by a SIGKILL torchrun did not send; the others lost a peer",
    ),
    "event-in-backward": Klass(
        "outside.py",
        ("--scenario", "event-in-backward"),
        nodes=2,
        nproc=2,
        fault_rank=2,
        other_ranks=(1,),
        kinds=("hang",),
        phase="backward",
        why="2 nodes x 2; a gradient hook of rank 2 waits on a threading.Event that a never-completed future's "
        "callback would set: blocked, no CPU, inside backward — as quiet as the ranks that wait for it in DDP's "
        "all_reduce (also in backward)",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "del-deadlock": Klass(
        "outside.py",
        ("--scenario", "del-deadlock"),
        nodes=1,
        nproc=4,
        fault_rank=0,
        other_ranks=(2,),
        kinds=("hang",),
        phase="forward",
        why="rank 0's forward holds a cache lock while allocating; the cyclic collector runs a dropped handle's "
        "__del__, which takes the same (non-reentrant) lock: deadlocked on itself inside gc, no CPU; the others "
        "wait in DDP's all_reduce",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "debug-pause": Klass(
        "outside.py",
        ("--scenario", "debug-pause"),
        nodes=1,
        nproc=4,
        fault_rank=3,
        other_ranks=(1,),
        kinds=("hang",),
        phase="optimizer",
        why="rank 3's optimizer step post-hook sleeps for a day at step 5 (a debug pause left in): asleep in the "
        "optimizer; the others finish their step and wait for it in the metrics all_gather",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
    "gather-shape": Klass(
        "outside.py",
        ("--scenario", "gather-shape"),
        nodes=1,
        nproc=4,
        fault_rank=1,
        other_ranks=(3,),
        kinds=("collective_mismatch",),
        phase=None,
        why="rank 1's metrics tensor has 3 elements where the others' have 2 in step 5's all_gather: one collective, "
        "mismatched shapes; gloo aborts whichever rank receives a message of the wrong size",
        offline=False,
        offline_why="gloo's size error is printed by a receiver, the culprit or a peer: the log shows a mismatch, "
        "not who is out of step",
    ),
    "group-a2a-skip": Klass(
        "outside.py",
        ("--scenario", "group-a2a-skip", "--groups"),
        nodes=2,
        nproc=2,
        fault_rank=3,
        other_ranks=(0,),
        kinds=("collective_mismatch",),
        phase=None,
        why="2 nodes x 2, expert pairs {0,2} {1,3} across the nodes; rank 3 skips its pair's all_to_all_single at "
        "step 5 and goes on to DDP's all_reduce: rank 1 waits in the all_to_all that rank 3 never calls, 0 and 2 "
        "wait in DDP's all_reduce for rank 1. The culprit is the one whose collective sequence differs",
        offline=False,
        offline_why="nothing printed before the kill",
    ),
}



def table() -> str:
    """One line per entry: what ``python examples/fault_catalogue.py`` prints."""
    lines = [f"{'scenario':24} {'fires':14} program: what"]
    lines += [f"{name:24} {s.fires:14} {s.program}: {s.what}" for name, s in SCENARIOS.items()]
    for title, table in (("FAULTS", FAULTS), ("DDP_DEMO_FAULTS", DDP_DEMO_FAULTS)):
        lines += ["", f"{title}: name (scenario) -> kinds, culprit, phase, offline"]
        lines += [
            f"{name:24} ({e.scenario}) -> {'/'.join(e.kinds)}, {e.culprit}, {e.phase}, {e.offline}"
            for name, e in table.items()
        ]
    lines += ["", "CLASSES: name (scenario, nodes x ranks) -> kinds, truth, phase, offline"]
    lines += [
        f"{name:24} ({k.scenario}, {k.nodes}x{k.nproc}) -> {'/'.join(k.kinds) or 'no incident'}, "
        f"{list(k.truth)}, {k.phase}, {k.offline}"
        for name, k in CLASSES.items()
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
