"""Reading a rank's host signals: the kernel's per-process and per-cgroup counters (``core.host_signals``).

Run where the job owner's reader runs (the ``signals`` request registered here): the files are the kernel's, but which
cgroup a rank is in is the job's choice, so they are read with the owner's authority, like everything of
the job's. Each rank costs a handful of small reads (its threads' schedstat, status, stat, /proc/<pid>/cgroup
and three or four cgroup files); ``benchmarks/bench_signals.py`` measures the cost per poll. The host's own
pressure (``/proc/pressure``) is nobody's and is read by the daemon itself.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import os
import socket
import struct
import threading
import time
from typing import Any

from ..core.host_signals import (
    MISSING,
    HostPressure,
    NetCounters,
    RankCounters,
    TcpInfo,
    net_counters,
    parse_cgroup_mounts,
    parse_cpu_stat,
    parse_inet_diag,
    parse_pressure,
    parse_proc_cgroup,
    parse_schedstat,
    parse_socket_link,
    parse_stat_counters,
    parse_status_switches,
    tcp_info,
)
from ..privsep.frames import WireError, w_int, w_str
from ..privsep.registry import Worker, handler

MAX_THREADS = 4096  # threads read per rank: a rank has tens; a thread bomb is not read to the end
MAX_FDS = 4096  # fds looked at per rank for its sockets: a rank has hundreds at most
MAX_TCP_SOCKETS = 65536  # sockets read per dump: a node's own; beyond it the dump is cut short
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY = 4, 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
TCP_STATES = 1 << 1  # TCP_ESTABLISHED: the connections that carry the job's traffic


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


def tcp_sockets(timeout_s: float = 0.5) -> list[TcpInfo] | None:
    """Every established TCP socket of this network namespace with its ``tcp_info``, from the kernel's
    sock_diag netlink interface (what ``ss -ti`` reads: unprivileged, one dump per family, no process
    started); None where netlink is not available."""
    out: list[TcpInfo] = []
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    except OSError:
        return None
    try:
        nl.settimeout(timeout_s)
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            # struct inet_diag_req_v2: family, protocol, ext (1 << (INET_DIAG_INFO - 1)), pad, states, sockid
            req = struct.pack("=BBBBI48s", family, socket.IPPROTO_TCP, 1 << 1, 0, TCP_STATES, b"")
            nl.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, seq, 0) + req)
            while len(out) < MAX_TCP_SOCKETS:
                got, done = parse_inet_diag(nl.recv(1 << 16))
                out.extend(got)
                if done:
                    break
    except OSError:
        return None
    finally:
        nl.close()
    return out


def socket_inodes(pid: int, proc_root: str = "/proc") -> set[int]:
    """The inodes of the sockets ``pid`` holds (its ``/proc/<pid>/fd`` links; the owner's to read)."""
    base = f"{proc_root}/{pid}/fd"
    try:
        fds = os.listdir(base)[:MAX_FDS]
    except OSError:
        return set()
    out = set()
    for fd in fds:
        try:
            ino = parse_socket_link(os.readlink(f"{base}/{fd}"))
        except OSError:
            continue
        if ino is not None:
            out.add(ino)
    return out


SYS_PIDFD_GETFD = 438  # Linux 5.6; the same number on x86_64 and aarch64 (the unified syscall table)
TCP_INFO_LEN = 256  # more than struct tcp_info is today (248 bytes on 6.x): the kernel writes what it has
TCP_ESTABLISHED = 1
# read a rank's TCP sockets through duplicates of its own fds (``tcp_sockets_of_pid``) rather than a sock_diag dump
# of the whole table; False: the dump only (``benchmarks/bench_signals.py --net dump`` measures it)
NET_BY_FD = True


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def tcp_sockets_of_pid(pid: int, proc_root: str = "/proc") -> list[TcpInfo] | None:
    """The established TCP sockets ``pid`` holds, each with its ``tcp_info``, asked of the socket itself through
    a duplicate of the rank's fd (``pidfd_getfd``) and closed at once: a few syscalls per socket of the rank's,
    where a sock_diag dump walks the kernel's whole established-socket hash whatever the rank holds
    (``NET_EVERY_S``). Needs ptrace access to the process (its owner's reader has it, unless Yama's
    ptrace_scope forbids); None where refused or unsupported (a kernel before 5.6): the caller dumps instead.
    Works across network namespaces: the socket is asked, not the namespace's table."""
    base = f"{proc_root}/{pid}/fd"
    try:
        fds = os.listdir(base)[:MAX_FDS]
    except OSError:
        return None
    socks = []
    for fd in fds:
        try:
            ino = parse_socket_link(os.readlink(f"{base}/{fd}"))
        except OSError:
            continue
        if ino is not None and fd.isdigit():
            socks.append((int(fd), ino))
    if not socks:
        return []
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    out: list[TcpInfo] = []
    try:
        for num, ino in socks:
            dup = _libc().syscall(SYS_PIDFD_GETFD, pidfd, num, 0)
            if dup < 0:
                if ctypes.get_errno() == errno.EBADF:  # closed since the listing
                    continue
                return None
            try:
                s = socket.socket(fileno=dup)
            except OSError:
                os.close(dup)
                continue
            with s:
                if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                    continue
                try:
                    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
                    if not info or info[0] != TCP_ESTABLISHED:
                        continue
                    own, peer = s.getsockname(), s.getpeername()
                except OSError:
                    continue
            host = str(peer[0])
            remote = f"[{host}]:{peer[1]}" if s.family == socket.AF_INET6 else f"{host}:{peer[1]}"
            out.append(tcp_info(ino, info, remote, host == str(own[0]) or _loopback_text(host)))
    finally:
        os.close(pidfd)
    return out


def _loopback_text(host: str) -> bool:
    return host.startswith("127.") or host in ("::1",) or host.startswith("::ffff:127.")


CLONE_NEWNET = 0x40000000
# a sock_diag dump walks the kernel's whole established-socket hash (262,144 buckets on a 24 GB host, more on
# a GPU node): ~2 ms of CPU per address family whatever the sockets, 5x a poll's other reads for 8 ranks
# (``benchmarks/bench_signals.py``); asking the ranks' own sockets costs ~40 % of that for 16 sockets a rank, more
# with more. The TCP figures are states read as a median over the window and a cumulative retransmit count, so
# one reading per network namespace every 2 s is enough (a 200-step window of 50 ms steps holds 5 of them); the
# polls in between carry no ``net``
NET_EVERY_S = 2.0
_dumped_at: dict[int | None, float] = {}


def _netns(pid: int | str, proc_root: str = "/proc") -> int | None:
    try:
        return os.stat(f"{proc_root}/{pid}/ns/net").st_ino
    except OSError:
        return None


def tcp_sockets_of_netns(pid: int, proc_root: str = "/proc") -> list[TcpInfo] | None:
    """``tcp_sockets`` of the network namespace ``pid`` is in, when it is not this process's: asked from a
    thread of its own that joins that namespace (``setns``; only that thread moves, and it ends after the
    dump). Needs CAP_SYS_ADMIN over the namespace (a root reader: ranks in containers or in simulated nodes
    of their own); None where that is refused."""
    try:
        fd = os.open(f"{proc_root}/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    got: list[list[TcpInfo] | None] = [None]

    def dump() -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            return
        got[0] = tcp_sockets()

    try:
        t = threading.Thread(target=dump, name="rankwatch-netns", daemon=True)
        t.start()
        t.join(2.0)
    finally:
        os.close(fd)
    return got[0]


def read_ranks(pids: list[int], proc_root: str = "/proc") -> dict[int, RankCounters | None]:
    """``read_rank`` of each pid, with its TCP sockets every ``NET_EVERY_S`` per network namespace: asked of
    each rank's own sockets (``tcp_sockets_of_pid``), else from one sock_diag dump per namespace (one for a
    node's ranks; one per simulated node or container where ranks have their own)."""
    own = _netns("self", proc_root)
    now = time.monotonic()
    due: dict[int | None, bool] = {}
    dumps: dict[int | None, list[TcpInfo] | None] = {}
    out: dict[int, RankCounters | None] = {}
    for pid in pids:
        c = read_rank(pid, proc_root)
        if c is not None:
            ns = _netns(pid, proc_root)
            if ns not in due:
                due[ns] = now - _dumped_at.get(ns, -NET_EVERY_S) >= NET_EVERY_S
                if due[ns]:
                    _dumped_at[ns] = now
                    if len(_dumped_at) > 1024:  # namespaces come and go with containers: forget old ones
                        _dumped_at.clear()
            if due[ns]:
                infos = tcp_sockets_of_pid(pid, proc_root) if NET_BY_FD else None
                if infos is not None:
                    inodes = {i.inode for i in infos}
                else:  # refused (or switched off): the namespace's table, dumped once for all its ranks
                    if ns not in dumps:
                        dumps[ns] = tcp_sockets() if ns == own or ns is None else tcp_sockets_of_netns(pid, proc_root)
                    infos = dumps[ns]
                    inodes = socket_inodes(pid, proc_root) if infos else set()
                net = net_counters(infos, inodes) if infos else None
                if net is not None:
                    c = dataclasses.replace(c, net=net)
        out[pid] = c
    return out


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


_NET_FIELDS = tuple(f.name for f in dataclasses.fields(NetCounters))


def counters_to_doc(c: RankCounters) -> dict[str, Any]:
    doc = {**{k: getattr(c, k) for k in _FIELDS}, "cgroup": c.cgroup}
    if c.net is not None:
        doc["net"] = {k: getattr(c.net, k) for k in _NET_FIELDS}
    return doc


def counters_from_doc(d: Any) -> RankCounters:
    """Back from a reader's answer, every field checked (WireError)."""
    if not isinstance(d, dict):
        raise WireError("signals: expected an object")
    vals: dict[str, Any] = {k: w_int(d.get(k), MISSING) for k in _FIELDS}
    net = d.get("net")
    if net is not None and not isinstance(net, dict):
        raise WireError("signals: net: expected an object")
    return RankCounters(**vals, cgroup=w_str(d.get("cgroup"), 256),
                        net=NetCounters(**{k: w_int(net.get(k), MISSING) for k in _NET_FIELDS}) if net else None)



@handler("signals")
def _signals_request(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """The kernel's counters of each rank process and its cgroup, read as its owner: which cgroup a rank is
    in is the job's choice."""
    pids = req.get("pids")
    if not isinstance(pids, list) or len(pids) > w.policy.max_records:
        raise ValueError(f"pids: a list of at most {w.policy.max_records}")
    got = read_ranks([w_int(x, 1, 1 << 22) for x in pids])
    return {"ranks": {str(pid): counters_to_doc(c) if c is not None else None for pid, c in got.items()}}
