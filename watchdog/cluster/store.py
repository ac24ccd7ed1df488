"""The TCPStore exchange between node daemons: bounded, schema-checked JSON values under
``rankwatch/<job-id>/``.

Everything read from the store is untrusted: a value is size-bounded, parsed as JSON (never unpickled,
never evaluated), checked against its schema, and dropped with one log line when it does not fit. With a
store secret every value is also sealed on write and its MAC checked on read (``cluster.auth``).
Every store is read through ``store_client``, rankwatch's own bounded TCPStore client (pure Python: a value
over MAX_VALUE_BYTES is refused before it is allocated, every call has a deadline), so the daemon never
imports torch for it; torch is imported only where a process hosts the store itself (``_host``: `rankwatch
run`'s and `inspect`'s node 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, cast

import structlog

from ..core.fr_trace import FlightRecorderFormatError, RankTrace, compact_dump, parse_dump
from ..core.schema import NODE_SCHEMA
from ..core.snapshot import MAX_KNOWN_PEERS, P2P_DIRECTIONS, RankView
from . import auth
from .store_client import KeyVanished, StoreClient, StoreClientError, StoreClientPolicy, ValueTooLarge

log = structlog.get_logger("rankwatch.store")

DEFAULT_STORE_PORT = 29431
MAX_VALUE_BYTES = 4 << 20  # a node snapshot of 4096 ranks with stack tops stays well below this
MAX_RANKS_PER_NODE = 4096
MAX_STR = 512
MAX_STACK_FRAMES = 16


class StoreError(Exception):
    """The store cannot be reached or answered badly; the caller falls back to a local verdict."""


class Oversize(StoreError):
    """A value to publish over the limit it was written under: refused before it is sent."""

    def __init__(self, key: str, size: int, limit: int) -> None:
        super().__init__(f"refusing to publish {size} bytes under {key}")
        self.size, self.limit = size, limit


class ValueRejected(Exception):
    """A value in the store is malformed, oversized or of the wrong schema."""


class Refused(bytes):
    """What a read returns for a value the client refused unread (over MAX_VALUE_BYTES): empty bytes that
    ``JobStore.unseal`` turns into ValueRejected with the reason, so a caller treats the key as tampered
    with, as it does a malformed value."""

    reason: str

    def __new__(cls, reason: str) -> Refused:
        self = super().__new__(cls, b"")
        self.reason = reason
        return self


def _host(host: str, port: int, timeout_s: float) -> tuple[Any, int]:
    """torch's TCPStore server in this process (``rankwatch run``'s node 0, ``inspect``'s node 0: the job
    owner's own processes; the root daemon never hosts, ``store_host``). It is only served here: this process
    reads it through the bounded client like any other store."""
    import torch.distributed as dist

    # it listens on every interface, as torchrun's store does; ``host`` is only what its own client dials
    server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)
    return server, int(server.port)


class Vanished(StoreError):
    """A key the store said exists was gone when its value was read: deleted in between (a hostile client)."""


def v_str(value: Any, field: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_STR:
        raise ValueRejected(f"{field}: expected a string of at most {MAX_STR} chars")
    return value


def v_int(value: Any, field: str, *, optional: bool = False, lo: int = -(2**63), hi: int = 2**63 - 1) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueRejected(f"{field}: expected an integer in [{lo}, {hi}]")
    return value


def v_float(value: Any, field: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueRejected(f"{field}: expected a finite number")
    return float(value)


_VIEW_STATES = {
    "running", "stopped", "dead", "crashed", "zombie", "exited", "missing", "unknown", "unverified", "unreadable"
}


def view_to_doc(v: RankView) -> dict[str, Any]:
    doc = dataclasses.asdict(v)
    doc["stack_top"] = list(v.stack_top)[:MAX_STACK_FRAMES]
    doc["p2p_known"] = sorted(v.p2p_known)[:MAX_KNOWN_PEERS] if v.p2p_known is not None else None  # a set is no JSON
    return doc


def view_from_doc(doc: Any) -> RankView:
    """A RankView from untrusted JSON: every field type- and range-checked."""
    if not isinstance(doc, dict):
        raise ValueRejected("rank entry: expected an object")
    state = v_str(doc.get("state"), "state")
    if state not in _VIEW_STATES:
        raise ValueRejected(f"state: unknown value {state!r}")
    stack = doc.get("stack_top", [])
    if not isinstance(stack, list) or len(stack) > MAX_STACK_FRAMES:
        raise ValueRejected("stack_top: expected a short list")
    waiting = doc.get("waiting")
    if waiting is not None and not isinstance(waiting, bool):
        raise ValueRejected("waiting: expected a boolean")
    return RankView(
        rank=v_int(doc.get("rank"), "rank", lo=0, hi=10**7) or 0,
        node=v_str(doc.get("node"), "node") or "",
        pid=v_int(doc.get("pid"), "pid", lo=-1, hi=2**31) or 0,
        state=state,
        step=v_int(doc.get("step"), "step", lo=0) or 0,
        phase=v_str(doc.get("phase"), "phase", optional=True),
        in_phase_s=v_float(doc.get("in_phase_s"), "in_phase_s") or 0.0,
        since_progress_s=v_float(doc.get("since_progress_s"), "since_progress_s") or 0.0,
        coll_seq=v_int(doc.get("coll_seq", 0), "coll_seq", lo=0) or 0,
        coll_done=v_int(doc.get("coll_done", 0), "coll_done", lo=0) or 0,
        coll_op=v_str(doc.get("coll_op"), "coll_op", optional=True),
        budget_s=v_float(doc.get("budget_s", 0.0), "budget_s") or 0.0,
        budget_elapsed_s=v_float(doc.get("budget_elapsed_s", 0.0), "budget_elapsed_s") or 0.0,
        exit_order=v_int(doc.get("exit_order"), "exit_order", optional=True, lo=0, hi=10**7),
        exit_age_s=v_float(doc.get("exit_age_s"), "exit_age_s", optional=True),
        exit_cause=v_str(doc.get("exit_cause"), "exit_cause", optional=True),
        node_rank=cast(int, v_int(doc.get("node_rank", -1), "node_rank", lo=-1, hi=10**6)),
        verified=doc.get("verified", True) is True,
        gpu_util=v_float(doc.get("gpu_util"), "gpu_util", optional=True),
        gpu_missing=bool(doc.get("gpu_missing", False)),
        stack_top=tuple(v_str(f, "stack_top[]") or "" for f in stack),
        stack_signature=v_str(doc.get("stack_signature"), "stack_signature", optional=True),
        waiting=waiting,
        **_p2p_of(doc),
    )


def _p2p_of(doc: dict[str, Any]) -> dict[str, Any]:
    """A remote rank's send/recv peer and the peers it exchanged with (a node of an older release sends none)."""
    direction, known = doc.get("p2p_dir"), doc.get("p2p_known")
    if direction is not None and direction not in P2P_DIRECTIONS:
        raise ValueRejected("p2p_dir: expected send or recv")
    if known is not None and (not isinstance(known, list) or len(known) > MAX_KNOWN_PEERS):
        raise ValueRejected("p2p_known: expected a short list")
    return {"p2p_dir": direction, "p2p_peer": v_int(doc.get("p2p_peer"), "p2p_peer", optional=True, lo=0, hi=10**7),
            "p2p_known": None if known is None else frozenset(
                v_int(p, "p2p_known[]", lo=0, hi=10**7) or 0 for p in known)}


def fr_share(traces: Mapping[int, RankTrace], per_pg: int, budget_bytes: int) -> dict[str, Any]:
    """This node's flight-recorder traces for its evidence: the newest ``per_pg`` entries of each process
    group per rank, halved until the whole share fits ``budget_bytes`` (empty when even a few do not)."""
    while per_pg >= 4:
        share = {str(r): compact_dump(t, per_pg) for r, t in sorted(traces.items())}
        if len(json.dumps(share, separators=(",", ":"))) <= budget_bytes:
            return share
        per_pg //= 2
    return {}


def node_doc(
    node_rank: int,
    node: str,
    seq: int,
    views: list[RankView],
    kind: str = "snapshot",
    flight_recorder: Mapping[str, Any] | None = None,
    bound: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    doc = {
        **(extra or {}),
        "schema": NODE_SCHEMA,
        "kind": kind,
        "node_rank": node_rank,
        "node": node,
        "seq": seq,
        "ranks": [view_to_doc(v) for v in views[:MAX_RANKS_PER_NODE]],
    }
    if flight_recorder:
        doc["flight_recorder"] = dict(flight_recorder)
    if bound is not None:
        doc["bound"] = dict(bound)
    return doc


def binding(incident_id: str) -> dict[str, Any]:
    """What an incident's evidence and verdict carry, sealed with the rest (``cluster.auth``): the incident
    they answer and when they were made. A value left in the store by an earlier run or an earlier daemon
    (the same ``evidence/1/0`` key, the same incident id after a restart) then no longer passes for a fresh
    one (``check_binding``)."""
    return {"incident": incident_id, "issued": round(time.time(), 3)}


def check_binding(bound: Any, incident_id: str, not_before_unix: float) -> None:
    """ValueRejected unless ``bound`` names ``incident_id`` and was issued at or after ``not_before_unix``."""
    if not isinstance(bound, dict):
        raise ValueRejected("value not bound to an incident (from an older rankwatch, or replayed)")
    if v_str(bound.get("incident"), "bound.incident") != incident_id:
        raise ValueRejected("value of another incident (replayed from an earlier run)")
    issued = v_float(bound.get("issued"), "bound.issued") or 0.0
    if issued < not_before_unix:
        raise ValueRejected("value issued before this incident's claim or this daemon's start (replayed)")


@dataclass(frozen=True)
class NodeEvidence:
    """One node's answer to an incident: its ranks' views and the flight-recorder traces it shared."""

    node_rank: int
    node: str
    views: list[RankView]
    fr: dict[int, RankTrace]
    notes: tuple[str, ...] = ()
    bound: Any = None  # the doc's ``bound`` as sent (``check_binding`` decides)


def _node_fields(doc: dict[str, Any]) -> tuple[int, str, int, list[RankView]]:
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or len(ranks) > MAX_RANKS_PER_NODE:
        raise ValueRejected(f"ranks: expected a list of at most {MAX_RANKS_PER_NODE} entries")
    node_rank = v_int(doc.get("node_rank"), "node_rank", lo=0, hi=10**6) or 0
    return (
        node_rank,
        v_str(doc.get("node"), "node") or "",
        v_int(doc.get("seq"), "seq", lo=0) or 0,
        [view_from_doc(r) for r in ranks],
    )


def parse_node_doc(raw: bytes) -> tuple[int, str, int, list[RankView]]:
    return _node_fields(parse_json(raw, NODE_SCHEMA))


@dataclass(frozen=True)
class Snapshot:
    """A node's per-poll snapshot as the leader reads it: its ranks, and the per-node sequence that says
    whether its daemon is alive (``order`` grows with every poll of one daemon, and with a restarted one)
    and which incident it last published evidence for (``published``)."""

    node_rank: int
    views: list[RankView]
    order: tuple[float, int]  # (the publishing daemon's start, its poll sequence)
    published: int  # the newest incident generation this node published evidence for (0: none)


def parse_snapshot(raw: bytes) -> Snapshot:
    doc = parse_json(raw, NODE_SCHEMA)
    node_rank, _, seq, views = _node_fields(doc)
    boot = v_float(doc.get("boot", 0.0), "boot") or 0.0
    published = v_int(doc.get("published", 0), "published", lo=0, hi=10**9) or 0
    return Snapshot(node_rank, views, (boot, seq), published)


def parse_evidence_doc(raw: bytes) -> NodeEvidence:
    """A node's evidence, flight-recorder traces included. A trace is taken only for a rank the node
    reports among its own (a node cannot speak for another's ranks) and only when it validates as a dump
    (``core.fr_trace.parse_dump``: bounded, typed, never unpickled); a bad one is a note, not a rejection
    of the node's views."""
    doc = parse_json(raw, NODE_SCHEMA)
    node_rank, node, _, views = _node_fields(doc)
    own = {v.rank for v in views}
    fr: dict[int, RankTrace] = {}
    notes: list[str] = []
    section = doc.get("flight_recorder", {})
    if not isinstance(section, dict):
        section = {}
        notes.append(f"node {node_rank}: flight_recorder is not an object, ignored")
    for key, dump in list(section.items())[:MAX_RANKS_PER_NODE]:
        try:
            rank = int(key)
        except ValueError:
            notes.append(f"node {node_rank}: flight-recorder key {key[:40]!r} is not a rank, ignored")
            continue
        if rank not in own:
            notes.append(f"node {node_rank}: flight recorder for rank {rank}, not one of its ranks, ignored")
            continue
        try:
            fr[rank] = parse_dump(dump, rank)
        except (FlightRecorderFormatError, ValueError, TypeError, RecursionError) as exc:
            notes.append(f"node {node_rank}: rank {rank}'s flight recorder rejected: {str(exc)[:200]}")
    return NodeEvidence(node_rank, node, views, fr, tuple(notes), doc.get("bound"))


def parse_json(raw: bytes, schema: str) -> dict[str, Any]:
    if len(raw) > MAX_VALUE_BYTES:
        raise ValueRejected(f"value of {len(raw)} bytes exceeds {MAX_VALUE_BYTES}")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueRejected(f"not JSON: {str(exc)[:200]}") from None
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        raise ValueRejected(f"expected schema {schema}")
    return doc


# what the poll loop waits at most for a store call before going on with the newest answer it has: a
# healthy store answers in a millisecond, so this keeps its answers current without ever holding the loop
NOWAIT_S = 0.1


class _StoreThread:
    """Store calls run here, one at a time, on a daemon thread of their own: a store that accepts and never
    answers holds this thread, never the caller. Callers wait with a total deadline (``call``) or not at all
    (``submit``); once a call has been outstanding past the deadline the store counts as wedged."""

    MAX_QUEUED = 8  # calls waiting behind a slow one; beyond that new ones are refused, not queued

    def __init__(self, name: str, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._busy_since: float | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            with self._lock:
                self._busy_since = time.monotonic()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to whoever waits
                fut.set_exception(exc)
            finally:
                with self._lock:
                    self._busy_since = None
                    self._outstanding -= 1

    @property
    def wedged(self) -> bool:
        with self._lock:
            return self._busy_since is not None and time.monotonic() - self._busy_since > self.deadline_s

    def submit(self, fn: Callable[[], Any]) -> Future[Any] | None:
        with self._lock:
            if self._outstanding >= self.MAX_QUEUED:
                return None
            self._outstanding += 1
        fut: Future[Any] = Future()
        self._q.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], Any], what: str) -> Any:
        if self.wedged:
            raise StoreError(f"{what}: the store has not answered an earlier call for over {self.deadline_s:.0f}s")
        fut = self.submit(fn)
        if fut is None:
            raise StoreError(f"{what}: too many store calls waiting on a store that does not answer")
        try:
            return fut.result(timeout=self.deadline_s)
        except FutureTimeout:
            raise StoreError(f"{what}: no answer within {self.deadline_s:.0f}s") from None

    def close(self) -> None:
        self._q.put(None)


class JobStore:
    """One job's keys in a TCPStore. Every call runs on the store's own thread under a total deadline
    (a TCPStore's own timeout is per read: a peer that trickles or never answers is not bounded by it)."""

    def __init__(
        self,
        host: str,
        port: int,
        job_id: str,
        *,
        host_server: bool,
        timeout_s: float = 5.0,
        secret: bytes | None = None,
        op_timeout_s: float = 2.0,
    ) -> None:
        self.job_id = job_id
        self.secret = secret  # None: values are written and read unauthenticated
        self.prefix = f"rankwatch/{job_id}/"
        self.address = f"{host}:{port}"
        self._io = _StoreThread(f"rankwatch-store-{job_id[:16]}", timeout_s)
        self._polled: dict[str, Future[Any]] = {}
        self._last: dict[str, bytes | None] = {}
        # every store is read through the bounded client (``store_client``): a value over MAX_VALUE_BYTES is
        # refused unread, each call has a deadline of ``op_timeout_s``, a multi-key read a byte budget
        self.policy = StoreClientPolicy(max_value_bytes=MAX_VALUE_BYTES, op_timeout_s=op_timeout_s,
                                        connect_timeout_s=timeout_s)
        self.read_budget_bytes = self.policy.max_read_bytes
        self._server: Any = None  # torch's TCPStore server, only where this process hosts (never a daemon)
        self._waiter: StoreClient | None = None  # the second connection ``wait_for`` blocks on (prepare_waits)
        self._sides: list[SideConnection] = []  # background threads' own connections (``side``)
        try:
            if host_server:
                import torch.distributed  # noqa: F401  (imported before the deadline: seconds on a loaded node)

                self._server, port = self._io.call(lambda: _host(host, port, timeout_s), "host")
                self.address = f"{host}:{port}"
            self._store = StoreClient(host, port, self.policy)
            self._io.call(self._store.connect, "connect")
        except Exception as exc:  # StoreClientError, RuntimeError (torch's server), StoreError (no answer in time)
            self._io.close()
            raise StoreError(f"cannot {'host' if host_server else 'reach'} store {self.address}: {exc}") from exc
        self.hosting = host_server

    def close(self, timeout_s: float = 2.0) -> None:
        """Release the connections (and the server, when hosting) on the store's thread, then stop it: left
        to the interpreter's exit, a TCPStore is torn down in whatever order finalisation picks, beside
        threads still inside it."""

        def release() -> None:
            self._store.close()
            for side in self._sides:
                side.close()
            if self._waiter is not None:
                self._waiter.close()
            self._server = None  # torch's server stops with its last reference

        fut = self._io.submit(release)
        if fut is not None:
            with contextlib.suppress(Exception):
                fut.result(timeout=timeout_s)
        self._io.close()

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _encode(self, key: str, doc: dict[str, Any]) -> str:
        text = json.dumps(doc, separators=(",", ":"))
        return text if self.secret is None else auth.seal(self.secret, self.job_id, key, text)

    def unseal(self, key: str, raw: bytes) -> bytes:
        """The JSON document in a value read from ``key``: with a secret only if its MAC is valid for this
        key and job; without one only if it is not sealed (nodes must agree on having a secret).
        ValueRejected otherwise."""
        if isinstance(raw, Refused):
            raise ValueRejected(raw.reason)
        if len(raw) > MAX_VALUE_BYTES:
            raise ValueRejected(f"value of {len(raw)} bytes exceeds {MAX_VALUE_BYTES}")
        if self.secret is None:
            if auth.is_sealed(raw):
                raise ValueRejected("value is signed but this node has no --store-secret-file (give every node one)")
            return raw
        try:
            return auth.unseal(self.secret, self.job_id, key, raw)
        except auth.EnvelopeError as exc:
            raise ValueRejected(str(exc)) from None

    def set_json(self, key: str, doc: dict[str, Any]) -> None:
        text = self._encode(key, doc)
        if len(text) > MAX_VALUE_BYTES:
            raise StoreError(f"refusing to publish {len(text)} bytes under {key}")
        try:
            self._io.call(lambda: self._store.set(self._k(key), text.encode()), f"store set {key}")
        except Exception as exc:
            raise StoreError(f"store set {key} failed: {exc}") from exc

    def set_json_nowait(self, key: str, doc: dict[str, Any]) -> None:
        """``set_json`` handed to the store's thread without waiting (the poll loop's snapshots); StoreError
        once the store is wedged, so the caller can say so and reconnect."""
        text = self._encode(key, doc)
        if len(text) > MAX_VALUE_BYTES:
            raise StoreError(f"refusing to publish {len(text)} bytes under {key}")
        if self._io.wedged:
            raise StoreError(f"store set {key}: the store has not answered for over {self._io.deadline_s:.0f}s")
        fut = self._io.submit(lambda: self._store.set(self._k(key), text.encode()))
        if fut is not None:
            with contextlib.suppress(FutureTimeout):
                fut.exception(timeout=NOWAIT_S)  # a healthy store has answered by then: the value is there

    def _get(self, full: str) -> bytes | None:
        if not self._store.check([full]):
            return None
        try:
            return self._store.get(full)
        except KeyVanished as exc:  # there a moment ago: deleted in between
            raise Vanished(f"{full}: gone after the store said it exists ({str(exc)[:120]})") from None
        except ValueTooLarge as exc:  # never read, never allocated: the key holds no rankwatch value
            return Refused(str(exc))

    def get_raw(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist (never blocks waiting for it); Vanished when it was
        deleted between the existence check and the read."""
        full = self._k(key)
        try:
            return cast("bytes | None", self._io.call(lambda: self._get(full), f"store get {key}"))
        except Vanished:
            raise
        except Exception as exc:
            raise StoreError(f"store get {key} failed: {exc}") from exc

    def get_raw_nowait(self, key: str) -> bytes | None:
        """The newest value the store's thread fetched for ``key`` (None before the first answer); a new fetch
        is started when the last one finished. The poll loop never waits on the network."""
        fut = self._polled.get(key)
        if fut is not None and fut.done():
            del self._polled[key]
            exc = fut.exception()
            if exc is not None:
                raise StoreError(f"store get {key} failed: {exc}")
            self._last[key] = fut.result()
        if self._io.wedged:
            raise StoreError(f"store get {key}: the store has not answered for over {self._io.deadline_s:.0f}s")
        if key not in self._polled:
            full = self._k(key)
            started = self._io.submit(lambda: self._get(full))
            if started is not None:
                self._polled[key] = started
        fut = self._polled.get(key)
        if fut is not None:
            with contextlib.suppress(FutureTimeout):
                fut.exception(timeout=NOWAIT_S)
            if fut.done():
                del self._polled[key]
                exc = fut.exception()
                if exc is not None:
                    raise StoreError(f"store get {key} failed: {exc}")
                self._last[key] = fut.result()
        return self._last.get(key)

    def claim(self, key: str, doc: dict[str, Any], *, replacing: bytes = b"") -> bytes:
        """Set ``key`` only if absent (or still holding exactly ``replacing``); returns the value now stored
        (ours, or the earlier claimant's), still sealed: read it through ``unseal``."""
        text = self._encode(key, doc)
        # compared byte for byte: what is replaced need not be UTF-8
        try:
            return cast(bytes, self._io.call(lambda: self._store.compare_set(self._k(key), replacing, text.encode()),
                                             f"claim {key}"))
        except Exception as exc:
            raise StoreError(f"store claim {key} failed: {exc}") from exc

    def add(self, key: str, amount: int) -> int:
        try:
            return int(self._io.call(lambda: self._store.add(self._k(key), amount), f"store add {key}"))
        except Exception as exc:
            raise StoreError(f"store add {key} failed: {exc}") from exc

    # -- waking on changes (cluster/correlate.py): the server answers when the keys exist ----------------
    def prepare_waits(self) -> None:
        """Open the second connection that ``wait_for`` blocks on: a client serialises its requests, so a
        wait of seconds on the shared one would hold up every other call (the poll loop's snapshots).
        Called once from the connecting thread; ``wait_for`` falls back to the shared one without it."""
        if self._waiter is not None:
            return
        self._waiter = self._connection("a waiting connection")

    def _connection(self, what: str) -> StoreClient:
        """One more client connection to this store, with the client's bounds (StoreError when refused)."""
        host, _, port = self.address.rpartition(":")
        client = StoreClient(host, int(port), self.policy)
        try:
            client.connect()
        except StoreClientError as exc:
            raise StoreError(f"cannot open {what} to {self.address}: {exc}") from exc
        return client

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists, False when ``timeout_s`` passed first: the server wakes the caller
        the moment the last key is set, instead of the caller polling."""
        if not keys:
            return True
        full = [self._k(k) for k in keys]
        waiter = self._waiter or self._store
        try:
            if waiter.wait(full, max(0.001, timeout_s)):
                return True
            raise StoreClientError("not there yet")
        except Exception as wait_exc:
            try:  # a timeout, or the connection: tell them apart with one bounded call
                return bool(self._io.call(lambda: self._store.check(full), "store check"))
            except Exception as exc:
                raise StoreError(f"store wait for {keys[0]}… failed: {wait_exc}; {exc}") from exc

    def side(self) -> SideConnection:
        """A connection of its own for one background thread's bulk values (``cluster.live_share``): its writes and
        reads never queue behind or ahead of the poll loop's calls on the store's thread, and each has the
        client's deadline. The caller's thread blocks on it (never the poll loop's); closed with the store."""
        side = SideConnection(self, self._connection("a connection"))
        self._sides.append(side)
        return side

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """The values of keys that all exist (``wait_for`` returned True), in one round trip."""
        try:
            full = [self._k(k) for k in keys]
            return cast("list[bytes]", self._io.call(lambda: self._store.multi_get(full), "store multi_get"))
        except Exception as exc:
            raise StoreError(f"store multi_get of {len(keys)} keys failed: {exc}") from exc


class SideConnection:
    """``JobStore.side``: one background thread's own connection to the job's keys, values sealed and read as the
    store's are (``JobStore.unseal`` is the caller's: a read returns the raw value). Blocks its caller for at most
    the client's deadline per call."""

    def __init__(self, store: JobStore, client: StoreClient) -> None:
        self._store, self._client = store, client

    def set_json(self, key: str, doc: dict[str, Any], limit: int = MAX_VALUE_BYTES) -> int:
        """Writes ``doc`` under ``key``; the bytes written. Oversize, and nothing sent, past ``limit`` (what its
        readers accept)."""
        text = self._store._encode(key, doc)
        if len(text) > limit:
            raise Oversize(key, len(text), limit)
        try:
            self._client.set(self._store._k(key), text.encode())
        except StoreClientError as exc:
            raise StoreError(f"store set {key} failed: {exc}") from exc
        return len(text)

    def get_raw(self, key: str) -> bytes | None:
        """The value under ``key`` (None: no such key); a value over MAX_VALUE_BYTES is ``Refused`` unread."""
        full = self._store._k(key)
        try:
            if not self._client.check([full]):
                return None
            return self._client.get(full)
        except KeyVanished:
            return None
        except ValueTooLarge as exc:
            return Refused(str(exc))
        except StoreClientError as exc:
            raise StoreError(f"store get {key} failed: {exc}") from exc

    def close(self) -> None:
        self._client.close()
