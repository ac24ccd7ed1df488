"""``rankwatch diagnose LOG [LOG…]``: name the initiating rank from logs a job already wrote.

Offline and streaming: sources → (prefilter) → parser → evidence → reasoning → render. Each stage is
its own module; ``rankwatch.watchdog.cli.diagnose`` is the command.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import UserError
from . import events as ev
from .facts import Collector, Evidence
from .parser import SourceParser
from .patterns import split_prefix
from .reasoning import Diagnosis, diagnose_evidence
from .sources import ScanStats, Source, expand, open_source, scan

__all__ = ["diagnose_evidence", "diagnose_logs", "read_sources"]

def read_sources(sources: Iterable[Source], collector: Collector) -> None:
    """Stream every source through its parser into the collector."""
    stats = ScanStats()
    for src in sources:
        collector.note_file(src.name)
        parser = SourceParser(src.name, src.path_rank)
        for e in parser.rank_events():
            collector.add(e)
        prefixes: set[bytes] = set()
        stream = open_source(src)
        try:
            for lineno, raw in scan(stream, stats, prefixes=prefixes):
                for e in parser.feed(lineno, raw.decode("utf-8", "replace")):
                    collector.add(e)
        except OSError as exc:
            raise UserError(f"cannot read {src.name}: {exc.strerror or exc}") from exc
        finally:
            if src.path is not None:
                stream.close()
        for pre in sorted(prefixes)[:100_000]:
            for e in _seen(src.name, pre):
                collector.add(e)
    collector.evidence.bytes = stats.bytes
    collector.evidence.lines = stats.lines


def _seen(name: str, prefix: bytes) -> list[ev.Event]:
    """A rank prefix seen at a line start: the rank exists even if it never printed an error."""
    pre, _ = split_prefix(prefix.decode("ascii", "replace"))
    if pre.rank is None and pre.local_rank is None:
        return []
    return [ev.Event(ev.RANK_SEEN, name, 0, "", rank=pre.rank, local_rank=pre.local_rank, detail="prefix")]


def diagnose_logs(paths: list[str]) -> tuple[Diagnosis, Evidence]:
    sources = expand(paths)
    if not sources:
        raise UserError("no log files found in " + ", ".join(paths))
    collector = Collector()
    read_sources(sources, collector)
    evidence = collector.finish()
    return diagnose_evidence(evidence), evidence


