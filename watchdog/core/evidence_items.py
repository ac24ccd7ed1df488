"""Evidence items: what an edge knows beside the ranks' views (the nodes' exchange, the incident pipeline, GPU
devices, NCCL RAS, live stragglers), as data.

Each item is made where its fact is known and carried to the verdict stage, which renders it in words through
``report.evidence_words`` (one phrase per kind) into the document's ``evidence`` lines — the
``rankwatch.verdict/1`` contract users read — and keeps the items themselves as ``evidence_items``. So a test
asserts the data, one renderer test holds the words, and ``tests/architecture/test_words_complete.py`` fails
while a kind has no words. Pure: no I/O, no words.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

Ranks = tuple[int, ...]


@dataclass(frozen=True)
class EvidenceItem:
    """One evidence line as data; ``KIND`` names it in ``evidence_items`` and picks its words."""

    KIND: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.KIND}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


def item_kinds() -> Iterator[type[EvidenceItem]]:
    """Every kind of item there is (the subclasses, at any depth)."""
    todo = list(EvidenceItem.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        yield cls


# -- lines other modules phrase themselves --------------------------------------------------------------


@dataclass(frozen=True)
class Line(EvidenceItem):
    """A line phrased where it was made, passed through as it is: the flight-recorder analysis's
    (``evidence.flight_recorder.FrFindings.lines``, rewritten on its own) and ``rankwatch inspect``'s notes
    (not items yet)."""

    KIND: ClassVar[str] = "line"
    line: str


@dataclass(frozen=True)
class FrNote(EvidenceItem):
    """A flight-recorder note another node sent with its evidence (its own words, cleaned by the exchange)."""

    KIND: ClassVar[str] = "fr_note"
    note: str


# -- the nodes' exchange (``cluster.correlate``) ---------------------------------------------------------

# why this node decided alone (``DecidedLocally.why``)
STORE_UNREACHABLE = "store_unreachable"  # no store at all (``error``: why)
EVIDENCE_UNPUBLISHED = "evidence_unpublished"  # publishing this node's evidence failed (``error``)
LEADER_SILENT = "leader_silent"  # no verdict from the leader in time
LEADER_REJECTED = "leader_rejected"  # the value under verdict/ was rejected, and no valid one came
HELD_AS = "held_as"  # the leader holds this node's evidence as ``held`` (tampered, unavailable, silent)
HELD_MISSING = "held_missing"  # the leader holds ``ranks`` (this node's) as never answered
REFUSED_UNAUTHENTICATED = "refused_unauthenticated"  # unauthenticated, it names ``ranks`` progressing here
LOCAL_REASONS = (STORE_UNREACHABLE, EVIDENCE_UNPUBLISHED, LEADER_SILENT, LEADER_REJECTED, HELD_AS, HELD_MISSING,
                 REFUSED_UNAUTHENTICATED)


@dataclass(frozen=True)
class DecidedLocally(EvidenceItem):
    """This node decided over its own evidence (and what the store held of the others'), not the leader's."""

    KIND: ClassVar[str] = "decided_locally"
    why: str  # one of ``LOCAL_REASONS``
    error: str = ""
    ranks: Ranks = ()
    held: str = ""


# why a node's evidence was not heard (``NodeEvidence.why``); a tampered value carries its rejection instead
DELETED_AFTER_SEEN = "deleted_after_seen"
OVER_READ_BUDGET = "over_read_budget"  # the store held more than one look may read before its snapshot
KEY_EMPTY_NODE_ALIVE = "key_empty_node_alive"  # its daemon publishes on, its evidence key is empty
REJECTED = "rejected"  # its value failed authentication, its shape or its binding (``error``: how)
NODE_REASONS = (DELETED_AFTER_SEEN, OVER_READ_BUDGET, KEY_EMPTY_NODE_ALIVE, REJECTED)


@dataclass(frozen=True)
class NodeEvidence(EvidenceItem):
    """A node whose evidence was tampered with or made unavailable: evidence about the store, never about its
    ranks — judged (``judged``) on its last snapshot, or not at all."""

    KIND: ClassVar[str] = "node_evidence"
    node: int
    held: str  # ``cluster.correlate``'s TAMPERED or UNAVAILABLE
    why: str  # one of ``NODE_REASONS``
    error: str = ""
    judged: Ranks = ()
    authenticated: bool = True  # the snapshot it was judged on was authenticated


@dataclass(frozen=True)
class UnauthenticatedExchange(EvidenceItem):
    """No store secret: anyone reaching the store could have written or removed what the nodes said."""

    KIND: ClassVar[str] = "unauthenticated_exchange"


@dataclass(frozen=True)
class NoEvidenceFrom(EvidenceItem):
    """Ranks nothing was heard from: of nodes that did not answer (``silent_nodes``), or never seen at all."""

    KIND: ClassVar[str] = "no_evidence_from"
    ranks: Ranks
    silent_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class NotJudged(EvidenceItem):
    """Ranks left out: the store was tampered with, so their silence is no evidence about them."""

    KIND: ClassVar[str] = "not_judged"
    ranks: Ranks


# -- the incident pipeline (``serve.incident``) ----------------------------------------------------------


@dataclass(frozen=True)
class PipelineFailed(EvidenceItem):
    """A stage of the incident pipeline raised: the verdict stands on the detection-time views alone."""

    KIND: ClassVar[str] = "pipeline_failed"
    error_type: str
    error: str


# -- GPU devices (``evidence.gpu``) ------------------------------------------------------------------------


# the names NVIDIA's XID catalogue gives the events (the evidence line and the daemon's log quote them)
XID_MEANING = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    63: "ECC page retirement / row remap recorded",
    64: "ECC page retirement / row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


@dataclass(frozen=True)
class GpuXid(EvidenceItem):
    """An XID event of a device since the watchdog started (``ranks``: the job's ranks on that device)."""

    KIND: ClassVar[str] = "gpu_xid"
    device: int
    xid: int
    age_s: float  # since the watchdog started
    ranks: Ranks = ()


@dataclass(frozen=True)
class GpuXidsOlder(EvidenceItem):
    """XID events beyond the ones kept (``evidence.gpu.MAX_XIDS_KEPT``)."""

    KIND: ClassVar[str] = "gpu_xids_older"
    count: int


@dataclass(frozen=True)
class GpuEcc(EvidenceItem):
    """Uncorrected ECC errors of a device since driver load."""

    KIND: ClassVar[str] = "gpu_ecc"
    device: int
    count: int
    ranks: Ranks = ()


@dataclass(frozen=True)
class GpuRemap(EvidenceItem):
    """A device's row remapping failed (it needs service) or is pending (until a GPU reset)."""

    KIND: ClassVar[str] = "gpu_remap"
    device: int
    failed: bool
    ranks: Ranks = ()


# -- NCCL RAS (``evidence.ras_findings``) ------------------------------------------------------------------

RAS_WHATS = ("stuck", "lagging", "dead", "unresponsive", "error", "timeout", "incomplete")


@dataclass(frozen=True)
class RasFinding(EvidenceItem):
    """What two NCCL RAS queries say, one finding. ``what``: one of ``RAS_WHATS``; ``comm`` the communicator's
    hash and ``name`` how the report labels it; the other fields only where the finding has them."""

    KIND: ClassVar[str] = "nccl_ras"
    what: str
    comm: str | None
    ranks: Ranks
    pids: tuple[int, ...]
    name: str = ""
    host: str | None = None
    gpus: str | None = None  # a missing process's GPUs, as the report lists them
    pid: int | None = None  # a missing rank's process, where the report names it
    error: str = ""  # what a rank reported
    count: int = 0  # timeouts; a lagging group's collective count
    top: int = 0  # a lagging group's op: the highest count of the others
    op: str = ""
    n_ranks: int = 0  # a lagging group's size, where the report does not list its ranks
    frozen: bool = False  # the counts did not move since the previous query


# -- live stragglers (``core.straggler_live``) -------------------------------------------------------------


@dataclass(frozen=True)
class StragglerBefore(EvidenceItem):
    """A rank that was a live straggler when the job stalled (the diagnosis's own values; ``why`` and
    ``cause_text`` are the straggler diagnosis's sentences, ``core.straggler``/``core.straggler_cause``)."""

    KIND: ClassVar[str] = "straggler_before"
    rank: int
    label: str
    phase: str  # "all": rank-wide, its own work in every phase
    since_step: int  # -1: unknown
    since_unix: float
    ago_s: float  # from ``since_unix`` to the incident
    why: str
    cause_text: str = ""
