"""NCCL RAS client: ask the job's local RAS thread (NCCL ≥ 2.24) for communicator state.

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
import socket
import time
from dataclasses import replace

import structlog

from .ras_report import parse_ras_reply
from .ras_status import RasStatus

log = structlog.get_logger()

DEFAULT_ADDR = "localhost:28028"
CLIENT_PROTOCOL = 2
MAX_REPLY_BYTES = 4 * 1024 * 1024
"""A JSON report is ~600 bytes per rank; 4 MiB covers several thousand ranks of one node's view."""
DEFAULT_RAS_TIMEOUT_S = 5
"""NCCL's own default (RAS_COLLECTIVE_LEG_TIMEOUT_SEC); the socket deadline adds slack on top."""
SOCKET_SLACK_S = 5.0
"""ncclras adds RAS_COLLECTIVE_EXTRA_TIMEOUT_SEC to the RAS timeout for its read deadline; so do we."""


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
    return replace(s, complete=complete)
