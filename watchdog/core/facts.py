"""Typed facts about ranks: what every source (live records, stacks, the flight recorder, exits, other
nodes, log lines) is turned into before the wait-for graph (``core.waitgraph``) is built over them.

Live and offline differ only in which facts they have. Each fact carries its strength, a ``Rung`` of the
evidence order (exit cause > stopped > flight recorder > counters > waiting > stacks > GPU > silence).
Pure data, never changed once made (not frozen: a frozen init costs ~3x, and a verdict over 8,192 ranks
makes one fact per rank); no rule lives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum


class Rung(IntEnum):
    """How strong a fact or an edge is; a larger value is stronger evidence."""

    SILENCE = 1  # a node (or rank) that never answered
    GPU = 2  # GPU activity
    STACKS = 3  # a Python stack
    WAITING = 4  # in a collective or a wait, by the record's phase or its stack
    COUNTERS = 5  # the hook's step and collective counters
    FLIGHT_RECORDER = 6  # per process group entries and sequence numbers
    STOPPED = 7  # process state T
    EXIT_CAUSE = 8  # an exit and why it happened

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class Ended:
    """A rank that is gone. ``own``: by its own cause (initiating); else a consequence of a peer's
    failure (connection closed, a timeout, a watchdog abort), which points at ``lost`` when known."""

    rank: int
    own: bool
    cause: str | None = None
    lost: frozenset[int] | None = None
    strength: Rung = Rung.EXIT_CAUSE
    pid: int | None = None  # the process that ended (tells a restarted generation from the one decided)
    peer_ended: bool = False  # a consequence whose cause says a peer's process closed the connection (gone)
    # when it ended, on one clock per fact set (offline: the log's time; live: minus the exit's age); None:
    # not known (an untimed log line), then its end is not ordered against the others
    ts: float | None = None
    # its place in its node's exit order (live: exact, the node sees its own ranks end); None: unknown (logs),
    # then ends close in time tie even on one node
    order: int | None = None
    verified: bool = True  # False (live): it ended before rankwatch saw its process; its time is when noticed
    how: str | None = None  # live: how the process went (``snapshot`` state: dead, crashed, exited early)
    step: int | None = None  # live: the step it was in
    # what a log says about it (offline): by which signal, whether its own message states the cause
    signal: str | None = None
    stated: bool = True  # False: a bare death by signal, no message of its own
    detail: str = ""  # the cause's own words (exception, CUDA error), bounded by the parser
    phase: str | None = None
    site: str = ""  # where its traceback ends
    node: str | None = None  # offline: the host a line names; live: "#N", the launcher's node rank (hosts repeat)


@dataclass(slots=True)
class Progress:
    """Where a rank is in its step: ``how`` its process went or goes (``core.snapshot`` states: running,
    stopped, dead, crashed, exited), ``phase`` and ``step``, and the Python-level collective it is inside
    (``in_collective``) or issued last (``seq``, ``op``). Live: every rank that answered
    (``core.live_facts.progress_facts``); offline: ranks whose lines say where they ended
    (``diagnose.log_facts``: a normal end, a timeout in a collective)."""

    rank: int
    how: str
    phase: str | None
    step: int | None = None
    in_collective: bool = False
    seq: int | None = None
    op: str | None = None
    blocked: bool | None = None  # live: its stack is blocked in a wait on peers (True), runs its own code
    # (False), or no stack was read (None)


@dataclass(slots=True)
class Stopped:
    """Stopped by SIGSTOP or a debugger: it waits for nobody. ``phase``/``step``: where it stopped."""

    rank: int
    phase: str | None = None
    step: int = 0


@dataclass(slots=True)
class Silent:
    """No evidence at all: its node never answered (or, offline, it is named by peers and says nothing)."""

    rank: int
    node: str | None = None


@dataclass(slots=True)
class Busy:
    """Alive and not waiting for any peer (computing, loading data, in a declared phase)."""

    rank: int
    phase: str | None
    strength: Rung = Rung.WAITING
    # live: it made progress within ``VerdictPolicy.in_motion_s`` — caught mid-step, not (yet) holding anyone
    moving: bool = False


@dataclass(slots=True)
class Waits:
    """A rank blocked on peers in ``group``. ``on``: the ranks it waits for (who has not entered what it
    is in); None when the source cannot say who (a p2p op whose peer is unknown, a timeout message)."""

    rank: int
    on: frozenset[int] | None
    group: str = ""
    seq: int | None = None
    op: str | None = None
    strength: Rung = Rung.WAITING
    source: str = ""  # what says so, when rules must tell sources apart (offline: ``DESYNC_REPORT``, …)
    ts: float | None = None  # offline: when its own wait ended (its timeout line), on the log's clock


DESYNC_REPORT = "desync_report"  # PyTorch's desync report: computed from every rank's trace in the store
NCCL_OP_COUNTS = "nccl_op_counts"  # NCCL INFO per-op lines: the last op each member of a communicator enqueued
STORE_KEYS = "store_key_waits"  # a start-up store wait timed out on a peer's gloo rendezvous key: waits for it
NAMED_IN_MESSAGE = "named_in_message"  # an error message names whom it waited for (``core.failures.NAMED_WAITS``)
OWN_TIMEOUT = "own_timeout"  # a rank's own timeout / mismatch line: it waits, for whom it cannot say
PEER_GONE = "peer_gone"  # a rank's own "connection closed/reset by peer" and no timeout: its peer went away
IN_COLLECTIVE = "in_collective"  # live: the hook's record says it is inside a Python-level collective
P2P_PEER = "p2p_peer"  # live: the hook's record says it is inside a send/recv with this peer (``on``: that peer)
OWN_WAITS = frozenset({OWN_TIMEOUT, PEER_GONE, IN_COLLECTIVE})
IN_OP_CALLS = frozenset({"stack", "counters"})  # InOp sources that say which call a rank waits in


@dataclass(slots=True)
class KnownPeers:
    """The peers a rank completed a send/recv with before the one it is in (live: the hook's record); ``peers``
    None: more than the record keeps, so whether a peer is new cannot be said."""

    rank: int
    peers: frozenset[int] | None


@dataclass(slots=True)
class Told:
    """Told by the store that a peer timed out, without timing out itself. ``pending``: it had NCCL work
    enqueued and not completed (inside a collective: it waits too), False: all its work completed (in no
    collective), None: unknown."""

    rank: int
    pending: bool | None = None
    completed: int | None = None


@dataclass(slots=True)
class Finished:
    """Reached its normal end (its last training-loop line, an exit 0) with nothing of its own wrong."""

    rank: int


@dataclass(slots=True)
class Exited:
    """How a launcher (torchrun, mpirun, DeepSpeed) says a rank ended; ``root_cause``: its report calls it the
    first observed failure (only the first exit it *noticed*)."""

    rank: int
    signal: str | None
    exitcode: int | None
    root_cause: bool = False


@dataclass(slots=True)
class InOp:
    """A rank says which collective it is in: the flight recorder's entry at a (group, sequence number)
    where members disagree (``source`` "flight_recorder", live: ``op`` is what this rank's entry says of
    the ``aspect`` they disagree on — the op, its sizes or dtypes), the newest collective it entered in a
    group ("fr_entered", live), c10d's fingerprint check ("fingerprint"), NCCL's watchdog at a sequence
    number ("watchdog"), a traceback while waiting ("stack", at ``site``), or the hook's Python-level
    collective counter ("counters", live)."""

    rank: int
    op: str
    source: str
    seq: int | None = None
    site: str | None = None
    group: str | None = None  # the process group the sequence number counts in, where known
    aspect: str | None = None  # "op" | "size" | "dtype": what a recorder's mismatch is about


FR_ENTRY = "flight_recorder"  # InOp and Waits source: the flight recorder's entries (``core.fr_facts``)
FR_ENTERED = "fr_entered"  # InOp source: the newest collective a member entered in a group, by its recorder


@dataclass(slots=True)
class Count:
    """One counter's value for a rank in one process group: what "behind" is read from
    (``core.rules.behind``). Counters: ``step`` and ``collective_seq`` (the hook's, live, group ""),
    ``entered`` (the flight recorder's highest collective seq entered in ``group``), offline SeqNums
    ``enqueued`` (PG status), ``timeout`` (the watchdog's) and ``last`` (the higher of both). ``group``
    None: a log line that names no group (SeqNums count per group)."""

    rank: int
    group: str | None
    counter: str
    value: int


@dataclass(slots=True)
class ProcessGroup:
    """A process group as the flight recorder knows it (PyTorch fr_trace's ``Group`` and ``Membership``
    tables in one row): its ``members`` whose recorder traced it, those its ``pg_config`` declares, traced or
    not, and whether its sequence numbers are comparable across members (False: one counter for collectives
    and p2p ops, which pipeline stages issue in different numbers by design). ``default``: the world group,
    whose members are every rank of the job (a waiter waits for the ranks nobody traced too)."""

    name: str
    members: tuple[int, ...]
    declared: tuple[int, ...] = ()
    default: bool = False
    comparable: bool = True


@dataclass(slots=True)
class Unjoined:
    """A collective some members of ``group`` entered at ``seq`` while others never reached it (their
    highest entered seq is lower): the flight recorder's "missing"."""

    group: str
    seq: int
    op: str
    joined: tuple[int, ...]
    missing: tuple[int, ...]


@dataclass(slots=True)
class ThreadDied:
    """A helper thread of a live rank (a prefetch or I/O producer) died with an exception (``error``:
    "thread NAME: ExceptionType: message", the hook's record): what its training loop may wait for."""

    rank: int
    error: str


@dataclass(slots=True)
class SameStack:
    """Ranks whose Python stacks share one signature (STAT's stack equivalence class; live)."""

    signature: str
    ranks: tuple[int, ...]


@dataclass(slots=True)
class GpuUse:
    """A live rank's GPU use (NVML): ``util`` in %, None when unread; ``missing``: absent from the per-process
    samples while another rank's are fresh (no kernel of its own ran)."""

    rank: int
    util: float | None
    missing: bool = False


@dataclass(slots=True)
class SizeMismatch:
    """Gloo told this rank it received a message of the wrong size (only the receiver is told)."""

    rank: int
    detail: str = ""


@dataclass(slots=True)
class LoggedVerdict:
    """rankwatch's own verdict, printed in the log: it saw stacks, records and the flight recorder."""

    ranks: tuple[int, ...]
    kind: str
    confidence: str
    phase: str | None


@dataclass(slots=True)
class KilledByRankwatch:
    """Ended because rankwatch's ``--on-stall kill`` signalled it for an earlier incident."""

    rank: int


@dataclass(slots=True)
class PriorVerdict:
    """The job was already decided (an earlier incident named ``ranks`` and rankwatch acted on it)."""

    incident_id: str
    ranks: tuple[int, ...]
    killed: bool
    pids: Mapping[int, int] = field(default_factory=dict)  # rank → pid when it was decided


@dataclass
class FactSet:
    """Every fact about one incident's ranks."""

    ranks: tuple[int, ...] = ()
    ended: list[Ended] = field(default_factory=list)
    stopped: list[Stopped] = field(default_factory=list)
    silent: list[Silent] = field(default_factory=list)
    busy: list[Busy] = field(default_factory=list)
    waits: list[Waits] = field(default_factory=list)
    killed: list[KilledByRankwatch] = field(default_factory=list)
    prior: PriorVerdict | None = None
    progress: list[Progress] = field(default_factory=list)
    # what logs add (offline); live leaves them empty
    told: list[Told] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    exited: list[Exited] = field(default_factory=list)
    in_op: list[InOp] = field(default_factory=list)
    counts: list[Count] = field(default_factory=list)
    size_mismatch: list[SizeMismatch] = field(default_factory=list)
    logged: LoggedVerdict | None = None
    # ranks known to exist (a stated world size, the highest rank seen) that no line is about: silent
    unseen: tuple[int, ...] = ()
    # what only live sources hold: the flight recorder's groups and unjoined collectives, stacks, GPU use,
    # helper threads that died
    groups: list[ProcessGroup] = field(default_factory=list)
    unjoined: list[Unjoined] = field(default_factory=list)
    stacks: list[SameStack] = field(default_factory=list)
    gpu: list[GpuUse] = field(default_factory=list)
    threads: list[ThreadDied] = field(default_factory=list)
    peers: list[KnownPeers] = field(default_factory=list)  # live: whom each rank's sends/recvs reached before

    def waiting_own(self) -> set[int]:
        """Ranks whose own lines show them waiting on a peer (a timeout, a lost peer, a mismatch)."""
        return {w.rank for w in self.waits if w.source in OWN_WAITS}

    def waiting(self) -> set[int]:
        """Ranks that waited, or were told a peer timed out (offline's "is waiting")."""
        return self.waiting_own() | {t.rank for t in self.told}

    def inside(self) -> set[int]:
        """Ranks inside a collective: waiting on their own evidence, or told with NCCL work pending."""
        return self.waiting_own() | {t.rank for t in self.told if t.pending}

    def terminal(self) -> dict[int, Rung]:
        """Ranks that wait for nobody, with the strength of what says so: the candidate sinks."""
        out: dict[int, Rung] = {}
        for b in self.busy:
            out[b.rank] = max(out.get(b.rank, b.strength), b.strength)
        for s in self.silent:
            out.setdefault(s.rank, Rung.SILENCE)
        for st in self.stopped:
            out[st.rank] = Rung.STOPPED
        for e in self.ended:
            if e.own:
                out[e.rank] = Rung.EXIT_CAUSE
        return out
