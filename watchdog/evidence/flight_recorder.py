"""Flight-recorder dumps as evidence: load each captured dump (bounded, never unpickled), analyse them
across ranks and state the result as the facts the verdict reads (``core.fr_facts``). Nothing here raises
into the daemon: a dump that cannot be read is a note in the evidence."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import structlog

from ..core.facts import FactSet
from ..core.fr_analysis import FrAnalysis, analyze_fr
from ..core.fr_facts import fr_facts
from ..core.fr_trace import FlightRecorderFormatError, RankTrace, compact_dump, parse_dump
from .capture import RankCapture

MAX_DUMP_BYTES = 64 * 1024 * 1024
"""A 2000-entry NCCL dump with stack frames is a few MiB; anything far larger is not a dump."""

_RANK_FROM_NAME = re.compile(r"rank-(\d+)(?:\.fr)?\.json$")


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


WIRE_ENTRIES_PER_PG = 4096
"""Entries per process group a reader sends: the newest, as ``compact_dump`` keeps them. A recorder ring of
TORCH_FR_BUFFER_SIZE=2000 (the usual setting) arrives whole; a 40,000-entry dump costs the root side a
tenth of the work, and the analysis compares the newest sequence numbers anyway."""


def fr_wire_doc(data: bytes, budget_bytes: int) -> tuple[dict[str, object] | None, str | None]:
    """(the dump as a compact, typed document within ``budget_bytes``, a note): what a job owner's reader
    sends the root daemon instead of the rank's bytes (``capture.capture_to_doc``). Parsed here, on the
    owner's side; at most the newest ``WIRE_ENTRIES_PER_PG`` entries of each process group, fewer where the
    budget needs it (what ``compact_dump`` says is safe for the analysis)."""
    try:
        trace = load_dump(data)
    except (FlightRecorderFormatError, OSError, ValueError) as exc:
        return None, f"dump skipped: {exc}"[:300]
    longest = max(Counter(e.pg_name for e in trace.entries).values(), default=0)
    per_pg = max(1, min(longest, WIRE_ENTRIES_PER_PG))
    for _ in range(8):
        doc = compact_dump(trace, per_pg)
        size = len(json.dumps(doc, separators=(",", ":")))
        if size <= budget_bytes:
            cut = f"newest {per_pg} entries per process group kept of {longest}" if per_pg < longest else None
            return doc, cut
        if per_pg == 1:
            break
        per_pg = max(1, int(per_pg * budget_bytes / size * 0.9))  # one estimate, not a halving per try
    return None, f"dump skipped: over {budget_bytes} bytes even cut to {per_pg} entries per process group"


log = structlog.get_logger("rankwatch.evidence")

MAX_FR_LINES = 40
"""Flight-recorder lines in a verdict's evidence; per-rank lines grow with the world size."""


@dataclass(frozen=True)
class FrFindings:
    """The flight recorder's contribution to one incident."""

    lines: tuple[str, ...]  # evidence lines, most telling first (bounded)
    facts: FactSet | None  # the flight recorder as facts (``core.fr_facts``); None when no dump could be analysed
    notes: tuple[str, ...] = ()  # dumps skipped and why
    analysis: FrAnalysis | None = field(default=None, compare=False)
    traces: Mapping[int, RankTrace] = field(default_factory=dict, compare=False)  # this node's, by rank


def fr_evidence(captures: Mapping[int, RankCapture]) -> FrFindings:
    """Every capture's flight-recorder trace compared across ranks. Never raises. A raw dump (``fr_json``)
    is parsed here only in-process callers' captures (offline tools, the owner's side); the daemon's come
    parsed and checked (``fr_trace``).

    A rank without a dump or with a malformed one is left out with a note; conclusions then cover only
    the ranks that dumped (the facts' ``ranks``), which the verdict takes into account.
    """
    notes: list[str] = []
    traces: dict[int, RankTrace] = {}
    for rank, cap in sorted(captures.items()):
        if cap.fr_trace is not None:  # the owner's reader parsed it; checked again on arrival
            traces[rank] = cap.fr_trace
            continue
        if not cap.fr_json:
            why = next((n for n in cap.notes if n.startswith("flight recorder")), None) or cap.responder_error
            notes.append(f"rank {rank}: no flight-recorder dump" + (f" ({why})" if why else ""))
            continue
        try:
            traces[rank] = load_dump(cap.fr_json, rank=rank)
        except (FlightRecorderFormatError, OSError, ValueError) as exc:
            notes.append(f"rank {rank}: flight-recorder dump skipped: {exc}"[:300])
    return analyse_traces(traces, notes)


def with_remote(local: FrFindings, remote: Mapping[int, RankTrace]) -> FrFindings:
    """This node's findings redone over its own traces and the other nodes' (multi-node leader): the
    recorder then covers every rank, not only the ones on the node that decides. A remote trace never
    replaces a local one."""
    if not remote:
        return local
    merged = analyse_traces({**remote, **local.traces}, list(local.notes), dumps_in="fr/ of each node's bundle")
    return replace(merged, traces=local.traces)


def analyse_traces(traces: Mapping[int, RankTrace], notes: list[str], dumps_in: str = "fr/") -> FrFindings:
    """Compare parsed traces across ranks into evidence lines and the facts the verdict reads (``dumps_in``: where the
    lines left out can be read). Never raises."""
    if not traces:
        return FrFindings(lines=tuple(f"flight recorder: {n}" for n in notes), facts=None, notes=tuple(notes))
    try:
        analysis = analyze_fr(traces)
    except Exception as exc:  # analyze is pure, but a dump can hold shapes nobody anticipated
        log.exception("fr_analyze_failed")
        notes.append(f"flight-recorder analysis failed: {type(exc).__name__}: {exc}"[:300])
        return FrFindings(
            lines=tuple(f"flight recorder: {n}" for n in notes), facts=None, notes=tuple(notes), traces=traces
        )
    facts = fr_facts(analysis)
    if not facts.ranks:
        notes.append("every flight-recorder dump is empty (TORCH_FR_BUFFER_SIZE unset, or no collective yet)")
    summary = analysis.summary_lines()
    if len(summary) > MAX_FR_LINES:
        summary = [*summary[:MAX_FR_LINES], f"{len(summary) - MAX_FR_LINES} more flight-recorder line(s) in {dumps_in}"]
    lines = tuple(f"flight recorder: {s}" for s in [*summary, *notes])
    return FrFindings(
        lines=lines, facts=facts if facts.ranks else None, notes=tuple(notes), analysis=analysis, traces=traces
    )
