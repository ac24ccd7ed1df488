"""NCCL RAS client: ask the job's local RAS thread (NCCL ≥ 2.24) for communicator state, and compare queries.

Protocol (NCCL src/ras/client.cc and the server side in src/ras/client_support.cc; docs:
docs/userguide/source/troubleshooting/ras.rst). Plain text lines over TCP, by default ``localhost:28028``
(``NCCL_RAS_ADDR`` moves it):

- ``CLIENT PROTOCOL 2`` → ``SERVER PROTOCOL <n>`` (the server ignores the client's number);
- ``TIMEOUT <secs>`` → ``OK`` (how long RAS waits for other processes while collecting);
- ``SET FORMAT json`` → ``OK`` from NCCL 2.28.7 on, ``ERROR: Unknown command ...`` before, so the client
  falls back to text;
- ``VERBOSE STATUS`` (or ``STATUS``) → the report, then the server closes the connection.

The JSON report lists every communicator with per-rank collective counts (Broadcast, Reduce, AllGather,
ReduceScatter, AllReduce), status flags and missing ranks (unresponsive / considered dead). The text report
prints only anomalies: a summary table, ``Errors`` (INCOMPLETE, DEAD, per-communicator INCOMPLETE/ERROR)
and ``Warnings`` (TIMEOUT, per-communicator MISMATCH with count groups). Both are parsed into ``RasStatus``.

The NCCL docs stress that count differences are normal while a job runs (collectives outpace the RAS
query); only counts that stay the same across two queries point at a stuck communicator. That comparison
is ``ras_findings(prev, cur)``.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger()

DEFAULT_ADDR = "localhost:28028"
CLIENT_PROTOCOL = 2
MAX_REPLY_BYTES = 4 * 1024 * 1024
"""A JSON report is ~600 bytes per rank; 4 MiB covers several thousand ranks of one node's view."""
DEFAULT_RAS_TIMEOUT_S = 5
"""NCCL's own default (RAS_COLLECTIVE_LEG_TIMEOUT_SEC); the socket deadline adds slack on top."""
SOCKET_SLACK_S = 5.0
"""ncclras adds RAS_COLLECTIVE_EXTRA_TIMEOUT_SEC to the RAS timeout for its read deadline; so do we."""


# ------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class RasProcess:
    pid: int | None
    host: str | None
    gpus: str | None = None


@dataclass(frozen=True)
class RasRank:
    rank: int
    host: str | None = None
    pid: int | None = None
    cuda_dev: int | None = None
    nvml_dev: int | None = None
    init_state: int | None = None
    async_error: int | None = None
    finalize_called: bool | None = None
    destroy_flag: bool | None = None
    abort_flag: bool | None = None
    collective_counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class RasMissingRank:
    rank: int
    host: str | None = None
    pid: int | None = None
    cuda_dev: int | None = None
    unresponsive: bool | None = None
    dead: bool | None = None


@dataclass(frozen=True)
class RasCountGroup:
    """Ranks of one communicator that launched ``count`` operations of ``op`` (only ops where ranks differ).

    ``ranks`` may list fewer than ``n_ranks`` in the text format, which names only outlier groups.
    """

    op: str
    count: int
    n_ranks: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class RasCommunicator:
    hash: str  # 16 lower-case hex digits, the form NCCL's logs use
    label: str | None = None  # "#<group>-<index>" in the text report
    size: int | None = None
    errors: tuple[str, ...] = ()  # INCOMPLETE / ERROR / MISMATCH
    ranks: tuple[RasRank, ...] = ()
    missing_ranks: tuple[RasMissingRank, ...] = ()
    count_groups: tuple[RasCountGroup, ...] = ()
    rank_status: Mapping[int, str] = field(default_factory=dict)
    rank_errors: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RasGroupRow:
    """One row of the text summary table (communicators grouped by size and state)."""

    group: int
    comms: int
    nodes: int
    ranks_per_node: str
    ranks_per_comm: int
    ranks_in_group: int
    status: str
    errors: str


@dataclass(frozen=True)
class RasStatus:
    format: str  # "json" | "text"
    nccl_version: str | None
    communicators: tuple[RasCommunicator, ...]
    groups: tuple[RasGroupRow, ...] = ()
    missing_processes: tuple[RasProcess, ...] = ()
    dead_processes: tuple[RasProcess, ...] = ()
    timeouts: int = 0
    complete: bool = True  # False when the reply was cut by the deadline or the size bound
    raw: str = ""

    def communicator(self, comm_hash: str) -> RasCommunicator | None:
        for c in self.communicators:
            if c.hash == comm_hash:
                return c
        return None


@dataclass(frozen=True)
class RasFinding:
    kind: str  # "stuck" | "lagging" | "dead" | "unresponsive" | "error" | "timeout" | "incomplete"
    comm: str | None
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    text: str


# ------------------------------------------------------------------------------------------------
# client


def parse_ras_addr(addr: str) -> tuple[str, int]:
    """``host:port`` → (host, port). Loopback only: RAS tells anyone about the whole job, unauthenticated."""
    host, sep, port_s = addr.rpartition(":")
    if not sep or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"RAS address must be host:port, got {addr!r}")
    host = host.strip("[]") or "localhost"
    if host != "localhost":
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"RAS address must be loopback (localhost, 127.x, ::1), got {host!r}") from None
        if not ip.is_loopback:
            raise ValueError(f"RAS address must be loopback (localhost, 127.x, ::1), got {host!r}")
    return host, int(port_s)


class _Conn:
    """Line reads over a socket with one overall deadline and a size bound."""

    def __init__(self, sock: socket.socket, deadline: float, max_bytes: int) -> None:
        self.sock = sock
        self.deadline = deadline
        self.max_bytes = max_bytes
        self.buf = b""
        self.total = 0

    def _recv(self) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("RAS reply deadline passed")
        self.sock.settimeout(left)
        chunk = self.sock.recv(65536)
        self.total += len(chunk)
        return chunk

    def send(self, line: str) -> None:
        self.sock.settimeout(max(0.001, self.deadline - time.monotonic()))
        self.sock.sendall(line.encode("ascii") + b"\n")

    def line(self) -> str:
        while b"\n" not in self.buf:
            chunk = self._recv()
            if not chunk:
                raise ConnectionError("RAS closed the connection")
            self.buf += chunk
            if len(self.buf) > 65536:
                raise ValueError("RAS handshake line too long")
        head, self.buf = self.buf.split(b"\n", 1)
        return head.decode("utf-8", "replace").rstrip("\r")

    def rest(self) -> tuple[bytes, bool]:
        """Everything until EOF; (data, complete)."""
        parts = [self.buf]
        size = len(self.buf)
        self.buf = b""
        while size <= self.max_bytes:
            try:
                chunk = self._recv()
            except TimeoutError:
                return b"".join(parts), False
            if not chunk:
                return b"".join(parts), True
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)[: self.max_bytes], False


def query_ras(
    addr: str = DEFAULT_ADDR,
    *,
    ras_timeout_s: int = DEFAULT_RAS_TIMEOUT_S,
    timeout_s: float | None = None,
    verbose: bool = True,
    prefer_json: bool = True,
    max_bytes: int = MAX_REPLY_BYTES,
) -> RasStatus | None:
    """One RAS status query. None (with one log line) when RAS is unreachable, silent, or not RAS.

    ``timeout_s`` bounds the whole exchange (default ``ras_timeout_s`` + 5 s). A reply cut short by the
    deadline or by ``max_bytes`` is still parsed, with ``complete=False``. Never raises.
    """
    try:
        host, port = parse_ras_addr(addr)
    except ValueError as exc:
        log.warning("nccl_ras.bad_address", addr=addr, error=str(exc))
        return None
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else ras_timeout_s + SOCKET_SLACK_S)
    try:
        sock = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
    except OSError as exc:
        log.info("nccl_ras.unreachable", addr=addr, error=str(exc))
        return None
    try:
        conn = _Conn(sock, deadline, max_bytes)
        conn.send(f"CLIENT PROTOCOL {CLIENT_PROTOCOL}")
        hello = conn.line()
        if not hello.upper().startswith("SERVER PROTOCOL "):
            log.warning("nccl_ras.not_ras", addr=addr, reply=hello[:200])
            return None
        conn.send(f"TIMEOUT {int(ras_timeout_s)}")
        reply = conn.line()
        if reply.strip().upper() != "OK":
            log.warning("nccl_ras.timeout_refused", addr=addr, reply=reply[:200])
        fmt = "text"
        if prefer_json:
            conn.send("SET FORMAT json")
            reply = conn.line()
            if reply.strip().upper() == "OK":
                fmt = "json"
        conn.send("VERBOSE STATUS" if verbose else "STATUS")
        data, complete = conn.rest()
    except (OSError, TimeoutError, ConnectionError, ValueError) as exc:
        log.info("nccl_ras.query_failed", addr=addr, error=f"{type(exc).__name__}: {exc}")
        return None
    finally:
        sock.close()
    if not data.strip():
        log.info("nccl_ras.empty_reply", addr=addr, complete=complete)
        return None
    text = data.decode("utf-8", "replace")
    status = parse_ras_reply(text, prefer=fmt)
    if not complete:
        log.info("nccl_ras.partial_reply", addr=addr, bytes=len(data))
        status = _replace_complete(status, False)
    return status


def _replace_complete(s: RasStatus, complete: bool) -> RasStatus:
    from dataclasses import replace

    return replace(s, complete=complete)


# ------------------------------------------------------------------------------------------------
# parsing


def _norm_hash(h: str) -> str:
    try:
        return f"{int(h, 16):016x}"
    except ValueError:
        return h.lower()


def parse_ras_reply(text: str, prefer: str = "json") -> RasStatus:
    """JSON when the reply is a JSON document, else the text report."""
    if prefer == "json" or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            doc = None
        if isinstance(doc, Mapping):
            return parse_ras_json(doc, raw=text)
    return parse_ras_text(text)


def _obj(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _opt_bool(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def _count_groups(ranks: tuple[RasRank, ...]) -> tuple[RasCountGroup, ...]:
    ops: list[str] = []
    for r in ranks:
        for op in r.collective_counts:
            if op not in ops:
                ops.append(op)
    out: list[RasCountGroup] = []
    for op in ops:
        by_value: dict[int, list[int]] = {}
        for r in ranks:
            if op in r.collective_counts:
                by_value.setdefault(r.collective_counts[op], []).append(r.rank)
        if len(by_value) > 1:
            for value, rs in sorted(by_value.items(), key=lambda kv: (-len(kv[1]), -kv[0])):
                out.append(RasCountGroup(op=op, count=value, n_ranks=len(rs), ranks=tuple(sorted(rs))))
    return tuple(out)


def parse_ras_json(doc: Mapping[str, Any], raw: str = "") -> RasStatus:
    """The ``SET FORMAT json`` report (NCCL ≥ 2.28.7, rasDumpCommsToJSON)."""
    comms: list[RasCommunicator] = []
    dead: list[RasProcess] = []
    for c in doc.get("communicators") or []:
        if not isinstance(c, Mapping):
            continue
        ranks: list[RasRank] = []
        for r in c.get("ranks") or []:
            if not isinstance(r, Mapping) or _opt_int(r.get("rank")) is None:
                continue
            st = _obj(r.get("status"))
            counts = _obj(r.get("collective_counts"))
            ranks.append(
                RasRank(
                    rank=int(r["rank"]),
                    host=r.get("host") if isinstance(r.get("host"), str) else None,
                    pid=_opt_int(r.get("pid")),
                    cuda_dev=_opt_int(r.get("cuda_dev")),
                    nvml_dev=_opt_int(r.get("nvml_dev")),
                    init_state=_opt_int(st.get("init_state")),
                    async_error=_opt_int(st.get("async_error")),
                    finalize_called=_opt_bool(st.get("finalize_called")),
                    destroy_flag=_opt_bool(st.get("destroy_flag")),
                    abort_flag=_opt_bool(st.get("abort_flag")),
                    collective_counts={str(k): v for k, v in counts.items() if _opt_int(v) is not None},
                )
            )
        missing: list[RasMissingRank] = []
        for m in c.get("missing_ranks") or []:
            if not isinstance(m, Mapping) or _opt_int(m.get("rank")) is None:
                continue
            st = _obj(m.get("status"))
            mr = RasMissingRank(
                rank=int(m["rank"]),
                host=m.get("host") if isinstance(m.get("host"), str) else None,
                pid=_opt_int(m.get("pid")),
                cuda_dev=_opt_int(m.get("cuda_dev")),
                unresponsive=_opt_bool(st.get("unresponsive")),
                dead=_opt_bool(st.get("considered_dead")),
            )
            missing.append(mr)
            if mr.dead:
                dead.append(RasProcess(pid=mr.pid, host=mr.host, gpus=str(mr.cuda_dev)))
        rank_t = tuple(sorted(ranks, key=lambda r: r.rank))
        errors = []
        if missing:
            errors.append("INCOMPLETE")
        if any(_is_error(r) for r in rank_t):
            errors.append("ERROR")
        groups = _count_groups(rank_t)
        if groups:
            errors.append("MISMATCH")
        comms.append(
            RasCommunicator(
                hash=_norm_hash(str(c.get("hash", ""))),
                size=_opt_int(c.get("size")),
                errors=tuple(errors),
                ranks=rank_t,
                missing_ranks=tuple(sorted(missing, key=lambda m: m.rank)),
                count_groups=groups,
                rank_status={r.rank: _rank_state(r) for r in rank_t},
                rank_errors={r.rank: _rank_error(r) for r in rank_t if _is_error(r)},
            )
        )
    ras = _obj(doc.get("ras"))
    version = doc.get("nccl_version")
    return RasStatus(
        format="json",
        nccl_version=version if isinstance(version, str) else None,
        communicators=tuple(comms),
        dead_processes=tuple(dict.fromkeys(dead)),
        timeouts=_opt_int(ras.get("timeouts_count")) or 0,
        raw=raw,
    )


_NCCL_OK = (0, 7)  # ncclSuccess, ncclInProgress (initialisation still running)


def _is_error(r: RasRank) -> bool:
    return (r.init_state is not None and r.init_state not in _NCCL_OK) or (
        r.async_error is not None and r.async_error not in _NCCL_OK
    )


def _rank_error(r: RasRank) -> str:
    parts = []
    if r.init_state is not None and r.init_state not in _NCCL_OK:
        parts.append(f"init error {r.init_state}")
    if r.async_error is not None and r.async_error not in _NCCL_OK:
        parts.append(f"async error {r.async_error}")
    return ", ".join(parts)


def _rank_state(r: RasRank) -> str:
    """Same precedence as client_support.cc: abort, then finalize/destroy, then init, else running."""
    if r.abort_flag:
        return "ABORT"
    if r.finalize_called or r.destroy_flag:
        return "FINALIZE"
    if r.init_state == 7:
        return "INIT"
    return "RUNNING"


_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$")
_COMM = re.compile(r"^#(\d+)-(\d+) \(([0-9a-fA-F]+)\) ([A-Z]+)\s*$")
_PROC = re.compile(r"^\s+Process (\d+) on node (\S+) managing GPUs? (.+?)\s*$")
_RANK_WHO = (
    r"(?: -- (?:GPU (?P<gpu>\S+)(?: \(NVML \d+\))? managed by process (?P<pid>\d+) on node (?P<host>\S+)"
    r"|\[.*\]))?"
)
_DIFF_COUNTS = re.compile(r"^\s+Communicator ranks have different (\w+) operation counts")
_GROUP_UPTO = re.compile(r"^\s+(\d+) ranks have launched up to operation (\d+)")
_GROUP_NONE = re.compile(r"^\s+(\d+) ranks have not launched any operations")
_RANK_UPTO = re.compile(r"^\s+Rank (\d+) has launched up to operation (\d+)" + _RANK_WHO)
_RANK_NONE = re.compile(r"^\s+Rank (\d+) has not launched any operations" + _RANK_WHO)
_GROUP_STATUS = re.compile(r"^\s+(\d+) ranks have status (\w+)")
_RANK_STATUS = re.compile(r"^\s+Rank (\d+) has status (\w+)" + _RANK_WHO)
_GROUP_REPORTED = re.compile(r"^\s+(\d+) ranks reported (.+?)\s*$")
_RANK_REPORTED = re.compile(r"^\s+Rank (\d+) reported (.+?)" + _RANK_WHO + r"\s*$")
_RANK_PLAIN = re.compile(r"^\s+Rank (\d+)" + _RANK_WHO + r"\s*$")
_MISSING_LIST = re.compile(r"^\s+The missing ranks?: ([\d, ]+)")
_TIMEOUTS = re.compile(r"^\s+Encountered (\d+) communication timeouts?")
_VERSION = re.compile(r"^NCCL version (\S+)")


class _CommBuilder:
    def __init__(self, comm_hash: str, label: str) -> None:
        self.hash = comm_hash
        self.label = label
        self.errors: list[str] = []
        self.missing: dict[int, RasMissingRank] = {}
        self.groups: list[RasCountGroup] = []
        self.rank_status: dict[int, str] = {}
        self.rank_errors: dict[int, str] = {}
        self.ranks: dict[int, RasRank] = {}

    def build(self) -> RasCommunicator:
        return RasCommunicator(
            hash=self.hash,
            label=self.label,
            errors=tuple(self.errors),
            ranks=tuple(self.ranks[r] for r in sorted(self.ranks)),
            missing_ranks=tuple(self.missing[r] for r in sorted(self.missing)),
            count_groups=tuple(self.groups),
            rank_status=dict(self.rank_status),
            rank_errors=dict(self.rank_errors),
        )


def parse_ras_text(text: str) -> RasStatus:
    """The human report (every NCCL with RAS). Unknown lines are skipped: the wording varies by release."""
    version = None
    rows: list[RasGroupRow] = []
    comms: dict[str, _CommBuilder] = {}
    missing_procs: list[RasProcess] = []
    dead_procs: list[RasProcess] = []
    timeouts = 0
    section: str | None = None  # "INCOMPLETE" | "DEAD" | "TIMEOUT" | "COMM"
    cur: _CommBuilder | None = None
    kind = ""  # current communicator block kind
    op = ""  # op of the current count listing
    group_idx: int | None = None  # index into cur.groups of the last multi-rank group
    status_ctx: str | None = None  # status of the last "N ranks have status X"
    error_ctx: str | None = None

    def who(m: re.Match[str], rank: int) -> RasRank:
        gd = m.groupdict()
        gpu = gd.get("gpu")
        return RasRank(
            rank=rank,
            host=gd.get("host"),
            pid=int(gd["pid"]) if gd.get("pid") else None,
            cuda_dev=int(gpu) if gpu and gpu.isdigit() else None,
        )

    for line in text.splitlines():
        if m := _VERSION.match(line):
            version = m.group(1)
            continue
        if m := _ROW.match(line):
            rows.append(
                RasGroupRow(
                    group=int(m.group(1)),
                    comms=int(m.group(2)),
                    nodes=int(m.group(3)),
                    ranks_per_node=m.group(4),
                    ranks_per_comm=int(m.group(5)),
                    ranks_in_group=int(m.group(6)),
                    status=m.group(7),
                    errors=m.group(8),
                )
            )
            continue
        stripped = line.strip()
        if stripped in ("INCOMPLETE", "DEAD", "TIMEOUT"):
            section, cur = stripped, None
            continue
        if stripped in ("Errors", "Warnings"):
            section, cur = None, None
            continue
        if m := _COMM.match(line):
            h = _norm_hash(m.group(3))
            cur = comms.setdefault(h, _CommBuilder(h, f"#{m.group(1)}-{m.group(2)}"))
            kind = m.group(4)
            if kind not in cur.errors:
                cur.errors.append(kind)
            section, op, group_idx, status_ctx, error_ctx = "COMM", "", None, None, None
            continue
        if section in ("INCOMPLETE", "DEAD") and (m := _PROC.match(line)):
            proc = RasProcess(pid=int(m.group(1)), host=m.group(2), gpus=m.group(3))
            (missing_procs if section == "INCOMPLETE" else dead_procs).append(proc)
            continue
        if m := _TIMEOUTS.match(line):
            timeouts = int(m.group(1))
            continue
        if section != "COMM" or cur is None:
            continue
        if m := _DIFF_COUNTS.match(line):
            op, group_idx, status_ctx = m.group(1), None, None
            continue
        if "have different status" in line:
            op, group_idx, status_ctx = "", None, None
            continue
        if m := _GROUP_UPTO.match(line) or _GROUP_NONE.match(line):
            value = int(m.group(2)) if m.re is _GROUP_UPTO else 0
            cur.groups.append(
                RasCountGroup(op=op or "collective", count=value, n_ranks=int(m.group(1)), ranks=())
            )
            group_idx = len(cur.groups) - 1
            continue
        if m := _RANK_UPTO.match(line) or _RANK_NONE.match(line):
            r = int(m.group(1))
            value = int(m.group(2)) if m.re is _RANK_UPTO else 0
            cur.groups.append(RasCountGroup(op=op or "collective", count=value, n_ranks=1, ranks=(r,)))
            cur.ranks.setdefault(r, who(m, r))
            group_idx = None
            continue
        if m := _GROUP_STATUS.match(line):
            status_ctx = m.group(2)
            continue
        if m := _RANK_STATUS.match(line):
            r = int(m.group(1))
            cur.rank_status[r] = m.group(2)
            cur.ranks.setdefault(r, who(m, r))
            continue
        if m := _GROUP_REPORTED.match(line):
            error_ctx = m.group(2)
            continue
        if m := _RANK_REPORTED.match(line):
            r = int(m.group(1))
            cur.rank_errors[r] = m.group(2)
            cur.ranks.setdefault(r, who(m, r))
            continue
        if m := _MISSING_LIST.match(line):
            for tok in m.group(1).replace(" ", "").split(","):
                if tok.isdigit():
                    cur.missing.setdefault(int(tok), RasMissingRank(rank=int(tok)))
            continue
        if m := _RANK_PLAIN.match(line):
            r = int(m.group(1))
            info = who(m, r)
            if kind == "INCOMPLETE":
                cur.missing[r] = RasMissingRank(rank=r, host=info.host, pid=info.pid, cuda_dev=info.cuda_dev)
                continue
            cur.ranks.setdefault(r, info)
            if kind == "ERROR" and error_ctx:
                cur.rank_errors[r] = error_ctx
            elif status_ctx is not None and not op:
                cur.rank_status[r] = status_ctx
            elif group_idx is not None:
                g = cur.groups[group_idx]
                cur.groups[group_idx] = RasCountGroup(g.op, g.count, g.n_ranks, (*g.ranks, r))
    return RasStatus(
        format="text",
        nccl_version=version,
        communicators=tuple(b.build() for b in comms.values()),
        groups=tuple(rows),
        missing_processes=tuple(missing_procs),
        dead_processes=tuple(dead_procs),
        timeouts=timeouts,
        raw=text,
    )


# ------------------------------------------------------------------------------------------------
# evidence


def _lagging(c: RasCommunicator) -> list[tuple[str, int, int, RasCountGroup]]:
    """(op, top count, this count, group) for every count group below the highest count of its op."""
    out = []
    tops: dict[str, int] = {}
    for g in c.count_groups:
        tops[g.op] = max(tops.get(g.op, g.count), g.count)
    for g in c.count_groups:
        if g.count < tops[g.op]:
            out.append((g.op, tops[g.op], g.count, g))
    return out


def _counts_frozen(prev: RasCommunicator, cur: RasCommunicator) -> bool:
    """True when the two queries show the same collective counts (per rank, or the same count groups)."""
    if prev.ranks and cur.ranks and all(r.collective_counts for r in cur.ranks):
        p = {r.rank: dict(r.collective_counts) for r in prev.ranks}
        q = {r.rank: dict(r.collective_counts) for r in cur.ranks}
        return p == q and any(v for counts in q.values() for v in counts.values())
    # text: counts are printed only when ranks disagree; same groups twice means nobody caught up
    return bool(cur.count_groups) and set(prev.count_groups) == set(cur.count_groups)


def ras_findings(prev: RasStatus | None, cur: RasStatus) -> list[RasFinding]:
    """Structured evidence from the latest query, sharpened by the previous one when given.

    Lagging ranks alone are normal in a running job (NCCL's docs say so); they become evidence when the
    counts did not move between the two queries ("stuck").
    """
    out: list[RasFinding] = []
    for p in cur.dead_processes:
        out.append(
            RasFinding(
                "dead",
                None,
                (),
                (p.pid,) if p.pid else (),
                f"process {p.pid} on {p.host} considered dead by RAS",
            )
        )
    for p in cur.missing_processes:
        out.append(
            RasFinding(
                "incomplete",
                None,
                (),
                (p.pid,) if p.pid else (),
                f"no communicator data from process {p.pid} on {p.host} (GPU {p.gpus})",
            )
        )
    if cur.timeouts:
        out.append(RasFinding("timeout", None, (), (), f"RAS hit {cur.timeouts} timeout(s) collecting data"))
    for c in cur.communicators:
        name = c.label or c.hash
        for m in c.missing_ranks:
            if m.dead:
                kind, what = "dead", "considered dead"
            elif m.unresponsive is False:
                kind, what = "incomplete", "reachable but not reporting this communicator"
            else:
                kind, what = "unresponsive", "did not respond"
            pid = f" (pid {m.pid} on {m.host})" if m.pid is not None else ""
            out.append(
                RasFinding(
                    kind,
                    c.hash,
                    (m.rank,),
                    (m.pid,) if m.pid else (),
                    f"comm {name}: rank {m.rank}{pid} {what}",
                )
            )
        for r, err in sorted(c.rank_errors.items()):
            out.append(RasFinding("error", c.hash, (r,), (), f"comm {name}: rank {r} reported {err}"))
        before = prev.communicator(c.hash) if prev is not None else None
        frozen = before is not None and _counts_frozen(before, c)
        for op, top, count, g in _lagging(c):
            ranks = g.ranks
            who = f"rank(s) {list(ranks)}" if ranks else f"{g.n_ranks} rank(s)"
            tail = " — unchanged since the previous query" if frozen else ""
            out.append(
                RasFinding(
                    "lagging",
                    c.hash,
                    ranks,
                    (),
                    f"comm {name}: {who} at {op} #{count}, others at #{top}{tail}",
                )
            )
        if frozen:
            out.append(
                RasFinding(
                    "stuck",
                    c.hash,
                    tuple(r for _op, _t, _c, g in _lagging(c) for r in g.ranks),
                    (),
                    f"comm {name}: collective counts did not move between two RAS queries",
                )
            )
    return out
