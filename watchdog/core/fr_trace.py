"""The flight-recorder trace of one rank, parsed from its decoded JSON dump (pure: no file or socket I/O).

A dump is the JSON that ``torch._C._distributed_c10d._dump_fr_trace_json`` (any backend) or
``_dump_nccl_trace_json`` (NCCL builds) returns; the hook's responder writes it as ``rank-<g>.fr.json``.
Field names follow torch's ``FlightRecorder`` (torch/csrc/distributed/c10d/FlightRecorderDetail.hpp):
top level ``version``, ``comm_lib_version``, ``pg_config`` (keyed by pg name: ``name``, ``desc``,
``ranks`` as the *string* "[0, 1]"), ``pg_status`` (keyed by the *local* pg id as a string:
``last_enqueued_collective``, ``last_started_collective``, ``last_completed_collective``, values are
strings in JSON and ints in the pickle), optional ``nccl_comm_state`` and ``entries`` (absent when
empty). Each entry: ``record_id``, ``pg_id``, ``process_group`` [name, desc], ``collective_seq_id``,
``p2p_seq_id``, ``op_id``, ``profiling_name`` ("nccl:all_reduce"), ``time_created_ns``, sizes and
dtypes, ``state``, ``time_discovered_started_ns``/``..._completed_ns`` (0 when unset in JSON, None in
the pickle), ``retired``, ``timeout_ms``, ``is_p2p``, optional ``duration_ms``, ``thread_id``,
``thread_name``; ``frames`` only in the pickled dump.

What torch 2.13 (CPU build) really records for gloo, checked with the committed fixtures
(tests/fixtures/fr/make_gloo_dumps.py):

- Gloo collectives *are* recorded once ``TORCH_FR_BUFFER_SIZE`` > 0 (profiling names "gloo:all_reduce",
  "gloo:broadcast", ...), one entry per call with ``collective_seq_id`` counting from 1 per pg.
- ``state`` is always "scheduled": gloo has no start/end events, so the discovered-started/completed
  times stay 0. Completion shows only as ``retired: true``, and ``pg_status`` says
  ``last_started_collective: "-1"``. A collective a rank is blocked in is ``retired: false``.
- Retirement is asynchronous: a rank can already have entered seq N+1 while seq N still reads
  ``retired: false`` (fixture mismatch_size, rank 0). Completion is therefore weaker evidence than
  entry; "behind" is decided on the entered sequence number.
- ``pg_config`` holds one entry keyed "" with empty name and desc (the gloo pg does not register its
  name), while entries name the pg "0"/"default_pg". Membership falls back to the traced ranks.
- The JSON dump has no ``frames``; the pickled ``_dump_fr_trace`` has them (and tuples, ints and None
  where JSON has lists, strings and 0). Pickles are refused here: unpickling a file runs code.
- A size mismatch makes gloo abort the receiving process (``gloo::EnforceNotMet``), an op mismatch
  (all_reduce vs broadcast) just hangs; both show in the dumps at the same ``collective_seq_id``.

For NCCL, ``state`` moves scheduled → started (only with ``TORCH_NCCL_ENABLE_TIMING``) → completed, and
a retired entry that never completed timed out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .fields import is_num

MAX_ENTRIES = 100_000
"""TORCH_FR_BUFFER_SIZE is typically 2000; bound the work a hostile file can cause."""


class FlightRecorderFormatError(ValueError):
    """The bytes are not a flight-recorder JSON dump (wrong type, too large, missing or mistyped fields)."""


@dataclass(frozen=True)
class PgConfig:
    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class PgStatus:
    """Per-pg counters from ``pg_status``; -1 means 'none yet' (gloo never sets ``last_started``)."""

    last_enqueued: int
    last_started: int
    last_completed: int


@dataclass(frozen=True)
class FrEntry:
    record_id: int
    pg_id: int
    pg_name: str
    pg_desc: str
    collective_seq_id: int
    p2p_seq_id: int
    op_id: int
    profiling_name: str
    input_sizes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_sizes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[str, ...]
    state: str
    retired: bool
    is_p2p: bool
    time_created_ns: int
    time_started_ns: int | None
    time_completed_ns: int | None
    timeout_ms: int | None
    duration_ms: float | None
    frames: tuple[str, ...] = ()

    @property
    def op(self) -> str:
        """Op name without the backend prefix ("nccl:all_reduce" → "all_reduce")."""
        return self.profiling_name.split(":", 1)[-1]

    @property
    def backend(self) -> str:
        return self.profiling_name.split(":", 1)[0] if ":" in self.profiling_name else ""

    @property
    def finished(self) -> bool:
        """Completed, as far as the dump can tell.

        NCCL entries say "completed" once the end event fired (retired but not completed = timed out).
        Backends without events (gloo) never leave "scheduled", so retirement is the only signal.
        """
        if self.state == "completed":
            return True
        return self.retired and self.backend != "nccl"

    @property
    def timed_out(self) -> bool:
        return self.backend == "nccl" and self.retired and self.state != "completed"


@dataclass(frozen=True)
class RankTrace:
    rank: int | None
    version: str
    comm_lib_version: str
    pg_config: Mapping[str, PgConfig]
    pg_status: Mapping[int, PgStatus]
    entries: tuple[FrEntry, ...]


def _int(d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or v is None:
        if default is not None and v is None:
            return default
        raise FlightRecorderFormatError(f"entry field {key!r} is not an integer: {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    if isinstance(v, float) and v.is_integer():
        return int(v)
    raise FlightRecorderFormatError(f"field {key!r} is not an integer: {v!r}")


def _opt_time(v: Any) -> int | None:
    """Discovered times: None in the pickle, 0 in JSON when unset."""
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int | float) and v > 0:
        return int(v)
    return None


def _sizes(v: Any, key: str) -> tuple[tuple[int, ...], ...]:
    if v is None:
        return ()
    if not isinstance(v, list | tuple):
        raise FlightRecorderFormatError(f"{key} is not a list: {v!r}")
    out = []
    for s in v:
        if not isinstance(s, list | tuple) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in s
        ):
            raise FlightRecorderFormatError(f"{key} holds a non-integer list: {s!r}")
        out.append(tuple(s))
    return tuple(out)


def _strs(v: Any, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) for x in v):
        raise FlightRecorderFormatError(f"{key} is not a list of strings: {v!r}")
    return tuple(v)


def _frames(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list | tuple):
        return ()
    out = []
    for f in v[:64]:
        if isinstance(f, Mapping):
            out.append(f"{f.get('name', '?')} ({f.get('filename', '?')}:{f.get('line', '?')})")
    return tuple(out)


def _entry(raw: Any) -> FrEntry:
    if not isinstance(raw, Mapping):
        raise FlightRecorderFormatError(f"entry is not an object: {type(raw).__name__}")
    pg = raw.get("process_group")
    if not isinstance(pg, list | tuple) or len(pg) != 2 or not all(isinstance(x, str) for x in pg):
        raise FlightRecorderFormatError(f"process_group is not [name, desc]: {pg!r}")
    name = raw.get("profiling_name")
    if not isinstance(name, str):
        raise FlightRecorderFormatError(f"profiling_name is not a string: {name!r}")
    state = raw.get("state", "scheduled")
    if state not in ("scheduled", "started", "completed"):
        raise FlightRecorderFormatError(f"unknown entry state {state!r}")
    timeout = raw.get("timeout_ms")
    duration = raw.get("duration_ms")
    return FrEntry(
        record_id=_int(raw, "record_id"),
        pg_id=_int(raw, "pg_id", 0),
        pg_name=pg[0],
        pg_desc=pg[1],
        collective_seq_id=_int(raw, "collective_seq_id", 0),
        p2p_seq_id=_int(raw, "p2p_seq_id", 0),
        op_id=_int(raw, "op_id", 0),
        profiling_name=name,
        input_sizes=_sizes(raw.get("input_sizes"), "input_sizes"),
        input_dtypes=_strs(raw.get("input_dtypes"), "input_dtypes"),
        output_sizes=_sizes(raw.get("output_sizes"), "output_sizes"),
        output_dtypes=_strs(raw.get("output_dtypes"), "output_dtypes"),
        state=state,
        retired=bool(raw.get("retired", False)),
        is_p2p=bool(raw.get("is_p2p", False)),
        time_created_ns=_int(raw, "time_created_ns", 0),
        time_started_ns=_opt_time(raw.get("time_discovered_started_ns")),
        time_completed_ns=_opt_time(raw.get("time_discovered_completed_ns")),
        timeout_ms=int(timeout) if isinstance(timeout, int | float) and is_num(timeout) else None,
        duration_ms=float(duration) if isinstance(duration, int | float) and is_num(duration) else None,
        frames=_frames(raw.get("frames")),
    )


def _ranks_str(v: Any) -> tuple[int, ...]:
    """``ranks`` is the string "[0, 1, 2]" (a list in hand-made dumps)."""
    if isinstance(v, list | tuple):
        items: list[Any] = list(v)
    elif isinstance(v, str):
        body = v.strip().strip("[]").strip()
        items = [x.strip() for x in body.split(",")] if body else []
    else:
        return ()
    out = []
    for x in items:
        try:
            out.append(int(x))
        except (TypeError, ValueError):
            return ()
    return tuple(out)


def parse_dump(doc: Any, rank: int | None = None) -> RankTrace:
    """Validate an already-decoded dump object."""
    if not isinstance(doc, Mapping):
        raise FlightRecorderFormatError("dump is not a JSON object")
    if "version" not in doc:
        raise FlightRecorderFormatError("dump has no 'version' field: not a flight-recorder trace")
    raw_entries = doc.get("entries", [])  # torch omits the key when the buffer is empty
    if not isinstance(raw_entries, list):
        raise FlightRecorderFormatError("'entries' is not a list")
    if len(raw_entries) > MAX_ENTRIES:
        raise FlightRecorderFormatError(f"{len(raw_entries)} entries exceed the limit of {MAX_ENTRIES}")
    entries = tuple(sorted((_entry(e) for e in raw_entries), key=lambda e: e.record_id))
    pg_config: dict[str, PgConfig] = {}
    cfg = doc.get("pg_config", {})
    if isinstance(cfg, Mapping):
        for key, c in cfg.items():
            if isinstance(c, Mapping):
                pg_config[str(key)] = PgConfig(
                    name=str(c.get("name", key)),
                    desc=str(c.get("desc", "")),
                    ranks=_ranks_str(c.get("ranks")),
                )
    pg_status: dict[int, PgStatus] = {}
    st = doc.get("pg_status", {})
    if isinstance(st, Mapping):
        for key, s in st.items():
            if not isinstance(s, Mapping):
                continue
            try:
                pg_status[int(key)] = PgStatus(
                    last_enqueued=_int(s, "last_enqueued_collective", -1),
                    last_started=_int(s, "last_started_collective", -1),
                    last_completed=_int(s, "last_completed_collective", -1),
                )
            except (ValueError, FlightRecorderFormatError):
                continue
    return RankTrace(
        rank=rank,
        version=str(doc.get("version")),
        comm_lib_version=str(doc.get("comm_lib_version", "")),
        pg_config=pg_config,
        pg_status=pg_status,
        entries=entries,
    )


def _entry_doc(e: FrEntry) -> dict[str, Any]:
    # output sizes are left out: no cross-rank comparison reads them (``fr_analysis`` compares input
    # sizes and both dtypes), and for coalesced ops they are as long as the input list
    doc: dict[str, Any] = {
        "record_id": e.record_id,
        "pg_id": e.pg_id,
        "process_group": [e.pg_name, e.pg_desc],
        "collective_seq_id": e.collective_seq_id,
        "p2p_seq_id": e.p2p_seq_id,
        "op_id": e.op_id,
        "profiling_name": e.profiling_name,
        "time_created_ns": e.time_created_ns,
        "input_sizes": [list(s) for s in e.input_sizes],
        "input_dtypes": list(e.input_dtypes),
        "output_sizes": [],
        "output_dtypes": list(e.output_dtypes),
        "state": e.state,
        "time_discovered_started_ns": e.time_started_ns or 0,
        "time_discovered_completed_ns": e.time_completed_ns or 0,
        "retired": e.retired,
        "is_p2p": e.is_p2p,
    }
    if e.timeout_ms is not None:
        doc["timeout_ms"] = e.timeout_ms
    if e.duration_ms is not None:
        doc["duration_ms"] = e.duration_ms
    return doc


def compact_dump(trace: RankTrace, per_pg: int) -> dict[str, Any]:
    """The trace as a dump ``parse_dump`` reads back, holding only the newest ``per_pg`` entries of each
    process group, without frames or output sizes: what crosses nodes so the leader can compare every
    rank's recorder.

    Dropping older entries is safe for the analysis: a rank is "missing" a collective only when its
    entered seq is below it, mismatches compare only the ranks that hold an entry, and ``pg_status``
    (kept whole) carries the counters past any cut — the same as a ring buffer that wrapped.
    """
    by_pg: dict[str, list[FrEntry]] = {}
    for e in trace.entries:
        by_pg.setdefault(e.pg_name, []).append(e)
    kept = sorted((e for es in by_pg.values() for e in es[-per_pg:]), key=lambda e: e.record_id) if per_pg > 0 else []
    return {
        "version": trace.version,
        "comm_lib_version": trace.comm_lib_version,
        "pg_config": {
            k: {"name": c.name, "desc": c.desc, "ranks": "[" + ", ".join(str(r) for r in c.ranks) + "]"}
            for k, c in trace.pg_config.items()
        },
        "pg_status": {
            str(pid): {
                "last_enqueued_collective": str(st.last_enqueued),
                "last_started_collective": str(st.last_started),
                "last_completed_collective": str(st.last_completed),
            }
            for pid, st in trace.pg_status.items()
        },
        "entries": [_entry_doc(e) for e in kept],
    }
