"""Flight-recorder dumps as evidence: load each captured dump (bounded, never unpickled), analyse them
across ranks and state the result as the facts the verdict reads (``core.fr_facts``). Nothing here raises
into the daemon: a dump that cannot be read is a note in the evidence."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import structlog

from ..core.facts import FactSet
from ..core.fr_analysis import FrAnalysis, analyze_fr
from ..core.fr_facts import fr_facts
from ..core.fr_trace import FlightRecorderFormatError, RankTrace
from .capture import RankCapture
from .fr_dump import load_dump

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
