"""``rankwatch diagnose LOG [LOG…]``: name the initiating rank from logs a job already wrote.

Offline and streaming: sources → (prefilter) → parser → evidence → jobs → reasoning → render. Each
source is parsed once into its own bounded collector; ``jobs.group`` decides which sources are one job
(a directory may hold several), the collectors of each job are merged and every job gets its own
verdict. Each stage is its own module; ``rankwatch.watchdog.cli.diagnose`` is the command.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import UserError
from . import events as ev
from . import jobs
from .facts import Collector, Evidence
from .parser import SourceParser
from .patterns import split_prefix
from .reasoning import Diagnosis, diagnose_evidence
from .sources import ScanStats, Source, expand, open_source, scan

__all__ = ["Job", "JobsResult", "diagnose_evidence", "diagnose_jobs", "diagnose_logs", "read_sources"]


@dataclass
class _Read:
    """One source, parsed: its events folded into its own collector, and what it says about its job."""

    collector: Collector
    info: jobs.SourceInfo


@dataclass
class Job:
    """The verdict of one job found in the inputs."""

    label: str | None  # "Slurm job 48811", "torchrun run fx5", … (None when no key names it)
    job_id: str | None  # "slurm:48811" for the verdict document, or None
    files: list[str]
    diagnosis: Diagnosis
    evidence: Evidence

    @property
    def decided(self) -> bool:
        return self.diagnosis.decided and bool(self.diagnosis.initiating_ranks)


@dataclass
class JobsResult:
    jobs: list[Job]
    ungrouped: list[str] = field(default_factory=list)  # sources no job could claim

    @property
    def decided(self) -> bool:
        return bool(self.jobs) and all(j.decided for j in self.jobs)


def _read_one(src: Source, stats: ScanStats) -> _Read:
    collector = Collector()
    collector.note_file(src.name)
    info = jobs.SourceInfo(src.name, folder=os.path.dirname(src.path) if src.path else "")
    jobs.read_path(info, src.path)
    parser = SourceParser(src.name, src.path_rank)
    if src.path_rank.local_rank is not None:
        info.local_ranks.add(src.path_rank.local_rank)
    for e in parser.rank_events():
        collector.add(e)
    prefixes: set[bytes] = set()
    head: list[bytes] = []
    stream = open_source(src)
    before_b, before_l = stats.bytes, stats.lines
    try:
        for lineno, raw in scan(stream, stats, prefixes=prefixes, head=head):
            for e in parser.feed(lineno, raw.decode("utf-8", "replace")):
                collector.add(e)
                if e.family == ev.SLURM and e.rank is None and e.detail.startswith("step "):
                    info.add_key(jobs.SLURM, e.detail.split()[1].split(".")[0])
    except OSError as exc:
        raise UserError(f"cannot read {src.name}: {exc.strerror or exc}") from exc
    finally:
        if src.path is not None:
            stream.close()
    for pre in sorted(prefixes)[:100_000]:
        for e in _seen(src.name, pre):
            collector.add(e)
            if e.rank is not None and len(info.ranks) < 100_000:
                info.ranks.add(e.rank)
            if e.local_rank is not None and len(info.local_ranks) < 100_000:
                info.local_ranks.add(e.local_rank)
    if head:
        jobs.read_head(info, head[0].decode("utf-8", "replace"))
    info.ranks |= parser.ranks
    info.hosts |= parser.hosts
    info.saw_time(parser.t_min)
    info.saw_time(parser.t_max)
    collector.evidence.bytes = stats.bytes - before_b
    collector.evidence.lines = stats.lines - before_l
    return _Read(collector, info)


def read_sources(sources: Iterable[Source], collector: Collector) -> None:
    """Stream every source through its parser into the collector (all of them as one job)."""
    stats = ScanStats()
    for src in sources:
        collector.merge(_read_one(src, stats).collector)


def _seen(name: str, prefix: bytes) -> list[ev.Event]:
    """A rank prefix seen at a line start: the rank exists even if it never printed an error."""
    pre, _ = split_prefix(prefix.decode("ascii", "replace"))
    if pre.rank is None and pre.local_rank is None:
        return []
    return [ev.Event(ev.RANK_SEEN, name, 0, "", rank=pre.rank, local_rank=pre.local_rank, detail="prefix")]


def _sources(paths: list[str]) -> list[Source]:
    sources = expand(paths)
    if not sources:
        raise UserError("no log files found in " + ", ".join(paths))
    return sources


def diagnose_logs(paths: list[str]) -> tuple[Diagnosis, Evidence]:
    """Every source as one job (the caller says they are): one verdict."""
    collector = Collector()
    read_sources(_sources(paths), collector)
    evidence = collector.finish()
    return diagnose_evidence(evidence), evidence


def diagnose_jobs(paths: list[str], policy: jobs.GroupingPolicy = jobs.DEFAULT_GROUPING) -> JobsResult:
    """Group the sources into jobs (``jobs.group``) and diagnose each one on its own."""
    sources = _sources(paths)
    stats = ScanStats()
    reads = [_read_one(src, stats) for src in sources]
    infos = [r.info for r in reads]
    grouping = jobs.group(infos, policy)
    out: list[Job] = []
    for members in grouping.jobs:
        collector = Collector()
        for i in members:
            collector.merge(reads[i].collector)
        evidence = collector.finish()
        out.append(
            Job(
                label=jobs.job_label(infos, members),
                job_id=jobs.job_id(infos, members),
                files=[sources[i].name for i in members],
                diagnosis=diagnose_evidence(evidence),
                evidence=evidence,
            )
        )
    return JobsResult(out, [sources[i].name for i in grouping.ungrouped])
