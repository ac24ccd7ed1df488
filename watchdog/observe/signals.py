"""Reading a rank's host signals: the kernel's per-process and per-cgroup counters (``core.host_signals``).

Run where the job owner's reader runs (the ``signals`` request registered here): the files are the kernel's, but which
cgroup a rank is in is the job's choice, so they are read with the owner's authority, like everything of
the job's. Each rank costs a handful of small reads (its threads' schedstat, status, stat, /proc/<pid>/cgroup
and three or four cgroup files); ``benchmarks/bench_signals.py`` measures the cost per poll. The host's own
pressure (``/proc/pressure``) is nobody's and is read by the daemon itself.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ..core.host_signals import (
    MISSING,
    HostPressure,
    RankCounters,
    parse_cgroup_mounts,
    parse_cpu_stat,
    parse_pressure,
    parse_proc_cgroup,
    parse_schedstat,
    parse_stat_counters,
    parse_status_switches,
)
from ..privsep.frames import WireError, w_int, w_str
from ..privsep.registry import Worker, handler

MAX_THREADS = 4096  # threads read per rank: a rank has tens; a thread bomb is not read to the end


def _read(path: str, limit: int = 4096) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def cgroup_mounts() -> tuple[str | None, str | None]:
    """(cgroup v2 mount, v1 cpu controller mount) of this process's mount namespace (read once)."""
    data = _read("/proc/self/mountinfo", 1 << 20)
    return parse_cgroup_mounts(data) if data else (None, None)


def read_rank(pid: int, proc_root: str = "/proc") -> RankCounters | None:
    """The counters of process ``pid``, None when it is gone or unreadable."""
    base = f"{proc_root}/{pid}"
    stat = _read(f"{base}/stat")
    st = parse_stat_counters(stat) if stat else None
    status = _read(f"{base}/status", 8192)
    sw = parse_status_switches(status) if status else None
    if st is None or sw is None:
        return None
    run = wait = 0
    try:
        tids = os.listdir(f"{base}/task")[:MAX_THREADS]
    except OSError:
        return None
    for tid in tids:
        data = _read(f"{base}/task/{tid}/schedstat", 256)
        got = parse_schedstat(data) if data else None
        if got is not None:  # a thread that ended between the listing and the read: its time is gone
            run += got[0]
            wait += got[1]
    throttled = nr = cpu_some = mem_some = io_some = MISSING
    where = ""
    cg = _read(f"{base}/cgroup", 8192)
    v2_path, v1_path = parse_proc_cgroup(cg) if cg else (None, None)
    v2_mount, v1_mount = cgroup_mounts()
    if v2_mount and v2_path is not None:
        d = os.path.join(v2_mount, v2_path.lstrip("/"))
        where = v2_path
        for name in ("cpu", "memory", "io"):
            data = _read(os.path.join(d, f"{name}.pressure"))
            p = parse_pressure(data) if data else None
            if p is not None:
                if name == "cpu":
                    cpu_some = p[1]
                elif name == "memory":
                    mem_some = p[1]
                else:
                    io_some = p[1]
        data = _read(os.path.join(d, "cpu.stat"))
        t = parse_cpu_stat(data) if data else None
        if t is not None:
            throttled, nr = t
    if throttled == MISSING and v1_mount and v1_path is not None:
        data = _read(os.path.join(v1_mount, v1_path.lstrip("/"), "cpu.stat"))
        t = parse_cpu_stat(data) if data else None
        if t is not None:
            throttled, nr = t
            where = where if where and where != "/" else v1_path
    return RankCounters(
        start_ticks=st[0], run_ns=run, wait_ns=wait, cpu_ticks=st[1], majflt=st[2], nvcsw=sw[1],
        throttled_us=throttled, nr_throttled=nr, cpu_some_us=cpu_some, mem_some_us=mem_some, io_some_us=io_some,
        cgroup=where[:256],
    )


def read_host(proc_root: str = "/proc") -> HostPressure:
    """The host's PSI (``/proc/pressure``); every field MISSING on a kernel without it."""
    got: dict[str, tuple[float, int]] = {}
    for name in ("cpu", "memory", "io"):
        data = _read(f"{proc_root}/pressure/{name}")
        p = parse_pressure(data) if data else None
        if p is not None:
            got[name] = p
    cpu, mem, io = (got.get(n, (0.0, MISSING)) for n in ("cpu", "memory", "io"))
    return HostPressure(cpu_some_us=cpu[1], mem_some_us=mem[1], io_some_us=io[1],
                        cpu_avg10=cpu[0], mem_avg10=mem[0], io_avg10=io[0])


_FIELDS = ("start_ticks", "run_ns", "wait_ns", "cpu_ticks", "majflt", "nvcsw", "throttled_us", "nr_throttled",
           "cpu_some_us", "mem_some_us", "io_some_us")


def counters_to_doc(c: RankCounters) -> dict[str, Any]:
    return {**{k: getattr(c, k) for k in _FIELDS}, "cgroup": c.cgroup}


def counters_from_doc(d: Any) -> RankCounters:
    """Back from a reader's answer, every field checked (WireError)."""
    if not isinstance(d, dict):
        raise WireError("signals: expected an object")
    vals = {k: w_int(d.get(k), MISSING) for k in _FIELDS}
    return RankCounters(**vals, cgroup=w_str(d.get("cgroup"), 256))


@handler("signals")
def _signals_request(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """The kernel's counters of each rank process and its cgroup, read as its owner: which cgroup a rank is
    in is the job's choice."""
    pids = req.get("pids")
    if not isinstance(pids, list) or len(pids) > w.policy.max_records:
        raise ValueError(f"pids: a list of at most {w.policy.max_records}")
    out: dict[str, Any] = {}
    for pid in (w_int(x, 1, 1 << 22) for x in pids):
        c = read_rank(pid)
        out[str(pid)] = counters_to_doc(c) if c is not None else None
    return {"ranks": out}
