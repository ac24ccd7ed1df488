"""What one NCCL RAS status query says, as plain frozen data: communicators, their ranks' collective counts,
missing and dead processes (``ras_report`` parses the replies into it, ``ras_findings`` compares two)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RasProcess:
    pid: int | None
    host: str | None
    gpus: str | None = None


@dataclass(frozen=True)
class RasRank:
    rank: int
    host: str | None = None
    pid: int | None = None
    cuda_dev: int | None = None
    nvml_dev: int | None = None
    init_state: int | None = None
    async_error: int | None = None
    finalize_called: bool | None = None
    destroy_flag: bool | None = None
    abort_flag: bool | None = None
    collective_counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RasMissingRank:
    rank: int
    host: str | None = None
    pid: int | None = None
    cuda_dev: int | None = None
    unresponsive: bool | None = None
    dead: bool | None = None


@dataclass(frozen=True)
class RasCountGroup:
    """Ranks of one communicator that launched ``count`` operations of ``op`` (only ops where ranks differ).

    ``ranks`` may list fewer than ``n_ranks`` in the text format, which names only outlier groups.
    """

    op: str
    count: int
    n_ranks: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RasCommunicator:
    hash: str  # 16 lower-case hex digits, the form NCCL's logs use
    label: str | None = None  # "#<group>-<index>" in the text report
    size: int | None = None
    errors: tuple[str, ...] = ()  # INCOMPLETE / ERROR / MISMATCH
    ranks: tuple[RasRank, ...] = ()
    missing_ranks: tuple[RasMissingRank, ...] = ()
    count_groups: tuple[RasCountGroup, ...] = ()
    rank_status: Mapping[int, str] = field(default_factory=dict)
    rank_errors: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RasGroupRow:
    """One row of the text summary table (communicators grouped by size and state)."""

    group: int
    comms: int
    nodes: int
    ranks_per_node: str
    ranks_per_comm: int
    ranks_in_group: int
    status: str
    errors: str


@dataclass(frozen=True)
class RasStatus:
    format: str  # "json" | "text"
    nccl_version: str | None
    communicators: tuple[RasCommunicator, ...]
    groups: tuple[RasGroupRow, ...] = ()
    missing_processes: tuple[RasProcess, ...] = ()
    dead_processes: tuple[RasProcess, ...] = ()
    timeouts: int = 0
    complete: bool = True  # False when the reply was cut by the deadline or the size bound
    raw: str = ""

    def communicator(self, comm_hash: str) -> RasCommunicator | None:
        for c in self.communicators:
            if c.hash == comm_hash:
                return c
        return None
