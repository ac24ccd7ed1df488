"""Plain, immutable views of ranks that the pure detection and verdict functions work on."""

from __future__ import annotations

from dataclasses import dataclass

from . import phases

# Process states as the verdict sees them.
RUNNING = "running"
STOPPED = "stopped"  # SIGSTOP / state T
DEAD = "dead"  # gone without the hook's normal-exit mark (killed by a signal)
CRASHED = "crashed"  # the script raised or exited non-zero
ZOMBIE = "zombie"  # exited, not yet reaped
EXITED = "exited"  # normal interpreter exit
MISSING = "missing"  # no evidence (node never answered)
UNVERIFIED = "unverified"  # the record's pid is not proven to write it: never dead, never stalled, never a target
UNREADABLE = "unreadable"  # the record stopped parsing (corrupt, truncated): its own state, never a stall
UNKNOWN = "unknown"

GONE_STATES = frozenset({DEAD, CRASHED, ZOMBIE})

# a send/recv's direction as ``RankView.p2p_dir`` names it (the hook record's ``P2P_DIRS``), and how many known
# peers a rank's view may carry across a wire or a store (the record keeps 8; more is not a rank's record)
P2P_DIRECTIONS = ("send", "recv")
MAX_KNOWN_PEERS = 64

# Within one step the canonical phases run in this order; a rank earlier in the order than its peers
# (same step, same collective count) is behind them (the one phase table: ``core.phases``).
STEP_PHASE_ORDER = phases.STEP_PHASE_ORDER


@dataclass(frozen=True)
class RankView:
    """Everything known about one rank at one instant; times are durations, never clock readings."""

    rank: int
    node: str
    pid: int
    state: str
    step: int
    phase: str | None
    in_phase_s: float
    since_progress_s: float
    coll_seq: int = 0
    coll_done: int = 0
    coll_op: str | None = None
    budget_s: float = 0.0
    budget_elapsed_s: float = 0.0
    exit_order: int | None = None  # 0 = first rank of its node to exit; node-local
    exit_age_s: float | None = None  # seconds since it exited, as seen by its node's daemon
    exit_cause: str | None = None  # crashed: "ExceptionType: message" from the hook's crash mark
    thread_died: str | None = None  # "thread NAME: ExceptionType: message": a helper thread of it that died
    age_s: float | None = None  # seconds since the rank's record was created (its start); None: not known
    node_rank: int = -1  # the launcher's node rank (hostnames can repeat: containers, simulated nodes)
    # the process was proven to write the record; False for one that ended before rankwatch first saw it
    # (its record is evidence for a verdict, never a reason to open an incident or to act)
    verified: bool = True
    gpu_util: float | None = None
    gpu_missing: bool = False  # absent from the per-process GPU samples while others are present
    stack_top: tuple[str, ...] = ()
    stack_signature: str | None = None
    waiting: bool | None = None  # stack shows it blocked in a collective / wait (None: no stack)
    # the send/recv it is in or issued last, when that is its newest Python-level collective (the hook's record):
    # "send" or "recv", and the peer's global rank (None: the op named none)
    p2p_dir: str | None = None
    p2p_peer: int | None = None
    # the peers a send/recv of it completed with before; None: not known (more peers than the record keeps)
    p2p_known: frozenset[int] | None = None

    @property
    def node_key(self) -> tuple[int, str]:
        """Which node a rank ran on, for comparing exit order within a node."""
        return (self.node_rank, "") if self.node_rank >= 0 else (-1, self.node)

    @property
    def in_collective(self) -> bool:
        return self.coll_seq > self.coll_done

    @property
    def alive(self) -> bool:
        return self.state in (RUNNING, STOPPED)
