"""Which sources belong to which job: a directory of logs may hold several jobs, and their ranks must
never be mixed (rank 3 of one job is not rank 3 of another). Pure: sources' facts in, groups out.

What a source says about its job (``SourceInfo``):

* **keys** — a torchrun run id (launch config ``run_id``, ``TORCHELASTIC_RUN_ID=``, ``--rdzv-id``, the
  ``<run_id>_<8 chars>/attempt_N/`` directory of ``--log-dir``), a Slurm job id (``SLURM_JOB_ID=``,
  ``slurm-<id>.out``, slurmstepd's ``*** STEP <id>.<s> …``, srun's ``StepId=<id>.``), the rendezvous
  endpoint (torchrun's ``master_addr=``/``master_port=`` rendezvous result, ``rdzv_endpoint``,
  ``MASTER_ADDR=``/``MASTER_PORT=``); a run id of ``none`` and port 0 say nothing;
* **who printed** — global ranks named by line prefixes or the path (local ranks apart), the torchrun
  launcher's pid (its own log headers), hosts named (failure report, NCCL lines);
* **when** — the span of its timestamps (glog headers, wall-clock prefixes, the failure report, dmesg -T).

The rule (``group``):

1. Two sources *conflict* — different jobs — when they name different run ids, Slurm job ids or master
   ports, or when the same global rank printed in both but at disjoint times, under different torchrun
   launchers or on different hosts (one rank is one process: it cannot be two).
2. Sources that share a key and do not conflict are one job.
3. A source with ranks but no key joins the one job it does not conflict with; if it conflicts with every
   job it (with others like it, while they do not conflict) is a job of its own; if several jobs fit,
   the one whose sources share the deepest directory with it wins, and on a tie it stays ungrouped —
   reported, never guessed.
4. A source without any rank line (dmesg, notes) is unrelated to any one job by itself: it joins the only
   job there is, else the one job whose time span overlaps its own (every job when it has no time),
   nearest in the directory tree as in 3; otherwise it stays ungrouped.
A source that names several run ids or Slurm jobs (a launch script, logs pasted together) links to none
of them by that key.
5. No keys and no conflicts anywhere: everything is one job (what ``diagnose`` always did).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..core.policy import GroupingPolicy

__all__ = ["DEFAULT_GROUPING", "Grouping", "GroupingPolicy", "SourceInfo", "conflict", "group", "job_id",
           "job_label", "read_head", "read_path"]

RUN, SLURM, RDZV, PORT = "run", "slurm", "rdzv", "port"
LINK_KINDS = (RUN, SLURM, RDZV)  # sharing one of these makes two sources one job
CONFLICT_KINDS = (RUN, SLURM, PORT)  # differing in one of these makes them two jobs
LABEL = {RUN: "torchrun run", SLURM: "Slurm job", RDZV: "rendezvous"}
MAX_VALUES = 16  # values kept per key kind and source (a concatenated log may carry a few)


DEFAULT_GROUPING = GroupingPolicy()


@dataclass
class SourceInfo:
    name: str
    folder: str = ""  # the directory it sits in ("" for stdin): the tie-breaker between jobs that fit
    keys: dict[str, set[str]] = field(default_factory=dict)
    ranks: set[int] = field(default_factory=set)  # global ranks that printed here
    local_ranks: set[int] = field(default_factory=set)
    launchers: set[int] = field(default_factory=set)  # torchrun agent pids
    hosts: set[str] = field(default_factory=set)
    t_min: float | None = None
    t_max: float | None = None

    def add_key(self, kind: str, value: str) -> None:
        vals = self.keys.setdefault(kind, set())
        if len(vals) < MAX_VALUES:
            vals.add(value)

    def saw_time(self, ts: float | None) -> None:
        if ts is None:
            return
        self.t_min = ts if self.t_min is None else min(self.t_min, ts)
        self.t_max = ts if self.t_max is None else max(self.t_max, ts)

    def links(self, kind: str) -> set[str]:
        """Values of ``kind`` that tie this source to a job: one only — a source naming several run ids or
        Slurm jobs (a launch script, logs pasted together) cannot say which job it belongs to."""
        vals = self.keys.get(kind, set())
        return vals if len(vals) == 1 else set()

    @property
    def linked(self) -> bool:
        return any(self.links(k) for k in LINK_KINDS)

    @property
    def ranked(self) -> bool:
        return bool(self.ranks or self.local_ranks)


# -- what the head of a source says ----------------------------------------------------------------
# Each pattern starts with a literal, so the regex engine skips to candidates at C speed (a 1 MiB head
# costs well under a millisecond per pattern when the literal is absent).
_RUN_IDS = (
    re.compile(r"run_id\s*[:=]\s*([\w.\-]{1,128})"),  # launch config "run_id : x", "run_id=x"
    re.compile(r"TORCHELASTIC_RUN_ID=([\w.\-]{1,128})"),
    re.compile(r"--rdzv[-_]id[= ]([\w.\-]{1,128})"),
    re.compile(r"torchelastic_\w+[/\\]([\w.\-]{1,128})_[a-z0-9_]{8}\b"),  # "log directory set to: …"
)
_SLURM_IDS = (
    re.compile(r"SLURM_JOB_?ID\s*[:=]\s*(\d{1,12})\b"),
    re.compile(r"\*\*\* (?:STEP|JOB) (\d{1,12})\b"),
    re.compile(r"StepId=(\d{1,12})\."),
    re.compile(r"srun: job (\d{1,12}) (?:queued|has been allocated)"),
)
_MASTER_ADDR = (
    re.compile(r"master_addr\s*[:=]\s*([\w.\-]{1,128})"),
    re.compile(r"MASTER_ADDR=([\w.\-]{1,128})"),
    re.compile(r"--master[-_]addr[= ]([\w.\-]{1,128})"),
)
_MASTER_PORT = (
    re.compile(r"master_port\s*[:=]\s*(\d{1,5})\b"),
    re.compile(r"MASTER_PORT=(\d{1,5})\b"),
    re.compile(r"--master[-_]port[= ](\d{1,5})\b"),
)
_RDZV_ENDPOINT = (
    re.compile(r"rdzv_endpoint\s*:\s*([\w.\-]{1,128}):(\d{1,5})\b"),
    re.compile(r"--rdzv[-_]endpoint[= ]([\w.\-]{1,128}):(\d{1,5})\b"),
)
# torch.distributed's Python logging header of the launcher itself: "W1130 19:34:39.610000 10481 …/torch/…"
_LAUNCHER_AT = "torch/distributed/"
_LAUNCHER = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(\d{1,8}) \S*$")
# path of torchrun --log-dir files: <log-dir>/<run_id>_<8 random>/attempt_<n>/<local rank>/…
_LOGDIR_RUN = re.compile(r"(?:^|[/\\])([\w.\-]{1,128})_[a-z0-9_]{8}[/\\]attempt_\d+[/\\]")
_SLURM_NAME = re.compile(r"^slurm-(\d{1,12})(?:[_.][\w.\-]*)?\.(?:out|err|log|txt)$")
_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                        "Nov", "Dec"), 1)}
_TIMES = re.compile(
    r"\b\d{4}-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)"  # ISO-ish, the failure report's time field
    r"|(?<![\w.])[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.\d+ "  # glog / torch logging headers
    r"|\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) (" + "|".join(_MONTHS) + r") +(\d{1,2}) (\d\d):(\d\d):(\d\d) \d{4}\]"
)
TIME_WINDOW = 16 << 10  # characters at each end of the head searched for timestamps (the parser adds the rest)


def _scale(month: int, day: int, hh: int, mm: int, ss: int) -> float:
    """The scale of ``patterns.glog_time`` (no year), so every format compares."""
    return float(((month * 31 + day) * 24 + hh) * 3600 + mm * 60 + ss)


def _first(patterns: tuple[re.Pattern[str], ...], text: str) -> re.Match[str] | None:
    found = [m for p in patterns if (m := p.search(text))]
    return min(found, key=lambda m: m.start()) if found else None


def read_head(info: SourceInfo, head: str) -> None:
    """Job keys, launcher pids and times from the start of a source."""
    for p in _RUN_IDS:
        for m in p.finditer(head):
            if m.group(1).lower() != "none":
                info.add_key(RUN, m.group(1))
    for p in _SLURM_IDS:
        for m in p.finditer(head):
            info.add_key(SLURM, m.group(1))
    # the rendezvous endpoint names the job; without one, the first MASTER_ADDR:MASTER_PORT. Every port
    # named is kept for conflicts only (a c10d rendezvous result's master_port differs from the endpoint's)
    ep = _first(_RDZV_ENDPOINT, head)
    addr = _first(_MASTER_ADDR, head)
    port = _first(_MASTER_PORT, head)
    if ep and int(ep.group(2)) > 0:
        info.add_key(RDZV, f"{ep.group(1)}:{ep.group(2)}")
        info.add_key(PORT, ep.group(2))
    elif addr and port and int(port.group(1)) > 0:
        info.add_key(RDZV, f"{addr.group(1)}:{port.group(1)}")
    for p in _MASTER_PORT:
        for m in p.finditer(head):
            if int(m.group(1)) > 0:
                info.add_key(PORT, m.group(1))
    i = head.find(_LAUNCHER_AT)
    while i >= 0 and len(info.launchers) < MAX_VALUES:
        line_start = head.rfind("\n", 0, i) + 1
        hdr = _LAUNCHER.search(head, line_start, i)  # a wrapper's prefix may come first
        if hdr:
            info.launchers.add(int(hdr.group(1)))
        nl = head.find("\n", i)
        i = head.find(_LAUNCHER_AT, nl) if nl >= 0 else -1
    windows = (head[:TIME_WINDOW], head[-TIME_WINDOW:]) if len(head) > 2 * TIME_WINDOW else (head,)
    for text in windows:
        for m in _TIMES.finditer(text):
            g = m.groups()
            if g[0]:
                t = _scale(*(int(x) for x in g[0:5]))
            elif g[5]:
                t = _scale(*(int(x) for x in g[5:10]))
            else:
                t = _scale(_MONTHS[g[10]], *(int(x) for x in g[11:15]))
            info.saw_time(t)


def read_path(info: SourceInfo, path: str | None) -> None:
    """Keys a source's location carries (torchrun --log-dir run directory, slurm-<id>.out)."""
    if not path:
        return
    m = _LOGDIR_RUN.search(path)
    if m and m.group(1).lower() != "none":
        info.add_key(RUN, m.group(1))
    m = _SLURM_NAME.match(os.path.basename(path))
    if m:
        info.add_key(SLURM, m.group(1))


# -- grouping ----------------------------------------------------------------------------------------
@dataclass
class _Group:
    members: list[int] = field(default_factory=list)  # indices into the sources
    info: SourceInfo = field(default_factory=lambda: SourceInfo(""))

    def absorb(self, i: int, s: SourceInfo) -> None:
        self.members.append(i)
        g = self.info
        for kind, vals in s.keys.items():
            for v in vals:
                g.add_key(kind, v)
        g.ranks |= s.ranks
        g.local_ranks |= s.local_ranks
        g.launchers |= s.launchers
        g.hosts |= s.hosts
        g.saw_time(s.t_min)
        g.saw_time(s.t_max)


@dataclass
class Grouping:
    jobs: list[list[int]]  # source indices per job, in source order, jobs by their first source
    ungrouped: list[int]


def _overlap(a: SourceInfo, b: SourceInfo, slack: float) -> bool:
    """Time spans overlap (or one of them is unknown)."""
    if a.t_min is None or b.t_min is None or a.t_max is None or b.t_max is None:
        return True
    return a.t_min <= b.t_max + slack and b.t_min <= a.t_max + slack


def conflict(a: SourceInfo, b: SourceInfo, p: GroupingPolicy = DEFAULT_GROUPING) -> bool:
    """True when the two cannot be one job."""
    for kind in CONFLICT_KINDS:
        va, vb = a.keys.get(kind), b.keys.get(kind)
        if va and vb and not va & vb:
            return True
    if a.ranks & b.ranks:
        if not _overlap(a, b, p.time_slack_s):
            return True
        if a.launchers and b.launchers and not a.launchers & b.launchers:
            return True
        if a.hosts and b.hosts and not a.hosts & b.hosts:
            return True
    elif not (a.ranks or b.ranks) and a.local_ranks & b.local_ranks and not _overlap(a, b, p.time_slack_s):
        return True  # only local ranks ("[default3]:" without "[rank3]:"): time is all there is
    return False


def _shares_key(group: SourceInfo, s: SourceInfo) -> bool:
    return any(group.keys.get(k, set()) & s.links(k) for k in LINK_KINDS)


def _depth(a: str, b: str) -> int:
    """How many leading directories two folders share."""
    pa, pb = a.replace("\\", "/").split("/"), b.replace("\\", "/").split("/")
    n = 0
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        n += 1
    return n


def _nearest(fits: list[_Group], s: SourceInfo, infos: Sequence[SourceInfo]) -> _Group | None:
    """The one fitting job whose sources sit closest to ``s`` in the directory tree, or None on a tie."""
    if len(fits) == 1:
        return fits[0]
    if not fits:
        return None
    depth = [max(_depth(s.folder, infos[i].folder) for i in g.members) for g in fits]
    best = max(depth)
    winners = [g for g, d in zip(fits, depth, strict=True) if d == best]
    return winners[0] if len(winners) == 1 else None


def group(infos: Sequence[SourceInfo], p: GroupingPolicy = DEFAULT_GROUPING) -> Grouping:
    groups: list[_Group] = []
    # 1-2: sources with a key: join the job they share a key with, unless they conflict with it
    for i, s in enumerate(infos):
        if not s.linked:
            continue
        home = next((g for g in groups if _shares_key(g.info, s) and not conflict(g.info, s, p)), None)
        if home is None:
            home = _Group()
            groups.append(home)
        home.absorb(i, s)
    keyed = len(groups)
    # 3: ranked sources without a key
    ungrouped: list[int] = []
    for i, s in enumerate(infos):
        if s.linked or not s.ranked:
            continue
        fits = [g for g in groups[:keyed] if not conflict(g.info, s, p)]
        home = _nearest(fits, s, infos)
        if home is not None:
            home.absorb(i, s)
        elif fits:
            ungrouped.append(i)
        else:
            own = next((g for g in groups[keyed:] if not conflict(g.info, s, p)), None)
            if own is None:
                own = _Group()
                groups.append(own)
            own.absorb(i, s)
    # 4: sources without a rank line
    rankless = [i for i, s in enumerate(infos) if not s.linked and not s.ranked]
    if not groups:
        if rankless:
            groups.append(_Group())
            for i in rankless:
                groups[0].absorb(i, infos[i])
    else:
        for i in rankless:
            s = infos[i]
            if len(groups) == 1:
                groups[0].absorb(i, s)
                continue
            # several jobs: the ones its time span overlaps (all of them when it has none), nearest first
            fits = [g for g in groups if _overlap(g.info, s, p.rankless_slack_s)]
            home = _nearest(fits, s, infos)
            if home is not None:
                home.absorb(i, s)
            else:
                ungrouped.append(i)
    jobs = sorted((sorted(g.members) for g in groups if g.members), key=lambda m: m[0])
    return Grouping(jobs, sorted(ungrouped))


def job_label(infos: Sequence[SourceInfo], members: Sequence[int]) -> str | None:
    """The job's identity as text ("Slurm job 48811"), from the strongest key its sources share."""
    for kind in (RUN, SLURM, RDZV):
        vals = sorted({v for i in members for v in infos[i].keys.get(kind, ())})
        if vals:
            return f"{LABEL[kind]} {', '.join(vals[:3])}"
    return None


def job_id(infos: Sequence[SourceInfo], members: Sequence[int]) -> str | None:
    """A short id for the verdict document's ``job_id`` ("slurm:48811"), when a key names the job."""
    for kind in (RUN, SLURM, RDZV):
        vals = sorted({v for i in members for v in infos[i].keys.get(kind, ())})
        if vals:
            return f"{kind}:{vals[0]}"
    return None
