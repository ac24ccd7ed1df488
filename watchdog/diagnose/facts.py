"""Fold a stream of events into bounded per-rank facts (constant memory however long the logs are).

Per rank it keeps the first event of each family, a count per family, the exit, the last traceback
and the NCCL sequence numbers. Events that name only a local rank or a pid are resolved to global
ranks at the end, with the mappings torch elastic's failure report provides.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ..core.failures import waited_for
from . import events as ev
from .patterns import SRUN_EXIT

MAX_PENDING = 4096  # events waiting for a local-rank/pid mapping
MAX_SEEN_FILES = 10_000
MAX_OP_GROUPS = 16  # NCCL communicators (by size) whose last op is kept per rank
MAX_REPORTS = 1024  # failure reports (file, host) whose entries are kept to find absent workers


@dataclass
class RankFacts:
    rank: int
    first: dict[str, ev.Event] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)
    exit: ev.Event | None = None  # the most informative exit (report entry over a one-line note)
    traceback: ev.Event | None = None  # last finished traceback
    nccl_timeout: ev.Event | None = None  # last watchdog timeout
    status: ev.Event | None = None  # last PG status (enqueued/completed)
    slurm: ev.Event | None = None
    finished: ev.Event | None = None  # last "reached its normal end" line, or a report entry with exit 0
    own_dump: bool = False  # a DUMP_SIGNAL from its own watchdog ("from this local rank"): it timed out
    told: ev.Event | None = None  # first DUMP_SIGNAL naming a peer: another rank timed out and told it
    agent_terminated: bool = False  # torchrun sent it a closing signal: its death is downstream
    ops: dict[str, ev.Event] = field(default_factory=dict)  # last NCCL op line per group (bounded)
    waited_on: frozenset[int] = frozenset()  # ranks its own error messages say it waited for (``waited_for``)

    def has(self, families: frozenset[str]) -> bool:
        return any(self.counts[f] for f in families)

    def firsts(self, families: frozenset[str]) -> list[ev.Event]:
        return sorted((e for f, e in self.first.items() if f in families), key=lambda e: (e.file, e.line))

    def add(self, e: ev.Event) -> None:
        self.counts[e.family] += 1
        if e.family not in self.first:
            self.first[e.family] = e
        self._fold(e)

    def merge(self, other: RankFacts) -> None:
        """Fold another source's facts about the same rank in, as if its events had come after ours."""
        self.counts.update(other.counts)
        for fam, e in other.first.items():
            self.first.setdefault(fam, e)
        self.own_dump = self.own_dump or other.own_dump
        if other.told is not None:
            self._fold(other.told)
        for last in (other.exit, other.slurm, other.finished, other.status, other.nccl_timeout, other.traceback,
                     *other.ops.values()):
            if last is not None:
                self._fold(last)
        self.agent_terminated = self.agent_terminated or other.agent_terminated
        self.waited_on |= other.waited_on

    def _fold(self, e: ev.Event) -> None:
        if e.family in ev.WAITING and (on := waited_for(e.detail or e.text)):
            self.waited_on |= on
        if e.family == ev.EXIT:
            if e.exitcode == 0:
                self.finished = e
            # a failure-report entry beats torchrun's one-line "failed (exitcode…)"; keep the root flag
            root = e.root_cause or (self.exit is not None and self.exit.root_cause)
            if self.exit is None or self.exit.detail == ev.FIRST_NOTICED:
                self.exit = replace(e, root_cause=root)
            elif root != self.exit.root_cause:
                self.exit = replace(self.exit, root_cause=root)
        elif e.family == ev.TRACEBACK:
            self.traceback = e
        elif e.family == ev.NCCL_TIMEOUT:
            self.nccl_timeout = e
        elif e.family in (ev.NCCL_STATUS, ev.DUMP_SIGNAL):
            if e.enqueued is not None:
                self.status = e
            if e.family == ev.DUMP_SIGNAL:
                if e.detail.startswith(ev.PEER_SIGNALLED):
                    # the first one, or a later one that names the rank ("rank 2" over "another rank")
                    if self.told is None or (self.told.detail == "another rank" and e.detail != "another rank"):
                        self.told = e
                else:
                    self.own_dump = True
        elif e.family == ev.SLURM:
            self.slurm = self.slurm or e
        elif e.family == ev.FINISHED:
            self.finished = e
        elif e.family == ev.NCCL_OP and (e.pg in self.ops or len(self.ops) < MAX_OP_GROUPS):
            self.ops[e.pg or ""] = e


@dataclass
class Evidence:
    """Everything the reasoning needs, already attributed to global ranks."""

    ranks: dict[int, RankFacts] = field(default_factory=dict)
    unattributed: list[ev.Event] = field(default_factory=list)  # bounded: first few of each family
    dump_paths: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    local_only: bool = False  # some ranks are local ranks that no report mapped to global ones
    slurm_cancel: ev.Event | None = None
    # rankwatch's own summary in the log: its last straggler diagnosis and that one's cause (a later run's
    # summary, or the end-of-run one after a live line, says the most)
    straggler: ev.Event | None = None
    straggler_cause: ev.Event | None = None
    world: int = 0  # the most ranks any line states the job (or one of its communicators) has
    bytes: int = 0
    lines: int = 0

    def facts(self, rank: int) -> RankFacts:
        f = self.ranks.get(rank)
        if f is None:
            f = self.ranks[rank] = RankFacts(rank)
        return f


class Collector:
    """Accumulates events; ``finish()`` resolves local ranks and pids and returns the Evidence."""

    def __init__(self) -> None:
        self.evidence = Evidence()
        self._pending: list[ev.Event] = []
        self._local_to_global: dict[tuple[str | None, int], int] = {}
        self._local_any: dict[int, set[int]] = {}
        self._local_hosts: set[str | None] = set()  # the hosts whose lines taught ``_local_any``
        self._pid_to_rank: dict[int, int] = {}
        self._agent_pids: set[int] = set()
        self._unattributed_count: Counter[str] = Counter()
        # torch elastic failure-report entries per (file, host): one agent's report, by local rank
        self._reported: dict[tuple[str, str | None], dict[int, ev.Event]] = {}
        # what srun's task lines say of how tasks ended, kept until the end: a task is a rank only where srun
        # started the ranks itself; where another launcher reported exits (torchrun under srun: a task is a
        # node's agent) they are dropped
        self._srun: list[ev.Event] = []
        self._launcher_exit = False

    def add(self, e: ev.Event) -> None:
        logs = self.evidence
        if e.detail.startswith(SRUN_EXIT) and e.family in (ev.EXIT, ev.HOST_OOM):
            if len(self._srun) < MAX_PENDING:
                self._srun.append(e)
            return
        if e.family == ev.EXIT:
            self._launcher_exit = True
        if e.family == ev.DUMP_WRITTEN:
            if len(logs.dump_paths) < 32 and e.detail not in logs.dump_paths:
                logs.dump_paths.append(e.detail)
            return
        if e.family == ev.AGENT_TERM:
            if e.pid is not None and len(self._agent_pids) < 1_000_000:
                self._agent_pids.add(e.pid)
            return
        if e.family == ev.WORLD:
            logs.world = max(logs.world, e.size or 0)
            return
        if e.family == ev.SLURM and e.rank is None:
            logs.slurm_cancel = logs.slurm_cancel or e
            return
        if e.family == ev.STRAGGLER:
            logs.straggler, logs.straggler_cause = e, None  # a cause belongs to the diagnosis above it
            return
        if e.family == ev.STRAGGLER_CAUSE:
            if logs.straggler is not None and e.file == logs.straggler.file and e.line > logs.straggler.line:
                logs.straggler_cause = logs.straggler_cause or e
            return
        if e.rank is not None and e.local_rank is not None and len(self._local_any) < 100_000:
            # "[default3]:[rank11]:" prefixes, report entries and per-rank files with [rankN] lines
            # all teach which global rank a local rank is
            if e.family == ev.EXIT:
                self._local_to_global[(e.host, e.local_rank)] = e.rank
            self._local_any.setdefault(e.local_rank, set()).add(e.rank)
            if len(self._local_hosts) < 1024:
                self._local_hosts.add(e.host)
        if e.family == ev.EXIT and e.rank is not None and e.pid is not None:
            self._pid_to_rank[e.pid] = e.rank
        if e.family == ev.EXIT and e.rank is not None and e.local_rank is not None and e.detail != ev.FIRST_NOTICED:
            report = self._reported.setdefault((e.file, e.host), {}) if len(self._reported) < MAX_REPORTS else {}
            if len(report) < MAX_PENDING:
                report[e.local_rank] = e
        if e.rank is not None:
            logs.facts(e.rank).add(e)
            return
        if len(self._pending) < MAX_PENDING:
            self._pending.append(e)
        else:
            self._unattributed(e)

    def merge(self, other: Collector) -> None:
        """Take in another (unfinished) collector's events, as if its sources had been read after ours:
        sources are parsed one collector each, then the ones of one job are merged (diagnose/jobs.py)."""
        logs, theirs = self.evidence, other.evidence
        for r, f in theirs.ranks.items():
            logs.facts(r).merge(f)
        for p in theirs.dump_paths:
            if len(logs.dump_paths) < 32 and p not in logs.dump_paths:
                logs.dump_paths.append(p)
        for name in theirs.files:
            self.note_file(name)
        logs.slurm_cancel = logs.slurm_cancel or theirs.slurm_cancel
        if theirs.straggler is not None:
            logs.straggler, logs.straggler_cause = theirs.straggler, theirs.straggler_cause
        logs.world = max(logs.world, theirs.world)
        logs.bytes += theirs.bytes
        logs.lines += theirs.lines
        for e in theirs.unattributed:
            self._unattributed(e)
        for e in other._pending:
            if len(self._pending) < MAX_PENDING:
                self._pending.append(e)
            else:
                self._unattributed(e)
        for k, g in other._local_to_global.items():
            self._local_to_global.setdefault(k, g)
        for lr, gs in other._local_any.items():
            if len(self._local_any) < 100_000:
                self._local_any.setdefault(lr, set()).update(gs)
        self._local_hosts |= set(list(other._local_hosts)[: max(0, 1024 - len(self._local_hosts))])
        for pid, r in other._pid_to_rank.items():
            self._pid_to_rank.setdefault(pid, r)
        self._agent_pids.update(other._agent_pids)
        self._srun += other._srun[: max(0, MAX_PENDING - len(self._srun))]
        self._launcher_exit = self._launcher_exit or other._launcher_exit
        for key, report in other._reported.items():
            if key in self._reported or len(self._reported) < MAX_REPORTS:
                self._reported.setdefault(key, {}).update(report)

    def note_file(self, name: str) -> None:
        if len(self.evidence.files) < MAX_SEEN_FILES:
            self.evidence.files.append(name)

    def _unattributed(self, e: ev.Event) -> None:
        if self._unattributed_count[e.family] < 3 and e.family not in (ev.RANK_SEEN, ev.TRACEBACK):
            self.evidence.unattributed.append(e)
        self._unattributed_count[e.family] += 1

    def _resolve(self, e: ev.Event) -> int | None:
        if e.local_rank is not None:
            g = self._local_to_global.get((e.host, e.local_rank))
            if g is not None:
                return g
            cands = self._local_any.get(e.local_rank, set())
            if len(cands) == 1:
                return next(iter(cands))
        if e.pid is not None and e.pid in self._pid_to_rank:
            return self._pid_to_rank[e.pid]
        if e.local_rank is not None and e.local_rank not in self._local_any:
            identity = all(cands == {lr} for lr, cands in self._local_any.items())
            if identity:
                # nothing maps this local rank, and every mapping seen is local == global (one node) — seen on
                # this line's host; a line of another host is only a guess (its node's ranks start elsewhere)
                other_host = e.host is not None and None not in self._local_hosts and e.host not in self._local_hosts
                if not self._local_any or other_host:
                    self.evidence.local_only = True
                return e.local_rank
        return None

    def finish(self) -> Evidence:
        logs = self.evidence
        if not self._launcher_exit:
            for e in self._srun:
                if e.rank is not None:
                    logs.facts(e.rank).add(e)
        self._srun.clear()
        for e in self._pending:
            r = self._resolve(e)
            if r is None:
                self._unattributed(e)
            else:
                logs.facts(r).add(replace(e, rank=r))
        self._pending.clear()
        for pid in self._agent_pids:
            r = self._pid_to_rank.get(pid)
            if r is not None:
                logs.facts(r).agent_terminated = True
        for e in self._absent_workers(logs):
            if e.rank is not None and (e.rank not in logs.ranks or logs.ranks[e.rank].exit is None):
                logs.facts(e.rank).add(e)
        return logs

    def _absent_workers(self, logs: Evidence) -> list[ev.Event]:
        """Workers missing from their agent's failure report: they had exited 0. Its local ranks are
        0 … nproc-1 with global rank = local rank + the node's offset, so a local rank below the highest
        listed one is a worker that did not end non-zero. That it had *exited 0*, and was not merely still
        running, holds when either
        * the report lists ranks ended by SIGTERM: that torch elastic records the workers it terminated
          after the first failure (torch ≥ 2.x bookkeeping), so a worker still running would be listed; or
        * every listed rank lost its connection to a peer: a peer went away while they all still ran,
          and the missing worker is the only one that is not one of the victims.
        A rank that exits 0 while its peers still need it is uneven data or an early return. A rank missing
        above the highest listed one cannot be seen: the report does not give nproc."""
        out: list[ev.Event] = []
        for report in self._reported.values():
            offsets = {e.rank - lr for lr, e in report.items() if e.rank is not None}
            terminated = any(e.signal == "SIGTERM" for e in report.values())
            victims = all(
                e.rank is not None and (f := logs.ranks.get(e.rank)) is not None
                and f.counts[ev.PEER_LOST] > 0 and not f.has(ev.PRIMARY)
                for e in report.values()
            )
            if len(offsets) != 1 or not (terminated or victims):
                continue
            (offset,) = offsets
            anchor = min(report.values(), key=lambda e: e.line)
            for lr in range(max(report)):
                if lr not in report and offset + lr >= 0:
                    out.append(
                        replace(
                            anchor,
                            text=f"(rank {offset + lr} is not in this failure report: it had exited 0)",
                            rank=offset + lr,
                            local_rank=lr,
                            pid=None,
                            ts=None,
                            exitcode=0,
                            signal=None,
                            root_cause=False,
                            detail="not in torchrun's failure report: it had exited 0",
                        )
                    )
        return out


def collect(events: list[ev.Event]) -> Evidence:
    """Convenience for tests: fold a list of events."""
    c = Collector()
    for e in events:
        c.add(e)
    return c.finish()
