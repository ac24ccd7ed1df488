"""Torch distributed ranks found in the process table, for a job that was never wrapped (``rankwatch inspect``).

No record, no hook: what a process is comes from what the launcher put in its environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``/``SLURM_JOB_ID``, ``GROUP_RANK``) and from the
process tree (the torchrun agent as parent). Everything read here is written by the job: environments are
read with a size bound, only known keys are kept, each value is bounded and validated (ranks are digits in
range), so a process that plants a huge or odd environment is left out with a note, never trusted.

Who counts:
* a *rank* is a process with a valid rank environment whose parent is not itself a rank of the same job
  and rank — a DataLoader worker or any other child inherits its rank's environment, so it is recorded as
  that rank's *worker*, never as a second rank;
* reading ``/proc/<pid>/environ`` needs the kernel's ptrace read check, so an unprivileged caller only ever
  sees processes it may ptrace; it must also run as their uid (py-spy attaches next);
* as root a process is taken only as a member of a job it provably belongs to: its parent is a torchrun
  agent owned by the same uid as the rank (real, effective and saved ids alike), and its environment agrees
  with the job's other ranks (one world size, one rank per global and local rank).

What is a job: the ranks of one torchrun agent run by one user — (owner uid, agent pid, run id) — not
the run id alone. A run id is in every rank's world-readable command line and environment; anyone can
start a rank that carries another user's, and grouped by it alone that rank would join (and, as a
second RANK=0, spoil) the other user's job. Ranks without an agent (only ever the caller's own: root
takes none) are grouped by (owner uid, run id).
Nothing here signals anything; a process that vanishes while it is read is simply not found.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..privsep.frames import w_int
from ..privsep.readers import ReaderError, Readers
from ..privsep.registry import Worker, handler

MAX_ENVIRON_BYTES = 1 << 20
"""A real environment is a few KiB (CUDA, Slurm and conda add up to tens); past 1 MiB we stop reading."""
MAX_ENV_VALUE = 256
"""Longer values of the keys we keep are not something a launcher wrote (ids, ports, paths): refused."""
MAX_CMDLINE_BYTES = 8192
MAX_WORLD = 1 << 20
"""No job has a million ranks; a larger world size is planted, not launched."""
MAX_DEPTH = 8
"""Parent hops followed from a worker up to its rank (a worker's own subprocesses are a few levels down)."""

RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
KEPT_KEYS = frozenset(
    {
        *RANK_KEYS,
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "SLURM_JOB_ID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    }
)
_SAFE_ID = re.compile(r"[^A-Za-z0-9._-]")
_AGENT_MARKERS = (b"torchrun", b"torch.distributed.run", b"torch.distributed.launch", b"torch/distributed/run.py")


@dataclass(frozen=True)
class Proc:
    """One process table entry: what ``/proc/<pid>/stat`` and ``status`` say (never job-written bytes)."""

    pid: int
    ppid: int
    state: str  # one letter, as in /proc/<pid>/stat
    start_ticks: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    utime_ticks: int = 0
    exit_code: int | None = None  # waitpid status of a zombie (stat field 52), None while alive
    # times the main thread blocked and was woken (``voluntary_ctxt_switches`` of /proc/<pid>/status,
    # which counts the thread-group leader alone); -1 when the kernel did not say
    wakeups: int = -1

    @property
    def uid(self) -> int:
        return self.uids[0] if self.uids else -1

    @property
    def one_uid(self) -> bool:
        """Real, effective and saved ids are one user: not a setuid program mid-flight."""
        return bool(self.uids) and len(set(self.uids)) == 1


@dataclass(frozen=True)
class RankProc:
    """A process proven (as far as the process table can prove it) to be one rank of a job."""

    pid: int
    rank: int
    local_rank: int
    world_size: int
    proc: Proc
    env: Mapping[str, str]
    workers: tuple[int, ...] = ()  # descendants that inherited this rank's environment (DataLoader workers)

    @property
    def node_rank(self) -> int:
        g = self.env.get("GROUP_RANK", "")
        return int(g) if g.isdigit() else -1


@dataclass
class Job:
    """One job's ranks on this node (several torchrun agents of one job on one host: several nodes)."""

    job_id: str
    world_size: int
    ranks: list[RankProc] = field(default_factory=list)
    agents: dict[int, Proc] = field(default_factory=dict)  # the torchrun agents the ranks run under
    zombies: list[Proc] = field(default_factory=list)  # exited children of the agents, not yet reaped
    owner_uid: int = -1
    launcher: int = -1  # the torchrun agent whose process tree this job is (-1: ranks without an agent)

    @property
    def label(self) -> str:
        """The job as a person tells it apart from another with the same run id."""
        return self.job_id + (f" (agent pid {self.launcher}, uid {self.owner_uid})" if self.launcher > 0 else "")

    @property
    def local_world_size(self) -> int:
        sizes = {r.env.get("LOCAL_WORLD_SIZE", "") for r in self.ranks}
        if len(sizes) == 1 and (s := sizes.pop()).isdigit():
            return int(s)
        return len(self.ranks)

    def missing_ranks(self) -> list[tuple[int, int]]:
        """(global rank, node rank) of each local rank the launcher started on a node here but that is no
        longer there: per agent, local ranks run 0..LOCAL_WORLD_SIZE-1 and global = base + local."""
        out: list[tuple[int, int]] = []
        by_agent: dict[int, list[RankProc]] = defaultdict(list)
        for r in self.ranks:
            by_agent[r.proc.ppid].append(r)
        for ranks in by_agent.values():
            bases = {r.rank - r.local_rank for r in ranks}
            sizes = {r.env.get("LOCAL_WORLD_SIZE", "") for r in ranks}
            if len(bases) != 1 or len(sizes) != 1 or not (size := sizes.pop()).isdigit():
                continue
            base, present = bases.pop(), {r.local_rank for r in ranks}
            node = ranks[0].node_rank
            out += [(base + lr, node) for lr in range(int(size)) if lr not in present and base + lr < self.world_size]
        return sorted(out)


@dataclass
class Discovery:
    jobs: list[Job]
    notes: list[str]  # processes left out, and why (bounded)
    idle_agents: list[int] = field(default_factory=list)  # torchrun agents without a live rank (torn down)


def read_proc(pid: int, proc_root: str = "/proc") -> Proc | None:
    """``stat`` and the ``Uid:`` line of ``status``; None when the process is gone or unreadable."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read(4096)
        fields = data[data.rindex(b")") + 2 :].split()
        uids: tuple[int, ...] = ()
        wakeups = -1
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f.read(16384).splitlines():
                if line.startswith(b"Uid:"):
                    uids = tuple(int(x) for x in line.split()[1:5])
                elif line.startswith(b"voluntary_ctxt_switches:"):
                    wakeups = int(line.split()[1])
        state = fields[0].decode("ascii", "replace")
        exit_code = int(fields[49]) if len(fields) > 49 and state in ("Z", "X") else None
        return Proc(
            pid=pid,
            ppid=int(fields[1]),
            state=state,
            start_ticks=int(fields[19]),
            uids=uids,
            utime_ticks=int(fields[11]) + int(fields[12]),
            exit_code=exit_code,
            wakeups=wakeups,
        )
    except (OSError, ValueError, IndexError):
        return None


def _kept(key: object, value: object) -> bool:
    """The one rule for an environment entry we keep: a kept key, a bounded printable ASCII value."""
    return (isinstance(key, str) and key in KEPT_KEYS and isinstance(value, str) and len(value) <= MAX_ENV_VALUE
            and value.isascii() and value.isprintable())


def parse_environ(raw: bytes) -> dict[str, str]:
    """The kept keys of a NUL-separated environment block; odd entries are skipped, never guessed at."""
    out: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if not sep or len(value) > MAX_ENV_VALUE:
            continue
        try:
            k, v = key.decode("ascii"), value.decode("ascii")
        except UnicodeDecodeError:
            continue
        if _kept(k, v):
            out[k] = v
    return out


def checked_env(value: object) -> dict[str, str] | None:
    """An environment as a reader sent it, held to what ``parse_environ`` keeps (anything else: None)."""
    if not isinstance(value, dict) or len(value) > len(KEPT_KEYS):
        return None
    return dict(value) if all(_kept(k, v) for k, v in value.items()) else None


def read_environ(pid: int, proc_root: str = "/proc") -> dict[str, str] | None:
    """The process's kept environment; None when the kernel refuses (not ours to ptrace) or it is gone."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            raw = f.read(MAX_ENVIRON_BYTES)
    except OSError:
        return None
    return parse_environ(raw)


def read_cmdline(pid: int, proc_root: str = "/proc") -> bytes:
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
            return f.read(MAX_CMDLINE_BYTES)
    except OSError:
        return b""


def is_agent_cmdline(cmdline: bytes) -> bool:
    """A torchrun elastic agent: ``torchrun …``, ``python -m torch.distributed.run …`` (or ``.launch``)."""
    argv = cmdline.split(b"\0")[:4]
    return any(m in a for a in argv for m in _AGENT_MARKERS)


def rank_fields(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when the environment holds a valid triple, else None."""
    values = [env.get(k, "") for k in RANK_KEYS]
    if not all(v.isdigit() and len(v) <= 7 for v in values):
        return None
    rank, local, world = (int(v) for v in values)
    if not 0 < world <= MAX_WORLD or rank >= world or local >= world:
        return None
    return rank, local, world


def job_id_of(env: Mapping[str, str], agent_pid: int) -> str:
    """The job id as rankwatch names jobs (TORCHELASTIC_RUN_ID, SLURM_JOB_ID), else the rendezvous address.

    torchrun without ``--rdzv-id`` sets the run id to ``none``; the master address then tells jobs apart."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        raw = run_id
    elif env.get("SLURM_JOB_ID"):
        raw = f"slurm-{env['SLURM_JOB_ID']}"
    elif env.get("MASTER_PORT"):
        raw = f"{env.get('MASTER_ADDR', 'localhost')}-{env['MASTER_PORT']}"
    else:
        raw = f"agent-{agent_pid}"
    safe = _SAFE_ID.sub("_", raw)[:64]
    # the id names a directory of the bundle: never ".", "..", or hidden
    return "_" + safe[1:] if safe.startswith(".") else safe or f"agent-{agent_pid}"


def _scan(proc_root: str) -> dict[int, Proc]:
    table: dict[int, Proc] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return table
    for name in names:
        if name.isdigit() and (p := read_proc(int(name), proc_root)) is not None:
            table[p.pid] = p
    return table


EnvReader = Callable[[int, list[int]], Mapping[int, "dict[str, str] | None"]]
"""(owner uid, pids of that owner) → each one's kept environment, read with that owner's authority."""


def _candidates(
    table: Mapping[int, Proc], skip: set[int], uid: int, proc_root: str, env_reader: EnvReader | None
) -> tuple[dict[int, dict[str, str]], dict[int, tuple[int, int, int]]]:
    """The live processes the caller may read whose environment names a rank: (environ, rank fields) by pid."""
    by_owner: dict[int, list[int]] = defaultdict(list)
    for pid, p in table.items():
        if pid in skip or p.state in ("Z", "X"):
            continue
        if uid != 0 and p.uid != uid:
            continue  # not ours: the kernel would refuse its environment anyway
        by_owner[p.uid].append(pid)
    envs: dict[int, dict[str, str]] = {}
    fields: dict[int, tuple[int, int, int]] = {}
    for owner, pids in by_owner.items():
        if env_reader is not None and owner != 0:
            got = env_reader(owner, pids)
        else:
            got = {pid: read_environ(pid, proc_root) for pid in pids}
        for pid in pids:
            env = got.get(pid)
            if env is None or (f := rank_fields(env)) is None:
                continue
            envs[pid], fields[pid] = env, f
    return envs, fields


def _workers(
    table: Mapping[int, Proc], envs: Mapping[int, Mapping[str, str]], fields: Mapping[int, tuple[int, int, int]]
) -> tuple[dict[int, int], dict[int, list[int]]]:
    """(candidate → the candidate it is a worker of, rank → its workers)."""
    # a candidate whose ancestor is a candidate of the same job and rank is that rank's worker
    worker_of: dict[int, int] = {}
    for pid in fields:
        up, hops = table[pid].ppid, 0
        while up in table and hops < MAX_DEPTH:
            if up in fields and fields[up][0] == fields[pid][0] and envs[up].get("TORCHELASTIC_RUN_ID") == envs[
                pid
            ].get("TORCHELASTIC_RUN_ID"):
                worker_of[pid] = up
            up, hops = table[up].ppid, hops + 1
    # the outermost matching ancestor is the rank (a worker's own child maps to the rank, not the worker)
    workers: dict[int, list[int]] = defaultdict(list)
    for pid, top in worker_of.items():
        while top in worker_of:
            top = worker_of[top]
        workers[top].append(pid)
    return worker_of, workers


def discover(
    *,
    proc_root: str = "/proc",
    caller_uid: int | None = None,
    protected: Iterable[int] = (),
    env_reader: EnvReader | None = None,
) -> Discovery:
    """Every job with ranks on this node that the caller may inspect (pure reads of ``proc_root``; a user's
    environments through ``env_reader`` where given — as root, the job owner's reader: root never parses
    what a job wrote)."""
    uid = os.geteuid() if caller_uid is None else caller_uid
    skip = {0, 1, os.getpid(), *protected}
    table = _scan(proc_root)
    notes: list[str] = []
    envs, fields = _candidates(table, skip, uid, proc_root, env_reader)
    worker_of, workers = _workers(table, envs, fields)
    agent_cache: dict[int, bool] = {}
    jobs: dict[tuple[int, int, str], Job] = {}
    for pid in sorted(set(fields) - set(worker_of)):
        p, env = table[pid], envs[pid]
        rank, local, world = fields[pid]
        parent = table.get(p.ppid)
        if p.ppid not in agent_cache:
            agent_cache[p.ppid] = parent is not None and is_agent_cmdline(read_cmdline(p.ppid, proc_root))
        has_agent = agent_cache[p.ppid]
        if uid == 0:
            why = None
            if not has_agent or parent is None:
                why = "its parent is not a torchrun agent, so as root it cannot be proven to belong to a job"
            elif not (p.one_uid and parent.one_uid and parent.uid == p.uid):
                why = f"it and its torchrun agent (pid {p.ppid}) do not run as one and the same user"
            if why is not None:
                notes.append(f"pid {pid} (RANK={rank}) left out: {why}")
                continue
        job_id = job_id_of(env, p.ppid if has_agent else pid)
        launcher = p.ppid if has_agent else -1
        job = jobs.setdefault((p.uid, launcher, job_id),
                              Job(job_id=job_id, world_size=world, owner_uid=p.uid, launcher=launcher))
        job.ranks.append(
            RankProc(pid, rank, local, world, p, env, workers=tuple(sorted(workers.get(pid, ()))))
        )
        if has_agent and parent is not None:
            job.agents[p.ppid] = parent
    busy = {a for j in jobs.values() for a in j.agents}
    idle = sorted(
        pid for pid, p in table.items()
        if pid not in busy and pid not in skip and (uid == 0 or p.uid == uid) and p.state not in ("Z", "X")
        and is_agent_cmdline(read_cmdline(pid, proc_root))
        and not any(q.ppid == pid and q.pid in fields for q in table.values())
    )
    out = []
    for job in jobs.values():
        if (why := _inconsistent(job)) is not None:
            notes.append(f"job {job.label} left out: {why}")
            continue
        job.ranks.sort(key=lambda r: r.rank)
        job.zombies = sorted(
            (q for q in table.values() if q.ppid in job.agents and q.state in ("Z", "X")), key=lambda q: q.pid
        )
        out.append(job)
    return Discovery(sorted(out, key=lambda j: (j.job_id, j.launcher)), notes[:100], idle[:20])


def _inconsistent(job: Job) -> str | None:
    """Why the ranks grouped as one job cannot be one (None: they can)."""
    if len({r.world_size for r in job.ranks}) != 1:
        return "its processes disagree on WORLD_SIZE"
    if len({r.proc.uid for r in job.ranks}) != 1:
        return "its processes run as different users"
    seen: dict[int, int] = {}
    for r in job.ranks:
        if r.rank in seen:
            return f"RANK={r.rank} is claimed by pids {seen[r.rank]} and {r.pid}"
        seen[r.rank] = r.pid
    per_agent: dict[int, set[int]] = defaultdict(set)
    for r in job.ranks:
        if r.local_rank in per_agent[r.proc.ppid]:
            return f"LOCAL_RANK={r.local_rank} appears twice under pid {r.proc.ppid}"
        per_agent[r.proc.ppid].add(r.local_rank)
    return None


def select(
    found: Discovery, *, pids: Sequence[int] = (), job_id: str | None = None
) -> tuple[list[Job], str | None]:
    """The jobs ``--pid``/``--job`` ask for, or an error line. A pid may be a rank, one of its workers or a
    torchrun agent: it selects every rank of that agent (this node's part of the job — one rank alone says
    nothing about who waits for whom); a rank without an agent selects itself."""
    jobs = found.jobs
    if job_id is not None:
        jobs = [j for j in jobs if j.job_id == job_id]
        if not jobs:
            known = ", ".join(j.job_id for j in found.jobs) or "none"
            return [], f"no job {job_id!r} among this node's ranks (jobs found: {known})"
    if not pids:
        return jobs, None
    asked = set(pids)
    out: list[Job] = []
    unmatched = set(asked)
    for j in jobs:
        hits = [r for r in j.ranks if r.pid in asked or r.proc.ppid in asked or set(r.workers) & asked]
        if not hits:
            continue
        unmatched -= {r.pid for r in hits} | {r.proc.ppid for r in hits} | {w for r in hits for w in r.workers}
        agents = {a: p for a, p in j.agents.items() if a in {r.proc.ppid for r in hits}}
        keep = [r for r in j.ranks if r in hits or r.proc.ppid in agents]
        out.append(Job(j.job_id, j.world_size, keep, agents, [z for z in j.zombies if z.ppid in agents], j.owner_uid,
                       j.launcher))
    if unmatched:
        return [], (
            f"pid {sorted(unmatched)[0]} is not a torch distributed rank, worker or torchrun agent this user may "
            "inspect"
        )
    return out, None


# -- environments read as their owner (``rankwatch inspect`` as root) ------------------------------------
@handler("environ")
def _environ_request(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """The kept rank keys of each process's environment, read and parsed as their owner (the kernel's
    ptrace read check applies to this uid: another user's process answers None)."""
    pids = req.get("pids")
    if not isinstance(pids, list) or len(pids) > 4096:
        raise ValueError("pids: a list of at most 4096")
    return {"envs": {str(pid): read_environ(pid) for pid in (w_int(x, 1, 1 << 22) for x in pids)}}


def environs_as(readers: Readers, uid: int, pids: list[int]) -> dict[int, dict[str, str] | None]:
    """Each process's kept environment read by ``uid``'s reader and checked here (discovery as root);
    unreadable (no reader, late, malformed) is None for all: those processes are simply not found."""
    try:
        out = readers.ask(uid, uid, {"op": "environ", "pids": pids}, timeout_s=10.0)
    except ReaderError:
        return {}
    envs = out.get("envs")
    if not isinstance(envs, dict):
        return {}
    return {pid: checked_env(envs.get(str(pid))) for pid in pids}


def env_reader_of(readers: Readers) -> EnvReader:
    """``discover``'s ``env_reader`` as root: every user's environments read by that user's reader."""
    return lambda uid, pids: environs_as(readers, uid, pids)
