"""Live stragglers across nodes: while the job runs, every node shares its ranks' recent steps and host-signal
samples, and the leader's live straggler diagnosis compares every rank of the job, not only its own node's.

A node's watchdog alone cannot tell that its ranks are the slow ones: a capped link or a slower host slows every
rank of the node alike, and only another node's ranks show the difference. The end-of-run summary has always
merged the nodes' histories (``Correlator.publish_history``); this is the same exchange, made periodic, so that
``rankwatch status``, ``/metrics`` and the state file on the leader name a straggler on another node, with its
cause, during the run.

Each node's ``LiveShare`` thread, every ``CorrelationPolicy.live_share_every_s``:

* publishes what the poll loop last offered (``offer``: the step lists and samples it built for its own live
  diagnosis, handed over by reference: the poll loop copies, thins, encodes and sends nothing for this) under
  ``live/<k>``: a ``rankwatch.history/1`` document bounded to ``live_steps_shared`` steps and
  ``live_samples_per_rank``/``live_samples_per_node`` samples, with the node's name, this daemon's start, a
  sequence and its issue time, sealed with the store secret when one is set; on a store connection of its own
  (``JobStore.side``), so its bulk values never queue beside the poll loop's snapshot writes;
* on the leader, reads the other nodes' values, in node order, at most ``live_read_budget_bytes`` and
  ``live_ranks_merged`` ranks per look. Each is checked as the end-of-run history is (its seal, its schema and
  bounds, ``parse_history_full``; its ``node_rank`` is its key's) and must be fresh: issued after this job
  generation and this daemon started (``Correlator.not_before``), never older than one already seen of its node
  (a replay). A rank the leader watches itself, or one an earlier node already shared, is not taken from
  another node. A node whose value has not changed for ``live_stale_s`` is left out (its watchdog or its
  part of the job ended). The leader then hands this node's offer and the other nodes' ranks to ``on_merge`` —
  the daemon's merged diagnosis (``serve.daemon``), run on this thread, never on the poll loop.

Only step numbers, durations and each node's own clock readings of its own ranks cross nodes: every rank is
compared over its own window on its own node's clock (``merge_live``, as ``with_other_nodes`` does at the end).
Without a store secret anyone who reaches the store can write a node's value: a forged one can make the leader
name a wrong straggler in status and metrics (never an incident or a kill), as the end-of-run summary can.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from ..core.host_signals import RankCounters
from ..core.policy import CorrelationPolicy
from ..core.schema import HISTORY_SCHEMA
from ..core.steps import StepTiming
from ..core.straggler_cause import thin_samples
from ..core.text import NAME, clean
from .correlate import MAX_NODES, Correlator, history_doc, history_from_doc, window_samples
from .store import JobStore, SideConnection, StoreError, ValueRejected, parse_json, v_float, v_int, v_str

log = structlog.get_logger("rankwatch.live_share")

Samples = Sequence[tuple[int, Mapping[int, RankCounters]]]
Rows = dict[int, list[tuple[int, RankCounters]]]  # rank -> its (t, counters) on its node's clock


@dataclass(frozen=True)
class Offer:
    """What the poll loop hands over after its own live look: lists it built anyway, never mutated afterwards."""

    steps: Mapping[int, Sequence[StepTiming]]  # this node's ranks' recent steps
    samples: Samples  # this node's host-signal samples, oldest first
    node: str  # this node's name
    world_size: int = 0  # ranks of the job (0: not known): a rank another node shares beyond it is not taken
    # on the leader, its ranks' whole rings (``steps`` otherwise): another node's steps arrive a share or two late,
    # hundreds of steps back for a fast job, and are compared with the leader's own steps of the same numbers
    history: Mapping[int, Sequence[StepTiming]] | None = None


@dataclass(frozen=True)
class RemoteRanks:
    """The other nodes' ranks as the leader holds them after one look: each rank's steps and samples on its own
    node's clock, and where it runs."""

    steps: Mapping[int, Sequence[StepTiming]] = field(default_factory=dict)
    signals: Mapping[int, Sequence[tuple[int, RankCounters]]] = field(default_factory=dict)
    nodes: Mapping[int, str] = field(default_factory=dict)  # rank -> its node's name
    node_ranks: Mapping[int, int] = field(default_factory=dict)  # rank -> its node's rank


@dataclass(frozen=True)
class _Held:
    """One node's newest valid live value on the leader."""

    raw: bytes
    order: tuple[float, int]  # (its daemon's start, its sequence): a value older than one seen is a replay
    node: str
    steps: dict[int, list[StepTiming]]
    signals: Rows
    changed_at: float  # the leader's monotonic time when it last saw the value change


MergeFn = Callable[[Offer, RemoteRanks], None]


def merge_live(
    local_steps: Mapping[int, Sequence[StepTiming]], local_samples: Samples, remote: RemoteRanks, keep: int, cap: int
) -> tuple[dict[int, Sequence[StepTiming]], list[tuple[int, Mapping[int, RankCounters]]]]:
    """The leader's live diagnosis's input: its own ranks' steps beside the other nodes' (a rank it watches itself
    is never taken from another node), and the samples ``straggler_cause.explain`` reads. Each rank is only ever
    read over its own window, on its own node's clock: the leader's own samples are thinned over the same last
    ``keep`` steps to ``cap`` per rank, as the other nodes' were, so every rank's sampling intervals are alike;
    one entry per node and sample time (the ranks of one node share their polls), each node's in time order.
    ``local_samples`` unchanged when no other node shared any sample."""
    steps: dict[int, Sequence[StepTiming]] = dict(local_steps)
    for r, s in remote.steps.items():
        if r not in steps and s:
            steps[r] = s
    theirs = {r: rows for r, rows in remote.signals.items() if r not in local_steps and r in steps}
    if not theirs:
        return steps, list(local_samples)
    # the steps the other nodes' ranks cover: the leader's own are thinned over those (the compared ones)
    lo = min(s[0].step for r, s in steps.items() if r in theirs)
    hi = max(s[-1].step for r, s in steps.items() if r in theirs)
    by_node: dict[int, dict[int, dict[int, RankCounters]]] = {}  # node (-1: this one) -> t -> rank -> counters
    for r, s in local_steps.items():
        compared = [t for t in s if lo <= t.step <= hi][-keep:]
        for t, c in window_samples(local_samples, r, compared, cap):
            by_node.setdefault(-1, {}).setdefault(t, {})[r] = c
    for r, rows in theirs.items():
        k = remote.node_ranks.get(r, -2)
        for t, c in rows:
            by_node.setdefault(k, {}).setdefault(t, {})[r] = c
    samples: list[tuple[int, Mapping[int, RankCounters]]] = []
    for k in sorted(by_node):
        samples.extend(sorted(by_node[k].items()))
    return steps, samples


class LiveShare:
    """One job's live exchange on this node (see the module): ``offer`` from the poll loop, the rest on its thread."""

    def __init__(self, correlator: Correlator, on_merge: MergeFn | None = None) -> None:
        self.corr = correlator
        self.policy: CorrelationPolicy = correlator.policy
        self.on_merge = on_merge
        self._offer: Offer | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._side: tuple[JobStore, SideConnection] | None = None
        self._seq = 0
        self._published: Offer | None = None
        self._merged_offer: Offer | None = None  # what the last merge was over (the offer by identity)
        self._merged_ident: tuple[tuple[int, tuple[float, int]], ...] = ()
        self._held: dict[int, _Held] = {}
        self._order: dict[int, tuple[float, int]] = {}  # the newest (boot, seq) taken per node: never forgotten
        self._bad: dict[int, bytes] = {}  # the value last refused per node: not parsed (nor logged) again
        self._stale: set[int] = set()
        self._error: str | None = None
        self.looks = 0  # completed looks (tests wait on it, as on the daemon's polls)
        self.published_bytes = 0  # the size of this node's newest value
        self._thread = threading.Thread(target=self._run, name=f"rankwatch-live-{correlator.job_id[:16]}",
                                        daemon=True)
        self._thread.start()

    def offer(self, offer: Offer) -> None:
        """The poll loop's newest lists: kept by reference (one assignment), published at the next share."""
        self._offer = offer

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        side, self._side = self._side, None
        if side is not None:
            side[1].close()

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        every = self.policy.live_share_every_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._once()
            except Exception:  # a live share is a nicety: it never ends the watchdog, nor this thread
                log.exception("live_share_failed", job=self.corr.job_id)
            self.looks += 1
            self._stop.wait(max(0.05, every - (time.monotonic() - started)))

    def _connection(self) -> tuple[JobStore, SideConnection] | None:
        store = self.corr.store
        if store is None:
            return None
        if self._side is not None and self._side[0] is store:
            return self._side
        if self._side is not None:  # the correlator reconnected: the old store's connection goes with it
            self._side[1].close()
            self._side = None
        try:
            self._side = (store, store.side())
        except StoreError as exc:
            self._failed(exc)
            return None
        return self._side

    def _failed(self, exc: StoreError) -> None:
        if self._error != str(exc):
            log.warning("live_share_store_failed", job=self.corr.job_id, error=str(exc))
        self._error = str(exc)
        side, self._side = self._side, None
        if side is not None:
            side[1].close()

    def _once(self) -> None:
        offer = self._offer
        conn = self._connection()
        if conn is None or offer is None:
            return
        store, side = conn
        try:
            if offer is not self._published:
                self._publish(side, offer)
            if not self.corr.leader:
                return
            self._read(store, side)
        except StoreError as exc:
            self._failed(exc)
            return
        self._error = None
        fresh = self._fresh()
        ident = tuple((k, h.order) for k, h in fresh.items())
        if self.on_merge is None or (offer is self._merged_offer and ident == self._merged_ident):
            return  # nothing new on either side: the daemon's merged diagnosis stands
        self._merged_offer, self._merged_ident = offer, ident
        self.on_merge(offer, self._remote(offer, fresh))

    def _publish(self, side: SideConnection, offer: Offer) -> None:
        p = self.policy
        self._seq += 1
        extra = {"node": offer.node[:255], "boot": round(self.corr.started_unix, 3), "seq": self._seq,
                 "issued": round(time.time(), 3)}
        doc = history_doc(self.corr.node_rank, offer.steps, offer.samples, p.live_steps_shared,
                          p.live_samples_per_rank, p.live_samples_per_node, extra)
        self.published_bytes = side.set_json(f"live/{self.corr.node_rank}", doc)
        self._published = offer

    def _read(self, store: JobStore, side: SideConnection) -> None:
        """Every other node's newest value into ``_held`` (within this look's budgets)."""
        p = self.policy
        nnodes = min(self.corr.nnodes or 0, MAX_NODES)
        left, ranks_left = p.live_read_budget_bytes, p.live_ranks_merged
        now = time.monotonic()
        for k in range(nnodes):
            if k == self.corr.node_rank:
                continue
            if left <= 0 or ranks_left <= 0:  # the nodes after it wait for the end-of-run summary
                self._held.pop(k, None)
                continue
            key = f"live/{k}"
            raw = side.get_raw(key)
            if raw is None:
                continue
            left -= len(raw)
            held = self._held.get(k)
            if held is not None and raw == held.raw:
                ranks_left -= len(held.steps)
                continue
            if raw == self._bad.get(k):
                continue  # refused before, logged then
            try:
                order, node, steps, signals = self._parse(store, k, key, raw)
            except ValueRejected as exc:
                self._bad[k] = raw
                self.corr._reject(key, exc)
                continue
            self._order[k] = order
            self._held[k] = _Held(raw, order, node, steps, signals, now)
            ranks_left -= len(steps)

    def _fresh(self) -> dict[int, _Held]:
        """The held nodes whose value changed within ``live_stale_s`` (one that stopped is logged once)."""
        now, stale_s = time.monotonic(), self.policy.live_stale_s
        fresh = {}
        for k, held in sorted(self._held.items()):
            if now - held.changed_at <= stale_s:
                fresh[k] = held
                self._stale.discard(k)
            elif k not in self._stale:
                self._stale.add(k)
                log.info("live_share_node_stale", job=self.corr.job_id, node=k, stale_s=stale_s)
        return fresh

    def _parse(self, store: JobStore, k: int, key: str, raw: bytes
               ) -> tuple[tuple[float, int], str, dict[int, list[StepTiming]], Rows]:
        doc = parse_json(store.unseal(key, raw), HISTORY_SCHEMA)
        if v_int(doc.get("node_rank"), "node_rank", lo=0, hi=10**6) != k:
            raise ValueRejected(f"live history of node {doc.get('node_rank')!r} under node {k}'s key")
        issued = v_float(doc.get("issued"), "issued") or 0.0
        if issued < self.corr.not_before():
            raise ValueRejected("live history issued before this job generation or this daemon started (replayed)")
        order = (v_float(doc.get("boot"), "boot") or 0.0, v_int(doc.get("seq"), "seq", lo=0) or 0)
        if order < self._order.get(k, (0.0, 0)):
            raise ValueRejected("live history older than one already seen (replayed)")
        node = clean(v_str(doc.get("node"), "node") or "", NAME)
        steps, signals = history_from_doc(doc)
        return order, node, steps, signals

    def _remote(self, offer: Offer, fresh: Mapping[int, _Held]) -> RemoteRanks:
        """The held nodes' ranks, nodes in order: none this node watches, none an earlier node shared, none beyond
        the job's ranks, at most ``live_ranks_merged``; each trimmed to the live bounds (a node may share more)."""
        p = self.policy
        steps: dict[int, list[StepTiming]] = {}
        signals: dict[int, list[tuple[int, RankCounters]]] = {}
        nodes: dict[int, str] = {}
        node_ranks: dict[int, int] = {}
        for k, held in sorted(fresh.items()):
            for r, s in sorted(held.steps.items()):
                if r in offer.steps or r in steps or (offer.world_size and r >= offer.world_size) or not s:
                    continue
                if len(steps) >= p.live_ranks_merged:
                    break
                steps[r] = s[-p.live_steps_shared:]
                rows = held.signals.get(r)
                if rows:
                    signals[r] = [(t, by[r]) for t, by in
                                  thin_samples([(t, {r: c}) for t, c in rows], p.live_samples_per_rank)]
                nodes[r], node_ranks[r] = held.node or f"node {k}", k
        return RemoteRanks(steps, signals, nodes, node_ranks)


__all__ = ["LiveShare", "Offer", "RemoteRanks", "merge_live"]
