"""Flight-recorder dumps: load one rank's trace, then compare all ranks' traces to name the odd ones.

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

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_DUMP_BYTES = 64 * 1024 * 1024
"""A 2000-entry NCCL dump with stack frames is a few MiB; anything far larger is not a dump."""
MAX_ENTRIES = 100_000
"""TORCH_FR_BUFFER_SIZE is typically 2000; bound the work a hostile file can cause."""
MAX_REPORTED = 16
"""Findings of one kind kept per process group; the first ones are the ones that matter."""

_RANK_FROM_NAME = re.compile(r"rank-(\d+)(?:\.fr)?\.json$")

# Ops whose input sizes must agree on every rank; others (gather, scatter, all_to_all, p2p) legitimately
# differ, so only their op name and dtypes are compared.
SIZE_MUST_MATCH = frozenset(
    {
        "all_reduce",
        "allreduce",
        "allreduce_coalesced",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "allgather",
        "_allgather_base",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "allgather_into_tensor_coalesced",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "barrier",
    }
)


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

    def pg_names(self) -> dict[int, tuple[str, str]]:
        """Local pg id → (name, desc), learnt from the entries (pg ids are per process)."""
        out: dict[int, tuple[str, str]] = {}
        for e in self.entries:
            out.setdefault(e.pg_id, (e.pg_name, e.pg_desc))
        return out


# ------------------------------------------------------------------------------------------------
# loading


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


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


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
        timeout_ms=int(timeout) if isinstance(timeout, int | float) and _is_num(timeout) else None,
        duration_ms=float(duration) if isinstance(duration, int | float) and _is_num(duration) else None,
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


def load_dump(
    source: bytes | str | os.PathLike[str], rank: int | None = None, max_bytes: int = MAX_DUMP_BYTES
) -> RankTrace:
    """Load and validate one rank's JSON dump from bytes or a path.

    The rank comes from ``rank`` or else from a ``rank-<g>.fr.json`` file name. Raises
    ``FlightRecorderFormatError`` for anything that is not a bounded, well-formed JSON dump (including
    pickled dumps, which are refused rather than unpickled) and ``OSError`` when the file cannot be read.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        if len(data) > max_bytes:
            raise FlightRecorderFormatError(f"dump of {len(data)} bytes exceeds the limit of {max_bytes}")
    else:
        path = os.fspath(source)
        if rank is None:
            m = _RANK_FROM_NAME.search(os.path.basename(path))
            rank = int(m.group(1)) if m else None
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise FlightRecorderFormatError(f"{path}: dump exceeds the limit of {max_bytes} bytes")
    if data[:1] == b"\x80":
        raise FlightRecorderFormatError("pickled dump refused (unpickling runs code); use the _json dump")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FlightRecorderFormatError(f"dump is not valid JSON: {exc}") from exc
    return parse_dump(doc, rank)


# ------------------------------------------------------------------------------------------------
# analysis


@dataclass(frozen=True)
class CollectiveRef:
    pg: str
    seq: int
    op: str


@dataclass(frozen=True)
class PgProgress:
    """How far one rank got in one pg: highest collective seq entered and finished (-1: none)."""

    entered: int
    completed: int
    entered_op: str | None
    in_flight: tuple[int, ...]


@dataclass(frozen=True)
class MissingCollective:
    """A collective some members entered while others never reached it (their last seq is lower)."""

    pg: str
    seq: int
    op: str
    joined: tuple[int, ...]
    missing: tuple[int, ...]


@dataclass(frozen=True)
class Mismatch:
    """Ranks disagree on the collective at one (pg, seq); ``odd_ranks`` are outside the majority."""

    pg: str
    seq: int
    kind: str  # "op" | "size" | "dtype"
    variants: Mapping[str, tuple[int, ...]]  # description → ranks
    odd_ranks: tuple[int, ...]  # empty when there is no strict majority (e.g. 1 vs 1)


@dataclass(frozen=True)
class PgAnalysis:
    name: str
    desc: str
    members: tuple[int, ...]
    progress: Mapping[int, PgProgress]
    behind: tuple[int, ...]
    completion_lag: tuple[int, ...]
    missing: tuple[MissingCollective, ...]
    mismatches: tuple[Mismatch, ...]


@dataclass(frozen=True)
class RankFr:
    rank: int
    entries: int
    last_entered: CollectiveRef | None
    last_completed: CollectiveRef | None
    in_flight: tuple[CollectiveRef, ...]
    timed_out: tuple[CollectiveRef, ...]


@dataclass(frozen=True)
class FrAnalysis:
    ranks: tuple[int, ...]
    empty_ranks: tuple[int, ...]
    groups: tuple[PgAnalysis, ...]
    per_rank: Mapping[int, RankFr]
    notes: tuple[str, ...] = field(default=())

    @property
    def behind_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for r in g.behind}))

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for m in g.missing for r in m.missing}))

    @property
    def mismatched_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for m in g.mismatches for r in m.odd_ranks}))

    @property
    def mismatches(self) -> tuple[Mismatch, ...]:
        return tuple(m for g in self.groups for m in g.mismatches)

    @property
    def missing(self) -> tuple[MissingCollective, ...]:
        return tuple(m for g in self.groups for m in g.missing)

    def summary_lines(self) -> list[str]:
        """Short human lines, most telling first: mismatches, missing ranks, laggards, then per rank."""
        lines: list[str] = []
        for g in self.groups:
            label = g.name if not g.desc or g.desc == g.name else f"{g.name} ({g.desc})"
            for mm in g.mismatches:
                variants = "; ".join(f"{_fmt_ranks(rs)}: {d}" for d, rs in mm.variants.items())
                who = f"odd rank(s) {_fmt_ranks(mm.odd_ranks)}" if mm.odd_ranks else "no majority"
                lines.append(f"pg {label} seq {mm.seq}: {mm.kind} mismatch, {who} ({variants})")
            for mc in g.missing:
                lines.append(
                    f"pg {label} seq {mc.seq} {mc.op}: entered by {_fmt_ranks(mc.joined)}, "
                    f"never joined by {_fmt_ranks(mc.missing)}"
                )
            if g.behind:
                top = max(p.entered for p in g.progress.values())
                detail = ", ".join(f"rank {r} at seq {g.progress[r].entered}" for r in g.behind)
                lines.append(f"pg {label}: behind (others entered seq {top}): {detail}")
            if g.completion_lag:
                detail = ", ".join(
                    f"rank {r} completed seq {g.progress[r].completed}" for r in g.completion_lag
                )
                lines.append(f"pg {label}: same seq entered but completion lags (weak evidence): {detail}")
        for r in self.empty_ranks:
            lines.append(
                f"rank {r}: flight recorder empty (TORCH_FR_BUFFER_SIZE unset, or no collective yet)"
            )
        for r in sorted(self.per_rank):
            info = self.per_rank[r]
            entered = _fmt_ref(info.last_entered)
            done = _fmt_ref(info.last_completed)
            waiting = ", ".join(_fmt_ref(c) for c in info.in_flight) or "none"
            lines.append(f"rank {r}: last entered {entered}, last completed {done}, in flight: {waiting}")
            for c in info.timed_out:
                lines.append(f"rank {r}: {_fmt_ref(c)} retired without completing (timed out)")
        lines.extend(self.notes)
        return lines


def _fmt_ranks(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return "[" + ", ".join(str(r) for r in rs) + "]"


def _fmt_ref(c: CollectiveRef | None) -> str:
    return "none" if c is None else f"{c.op}#{c.seq} (pg {c.pg})"


def _signature(e: FrEntry, kind: str) -> str:
    if kind == "op":
        return e.op
    if kind == "dtype":
        return f"in {list(e.input_dtypes)} out {list(e.output_dtypes)}"
    return f"in {[list(s) for s in e.input_sizes]}"


def _majority_split(groups: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Ranks outside the strict largest group; none when the largest size is tied."""
    sizes = sorted((len(v) for v in groups.values()), reverse=True)
    if len(sizes) < 2 or sizes[0] == sizes[1]:
        return ()
    top = max(groups, key=lambda k: len(groups[k]))
    return tuple(sorted(r for k, rs in groups.items() if k != top for r in rs))


def _compare_at_seq(pg: str, seq: int, by_rank: Mapping[int, FrEntry]) -> list[Mismatch]:
    if len(by_rank) < 2:
        return []
    out: list[Mismatch] = []
    kinds = ["op", "dtype"]
    ops = {e.op for e in by_rank.values()}
    if len(ops) == 1 and next(iter(ops)) in SIZE_MUST_MATCH:
        kinds.insert(1, "size")
    for kind in kinds:
        sig: dict[str, list[int]] = {}
        for r, e in sorted(by_rank.items()):
            sig.setdefault(_signature(e, kind), []).append(r)
        if len(sig) > 1:
            variants = {k: tuple(v) for k, v in sig.items()}
            out.append(
                Mismatch(pg=pg, seq=seq, kind=kind, variants=variants, odd_ranks=_majority_split(variants))
            )
            break  # an op mismatch explains size/dtype differences at the same seq
    return out


def _progress(trace: RankTrace, pg: str, entries: list[FrEntry]) -> PgProgress:
    entered = max((e.collective_seq_id for e in entries), default=-1)
    completed = max((e.collective_seq_id for e in entries if e.finished), default=-1)
    # pg_status is keyed by the local pg id; it survives ring-buffer wrap-around, so prefer it when higher
    local_ids = {e.pg_id for e in entries}
    for pid in local_ids:
        st = trace.pg_status.get(pid)
        if st is not None:
            entered = max(entered, st.last_enqueued)
            completed = max(completed, st.last_completed)
    op = None
    for e in entries:
        if e.collective_seq_id == entered:
            op = e.op
    in_flight = tuple(sorted({e.collective_seq_id for e in entries if not e.finished}))
    return PgProgress(entered=entered, completed=completed, entered_op=op, in_flight=in_flight)


def analyze_fr(traces: Mapping[int, RankTrace]) -> FrAnalysis:
    """Match collectives across ranks by (process group name, collective_seq_id) and report differences.

    Pure: ``traces`` maps global rank → trace. P2P entries (send/recv) are not matched, only listed per
    rank. A rank whose ring buffer wrapped is judged only on the sequence numbers it still holds plus its
    ``pg_status`` counters.
    """
    ranks = tuple(sorted(traces))
    empty = tuple(r for r in ranks if not traces[r].entries)
    notes: list[str] = []

    # pg name → rank → collective entries; pg name → desc
    per_pg: dict[str, dict[int, list[FrEntry]]] = {}
    descs: dict[str, str] = {}
    declared: dict[str, set[int]] = {}
    for r in ranks:
        t = traces[r]
        for e in t.entries:
            if e.is_p2p:
                continue
            per_pg.setdefault(e.pg_name, {}).setdefault(r, []).append(e)
            descs.setdefault(e.pg_name, e.pg_desc)
        for name, cfg in t.pg_config.items():
            if name and cfg.ranks:
                declared.setdefault(name, set()).update(cfg.ranks)

    groups: list[PgAnalysis] = []
    for pg in sorted(per_pg, key=lambda n: (len(n), n)):
        by_rank = per_pg[pg]
        members = set(by_rank)
        if pg in declared:
            members |= declared[pg] & set(ranks)
        if descs.get(pg) == "default_pg":
            members |= set(ranks)
        members_t = tuple(sorted(members))
        progress = {r: _progress(traces[r], pg, by_rank.get(r, [])) for r in members_t}
        top = max(p.entered for p in progress.values())
        behind = tuple(r for r in members_t if progress[r].entered < top)
        top_completed = max(p.completed for p in progress.values())
        completion_lag = tuple(
            r for r in members_t if progress[r].entered == top and progress[r].completed < top_completed
        )

        # index by seq
        at_seq: dict[int, dict[int, FrEntry]] = {}
        for r, es in by_rank.items():
            for e in es:
                at_seq.setdefault(e.collective_seq_id, {})[r] = e

        missing: list[MissingCollective] = []
        for seq in sorted(at_seq):
            joined = tuple(sorted(at_seq[seq]))
            absent = tuple(r for r in members_t if r not in at_seq[seq] and progress[r].entered < seq)
            if absent and len(missing) < MAX_REPORTED:
                op = Counter(e.op for e in at_seq[seq].values()).most_common(1)[0][0]
                missing.append(MissingCollective(pg=pg, seq=seq, op=op, joined=joined, missing=absent))

        mismatches: list[Mismatch] = []
        for seq in sorted(at_seq):
            if len(mismatches) >= MAX_REPORTED:
                notes.append(f"pg {pg}: more than {MAX_REPORTED} mismatching collectives, rest not listed")
                break
            mismatches.extend(_compare_at_seq(pg, seq, at_seq[seq]))

        groups.append(
            PgAnalysis(
                name=pg,
                desc=descs.get(pg, ""),
                members=members_t,
                progress=progress,
                behind=behind,
                completion_lag=completion_lag,
                missing=tuple(missing),
                mismatches=tuple(mismatches),
            )
        )

    per_rank: dict[int, RankFr] = {}
    for r in ranks:
        rank_entries = traces[r].entries
        last = rank_entries[-1] if rank_entries else None
        done = [e for e in rank_entries if e.finished]
        per_rank[r] = RankFr(
            rank=r,
            entries=len(rank_entries),
            last_entered=_ref(last) if last else None,
            last_completed=_ref(done[-1]) if done else None,
            in_flight=tuple(_ref(e) for e in rank_entries if not e.finished and not e.timed_out),
            timed_out=tuple(_ref(e) for e in rank_entries if e.timed_out),
        )
    return FrAnalysis(
        ranks=ranks, empty_ranks=empty, groups=tuple(groups), per_rank=per_rank, notes=tuple(notes)
    )


def _ref(e: FrEntry) -> CollectiveRef:
    seq = e.p2p_seq_id if e.is_p2p else e.collective_seq_id
    return CollectiveRef(pg=e.pg_name, seq=seq, op=e.op)
