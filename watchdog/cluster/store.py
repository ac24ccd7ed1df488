"""The TCPStore exchange between node daemons: bounded, schema-checked JSON values under
``rankwatch/<job-id>/``.

Everything read from the store is untrusted: a value is size-bounded, parsed as JSON (never unpickled,
never evaluated), checked against its schema, and dropped with one log line when it does not fit. With a
store secret every value is also sealed on write and its MAC checked on read (``cluster.auth``).
torch is imported only here and only when cross-node correlation is on, so a single-node daemon never
pays for it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import structlog

from ..core.fr_trace import FlightRecorderFormatError, RankTrace, compact_dump, parse_dump
from ..core.schema import NODE_SCHEMA
from ..core.snapshot import RankView
from . import auth

log = structlog.get_logger("rankwatch.store")

DEFAULT_STORE_PORT = 29431
MAX_VALUE_BYTES = 4 << 20  # a node snapshot of 4096 ranks with stack tops stays well below this
MAX_RANKS_PER_NODE = 4096
MAX_STR = 512
MAX_STACK_FRAMES = 16


class StoreError(Exception):
    """The store cannot be reached or answered badly; the caller falls back to a local verdict."""


class ValueRejected(Exception):
    """A value in the store is malformed, oversized or of the wrong schema."""


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
    )


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
) -> dict[str, Any]:
    doc = {
        "schema": NODE_SCHEMA,
        "kind": kind,
        "node_rank": node_rank,
        "node": node,
        "seq": seq,
        "ranks": [view_to_doc(v) for v in views[:MAX_RANKS_PER_NODE]],
    }
    if flight_recorder:
        doc["flight_recorder"] = dict(flight_recorder)
    return doc


@dataclass(frozen=True)
class NodeEvidence:
    """One node's answer to an incident: its ranks' views and the flight-recorder traces it shared."""

    node_rank: int
    node: str
    views: list[RankView]
    fr: dict[int, RankTrace]
    notes: tuple[str, ...] = ()


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
    return NodeEvidence(node_rank, node, views, fr, tuple(notes))


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


class JobStore:
    """One job's keys in a TCPStore; every call is bounded by the store timeout."""

    def __init__(
        self,
        host: str,
        port: int,
        job_id: str,
        *,
        host_server: bool,
        timeout_s: float = 5.0,
        secret: bytes | None = None,
    ) -> None:
        import torch.distributed as dist

        self.job_id = job_id
        self.secret = secret  # None: values are written and read unauthenticated
        self.prefix = f"rankwatch/{job_id}/"
        self.address = f"{host}:{port}"
        try:
            self._store = dist.TCPStore(
                host,
                port,
                is_master=host_server,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                use_libuv=True,
            )
        except Exception as exc:  # RuntimeError, DistNetworkError, …
            raise StoreError(f"cannot {'host' if host_server else 'reach'} store {self.address}: {exc}") from exc
        self.hosting = host_server

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _encode(self, key: str, doc: dict[str, Any]) -> str:
        text = json.dumps(doc, separators=(",", ":"))
        return text if self.secret is None else auth.seal(self.secret, self.job_id, key, text)

    def unseal(self, key: str, raw: bytes) -> bytes:
        """The JSON document in a value read from ``key``: with a secret only if its MAC is valid for this
        key and job; without one only if it is not sealed (nodes must agree on having a secret).
        ValueRejected otherwise."""
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
            self._store.set(self._k(key), text)
        except Exception as exc:
            raise StoreError(f"store set {key} failed: {exc}") from exc

    def get_raw(self, key: str) -> bytes | None:
        """The value, or None when the key does not exist (never blocks waiting for it)."""
        full = self._k(key)
        try:
            if not self._store.check([full]):
                return None
            return bytes(self._store.get(full))
        except Exception as exc:
            raise StoreError(f"store get {key} failed: {exc}") from exc

    def claim(self, key: str, doc: dict[str, Any], *, replacing: bytes = b"") -> bytes:
        """Set ``key`` only if absent (or still holding exactly ``replacing``); returns the value now stored
        (ours, or the earlier claimant's), still sealed: read it through ``unseal``."""
        text = self._encode(key, doc)
        # compared byte for byte: the binding takes bytes too (a std::string), and what is replaced need not
        # be UTF-8
        expected: Any = replacing
        try:
            return bytes(self._store.compare_set(self._k(key), expected, text))
        except Exception as exc:
            raise StoreError(f"store claim {key} failed: {exc}") from exc

    def add(self, key: str, amount: int) -> int:
        try:
            return int(self._store.add(self._k(key), amount))
        except Exception as exc:
            raise StoreError(f"store add {key} failed: {exc}") from exc

    # -- waking on changes (cluster/correlate.py): the server answers when the keys exist ----------------
    def prepare_waits(self) -> None:
        """Open the second connection that ``wait_for`` blocks on: a client serialises its requests, so a
        wait of seconds on the shared one would hold up every other call (the poll loop's snapshots).
        Called once from the connecting thread; ``wait_for`` falls back to the shared one without it."""
        if getattr(self, "_waiter", None) is not None:
            return
        import torch.distributed as dist

        host, _, port = self.address.rpartition(":")
        try:
            self._waiter = dist.TCPStore(
                host, int(port), is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=10.0), use_libuv=True,
            )
        except Exception as exc:
            raise StoreError(f"cannot open a waiting connection to {self.address}: {exc}") from exc

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists, False when ``timeout_s`` passed first: the server wakes the caller
        the moment the last key is set, instead of the caller polling."""
        if not keys:
            return True
        full = [self._k(k) for k in keys]
        waiter = getattr(self, "_waiter", None) or self._store
        try:
            waiter.wait(full, datetime.timedelta(seconds=max(0.001, timeout_s)))
            return True
        except Exception as wait_exc:
            try:  # a timeout, or the connection: tell them apart with one bounded call
                return bool(self._store.check(full))
            except Exception as exc:
                raise StoreError(f"store wait for {keys[0]}… failed: {wait_exc}; {exc}") from exc

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """The values of keys that all exist (``wait_for`` returned True), in one round trip."""
        try:
            return [bytes(v) for v in self._store.multi_get([self._k(k) for k in keys])]
        except Exception as exc:
            raise StoreError(f"store multi_get of {len(keys)} keys failed: {exc}") from exc
