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
  the daemon's merged diagnosis (``serve.daemon``), run on this thread, never on the poll loop — and publishes
  what ``on_merge`` returns, the merged diagnosis as its own status shows it (``diagnosis_share``: label, ranks,
  phase, the straggler's excess, the cause with its text and next step, each named rank's node), under
  ``live/diagnosis``, with its node, start, sequence and issue time, sealed when a secret is set, at most
  ``live_diagnosis_bytes`` — again every share while it stands (none once no other node shares a rank);
* on a follower, reads ``live/diagnosis`` and checks it as the leader checks the nodes' values (its seal, at most
  ``live_diagnosis_bytes``, its schema and bounds by the store's validators, the leader's node, issued after
  ``Correlator.not_before``, never older than one already seen), every string cleaned where it enters
  (``parse_diagnosis``); ``job_diagnosis`` hands it to the daemon's state file and metrics, and so to ``status``,
  beside the follower's own node's diagnosis, until it has not changed for ``live_stale_s``. Nothing else reads
  it: no incident, live straggler, alert or kill comes of it.

Only step numbers, durations and each node's own clock readings of its own ranks cross nodes: every rank is
compared over its own window on its own node's clock (``merge_live``, as ``with_other_nodes`` does at the end).
Without a store secret anyone who reaches the store can write a node's value: a forged one can make the leader
name a wrong straggler in status and metrics (never an incident or a kill), as the end-of-run summary can; a forged
``live/diagnosis`` can make a follower show a wrong job diagnosis, marked unauthenticated (never more).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..core.host_signals import RankCounters
from ..core.policy import CorrelationPolicy
from ..core.schema import HISTORY_SCHEMA, LIVE_DIAGNOSIS_SCHEMA
from ..core.steps import StepTiming
from ..core.straggler import StragglerDiagnosis
from ..core.straggler_cause import CAUSES, cause_line, thin_samples
from ..core.text import NAME, clean
from .correlate import MAX_NODES, Correlator, history_doc, history_from_doc, window_samples
from .store import (
    MAX_STR,
    JobStore,
    Oversize,
    SideConnection,
    StoreError,
    ValueRejected,
    parse_json,
    v_float,
    v_int,
    v_str,
)

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


@dataclass(frozen=True)
class _HeldDiagnosis:
    """The leader's newest valid job-wide diagnosis on a follower."""

    raw: bytes
    order: tuple[float, int]
    diagnosis: JobDiagnosis
    changed_at: float  # this follower's monotonic time when it last saw the value change


# the daemon's merge on the leader: returns the merged diagnosis's share (``diagnosis_share``) for the followers, or
# None when there is none to publish
MergeFn = Callable[[Offer, RemoteRanks], "Mapping[str, Any] | None"]
DIAGNOSIS_KEY = "live/diagnosis"  # the leader's job-wide live diagnosis, beside the nodes' ``live/<k>``


def diagnosis_share(diag: StragglerDiagnosis, nodes: Mapping[int, str], node: str, ranks: int) -> dict[str, Any]:
    """The leader's merged diagnosis as it publishes it for the followers: what its own status shows (label, ranks,
    phase, the straggler's excess, the cause with its text and next step) and the node each named rank runs on
    (``nodes``: the other nodes' ranks; the rest are the leader's own, on ``node``). Every line cut to the store's
    string bound, at most ``ranks`` ranks named: the value stays within ``live_diagnosis_bytes``."""
    cause = diag.cause or {}
    named = isinstance(cause.get("cause"), str) and isinstance(cause.get("rank"), int)
    who = list(diag.straggler_ranks[:ranks])
    where = {str(r): clean(nodes.get(r, node), NAME) for r in [*who, *([cause["rank"]] if named else [])]}
    return {
        "label": clean(diag.label, NAME), "straggler_ranks": who, "phase": diag.phase and clean(diag.phase, NAME),
        "why": clean(diag.why, MAX_STR), "steps": diag.steps, "excess_ms": round(diag.excess_ms, 3),
        "time_lost_ms": round(diag.time_lost_ms, 3),
        "cause": {"cause": clean(cause["cause"], NAME), "rank": cause["rank"],
                  "text": clean(cause.get("text") or "", MAX_STR), "next": clean(cause.get("next") or "", MAX_STR)}
        if named else None,
        "nodes": where,
    }


@dataclass(frozen=True)
class JobDiagnosis:
    """The leader's job-wide live diagnosis as a follower holds it: read from the store, every field re-typed and
    every string cleaned (it is another node's text). Shown beside the follower's own node's diagnosis in its
    status, state file and metrics, and nowhere else: it opens no incident, names no live straggler, sends no
    alert and kills nothing, so a forged one (no store secret) can at most change what those show."""

    label: str
    straggler_ranks: tuple[int, ...]
    phase: str | None
    why: str
    steps: int
    excess_ms: float
    time_lost_ms: float
    cause: str | None
    cause_rank: int | None
    cause_text: str  # ``cause_line``: "cause: … — …; next: …"
    nodes: Mapping[int, str]  # each named rank's node
    leader: str  # the leader node's name
    authenticated: bool  # sealed with the store secret (False: anyone who reaches the store could have written it)

    def doc(self) -> dict[str, Any]:
        """As the state file carries it (``serve.state.job_diagnosis_ref`` reads it back)."""
        return {"label": self.label, "straggler_ranks": list(self.straggler_ranks), "phase": self.phase,
                "why": self.why, "steps": self.steps, "excess_ms": self.excess_ms, "time_lost_ms": self.time_lost_ms,
                "cause": self.cause, "cause_rank": self.cause_rank, "cause_text": self.cause_text,
                "nodes": {str(r): n for r, n in sorted(self.nodes.items())}, "from": "leader",
                "leader": self.leader, "authenticated": self.authenticated}


def parse_diagnosis(doc: object, leader: str, authenticated: bool, ranks: int) -> JobDiagnosis:
    """``diagnosis_share``'s document read back on a follower: typed by the store's validators (ValueRejected
    otherwise), every string through ``clean``, at most ``ranks`` ranks."""
    if not isinstance(doc, Mapping):
        raise ValueRejected("diagnosis: expected an object")
    who = doc.get("straggler_ranks")
    if not isinstance(who, list) or len(who) > ranks:
        raise ValueRejected(f"straggler_ranks: expected a list of at most {ranks} ranks")
    straggler_ranks = tuple(v_int(r, "straggler_ranks", lo=0, hi=2**31 - 1) or 0 for r in who)
    cause_doc = doc.get("cause")
    cause = cause_rank = None
    text = ""
    if cause_doc is not None:
        if not isinstance(cause_doc, Mapping):
            raise ValueRejected("cause: expected an object or null")
        cause = v_str(cause_doc.get("cause"), "cause.cause")
        if cause not in CAUSES:
            raise ValueRejected(f"cause.cause: not a cause ({clean(cause, 64)!r})")
        cause_rank = v_int(cause_doc.get("rank"), "cause.rank", lo=0, hi=2**31 - 1)
        text = cause_line({"cause": cause, "text": clean(v_str(cause_doc.get("text"), "cause.text"), MAX_STR),
                           "next": clean(v_str(cause_doc.get("next"), "cause.next"), MAX_STR)})
    nodes = doc.get("nodes")
    if not isinstance(nodes, Mapping) or len(nodes) > ranks + 1:
        raise ValueRejected(f"nodes: expected an object of at most {ranks + 1} ranks")
    where: dict[int, str] = {}
    for r, n in nodes.items():
        if not isinstance(r, str) or not r.isdigit() or len(r) > 10:
            raise ValueRejected("nodes: expected rank keys")
        where[int(r)] = clean(v_str(n, "nodes"), NAME)
    phase = v_str(doc.get("phase"), "phase", optional=True)
    return JobDiagnosis(
        label=clean(v_str(doc.get("label"), "label"), NAME),
        straggler_ranks=straggler_ranks,
        phase=clean(phase, NAME) if phase else None,
        why=clean(v_str(doc.get("why"), "why"), MAX_STR),
        steps=v_int(doc.get("steps"), "steps", lo=0) or 0,
        excess_ms=v_float(doc.get("excess_ms"), "excess_ms") or 0.0,
        time_lost_ms=v_float(doc.get("time_lost_ms"), "time_lost_ms") or 0.0,
        cause=clean(cause, NAME) if cause else None,
        cause_rank=cause_rank,
        cause_text=clean(text, 3 * MAX_STR),
        nodes=where,
        leader=leader,
        authenticated=authenticated,
    )


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
        # a follower's copy of the leader's job-wide diagnosis (replaced wholesale: read by the poll loop and scrapes)
        self._diagnosis: _HeldDiagnosis | None = None
        self._diagnosis_order: tuple[float, int] = (0.0, 0)  # the newest taken: never forgotten
        self._diagnosis_bad: bytes | None = None  # the value last refused: not parsed (nor logged) again
        self._diagnosis_seq = 0
        self._share: Mapping[str, Any] | None = None  # on the leader, the last merge's share for the followers
        self.diagnosis_bytes = 0  # the size of the leader's newest published diagnosis
        self._too_large = False  # the leader's diagnosis was over what followers accept at its last try
        self.looks = 0  # completed looks (tests wait on it, as on the daemon's polls)
        self.published_bytes = 0  # the size of this node's newest value
        self._thread = threading.Thread(target=self._run, name=f"rankwatch-live-{correlator.job_id[:16]}",
                                        daemon=True)
        self._thread.start()

    def offer(self, offer: Offer) -> None:
        """The poll loop's newest lists: kept by reference (one assignment), published at the next share."""
        self._offer = offer

    def job_diagnosis(self) -> JobDiagnosis | None:
        """On a follower, the leader's job-wide live diagnosis while it keeps changing (None: none read yet, or
        unchanged for ``live_stale_s``: the leader's watchdog or its share stopped)."""
        held = self._diagnosis
        if held is None or time.monotonic() - held.changed_at > self.policy.live_stale_s:
            return None
        return held.diagnosis

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
        if conn is None or (offer is None and self.corr.leader):
            return
        store, side = conn
        try:
            if offer is not None and offer is not self._published:
                self._publish(side, offer)
            if not self.corr.leader:
                self._read_diagnosis(store, side)
                self._error = None
                return
            self._read(store, side)
        except StoreError as exc:
            self._failed(exc)
            return
        self._error = None
        assert offer is not None
        fresh = self._fresh()
        ident = tuple((k, h.order) for k, h in fresh.items())
        if self.on_merge is not None and (offer is not self._merged_offer or ident != self._merged_ident):
            self._merged_offer, self._merged_ident = offer, ident
            self._share = self.on_merge(offer, self._remote(offer, fresh))
        # nothing new on either side: the daemon's merged diagnosis stands, and is published again (a new sequence
        # and issue time), so the followers show it while this watchdog lives, also while the job makes no step
        if self._share is not None:
            try:
                self._publish_diagnosis(side, offer, self._share)
            except StoreError as exc:
                self._failed(exc)

    def _publish_diagnosis(self, side: SideConnection, offer: Offer, share: Mapping[str, Any]) -> None:
        """The merged diagnosis for the followers (``DIAGNOSIS_KEY``), as the node values are: the leader's node,
        this daemon's start, a sequence and its issue time, sealed with the store secret when one is set; never
        over ``live_diagnosis_bytes`` (the followers would refuse it)."""
        self._diagnosis_seq += 1
        doc = {"schema": LIVE_DIAGNOSIS_SCHEMA, "node_rank": self.corr.node_rank, "node": offer.node[:255],
               "boot": round(self.corr.started_unix, 3), "seq": self._diagnosis_seq, "issued": round(time.time(), 3),
               "diagnosis": dict(share)}
        try:
            self.diagnosis_bytes = side.set_json(DIAGNOSIS_KEY, doc, limit=self.policy.live_diagnosis_bytes)
        except Oversize as exc:  # not the store's failure: the connection stays
            if not self._too_large:  # once while it lasts (``_error`` is cleared by every round's reads)
                log.warning("live_diagnosis_too_large", job=self.corr.job_id, bytes=exc.size, limit=exc.limit)
            self._too_large = True
            self._error = "diagnosis too large"
            return
        self._too_large = False

    def _read_diagnosis(self, store: JobStore, side: SideConnection) -> None:
        """On a follower: the leader's newest diagnosis into ``_diagnosis``, checked as the leader checks the
        nodes' values (its seal, its schema and bounds, the leader's node, fresh, no replay); a value that stopped
        changing ages out in ``job_diagnosis``."""
        raw = side.get_raw(DIAGNOSIS_KEY)
        held = self._diagnosis
        if raw is None or (held is not None and raw == held.raw) or raw == self._diagnosis_bad:
            return  # none yet, unchanged (it ages), or refused before (logged then)
        try:
            order, diagnosis = self._parse_diagnosis(store, raw)
        except ValueRejected as exc:
            self._diagnosis_bad = raw
            self.corr._reject(DIAGNOSIS_KEY, exc)
            return
        self._diagnosis_order = order
        self._diagnosis = _HeldDiagnosis(raw, order, diagnosis, time.monotonic())

    def _parse_diagnosis(self, store: JobStore, raw: bytes) -> tuple[tuple[float, int], JobDiagnosis]:
        p = self.policy
        if len(raw) > p.live_diagnosis_bytes:
            raise ValueRejected(f"live diagnosis of {len(raw)} bytes exceeds {p.live_diagnosis_bytes}")
        doc = parse_json(store.unseal(DIAGNOSIS_KEY, raw), LIVE_DIAGNOSIS_SCHEMA)
        if v_int(doc.get("node_rank"), "node_rank", lo=0, hi=10**6) != 0:
            raise ValueRejected(f"live diagnosis of node {doc.get('node_rank')!r}: only the leader (node 0) has one")
        issued = v_float(doc.get("issued"), "issued") or 0.0
        if issued < self.corr.not_before():
            raise ValueRejected("live diagnosis issued before this job generation or this daemon started (replayed)")
        order = (v_float(doc.get("boot"), "boot") or 0.0, v_int(doc.get("seq"), "seq", lo=0) or 0)
        if order < self._diagnosis_order:
            raise ValueRejected("live diagnosis older than one already seen (replayed)")
        leader = clean(v_str(doc.get("node"), "node") or "", NAME) or "node 0"
        return order, parse_diagnosis(doc.get("diagnosis"), leader, store.secret is not None,
                                      p.live_diagnosis_ranks)

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


__all__ = ["DIAGNOSIS_KEY", "JobDiagnosis", "LiveShare", "Offer", "RemoteRanks", "diagnosis_share", "merge_live",
           "parse_diagnosis"]
