"""``rankwatch inspect --store``: one verdict for every node of a job that was never wrapped.

Each node's ``inspect`` publishes its evidence (views and flight-recorder share, the daemon's node
document, ``cluster.store``) under ``rankwatch/<job-id>/inspect/``. The node that runs the job's node 0
hosts the TCPStore for the exchange and decides over every node's evidence once all have answered (or the
deadline passed: the silent nodes' ranks are then ``missing``, itself evidence), publishes the verdict, and
keeps the store up until every node has read it. Every node prints that one verdict. Store values are
untrusted: bounded, schema-checked, and with ``--store-secret-file`` sealed and verified (``cluster.auth``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from ..core.document import DocumentError, VerdictDocument
from ..core.fr_trace import RankTrace
from ..core.schema import VERDICT_SCHEMA
from ..core.snapshot import MISSING, RankView
from .store import JobStore, StoreError, ValueRejected, fr_share, node_doc, parse_evidence_doc, parse_json

log = structlog.get_logger("rankwatch.inspect")

POLL_S = 0.1  # how often a waiting node looks for the others' keys (a local TCPStore round trip is ~0.1 ms)
FR_SHARE_BYTES = 2 << 20  # this node's flight-recorder share in its evidence document
FR_PER_PG = 64  # newest entries per process group in that share

Decide = Callable[[Sequence[RankView], Mapping[int, RankTrace], Sequence[str]], VerdictDocument]


@dataclass(frozen=True)
class Shared:
    verdict: VerdictDocument
    how: str  # how the nodes agreed, for the verdict's "correlation"


def _wait(store: JobStore, keys: Sequence[str], deadline: float) -> list[str]:
    """The keys present by the deadline (all of them as soon as they are)."""
    while True:
        have = [k for k in keys if store.get_raw(k) is not None]
        if len(have) == len(keys) or time.monotonic() >= deadline:
            return have
        time.sleep(POLL_S)


def _missing_views(world_size: int, have: Sequence[RankView], nnodes: int) -> list[RankView]:
    """A view per rank no node reported: its node never answered."""
    known = {v.rank for v in have}
    per_node = max(1, world_size // max(1, nnodes))
    return [
        RankView(rank=r, node=f"node {r // per_node}", pid=-1, state=MISSING, step=0, phase=None, in_phase_s=0.0,
                 since_progress_s=0.0, node_rank=r // per_node)
        for r in range(world_size)
        if r not in known
    ]


def parse_verdict(raw: bytes) -> VerdictDocument:
    """Node 0's verdict, read as one that is acted on (the one verdict spec, ``core.document``)."""
    try:
        return VerdictDocument.from_json(parse_json(raw, VERDICT_SCHEMA), acted_on=True)
    except DocumentError as exc:
        raise ValueRejected("; ".join(exc.problems[:3])) from None


def exchange(
    store: JobStore,
    *,
    node_rank: int,
    nnodes: int,
    world_size: int,
    node: str,
    views: Sequence[RankView],
    fr_traces: Mapping[int, RankTrace],
    decide: Decide,
    timeout_s: float,
) -> Shared:
    """Publish this node's evidence, then decide (node 0) or read node 0's verdict (the others)."""
    deadline = time.monotonic() + timeout_s
    share = fr_share(fr_traces, FR_PER_PG, FR_SHARE_BYTES)
    store.set_json(f"inspect/node-{node_rank}", node_doc(node_rank, node, 0, list(views), "evidence", share))
    if node_rank != 0:
        if not _wait(store, ["inspect/verdict"], deadline):
            raise StoreError(f"node 0 published no verdict within {timeout_s:.0f}s")
        raw = store.get_raw("inspect/verdict") or b""
        try:
            verdict = parse_verdict(store.unseal("inspect/verdict", raw))
        except ValueRejected as exc:
            raise StoreError(f"node 0's verdict rejected: {exc}") from None
        store.add("inspect/read", 1)
        return Shared(verdict, verdict.correlation or "decided by node 0")
    keys = [f"inspect/node-{n}" for n in range(nnodes)]
    have = set(_wait(store, keys, deadline))
    all_views: dict[int, RankView] = {v.rank: v for v in views}
    remote_fr: dict[int, RankTrace] = {}
    notes: list[str] = []
    for n in range(1, nnodes):
        key = f"inspect/node-{n}"
        if key not in have:
            notes.append(f"node {n} sent no evidence within {timeout_s:.0f}s")
            continue
        try:
            ev = parse_evidence_doc(store.unseal(key, store.get_raw(key) or b""))
        except ValueRejected as exc:
            notes.append(f"node {n}'s evidence rejected: {exc}")
            continue
        notes += ev.notes
        for v in ev.views:
            all_views.setdefault(v.rank, v)  # a node never speaks for a rank this node reports itself
        remote_fr.update({r: t for r, t in ev.fr.items() if r not in fr_traces})
    merged = sorted(all_views.values(), key=lambda v: v.rank)
    merged += _missing_views(world_size, merged, nnodes)
    answered = len(have)  # node 0's own key is among them
    how = f"decided by node 0 over {answered} of {nnodes} node(s)"
    verdict = replace(decide(merged, remote_fr, notes), correlation=how)
    store.set_json("inspect/verdict", verdict.to_json())
    # the store lives in this process: keep it up until every other node has read the verdict
    while time.monotonic() < deadline + 5.0:
        if store.add("inspect/read", 0) >= answered - 1:
            break
        time.sleep(POLL_S)
    return Shared(verdict, how)
