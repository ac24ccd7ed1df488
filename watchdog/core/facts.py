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


@dataclass(slots=True)
class Stopped:
    """Stopped by SIGSTOP or a debugger: it waits for nobody."""

    rank: int


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
