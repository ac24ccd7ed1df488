"""A flight-recorder dump read on the job owner's side: bounded, validated JSON (a pickled dump is refused,
never unpickled) cut to a compact typed document the root daemon can check. Apart from the cross-rank
analysis (``evidence.flight_recorder``) because the capture that runs in the owner's reader needs only this,
and the analysis needs the capture's types: one module each keeps both free of a cycle."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

from ..core.fr_trace import FlightRecorderFormatError, RankTrace, compact_dump, parse_dump

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
