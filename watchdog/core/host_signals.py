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

import ipaddress
import struct
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
    net: NetCounters | None = None  # its TCP sockets (``parse_inet_diag``), None where not read
    gpu: GpuState | None = None  # its GPU as NVML saw it at this poll (set by the daemon), None without NVML


# -- GPU (NVML) ------------------------------------------------------------------------------------------
# nvmlClocksEventReasons (nvml.h; the older name nvmlClocksThrottleReasons has the same bits): the reasons
# that slow a busy GPU down. GpuIdle (0x1), ApplicationsClocksSetting (0x2), SyncBoost (0x10) and
# DisplayClockSetting (0x100) are a configuration or an idle GPU, not a fault, and are left out.
CLOCK_REASONS = {
    0x4: "sw_power_cap",  # nvmlClocksEventReasonSwPowerCap: held under the power limit
    0x8: "hw_slowdown",  # nvmlClocksThrottleReasonHwSlowdown: clocks cut by 2x or more (temp, power brake)
    0x20: "sw_thermal",  # nvmlClocksEventReasonSwThermalSlowdown: GPU or memory temperature over its limit
    0x40: "hw_thermal",  # nvmlClocksThrottleReasonHwThermalSlowdown: HW slowdown for temperature
    0x80: "hw_power_brake",  # nvmlClocksThrottleReasonHwPowerBrakeSlowdown: the power supply asserted a brake
}
CLOCK_REASONS_SLOWING = sum(CLOCK_REASONS)


@dataclass(frozen=True)
class GpuState:
    """A rank's GPU at one poll, as NVML answered (None: NVML would not say). Clocks in MHz, the PCIe link
    as generation and lanes against the most the GPU and its slot support; ``pcie_replay``, ``ecc_volatile``
    and ``xids`` are cumulative (replays of the link, uncorrected ECC errors since the driver loaded, critical
    XID events since the watchdog started)."""

    device: int
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    mem_clock_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    reasons: int | None = None  # nvmlDeviceGetCurrentClocksEventReasons bits
    temperature_c: int | None = None
    slowdown_c: int | None = None  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_replay: int | None = None
    ecc_volatile: int | None = None
    xids: int = 0


def slowing_reasons(bits: int | None) -> tuple[str, ...]:
    """The names of the set clock-event reasons that slow a busy GPU (``CLOCK_REASONS``), in bit order."""
    if not bits:
        return ()
    return tuple(name for bit, name in sorted(CLOCK_REASONS.items()) if bits & bit)


def link_degraded(g: GpuState) -> bool | None:
    """Whether the PCIe link runs below what the GPU and its slot support (fewer lanes or an older
    generation); None when NVML did not say. An idle GPU drops its link generation to save power, so this is
    read against the rank's peers, never alone."""
    if None in (g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max):
        return None
    return bool(g.pcie_gen < g.pcie_gen_max or g.pcie_width < g.pcie_width_max)  # type: ignore[operator]


# -- TCP (the kernel's sock_diag) -------------------------------------------------------------------------
@dataclass(frozen=True)
class NetCounters:
    """A rank process's established TCP sockets summed at one instant: counters are cumulative over the
    sockets' lives (a socket that closes takes its share out of the sum: ``straggler_cause`` counts no
    delta then). The path is to another host (a socket whose peer address is its own or loopback is another
    rank of its node): the rate at which the data a rank sends is delivered is set by its own node's way out
    (a capped or degraded link delivers the rank's share of every ring collective slower), and its peers'
    sending to it go out through their own links."""

    sockets: int
    bytes_sent: int  # tcpi_bytes_sent (retransmissions included)
    bytes_acked: int
    retrans: int  # tcpi_total_retrans: segments retransmitted
    busy_us: int  # tcpi_busy_time: time with data in flight
    # its busiest path: the socket to another host that has sent the most (where its share of the collectives
    # goes; the rendezvous store's socket and a collective's control messages send little); MISSING without one
    rtt_us: int  # that socket's smoothed RTT (tcpi_rtt)
    delivery_bps: int  # that socket's delivery rate (tcpi_delivery_rate, bytes/s)


@dataclass(frozen=True)
class TcpInfo:
    """The fields of one socket's ``struct tcp_info`` (include/uapi/linux/tcp.h) a path's health shows in."""

    inode: int
    rtt_us: int
    rttvar_us: int
    min_rtt_us: int
    total_retrans: int
    bytes_acked: int
    bytes_sent: int
    delivery_rate: int  # bytes/s
    busy_us: int
    remote: str
    same_host: bool = False  # its peer's address is its own or loopback: a rank of the same node


# struct inet_diag_msg: family, state, timer, retrans (4 x u8), inet_diag_sockid (sport, dport: be16;
# src, dst: 4 x be32 each; if: u32; cookie: 2 x u32), expires, rqueue, wqueue, uid, inode (5 x u32)
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16sI8sIIIII")
_NLMSG = struct.Struct("=IHHII")
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO = 2
# offsets in struct tcp_info (stable ABI: fields are only ever appended)
_TI_RTT, _TI_RTTVAR, _TI_TOTAL_RETRANS = 68, 72, 100
_TI_BYTES_ACKED, _TI_MIN_RTT, _TI_DELIVERY_RATE, _TI_BUSY, _TI_BYTES_SENT = 120, 148, 160, 168, 200


def parse_inet_diag(data: bytes) -> tuple[list[TcpInfo], bool]:
    """The sockets in one netlink answer to a sock_diag dump (``SOCK_DIAG_BY_FAMILY`` with ``INET_DIAG_INFO``
    asked), and whether the dump is done (NLMSG_DONE or an error). A truncated message ends the parse; a
    socket whose tcp_info is shorter than a field leaves that field 0 (an older kernel)."""
    out: list[TcpInfo] = []
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            return out, True
        if mtype in (NLMSG_DONE, NLMSG_ERROR):
            return out, True
        body = data[off + _NLMSG.size: off + length]
        off += (length + 3) & ~3
        if len(body) < _DIAG_MSG.size:
            continue
        fam, _state, _timer, _retr, _sport, dport, src, dst, _if, _cookie, _exp, _rq, _wq, _uid, inode = \
            _DIAG_MSG.unpack_from(body)
        info = b""
        a = _DIAG_MSG.size
        while a + 4 <= len(body):
            alen, atype = struct.unpack_from("=HH", body, a)
            if alen < 4:
                break
            if atype == INET_DIAG_INFO:
                info = body[a + 4: a + alen]
            a += (alen + 3) & ~3
        if not info:
            continue
        out.append(tcp_info(inode, info, _addr(fam, dst, dport), src == dst or _loopback(fam, dst)))
    return out, False


def tcp_info(inode: int, info: bytes, remote: str, same_host: bool) -> TcpInfo:
    """The fields of a ``struct tcp_info`` as the kernel wrote it (a sock_diag answer's ``INET_DIAG_INFO`` or
    ``getsockopt(TCP_INFO)``: the same struct); a field past a shorter struct (an older kernel) reads 0."""
    return TcpInfo(
        inode=inode, rtt_us=_u32(info, _TI_RTT), rttvar_us=_u32(info, _TI_RTTVAR),
        min_rtt_us=_u32(info, _TI_MIN_RTT), total_retrans=_u32(info, _TI_TOTAL_RETRANS),
        bytes_acked=_u64(info, _TI_BYTES_ACKED), bytes_sent=_u64(info, _TI_BYTES_SENT),
        delivery_rate=_u64(info, _TI_DELIVERY_RATE), busy_us=_u64(info, _TI_BUSY),
        remote=remote, same_host=same_host,
    )


def net_counters(infos: list[TcpInfo], inodes: set[int]) -> NetCounters | None:
    """The sum over a process's sockets (``inodes``, from its ``/proc/<pid>/fd``); None when it has none."""
    mine = [i for i in infos if i.inode in inodes]
    if not mine:
        return None
    paths = [i for i in mine if i.bytes_sent > 0 and not i.same_host]
    busiest = max(paths, key=lambda i: i.bytes_sent) if paths else None
    return NetCounters(
        sockets=len(mine), bytes_sent=sum(i.bytes_sent for i in mine), bytes_acked=sum(i.bytes_acked for i in mine),
        retrans=sum(i.total_retrans for i in mine), busy_us=sum(i.busy_us for i in mine),
        rtt_us=busiest.rtt_us if busiest else MISSING,
        delivery_bps=busiest.delivery_rate if busiest and busiest.delivery_rate > 0 else MISSING,
    )


def parse_socket_link(target: str) -> int | None:
    """The inode of a ``/proc/<pid>/fd/N`` link to a socket ("socket:[12345]"), None for anything else."""
    if target.startswith("socket:[") and target.endswith("]"):
        return _int(target[8:-1].encode())
    return None


AF_INET, AF_INET6 = 2, 10  # <linux/socket.h>: the core reads the kernel's answer, it opens no socket


def _loopback(family: int, raw: bytes) -> bool:
    if family == AF_INET:
        return raw[0] == 127
    return raw == b"\x00" * 15 + b"\x01" or (raw[:12] == b"\x00" * 10 + b"\xff\xff" and raw[12] == 127)


def _u32(b: bytes, off: int) -> int:
    return int(struct.unpack_from("=I", b, off)[0]) if off + 4 <= len(b) else 0


def _u64(b: bytes, off: int) -> int:
    return int(struct.unpack_from("=Q", b, off)[0]) if off + 8 <= len(b) else 0


def _addr(family: int, raw: bytes, port: bytes) -> str:
    p = int.from_bytes(port, "big")
    if family == AF_INET:
        return f"{ipaddress.IPv4Address(raw[:4])}:{p}"
    if family == AF_INET6 and len(raw) == 16:
        return f"[{ipaddress.IPv6Address(raw)}]:{p}"
    return f"?:{p}"


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
    "CLOCK_REASONS",
    "MISSING",
    "GpuState",
    "HostPressure",
    "NetCounters",
    "RankCounters",
    "TcpInfo",
    "link_degraded",
    "net_counters",
    "parse_cgroup_mounts",
    "parse_cpu_stat",
    "parse_inet_diag",
    "parse_pressure",
    "parse_proc_cgroup",
    "parse_schedstat",
    "parse_socket_link",
    "parse_stat_counters",
    "parse_status_switches",
    "slowing_reasons",
    "tcp_info",
]
