"""What one log line said, as plain data: the parser's output and the reasoning's input.

Families say what a message means for blame, so the reasoning never looks at raw text:
``PRIMARY`` failures start an incident on the rank that prints them, ``WAITING`` ones are what a rank
prints when a *peer* let it down, ``MISMATCH`` ones say collectives disagreed, the rest is context.
"""

from __future__ import annotations

from dataclasses import dataclass

# primary: the rank that prints it failed by itself
CUDA_ERROR = "cuda_error"  # illegal memory access, device assert, launch failure, NCCL "Cuda failure"
CUDA_OOM = "cuda_oom"
HW_FAULT = "hw_fault"  # ECC errors, Xid
HOST_OOM = "host_oom"  # kernel / cgroup OOM killer
PY_ERROR = "python_error"  # a Python exception that is not about communication
# waiting: the rank that prints it was let down by a peer
GLOO_TIMEOUT = "gloo_timeout"
PEER_LOST = "peer_lost"  # connection closed/reset by peer, ncclRemoteError
NCCL_TIMEOUT = "nccl_timeout"  # watchdog caught collective operation timeout
NCCL_STATUS = "nccl_status"  # last enqueued / completed work (watchdog status, dump signal)
DUMP_SIGNAL = "dump_signal"  # flight-recorder dump signal: detail "this rank" (its own watchdog timed
# out) or "another rank" / "rank N" (a peer timed out and told it through the store: NOT its own timeout)
HEARTBEAT = "heartbeat"  # heartbeat monitor abort
COMM_ERROR = "comm_error"  # other NCCL/gloo errors (NCCL WARN, DistBackendError)
TIMEOUT_REPORTED = "timeout_reported"  # another rank's log says THIS rank timed out ("…from rank N")
WATCHDOG_ABORT = "watchdog_abort"  # NCCL's watchdog taking this process down (explains its SIGABRT)
# mismatch
SIZE_MISMATCH = "size_mismatch"  # gloo enforce: received size != expected
OP_MISMATCH = "op_mismatch"  # c10d TORCH_DISTRIBUTED_DEBUG=DETAIL fingerprint mismatch
# context
EXIT = "exit"  # torch elastic failure report entry or "failed (exitcode: …)" line
AGENT_TERM = "agent_term"  # torchrun sent this pid a closing signal (so its death is downstream)
TRACEBACK = "traceback"  # a finished Python traceback: innermost collective op and user call site
DUMP_WRITTEN = "dump_written"  # a flight-recorder dump went to a file
RANK_SEEN = "rank_seen"  # only says the rank exists (per-rank file, prefix)
SLURM = "slurm"  # srun/slurmstepd task exits and cancellations
FINISHED = "finished"  # the rank reached its normal end (last training-loop line, at-exit warning)
DESYNC = "desync"  # PyTorch's desync report names this rank as lagging ("finished #N, but didn't join #N+1")
NCCL_OP = "nccl_op"  # NCCL INFO "<Op>: opCount N … count C … [nranks=K]": the last op the rank enqueued
WORLD = "world_size"  # a launcher / torch / NCCL line stating how many ranks the job (or a communicator) has
RANKWATCH = "rankwatch"  # rankwatch's own verdict line in a console log (detail: "kind|confidence|phase")
STRAGGLER = "rankwatch_straggler"  # rankwatch's own straggler diagnosis in its summary (detail: "label|ranks|phase")
STRAGGLER_CAUSE = "rankwatch_cause"  # the straggler's cause under it (detail: "cause|its figures")

PEER_SIGNALLED = ("another rank", "rank ")  # DUMP_SIGNAL details that name a peer, not this rank

FIRST_NOTICED = "first failure torchrun noticed"  # detail of the one-line EXIT event

PRIMARY = frozenset({CUDA_ERROR, CUDA_OOM, HW_FAULT, HOST_OOM, PY_ERROR})
WAITING = frozenset({GLOO_TIMEOUT, PEER_LOST, NCCL_TIMEOUT, DUMP_SIGNAL, HEARTBEAT, COMM_ERROR})
MISMATCH = frozenset({SIZE_MISMATCH, OP_MISMATCH})
# the rank itself waited on a peer and gave up (a DUMP_SIGNAL counts only when it is its own, see
# diagnose/reasoning.py); TIMEOUT_REPORTED is the same fact told by another rank
WAITED = frozenset({GLOO_TIMEOUT, PEER_LOST, NCCL_TIMEOUT, HEARTBEAT, COMM_ERROR, TIMEOUT_REPORTED})
# NCCL's watchdog at work on the rank: a SIGABRT that follows is its abort, not the rank's own crash
WATCHDOG = frozenset({NCCL_TIMEOUT, NCCL_STATUS, DUMP_SIGNAL, HEARTBEAT, TIMEOUT_REPORTED, WATCHDOG_ABORT})


@dataclass(frozen=True, slots=True)
class Event:
    """One finding from one line. Fields a message does not carry stay None."""

    family: str
    file: str
    line: int
    text: str
    rank: int | None = None  # global rank, when the line or its file says so
    local_rank: int | None = None  # torchrun's [defaultN] prefix or the per-rank log path
    host: str | None = None
    pid: int | None = None
    ts: float | None = None  # seconds, only comparable between lines of one clock (one node)
    seq: int | None = None  # collective sequence number of the work that failed
    op: str | None = None  # collective op (ALLREDUCE / all_reduce …)
    phase: str | None = None  # what a traceback says the rank was doing (collective, backward, …)
    numel: int | None = None
    enqueued: int | None = None  # PG status: last enqueued work
    completed: int | None = None  # PG status: last completed work
    exitcode: int | None = None
    signal: str | None = None  # SIGKILL, SIGTERM, …
    root_cause: bool = False  # listed under torchrun's "Root Cause (first observed failure)"
    size: int | None = None  # WORLD: the number of ranks the line states (a lower bound of the world size)
    pg: str | None = None  # process group of ``seq`` ("0", "3", "nranks=8" for NCCL's own op lines); None: unknown
    detail: str = ""  # short family-specific text: call site, peer, error message

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"
