"""What the kernel says about a rank's process and its host: pure parsers and plain counters.

A straggler's time goes somewhere the rank's own code does not see: waiting for a CPU (other processes on
its cores), a CPU quota (its cgroup is throttled), memory or I/O stalls. The kernel counts each of these
per process or per cgroup, cumulatively, in files that cost microseconds to read; the watchdog samples them
at its poll rate from outside the rank (``observe.signals``) and ``core.straggler_cause`` turns the counters'
deltas into a cause. This module only parses: each function takes a file's bytes and returns numbers, so
it is tested on recorded real contents (``tests/fixtures/proc``).

Every counter here is cumulative and only grows while the process (or cgroup) lives; a sample that goes
backwards (a restarted rank, a pid reused) gives no delta at all rather than a negative one.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSING = -1  # a counter the host does not have (no cgroup v2 pressure, no cpu controller, no PSI)


@dataclass(frozen=True)
class RankCounters:
    """One rank's cumulative counters at one instant (nanoseconds, microseconds or counts as named)."""

    start_ticks: int  # the process's start time (``/proc/<pid>/stat`` field 22): tells a reused pid apart
    run_ns: int  # on a CPU, summed over its threads (``task/*/schedstat`` field 1)
    wait_ns: int  # runnable but waiting for a CPU, summed over its threads (``schedstat`` field 2)
    cpu_ticks: int  # utime + stime of the whole process (clock ticks)
    majflt: int  # major page faults of the whole process (a page read from disk or swap)
    nvcsw: int  # involuntary context switches of its main thread (the training thread)
    throttled_us: int = MISSING  # its cgroup's time throttled by a CPU quota (v2 throttled_usec / v1 throttled_time)
    nr_throttled: int = MISSING  # its cgroup's periods throttled
    cpu_some_us: int = MISSING  # its cgroup's PSI "some" totals (v2 cpu/memory/io.pressure)
    mem_some_us: int = MISSING
    io_some_us: int = MISSING
    cgroup: str = ""  # the cgroup these were read from (v2 path, else the v1 cpu controller's)


@dataclass(frozen=True)
class HostPressure:
    """The host's PSI "some" totals (µs) and 10 s averages (%): a slowdown every rank shares."""

    cpu_some_us: int = MISSING
    mem_some_us: int = MISSING
    io_some_us: int = MISSING
    cpu_avg10: float = 0.0
    mem_avg10: float = 0.0
    io_avg10: float = 0.0


def parse_schedstat(data: bytes) -> tuple[int, int] | None:
    """(on-CPU ns, run-queue wait ns) from ``/proc/<pid>/task/<tid>/schedstat`` ("run wait timeslices")."""
    parts = data.split()
    if len(parts) < 2:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def parse_status_switches(data: bytes) -> tuple[int, int] | None:
    """(voluntary, nonvoluntary) context switches from ``/proc/<pid>/status``."""
    vol = invol = None
    for line in data.splitlines():
        if line.startswith(b"voluntary_ctxt_switches:"):
            vol = _int(line.split(b":", 1)[1])
        elif line.startswith(b"nonvoluntary_ctxt_switches:"):
            invol = _int(line.split(b":", 1)[1])
    return (vol, invol) if vol is not None and invol is not None else None


def parse_stat_counters(data: bytes) -> tuple[int, int, int] | None:
    """(start ticks, utime + stime ticks, major faults) from ``/proc/<pid>/stat``.

    The command name may hold spaces and parentheses, so fields are counted after its last ')': there the
    state is field 3 of proc(5), majflt 12, utime 14, stime 15, starttime 22."""
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return int(fields[19]), int(fields[11]) + int(fields[12]), int(fields[9])
    except (ValueError, IndexError):
        return None


def parse_cpu_stat(data: bytes) -> tuple[int, int] | None:
    """(throttled µs, throttled periods) from a cgroup's ``cpu.stat``: v2 ``throttled_usec``, v1
    ``throttled_time`` (ns). None where the file has no throttling lines (v2 without the cpu controller)."""
    vals: dict[bytes, int] = {}
    for line in data.splitlines():
        k, _, v = line.partition(b" ")
        n = _int(v)
        if n is not None:
            vals[k] = n
    nr = vals.get(b"nr_throttled")
    if nr is None:
        return None
    if b"throttled_usec" in vals:
        return vals[b"throttled_usec"], nr
    if b"throttled_time" in vals:
        return vals[b"throttled_time"] // 1000, nr
    return None


def parse_pressure(data: bytes) -> tuple[float, int] | None:
    """("some" avg10 %, "some" total µs) from a PSI file (``/proc/pressure/*``, a cgroup's ``*.pressure``)."""
    for line in data.splitlines():
        if not line.startswith(b"some "):
            continue
        avg10 = total = None
        for item in line.split()[1:]:
            k, _, v = item.partition(b"=")
            if k == b"avg10":
                try:
                    avg10 = float(v)
                except ValueError:
                    return None
            elif k == b"total":
                total = _int(v)
        return (avg10, total) if avg10 is not None and total is not None else None
    return None


def parse_proc_cgroup(data: bytes) -> tuple[str | None, str | None]:
    """(cgroup v2 path, v1 cpu controller path) from ``/proc/<pid>/cgroup``; None for what the host lacks.
    A path with ``..`` or not starting with ``/`` is refused (None): it is joined under a mount point."""
    v2 = v1cpu = None
    for line in data.splitlines():
        parts = line.split(b":", 2)
        if len(parts) != 3:
            continue
        path = _cgroup_path(parts[2])
        if parts[0] == b"0" and parts[1] == b"":
            v2 = path
        elif b"cpu" in parts[1].split(b","):
            v1cpu = path
    return v2, v1cpu


def parse_cgroup_mounts(mountinfo: bytes) -> tuple[str | None, str | None]:
    """(cgroup v2 mount point, v1 cpu controller mount point) from ``/proc/self/mountinfo``."""
    v2 = v1cpu = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(b" - ")
        if not sep:
            continue
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount = fields[4].decode("utf-8", "replace")
        if tail[0] == b"cgroup2" and v2 is None:
            v2 = mount
        elif tail[0] == b"cgroup" and b"cpu" in tail[2].split(b",") and v1cpu is None:
            v1cpu = mount
    return v2, v1cpu


def _cgroup_path(raw: bytes) -> str | None:
    path = raw.strip().decode("utf-8", "replace")
    if not path.startswith("/") or any(p in ("..", ".") for p in path.split("/")) or "\x00" in path:
        return None
    return path


def _int(v: bytes) -> int | None:
    try:
        return int(v.strip())
    except ValueError:
        return None


__all__ = [
    "MISSING",
    "HostPressure",
    "RankCounters",
    "parse_cgroup_mounts",
    "parse_cpu_stat",
    "parse_pressure",
    "parse_proc_cgroup",
    "parse_schedstat",
    "parse_stat_counters",
    "parse_status_switches",
]
