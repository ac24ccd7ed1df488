"""``rankwatch diagnose LOG [LOG…]``: name the initiating rank from logs a job already wrote.

Offline and streaming: sources → (prefilter) → parser → evidence → reasoning → render. Each stage is
its own module; only this one does I/O to stdout.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable

from ..argparsing import Parser
from ..errors import UserError
from . import events as ev
from .evidence import Collector, Evidence
from .parser import SourceParser
from .patterns import split_prefix
from .reasoning import Diagnosis, diagnose
from .render import render_text
from .sources import ScanStats, Source, expand, open_source, scan

__all__ = ["analyze", "diagnose", "main", "read_sources"]

DESCRIPTION = """Name the rank that started a failure from logs a job already wrote: torchrun's console
(--tee 3 prefixes [defaultN]:/[rankN]:), torchrun --log-dir per-rank files, srun --label output, dmesg.
Offline, streamed in constant memory. Exit code 0 when the logs name an initiator, 1 when they cannot
decide, 2 on bad input."""


def _parser() -> Parser:
    p = Parser(prog="rankwatch diagnose", description=DESCRIPTION)
    p.add_argument("logs", nargs="+", metavar="LOG", help="log file, directory (recursive) or - for stdin")
    p.add_argument("--json", action="store_true", help="print a rankwatch.verdict/1 document")
    return p


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


def analyze(paths: list[str]) -> tuple[Diagnosis, Evidence]:
    sources = expand(paths)
    if not sources:
        raise UserError("no log files found in " + ", ".join(paths))
    collector = Collector()
    read_sources(sources, collector)
    evidence = collector.finish()
    return diagnose(evidence), evidence


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    d, evidence = analyze(args.logs)
    if args.json:
        sys.stdout.write(json.dumps(d.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(d, evidence))
    return 0 if d.initiating_ranks else 1
