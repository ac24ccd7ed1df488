"""Cross-node correlation: every node's daemon agrees on one verdict for a multi-node job.

Protocol under ``rankwatch/<job-id>/`` in a TCPStore hosted by the leader (the node of global rank 0):

* ``node/<k>``            each poll, node k's compact snapshot of its ranks (O(nodes) traffic per poll);
* ``incident/<gen>``      claimed with compare-and-set by the first node to detect incident ``gen``;
* ``incident/current``    a pointer to the newest claim, the one key every node polls;
* ``evidence/<gen>/<k>``  node k's captured evidence for that incident: rank views with stacks, and its
                          ranks' newest flight-recorder entries, so the leader compares every rank's
                          recorder and not only its own node's;
* ``verdict/<gen>``       the leader's verdict over all nodes' evidence, copied into every bundle.

Only durations, step counts and collective sequence numbers cross nodes, never clock readings. A node
that cannot reach the store, or gets no verdict from the leader, decides over what it has and says so
in the verdict's ``correlation`` field; a node that sends no evidence and shows no sign of life is named as
missing, while a node whose evidence was tampered with (rejected, deleted) is never: tampering is evidence
about the store, not about ranks (``_gather``), and every node keeps the verdict over its own ranks.

Trust: with a store secret every value is sealed with an HMAC bound to its key and job (``cluster.auth``)
and an unsealed or forged one is rejected like a malformed one. Without a secret anyone who reaches the
store can write, so another node's claim is captured for only when this node's own ranks show a stall
(``screen_unauthenticated``), never leads to a kill here (``IncidentRequest.trusted``), and the leader's
verdict is refused when it names a local rank that this node sees making progress.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..core.detect import progressing_here
from ..core.document import DocumentError, VerdictDocument
from ..core.evidence_items import (
    DELETED_AFTER_SEEN,
    EVIDENCE_UNPUBLISHED,
    HELD_AS,
    HELD_MISSING,
    KEY_EMPTY_NODE_ALIVE,
    LEADER_REJECTED,
    LEADER_SILENT,
    OVER_READ_BUDGET,
    REFUSED_UNAUTHENTICATED,
    REJECTED,
    STORE_UNREACHABLE,
    DecidedLocally,
    EvidenceItem,
    FrNote,
    NodeEvidence,
    NoEvidenceFrom,
    NotJudged,
    UnauthenticatedExchange,
)
from ..core.fr_trace import RankTrace
from ..core.host_signals import GpuState, NetCounters, RankCounters
from ..core.policy import CorrelationPolicy
from ..core.ranks import fmt_ranks
from ..core.schema import HISTORY_SCHEMA, INCIDENT_SCHEMA, VERDICT_SCHEMA
from ..core.snapshot import MISSING, RankView
from ..core.steps import StepTiming
from ..core.straggler_cause import thin_samples
from .store import (
    MAX_RANKS_PER_NODE,
    JobStore,
    Snapshot,
    StoreError,
    ValueRejected,
    Vanished,
    binding,
    check_binding,
    fr_share,
    node_doc,
    parse_evidence_doc,
    parse_json,
    parse_snapshot,
    v_float,
    v_int,
    v_str,
)

log = structlog.get_logger("rankwatch.correlate")

# what the leader holds of each node's evidence for one incident (the verdict's ``exchange.nodes``)
HEARD = "heard"  # a valid value: its ranks are judged on it
TAMPERED = "tampered"  # a value that failed authentication, its shape or its binding: evidence of tampering only
UNAVAILABLE = "unavailable"  # gone after it was seen, or its node alive but its key empty: deleted
SILENT = "silent"  # nothing, and no sign of the node since: the node (or its daemon) is down
MAX_NODES = 4096  # keys read per node and incident: a job.json claiming more nodes is read as this many


@dataclass(frozen=True)
class Resolution:
    """What the exchange left this node: the leader's verdict to adopt (``verdict``), or the evidence to decide
    over itself — as the leader (``publish``: hand the verdict to ``publish_verdict``) or alone."""

    how: str  # how the nodes agreed (or why this node decides alone)
    verdict: VerdictDocument | None = None
    views: Sequence[RankView] = ()
    notes: Sequence[EvidenceItem] = ()  # what the exchange adds to the evidence (``core.evidence_items``)
    remote_fr: Mapping[int, RankTrace] = field(default_factory=dict)
    publish: bool = False
    # the leader's verdict this node refused (it names a rank this node saw progressing) while this node sees a
    # stall of its own: the caller may still adopt it when its own verdict names the very same ranks — then it
    # blames no rank this node would not
    refused: VerdictDocument | None = None
    # how the exchange went, for the verdict (``exchange`` in verdict.json): authenticated or not, and what
    # the deciding node held of each node's evidence
    exchange: dict[str, Any] | None = None


@dataclass(frozen=True)
class SharedIncident:
    gen: int
    incident_id: str
    by_node: int
    trigger: dict[str, Any]
    issued: float = 0.0  # when the claim was made (sealed in it); 0 for a local-only incident


def validate_verdict(raw: bytes) -> tuple[VerdictDocument, object]:
    """The leader's verdict as read from the store (the one verdict spec, ``core.document``, read as acted
    on) and the binding it was published with (``bound``: the incident and time it belongs to)."""
    doc = parse_json(raw, VERDICT_SCHEMA)
    bound = doc.pop("bound", None)
    try:
        return VerdictDocument.from_json(doc, acted_on=True), bound
    except DocumentError as exc:
        raise ValueRejected("verdict: " + "; ".join(exc.problems[:3])) from None


class Correlator:
    def __init__(
        self,
        job_id: str,
        node_rank: int,
        host: str,
        port: int,
        *,
        nnodes: int | None = None,
        policy: CorrelationPolicy | None = None,
        secret: bytes | None = None,
        host_server: bool | None = None,
    ) -> None:
        self.job_id = job_id
        # whether this process hosts the store (None: the leader does, as `rankwatch run` on node 0); a root
        # daemon never does (``cluster.store_host`` runs its store in a process of its own)
        self.hosts = (node_rank == 0) if host_server is None else host_server
        self.secret = secret
        self.node_rank = node_rank
        self.leader = node_rank == 0
        self.host, self.port = host, port
        self.nnodes = nnodes
        self.policy = policy or CorrelationPolicy()
        self.store: JobStore | None = None
        self.error: str | None = "not connected yet"
        self.handled_gen = 0
        self._heard = 0
        self._seq = 0
        self._published = 0  # the newest incident generation this node published its evidence for
        self._snap_order: dict[int, tuple[float, int]] = {}  # newest (boot, seq) seen per node: no replays
        self._stop = threading.Event()
        self._rejected_logged: set[str] = set()
        # unauthenticated remote claims not (yet) confirmed by this node's ranks: (gen, id) → first seen
        self._unconfirmed: dict[tuple[int, str], float] = {}
        self._ignored: set[tuple[int, str]] = set()
        # wall-clock start of the job generation this node watches (set by the daemon from its ranks'
        # records): a claim issued before it belongs to an earlier run and is replayed, never acted on
        self.fresh_after_unix: float | None = None
        # this daemon's start: a value issued before it was left in the store by an earlier daemon
        self.started_unix = time.time()
        if secret is None:
            log.warning(
                "store_unauthenticated",
                job=job_id,
                store=f"{host}:{port}",
                detail="no --store-secret-file: anyone who reaches the store can write to it; other nodes' "
                "claims are checked against this node's ranks and never kill here",
            )
        self._connector = threading.Thread(target=self._connect_loop, name="rankwatch-store-connect", daemon=True)
        self._connector.start()

    # -- connection -------------------------------------------------------------------------------
    def _connect_loop(self) -> None:
        delay = 0.5
        while not self._stop.is_set() and self.store is None:
            try:
                store = JobStore(
                    self.host,
                    self.port,
                    self.job_id,
                    host_server=self.hosts,
                    timeout_s=self.policy.connect_timeout_s,
                    secret=self.secret,
                )
            except Exception as exc:  # StoreError; or torch's import failing under a concurrent one, at exit…
                if self._stop.is_set() or sys.is_finalizing():
                    return  # the run is over: nothing to report, and never a traceback on its stderr
                error = str(exc) if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
                if self.error != error:
                    log.warning("store_unreachable", job=self.job_id, error=error, retry_in_s=delay)
                self.error = error
                self._stop.wait(delay)
                delay = min(delay * 2, 10.0)
                continue
            try:
                store.prepare_waits()  # incidents then wake on store changes without holding up the polls
            except StoreError as exc:
                log.warning("store_wait_connection", job=self.job_id, error=str(exc))
            self.store = store
            self.error = None
            log.info(
                "store_connected",
                job=self.job_id,
                address=store.address,
                hosting=store.hosting,
                authenticated=self.authenticated,
            )

    @property
    def authenticated(self) -> bool:
        """Values are sealed and checked under a shared secret."""
        return self.secret is not None

    def _lost(self, exc: StoreError) -> None:
        log.warning("store_failed", job=self.job_id, error=str(exc))
        self.error = str(exc)
        if not self.hosts:  # a host keeps its server; a client reconnects in the background
            if self.store is not None:
                self.store.close()
            self.store = None
            if not self._connector.is_alive():
                self._connector = threading.Thread(target=self._connect_loop, daemon=True)
                self._connector.start()

    def _reject(self, key: str, exc: Exception) -> None:
        if key not in self._rejected_logged:
            self._rejected_logged.add(key)
            log.warning("store_value_rejected", job=self.job_id, key=key, error=str(exc))

    def close(self) -> None:
        self._stop.set()
        store, self.store = self.store, None
        if store is not None:
            store.close()

    # -- every poll -------------------------------------------------------------------------------
    def publish_snapshot(self, node: str, views: list[RankView]) -> None:
        store = self.store
        if store is None:
            return
        self._seq += 1
        # the per-node sequence (with this daemon's start) lets the leader tell a live node whose evidence was
        # deleted from a node that went down, and an old snapshot replayed from a fresh one
        extra = {"boot": round(self.started_unix, 3), "published": self._published}
        try:  # handed to the store's own thread: the poll loop never waits on the network
            store.set_json_nowait(f"node/{self.node_rank}",
                                  node_doc(self.node_rank, node, self._seq, views, extra=extra))
        except StoreError as exc:
            self._lost(exc)

    def _incident_from(self, store: JobStore, key: str, raw: bytes) -> SharedIncident | None:
        try:
            doc = parse_json(store.unseal(key, raw), INCIDENT_SCHEMA)
            trigger = doc.get("trigger")
            if not isinstance(trigger, dict):
                raise ValueRejected("trigger must be an object")
            issued = v_float(doc.get("issued"), "issued", optional=True)
            # sealed claims must say when they were made; an unsealed one proves nothing either way (anyone could
            # write any time) and goes through the local screening instead
            if (issued is not None and issued < self.not_before()) or (issued is None and self.authenticated):
                raise ValueRejected(
                    "claim issued before this job generation or this daemon started (a replay of an earlier "
                    "run's or daemon's claim)"
                )
            return SharedIncident(
                gen=v_int(doc.get("gen"), "gen", lo=1, hi=10**9) or 0,
                incident_id=_safe_id(v_str(doc.get("id"), "id") or ""),
                by_node=v_int(doc.get("by"), "by", lo=0, hi=10**6) or 0,
                trigger={k: v for k, v in trigger.items() if k in ("kind", "ranks", "reason", "detected_after_s")},
                issued=issued or 0.0,
            )
        except ValueRejected as exc:
            self._reject(key, exc)
            return None

    def not_before(self, inc: SharedIncident | None = None) -> float:
        """The oldest issue time a value may carry to count as fresh: not before this job generation started,
        this daemon started or (for an incident's evidence and verdict) the incident was claimed, less the
        clock skew allowed between nodes."""
        floor = max(self.started_unix, self.fresh_after_unix or 0.0, inc.issued if inc is not None else 0.0)
        return floor - self.policy.claim_skew_s

    def poll_incident(self) -> SharedIncident | None:
        """An incident another node opened that this node has not handled yet."""
        store = self.store
        if store is None:
            return None
        try:  # the newest answer the store's thread has (never a wait in the poll loop)
            raw = store.get_raw_nowait("incident/current")
        except StoreError as exc:
            self._lost(exc)
            return None
        if raw is None:
            return None
        inc = self._incident_from(store, "incident/current", raw)
        if inc is None or inc.gen <= self.handled_gen:
            return None
        return inc

    def screen_unauthenticated(
        self, inc: SharedIncident, local_signs: str | None, give_up_after_s: float
    ) -> SharedIncident | None:
        """Whether this node captures for a remote claim that no secret authenticates (with a secret: always).
        ``local_signs`` is what this node's own ranks show of a stall (``core.detect.local_stall_signs``);
        without any the claim waits (one log line) and is dropped after ``give_up_after_s`` — by then a
        real incident would have stalled the ranks here too."""
        if self.authenticated:
            return inc
        ident = (inc.gen, inc.incident_id)
        if ident in self._ignored:
            return None
        if local_signs is not None:
            self._unconfirmed.pop(ident, None)
            log.warning(
                "remote_claim_confirmed_locally",
                job=self.job_id,
                gen=inc.gen,
                incident=inc.incident_id,
                by_node=inc.by_node,
                seen_here=local_signs,
            )
            return inc
        now = time.monotonic()
        if ident not in self._unconfirmed:
            if len(self._unconfirmed) >= 64:  # bounded, whatever a writer floods the store with
                self._unconfirmed.clear()
            self._unconfirmed[ident] = now
            log.warning(
                "remote_claim_unconfirmed",
                job=self.job_id,
                gen=inc.gen,
                incident=inc.incident_id,
                by_node=inc.by_node,
                detail="unauthenticated claim while this node's ranks make progress: not captured unless they stall",
            )
        elif now - self._unconfirmed[ident] > give_up_after_s:
            del self._unconfirmed[ident]
            if len(self._ignored) >= 64:
                self._ignored.clear()
            self._ignored.add(ident)
            log.warning(
                "remote_claim_ignored",
                job=self.job_id,
                gen=inc.gen,
                incident=inc.incident_id,
                by_node=inc.by_node,
                waited_s=round(give_up_after_s, 1),
            )
        return None

    def claim(self, incident_id: str, trigger: dict[str, Any]) -> SharedIncident:
        """Open the next incident for every node, or join the one another node opened first."""
        local = SharedIncident(gen=0, incident_id=incident_id, by_node=self.node_rank, trigger=trigger)
        store = self.store
        if store is None:
            return local
        gen = self.handled_gen + 1
        doc = {
            "schema": INCIDENT_SCHEMA,
            "gen": gen,
            "id": incident_id,
            "by": self.node_rank,
            "trigger": trigger,
            # sealed with the rest: binds the claim to when it was made, so it cannot be replayed to a later run
            "issued": round(time.time(), 3),
        }
        try:
            key = f"incident/{gen}"
            raw = store.claim(key, doc)
            winner = self._incident_from(store, key, raw)
            if winner is None and self.authenticated:
                # a value no node signed squats the claim: replace exactly it, atomically, so that of several
                # nodes doing the same one wins and the others join it
                raw = store.claim(key, doc, replacing=raw)
                winner = self._incident_from(store, key, raw)
            winner = winner or dataclasses.replace(local, gen=gen)
            if winner.by_node == self.node_rank:
                store.set_json("incident/current", doc)
                log.info("incident_signalled", job=self.job_id, gen=gen, incident=incident_id)
            return winner
        except StoreError as exc:
            self._lost(exc)
            return local

    # -- end of run: the leader's summary covers every rank ------------------------------------------
    def publish_history(self, history: dict[int, list[StepTiming]],
                        signals: Sequence[tuple[int, Mapping[int, RankCounters]]] = ()) -> None:
        """This node's recent step rings (bounded), for the leader's end-of-run summary, with each rank's host
        signals over those steps (``signals``, this node's samples, thinned): the leader sets a rank's TCP path,
        GPU and pressure against its peers' on other nodes, which no node can do with its own ranks alone."""
        store = self.store
        if store is None:
            return
        policy = self.policy
        doc = history_doc(self.node_rank, history, signals, policy.history_steps_shared,
                          policy.history_samples_per_rank, policy.history_samples_per_node)
        try:
            store.set_json(f"history/{self.node_rank}", doc)
        except StoreError as exc:
            self._lost(exc)

    def gather_histories(
        self, wait_s: float, signals_out: dict[int, list[tuple[int, RankCounters]]] | None = None
    ) -> dict[int, list[StepTiming]]:
        """Other nodes' step rings, waiting up to ``wait_s`` for every node (leader only); their ranks' host
        signals into ``signals_out`` (per rank, on its own node's clock, as its steps' times are)."""
        store = self.store
        out: dict[int, list[StepTiming]] = {}
        if store is None or not self.nnodes:
            return out
        pending = {k for k in range(self.nnodes) if k != self.node_rank}
        deadline = time.monotonic() + wait_s
        while pending:
            keys = {k: f"history/{k}" for k in sorted(pending)}
            try:
                # woken by the store when the last node's ring arrives, not polled
                store.wait_for(list(keys.values()), deadline - time.monotonic())
                raws = {k: store.get_raw(key) for k, key in keys.items()}
            except StoreError as exc:
                self._lost(exc)
                return out
            for k, raw in raws.items():
                if raw is None:
                    continue
                pending.discard(k)
                try:
                    steps, sigs = parse_history_full(store.unseal(keys[k], raw))
                except ValueRejected as exc:
                    self._reject(keys[k], exc)
                    continue
                out.update(steps)
                if signals_out is not None:
                    signals_out.update({r: rows for r, rows in sigs.items() if r in steps})
            if time.monotonic() >= deadline:
                break
        if pending:
            log.warning("summary_missing_nodes", job=self.job_id, nodes=sorted(pending))
        return out

    # -- on an incident ---------------------------------------------------------------------------
    def resolve(
        self,
        inc: SharedIncident,
        local_views: list[RankView],
        node: str,
        world_size: int,
        *,
        stall_timeout_s: float | None = None,
        local_fr: Mapping[int, RankTrace] | None = None,
    ) -> Resolution:
        """Publishes this node's evidence (with its ranks' flight-recorder traces, ``local_fr``); the leader
        gets every node's evidence to decide over for all, a follower the leader's verdict as published (for
        the caller to finalize with this node's own ranks). Without a secret a leader's verdict that names as
        initiator a local rank progressing within ``stall_timeout_s`` is refused, and this node decides over
        its own ranks. The decision itself is the caller's: this layer only exchanges."""
        self.handled_gen = max(self.handled_gen, inc.gen)
        store = self.store
        if store is None or inc.gen == 0:
            why = f"local only: store unreachable ({self.error})"
            return Resolution(why, views=local_views, notes=[DecidedLocally(STORE_UNREACHABLE, error=str(self.error))])
        share = fr_share(local_fr or {}, self.policy.fr_shared_per_pg, self.policy.fr_shared_bytes)
        try:
            store.set_json(
                f"evidence/{inc.gen}/{self.node_rank}",
                node_doc(self.node_rank, node, 0, local_views, "evidence", flight_recorder=share,
                         bound=binding(inc.incident_id)),
            )
        except StoreError as exc:
            self._lost(exc)
            why = f"local only: could not publish evidence ({exc})"
            return Resolution(why, views=local_views, notes=[DecidedLocally(EVIDENCE_UNPUBLISHED, error=str(exc))])
        self._published = max(self._published, inc.gen)
        if self.leader:
            views, notes, remote_fr, nodes = self._gather(
                store, inc, local_views, world_size, self.policy.evidence_timeout_s
            )
            how = f"leader node {self.node_rank} over {self._heard} node(s)"
            return Resolution(how, views=views, notes=[*notes, *self._auth_note()], remote_fr=remote_fr,
                              publish=True, exchange=self._exchange(nodes))
        return self._follow(store, inc, local_views, world_size, stall_timeout_s)

    def _auth_note(self) -> list[EvidenceItem]:
        return [] if self.authenticated else [UnauthenticatedExchange()]

    def _exchange(self, nodes: Mapping[int, str]) -> dict[str, Any]:
        return {"authenticated": self.authenticated, "nodes": {str(k): v for k, v in sorted(nodes.items())}}

    def _follow(
        self,
        store: JobStore,
        inc: SharedIncident,
        local_views: list[RankView],
        world_size: int,
        stall_timeout_s: float | None,
    ) -> Resolution:
        """A follower waits for the leader's verdict; without a valid one in time it decides locally."""
        deadline = time.monotonic() + self.policy.verdict_timeout_s
        key = f"verdict/{inc.gen}"
        rejected = False  # a bad value may still be overwritten by the leader's: keep waiting for it
        while (left := deadline - time.monotonic()) > 0:
            try:
                # the store wakes every follower when the leader sets the key (no sleep-poll)
                raw = store.get_raw(key) if store.wait_for([key], left) else None
            except StoreError as exc:
                self._lost(exc)
                break
            if raw is None:
                continue
            try:
                verdict, bound = validate_verdict(store.unseal(key, raw))
                check_binding(bound, inc.incident_id, self.not_before(inc))
            except ValueRejected as exc:
                self._reject(key, exc)
                rejected = True
                # the key exists, so waiting for it returns at once: poll, until the leader replaces it
                time.sleep(self.policy.rejected_value_retry_s)
                continue
            return self._accept(key, inc, verdict, local_views, world_size, stall_timeout_s)
        why = (
            "local: no valid verdict from the leader in time (the value under verdict/ was rejected)"
            if rejected
            else "local: the leader gave no verdict in time (leader node down or its daemon restarted)"
        )
        item = DecidedLocally(LEADER_REJECTED if rejected else LEADER_SILENT)
        return self._local(inc, local_views, world_size, why, item)

    def _local(
        self, inc: SharedIncident, local_views: list[RankView], world_size: int, why: str, item: DecidedLocally,
        refused: VerdictDocument | None = None,
    ) -> Resolution:
        """This node decides (``why``, and ``item``: the same as data): its own ranks as it holds them, the other
        nodes' as their evidence in the store (read once) says."""
        remote_fr: dict[int, RankTrace] = {}
        views = local_views
        notes: list[EvidenceItem] = [item]
        nodes: dict[int, str] = {self.node_rank: HEARD}
        if self.store is not None:
            views, more, remote_fr, nodes = self._gather(self.store, inc, local_views, world_size, 0.0)
            notes += more
        return Resolution(why, views=views, notes=[*notes, *self._auth_note()], remote_fr=remote_fr,
                          refused=refused, exchange=self._exchange(nodes))

    def _accept(
        self,
        key: str,
        inc: SharedIncident,
        verdict: VerdictDocument,
        local_views: list[RankView],
        world_size: int,
        stall_timeout_s: float | None,
    ) -> Resolution:
        """The leader's verdict, unless it speaks of this node's ranks without this node's evidence (its
        evidence reached the leader tampered, deleted or not at all: the leader judged them from elsewhere),
        or it is unauthenticated and names a rank this node sees progressing. Each node keeps the right to the
        verdict over its own ranks; the leader's is still adopted when this node's own names the same ranks."""
        about_me = self._without_my_evidence(verdict, local_views)
        if about_me is not None:
            held_as = about_me.why == HELD_AS
            about = (f"it holds this node's evidence as {about_me.held[:32]}" if held_as
                     else f"it holds {fmt_ranks(about_me.ranks)} as never answered")
            why = f"local: the leader decided without this node's evidence ({about}); this node holds its own ranks"
            log.warning("remote_verdict_refused", job=self.job_id, key=key, why=about,
                        initiating_ranks=list(verdict.initiating_ranks[:16]))
            return self._local(inc, local_views, world_size, why, about_me, refused=verdict)
        healthy = (
            progressing_here(local_views, list(verdict.initiating_ranks), stall_timeout_s)
            if not self.authenticated and stall_timeout_s is not None
            else []
        )
        if not healthy:
            return Resolution(verdict.correlation or "leader", verdict=verdict)
        why = (
            f"local: refused the leader's unauthenticated verdict, it names {fmt_ranks(healthy)} "
            f"as initiating but this node sees it making progress"
        )
        log.warning(
            "remote_verdict_refused",
            job=self.job_id,
            key=key,
            initiating_ranks=list(verdict.initiating_ranks[:16]),
            progressing_here=healthy[:16],
            stall_timeout_s=stall_timeout_s,
        )
        # only a node that sees a stall itself may still confirm it with its own evidence (caller's decision)
        stalled_here = stall_timeout_s is not None and any(v.since_progress_s >= stall_timeout_s for v in local_views)
        return Resolution(why, views=local_views, notes=[DecidedLocally(REFUSED_UNAUTHENTICATED, ranks=tuple(healthy))],
                          refused=verdict if stalled_here else None)

    def _without_my_evidence(self, verdict: VerdictDocument, local_views: Sequence[RankView]) -> DecidedLocally | None:
        """What in the leader's verdict says it did not judge this node's ranks on this node's evidence."""
        nodes = (verdict.exchange or {}).get("nodes")
        mine = nodes.get(str(self.node_rank)) if isinstance(nodes, dict) else None
        if isinstance(mine, str) and mine != HEARD:
            return DecidedLocally(HELD_AS, held=mine[:32])
        gone = [v.rank for v in local_views
                if (e := verdict.ranks.get(str(v.rank))) is not None and e.state == MISSING]
        if gone:
            return DecidedLocally(HELD_MISSING, ranks=tuple(gone))
        return None

    def publish_verdict(self, inc: SharedIncident, verdict: VerdictDocument) -> None:
        """The leader's verdict for every node (slimmed for large jobs); a store error only logs."""
        if self.store is None:
            return
        try:
            slim = verdict.slimmed(self.policy.slim_verdict_above_ranks)
            self.store.set_json(f"verdict/{inc.gen}", {**slim.to_json(), "bound": binding(inc.incident_id)})
        except StoreError as exc:
            self._lost(exc)

    def _gather(
        self, store: JobStore, inc: SharedIncident, local_views: list[RankView], world_size: int, wait_s: float
    ) -> tuple[list[RankView], list[EvidenceItem], dict[int, RankTrace], dict[int, str]]:
        """Every node's evidence for this incident, waiting up to ``wait_s`` for all ranks to be covered;
        the other nodes' flight-recorder traces of their own ranks; and what was held of each node
        (``HEARD``, ``TAMPERED``, ``UNAVAILABLE``, ``SILENT``).

        Only a ``SILENT`` node — nothing under its key and no snapshot of it since the incident began — is
        taken as down: its ranks become ``missing`` (the ``missing_node`` rung may name them). A node whose
        value failed its checks, or vanished, or whose daemon goes on publishing snapshots while its evidence
        key is empty, was tampered with: that is evidence about the store, never about its ranks. They are
        judged on the node's newest authenticated snapshot when there is one, else not at all (left out of
        the decision, and then no rank nobody heard from is named as missing either: which node it ran on is
        not known)."""
        by_rank = {v.rank: v for v in local_views}
        remote_fr: dict[int, RankTrace] = {}
        fr_notes: list[str] = []
        nodes = list(self._candidate_nodes(world_size, len(local_views)))
        held: dict[int, str] = {self.node_rank: HEARD}
        why: dict[int, str] = {}  # ``core.evidence_items.NODE_REASONS``
        rejection: dict[int, str] = {}  # how a tampered value failed its checks
        seen: set[int] = set()  # nodes with a value under their key at some read
        before, _ = self._snapshots(store, [k for k in nodes if k != self.node_rank])
        deadline = time.monotonic() + wait_s
        while True:
            pending = [k for k in nodes if held.get(k) != HEARD]
            keys = [f"evidence/{inc.gen}/{k}" for k in pending]
            vanished: set[str] = set()
            try:
                raws, vanished = self._read_evidence(store, keys, deadline - time.monotonic())
            except StoreError as exc:
                self._lost(exc)
                raws = {}
            for k, key in zip(pending, keys, strict=True):
                raw = raws.get(key)
                if key in vanished or (raw is None and k in seen):
                    held[k], why[k] = UNAVAILABLE, DELETED_AFTER_SEEN
                    continue
                if raw is None:
                    continue
                seen.add(k)
                try:
                    answer = parse_evidence_doc(store.unseal(key, raw))
                    check_binding(answer.bound, inc.incident_id, self.not_before(inc))
                    if answer.node_rank != k:
                        raise ValueRejected(f"evidence of node {answer.node_rank} under node {k}'s key")
                except ValueRejected as exc:  # the node's own evidence may still replace it
                    self._reject(key, exc)
                    held[k], why[k] = TAMPERED, REJECTED
                    rejection[k] = str(exc)[:160]
                    continue
                held[k] = HEARD
                why.pop(k, None)
                fr_notes.extend(answer.notes[:8])
                for v in answer.views:
                    if v.rank not in by_rank:
                        by_rank[v.rank] = v
                        if v.rank in answer.fr:
                            remote_fr[v.rank] = answer.fr[v.rank]
            heard = [k for k, h in held.items() if h == HEARD]
            self._heard = len(heard)
            covered = all(r in by_rank for r in range(world_size)) and len(heard) >= (self.nnodes or 0)
            if covered or time.monotonic() >= deadline:
                break
            # every key there but not every rank covered (a rejected value, or fewer nodes than guessed):
            # the store cannot wake us for a replaced value, so poll until the deadline
            time.sleep(self.policy.rejected_value_retry_s)
        notes: list[EvidenceItem] = [FrNote(n) for n in fr_notes[:16]]
        unheard = [k for k in nodes if held.get(k) != HEARD]
        after, unread = self._snapshots(store, unheard) if unheard else ({}, set())
        for k in unheard:
            snap = after.get(k)
            if held.get(k) is None and k in unread:
                held[k], why[k] = UNAVAILABLE, OVER_READ_BUDGET
            elif held.get(k) is None:
                # nothing ever under its key: down, unless its daemon shows it is alive and has answered
                alive = snap is not None and (
                    snap.published >= inc.gen or (k in before and snap.order > before[k].order)
                )
                held[k] = UNAVAILABLE if alive else SILENT
                if alive:
                    why[k] = KEY_EMPTY_NODE_ALIVE
        tampered = sorted(k for k in unheard if held[k] != SILENT)
        unplaced = False  # a tampered node whose ranks are not known: no unheard rank can be called missing
        for k in tampered:
            snap = after.get(k)
            judged = [v for v in snap.views if v.rank not in by_rank] if snap is not None else []
            for v in judged:
                by_rank[v.rank] = v
            if not judged:
                unplaced = unplaced or snap is None
            notes.append(NodeEvidence(k, held[k], why.get(k, "?"), error=rejection.get(k, ""),
                                      judged=tuple(v.rank for v in judged), authenticated=self.authenticated))
            log.warning("store_evidence_" + held[k], job=self.job_id, gen=inc.gen, node=k, why=why.get(k),
                        error=rejection.get(k))
        uncovered = [r for r in range(world_size) if r not in by_rank]
        silent_ranks = {v.rank: v for k in unheard if held[k] == SILENT and (s := after.get(k)) for v in s.views}
        missing = [r for r in uncovered if r in silent_ranks or not (tampered and unplaced)]
        if missing:
            silent_nodes = sorted({silent_ranks[r].node for r in missing if r in silent_ranks})
            for r in missing:
                seen_view = silent_ranks.get(r)
                by_rank[r] = (
                    dataclasses.replace(seen_view, state=MISSING, stack_top=(), stack_signature=None, waiting=None)
                    if seen_view is not None
                    else RankView(
                        rank=r,
                        node="?",
                        pid=-1,
                        state=MISSING,
                        step=0,
                        phase=None,
                        in_phase_s=0.0,
                        since_progress_s=0.0,
                    )
                )
            notes.append(NoEvidenceFrom(tuple(missing), tuple(silent_nodes)))
        if len(missing) < len(uncovered):
            notes.append(NotJudged(tuple(r for r in uncovered if r not in missing)))
        return [by_rank[r] for r in sorted(by_rank)], notes, remote_fr, held

    @staticmethod
    def _read_evidence(store: JobStore, keys: list[str], wait_s: float) -> tuple[dict[str, bytes], set[str]]:
        """The values under ``keys`` that exist, and the keys that vanished between the store saying they
        exist and their read: waits up to ``wait_s`` for all of them (the store wakes the leader when the
        last one is set), then reads them in one round trip; after a timeout, the ones there, one by one."""
        if not keys:
            return {}, set()
        if wait_s > 0 and store.wait_for(keys, wait_s):
            try:
                return dict(zip(keys, store.get_many(keys), strict=True)), set()
            except StoreError:
                pass  # one was deleted between the wait and the read: one by one tells which
        out: dict[str, bytes] = {}
        vanished: set[str] = set()
        left = store.read_budget_bytes  # what one exchange may read, key by key as in one round trip
        for key in keys:
            if left <= 0:  # the values read so far filled the budget: the rest count as not available
                vanished.add(key)
                continue
            try:
                raw = store.get_raw(key)
            except Vanished:
                vanished.add(key)
                continue
            if raw is not None:
                out[key] = raw
                left -= len(raw)
        return out, vanished

    def _candidate_nodes(self, world_size: int, local_ranks: int) -> range:
        n = self.nnodes or max(1, -(-world_size // max(1, local_ranks)))
        return range(min(n, MAX_NODES))

    def _snapshots(self, store: JobStore, nodes: Sequence[int]) -> tuple[dict[int, Snapshot], set[int]]:
        """Each node's newest valid snapshot (one older than one seen before, a replay, is not taken), and the
        nodes not read because the values before them filled one look's read budget (a store stuffed with
        big values): those are unknown, never silent."""
        out: dict[int, Snapshot] = {}
        unread: set[int] = set()
        left = store.read_budget_bytes  # one look reads at most this much, whatever a job.json says of its nodes
        for k in nodes:
            key = f"node/{k}"
            if left <= 0:
                unread.add(k)
                continue
            try:
                raw = store.get_raw(key)
                if raw is None:
                    continue
                left -= len(raw)
                snap = parse_snapshot(store.unseal(key, raw))
                if snap.node_rank != k:
                    raise ValueRejected(f"snapshot of node {snap.node_rank} under node {k}'s key")
                if snap.order < self._snap_order.get(k, (0.0, 0)):
                    raise ValueRejected("snapshot older than one already seen (replayed)")
            except StoreError:
                continue
            except ValueRejected as exc:
                self._reject(key, exc)
                continue
            self._snap_order[k] = snap.order
            out[k] = snap
        return out, unread


def history_doc(node_rank: int, history: Mapping[int, Sequence[StepTiming]],
                signals: Sequence[tuple[int, Mapping[int, RankCounters]]], keep: int, samples_per_rank: int,
                samples_per_node: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A node's ``rankwatch.history/1`` document: each rank's last ``keep`` steps and its host-signal samples over
    them, thinned to ``samples_per_rank`` (fewer when the node's ranks would pass ``samples_per_node``) — what the
    end-of-run summary (``history/<k>``) and the leader's live diagnosis (``live/<k>``, ``cluster.live_share``)
    read back through ``parse_history_full``."""
    shared = list(history.items())[:MAX_RANKS_PER_NODE]
    doc: dict[str, Any] = {
        **(extra or {}),
        "schema": HISTORY_SCHEMA,
        "node_rank": node_rank,
        "ranks": {
            str(rank): [
                [t.step, t.start_ns, t.end_ns, t.phases_ms, [t.input_ms, t.input_batches, t.input_workers]]
                for t in list(steps)[-keep:]
            ]
            for rank, steps in shared
        },
    }
    if signals:
        per_rank = max(2, min(samples_per_rank, samples_per_node // max(1, len(shared))))
        doc["signals"] = {str(rank): signal_rows(signals, rank, list(steps)[-keep:], per_rank)
                          for rank, steps in shared if steps}
    return doc


def parse_history(raw: bytes) -> dict[int, list[StepTiming]]:
    return parse_history_full(raw)[0]


def parse_history_full(
    raw: bytes,
) -> tuple[dict[int, list[StepTiming]], dict[int, list[tuple[int, RankCounters]]]]:
    """A node's shared history: its ranks' steps and their host-signal samples (for ranks it has steps of)."""
    return history_from_doc(parse_json(raw, HISTORY_SCHEMA))


def history_from_doc(
    doc: dict[str, Any],
) -> tuple[dict[int, list[StepTiming]], dict[int, list[tuple[int, RankCounters]]]]:
    """``parse_history_full`` of a document already parsed (and its schema checked) by ``parse_json``."""
    steps = _history_steps(doc)
    return steps, _history_signals(doc.get("signals"), steps)


# a shared sample: [t_ns, cgroup index, the counters below, net (NetCounters' fields) or null, gpu or null]
_ROW_COUNTERS = ("start_ticks", "run_ns", "wait_ns", "cpu_ticks", "majflt", "nvcsw", "throttled_us", "nr_throttled",
                 "cpu_some_us", "mem_some_us", "io_some_us")
_ROW_NET = tuple(f.name for f in dataclasses.fields(NetCounters))
_ROW_GPU = tuple(f.name for f in dataclasses.fields(GpuState))
_MAX_CGROUPS = 8  # distinct cgroups of one rank over a window: a test or an operator moves it once or twice


def window_samples(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int,
                   steps: Sequence[StepTiming], cap: int) -> list[tuple[int, RankCounters]]:
    """``rank``'s samples over ``steps`` (one sample either side, for the window's edges), at most ``cap``: what
    a node shares of it, and what the leader keeps of its own ranks beside the shared ones, so that every rank's
    sampling intervals are alike when compared one by one (``straggler_cause``)."""
    if not steps:
        return []
    lo, hi = steps[0].start_ns, steps[-1].end_ns
    mine = [(t, by) for t, by in samples if rank in by]
    first = max((i for i, (t, _) in enumerate(mine) if t <= lo), default=0)
    last = min((i for i, (t, _) in enumerate(mine) if t >= hi), default=len(mine) - 1)
    picked = thin_samples([(t, {rank: by[rank]}) for t, by in mine[first:last + 1]], cap)
    return [(t, by[rank]) for t, by in picked]


def with_other_nodes(
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]], history: Mapping[int, Sequence[StepTiming]],
    own: Sequence[int], remote: Mapping[int, list[tuple[int, RankCounters]]], policy: CorrelationPolicy,
) -> list[tuple[int, Mapping[int, RankCounters]]]:
    """The samples the leader's summary reads: its own ranks' (``own``) beside the other nodes' ranks'
    (``remote``, from ``gather_histories``), one entry per rank and sample, each on its own node's clock (its
    steps' times are on it too: a rank is only ever compared with its own window). Its own are thinned over the
    same shared steps as the others' were; ``samples`` unchanged when no other node shared any."""
    remote = {r: rows for r, rows in remote.items() if r not in own}
    if not remote:
        return list(samples)
    keep, cap = policy.history_steps_shared, policy.history_samples_per_rank
    local = {r: window_samples(samples, r, list(history[r])[-keep:], cap) for r in own if r in history}
    return [(t, {r: c}) for rows_of in (local, remote) for r, rows in rows_of.items() for t, c in rows]


def signal_rows(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int, steps: Sequence[StepTiming],
                cap: int) -> dict[str, Any]:
    """``window_samples`` as the shared history carries them (``_history_signals`` reads them back)."""
    cgroups: list[str] = []
    rows = []
    for t, c in window_samples(samples, rank, steps, cap):
        if c.cgroup not in cgroups:
            if len(cgroups) >= _MAX_CGROUPS:
                continue
            cgroups.append(c.cgroup)
        rows.append([t, cgroups.index(c.cgroup), *(getattr(c, f) for f in _ROW_COUNTERS),
                     [getattr(c.net, f) for f in _ROW_NET] if c.net is not None else None,
                     [getattr(c.gpu, f) for f in _ROW_GPU] if c.gpu is not None else None])
    return {"cgroups": cgroups, "rows": rows}


def _history_signals(raw: Any, steps: Mapping[int, list[StepTiming]]) -> dict[int, list[tuple[int, RankCounters]]]:
    """The shared samples, every value checked (ValueRejected): bounded counts, integers in range, rows in time
    order. Absent (a node of an older version, sampling off): none."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_RANKS_PER_NODE:
        raise ValueRejected("history: signals malformed")
    cap = CorrelationPolicy.history_samples_per_rank
    out: dict[int, list[tuple[int, RankCounters]]] = {}
    for key, entry in raw.items():
        if not isinstance(key, str) or not key.isdigit() or int(key) not in steps or not isinstance(entry, dict):
            raise ValueRejected("history: signals entry malformed")
        cgroups, rows = entry.get("cgroups"), entry.get("rows")
        if (not isinstance(cgroups, list) or len(cgroups) > _MAX_CGROUPS or not isinstance(rows, list)
                or len(rows) > cap):
            raise ValueRejected("history: signals entry malformed")
        names = [v_str(g, "cgroup") or "" for g in cgroups]
        got: list[tuple[int, RankCounters]] = []
        for row in rows:
            if not isinstance(row, list) or len(row) != 4 + len(_ROW_COUNTERS):
                raise ValueRejected("history: signal row malformed")
            t = v_int(row[0], "t_ns", lo=0) or 0
            if got and t < got[-1][0]:
                raise ValueRejected("history: signal rows out of time order")
            cg = v_int(row[1], "cgroup index", lo=0, hi=max(0, len(names) - 1)) or 0
            vals = {f: v_int(v, f, lo=-1) for f, v in zip(_ROW_COUNTERS, row[2:2 + len(_ROW_COUNTERS)], strict=True)}
            got.append((t, RankCounters(
                **vals,  # type: ignore[arg-type]
                cgroup=names[cg] if names else "", net=_row_net(row[-2]), gpu=_row_gpu(row[-1]),
            )))
        out[int(key)] = got
    return out


def _row_net(raw: Any) -> NetCounters | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != len(_ROW_NET):
        raise ValueRejected("history: signal net malformed")
    return NetCounters(**{f: v_int(v, f, lo=-1) for f, v in zip(_ROW_NET, raw, strict=True)})  # type: ignore[arg-type]


def _row_gpu(raw: Any) -> GpuState | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != len(_ROW_GPU):
        raise ValueRejected("history: signal gpu malformed")
    # device and xids are always there; NVML may not have said the rest
    vals = {f: v_int(v, f, optional=f not in ("device", "xids"), lo=0) for f, v in zip(_ROW_GPU, raw, strict=True)}
    return GpuState(**vals)  # type: ignore[arg-type]


def _history_steps(doc: dict[str, Any]) -> dict[int, list[StepTiming]]:
    ranks = doc.get("ranks")
    if not isinstance(ranks, dict) or len(ranks) > MAX_RANKS_PER_NODE:
        raise ValueRejected("history: ranks malformed")
    out: dict[int, list[StepTiming]] = {}
    for key, steps in ranks.items():
        if not key.isdigit() or not isinstance(steps, list) or len(steps) > CorrelationPolicy.history_steps_shared:
            raise ValueRejected("history: rank entry malformed")
        timings = []
        for item in steps:
            if not isinstance(item, list) or len(item) not in (4, 5) or not isinstance(item[3], dict):
                raise ValueRejected("history: step entry malformed")
            inp = item[4] if len(item) == 5 else [0.0, 0, 0]
            if not isinstance(inp, list) or len(inp) != 3:
                raise ValueRejected("history: input entry malformed")
            step = v_int(item[0], "step", lo=0) or 0
            start = v_int(item[1], "start_ns", lo=0) or 0
            end = v_int(item[2], "end_ns", lo=0) or 0
            phases = {(v_str(k, "phase") or ""): (v_float(v, "phase_ms") or 0.0) for k, v in list(item[3].items())[:32]}
            timings.append(
                StepTiming(
                    step=step,
                    start_ns=start,
                    end_ns=end,
                    phases_ms=phases,
                    input_ms=v_float(inp[0], "input_ms") or 0.0,
                    input_batches=v_int(inp[1], "input_batches", lo=0, hi=1 << 32) or 0,
                    input_workers=v_int(inp[2], "input_workers", lo=0, hi=1 << 16) or 0,
                )
            )
        out[int(key)] = timings
    return out


def _safe_id(raw: str) -> str:
    """Incident ids become directory names on every node: keep them to a safe alphabet."""
    from rankwatch.hooks.jobinfo import sanitize_job_id

    return sanitize_job_id(raw)
