"""A small HTTP/1.0 server whose cost is bounded whatever its clients do (``/metrics`` and ``/healthz``).

The daemon's metrics port may face the cluster network (the Kubernetes example binds 0.0.0.0), so every
local user and every pod can connect to it. ``http.server.ThreadingHTTPServer`` gave each connection a
thread and waited for its request forever: a few hundred idle connections took the daemon to a thousand
threads and every fd, ``/healthz`` stopped answering and new jobs were no longer discovered (issue 43).

Here one thread runs an asyncio loop over every connection (an idle client costs a socket and a few KiB,
no thread); a connection has a deadline to send its request head (``head_timeout_s``, counted from the
accept, so trickling bytes does not extend it) and one to take its answer (``write_timeout_s``); the head
is read into a bounded buffer; at most ``max_connections`` are open, and a new one over the cap takes the
place of the oldest connection still waiting for its request (an idle or slow one) — so a flood of idle
clients cannot keep a liveness probe out — or is closed itself when every open connection is being
answered. Work that can block (a ``/metrics`` render asks NVML, which can hang with a sick GPU) runs on a
small pool under ``render_timeout_s``; everything the route answers at once (``/healthz``, errors) never
leaves the loop, so a wedged render never hides the daemon's health.

Each connection gets one answer and is closed (HTTP/1.0, as ``BaseHTTPRequestHandler`` answered), with
the same error pages ``http.server`` writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import io
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

import structlog

log = structlog.get_logger("rankwatch.metrics")


@dataclass(frozen=True)
class EndpointPolicy:
    """The bounds of the metrics port: what one client, or many, may cost the daemon."""

    # connections open at once. Prometheus scrapes a target over one connection at a time; two HA
    # Prometheus servers, a kubelet probe and an operator's curl need a handful, so 64 leaves room for
    # bursts while the port's fds (this plus ``accept_backlog``) stay a small share of the daemon's limit
    # (the unit's LimitNOFILE=65536; 1,024 where nobody raised it): it reads records, pidfds and stacks
    max_connections: int = 64
    # accepted per wake-up before the cap is applied (asyncio accepts up to the listen backlog at once),
    # and the kernel's queue of connections not yet accepted (those cost no fd of ours)
    accept_backlog: int = 16
    # a request head must arrive whole this long after the accept: a scraper or probe sends its few hundred
    # bytes in one segment at once; 5 s covers two TCP retransmissions (initial RTO 1 s) on a lossy link.
    # Counted from the accept, not from the last byte: a client trickling a header is cut off all the same
    head_timeout_s: float = 5.0
    # the longest request head read: a scrape's head is a few hundred bytes, the bearer token at most 4 KiB
    # (``read_token``); what is longer is refused (431), never buffered
    max_head_bytes: int = 16 << 10
    # a render that takes longer is answered 503: Prometheus' default scrape_timeout is 10 s, so nobody
    # waits for a later answer, and a render stuck in NVML must not hold the connection
    render_timeout_s: float = 10.0
    # the client must have taken the whole answer this long after it was ready (a node's body is tens of
    # KiB); a client that reads slower is cut off (Prometheus itself gives up after its scrape_timeout)
    write_timeout_s: float = 10.0
    # renders at once: concurrent scrapes of one registry share its collector's lock, so more would only
    # wait; two let the aggregate and the per-job view render side by side. A render that never returns
    # (a hung NVML call) keeps its thread; at most this many threads exist whatever happens
    render_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("max_connections", "accept_backlog", "max_head_bytes", "render_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"EndpointPolicy.{name} must be at least 1")
        for name in ("head_timeout_s", "render_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EndpointPolicy.{name} must be positive")


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: http.client.HTTPMessage
    client: str


@dataclass(frozen=True)
class Response:
    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


# ``http.server``'s error page and its type (``DEFAULT_ERROR_MESSAGE``, ``DEFAULT_ERROR_CONTENT_TYPE``), as
# written here, and ``html.escape(text, quote=False)`` as ``_escape``: importing ``http.server`` and ``html``
# (its table of entities) for two strings and three replacements cost every watchdog ~1.4 MB of RSS and ~10 ms
# of start-up, metrics served or not (tests/unit/serve/test_metrics_flood.py holds them equal)
ERROR_PAGE = """<!DOCTYPE HTML>
<html lang="en">
    <head>
        <meta charset="utf-8">
        <title>Error response</title>
    </head>
    <body>
        <h1>Error response</h1>
        <p>Error code: %(code)d</p>
        <p>Message: %(message)s.</p>
        <p>Error code explanation: %(code)s - %(explain)s.</p>
    </body>
</html>
"""
ERROR_CONTENT_TYPE = "text/html;charset=utf-8"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def error_response(status: int, message: str | None = None) -> Response:
    """The page ``BaseHTTPRequestHandler.send_error`` writes, so a client sees what it saw before."""
    short, explain = HTTPStatus(status).phrase, HTTPStatus(status).description
    page = ERROR_PAGE % {
        "code": status, "message": _escape(message or short), "explain": _escape(explain)}
    headers = (("Content-Type", ERROR_CONTENT_TYPE), ("Connection", "close"))
    return Response(status, headers, page.encode("utf-8", "replace"))


# what a route returns: the answer, or a function computing it that may block (run off the loop)
Route = Callable[[Request], "Response | Callable[[], Response]"]

_VERSION = re.compile(r"HTTP/(\d+)\.(\d+)")


def _head_end(buf: bytes | bytearray) -> int:
    """Where the request head ends (after its blank line), 0 while it has not: CRLF as clients send it, bare
    LF as ``BaseHTTPRequestHandler`` accepted too."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
    return min(ends) if ends else 0


def parse_head(head: bytes, client: str) -> Request | Response:
    """The request in ``head``, or the error answer ``BaseHTTPRequestHandler`` gave for it."""
    line, _, rest = head.partition(b"\n")
    words = line.decode("iso-8859-1").rstrip("\r\n").split()
    if len(words) != 3:
        return error_response(400, f"Bad request syntax ({line.decode('iso-8859-1').strip()!r})")
    method, target, version = words
    m = _VERSION.fullmatch(version)
    if m is None:
        return error_response(400, f"Bad request version ({version!r})")
    if int(m.group(1)) >= 2:
        return error_response(505, f"Invalid HTTP version ({version})")
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except http.client.LineTooLong as exc:
        return error_response(431, f"Line too long: {exc}")
    except http.client.HTTPException as exc:
        return error_response(431, f"Too many headers: {exc}")
    if method != "GET":
        return error_response(501, f"Unsupported method ({method!r})")
    return Request(method, target, headers, client)


@dataclass(eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    reading: bool = True  # still waiting for its request head: the first to make room under the cap


@dataclass
class BoundedHttpServer:
    """The server: ``start()`` on a bound, listening socket; ``close()`` stops it and frees the port."""

    sock: socket.socket
    route: Route
    policy: EndpointPolicy = field(default_factory=EndpointPolicy)
    name: str = "rankwatch-http"

    def __post_init__(self) -> None:
        self._conns: dict[_Conn, None] = {}  # open connections, oldest first
        self._pool = concurrent.futures.ThreadPoolExecutor(self.policy.render_workers,
                                                           thread_name_prefix=f"{self.name}-render")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self.refused = 0  # connections closed for the cap (the new one, or an idle one it displaced)
        self.timed_out = 0  # connections cut off at a deadline

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def close(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to start(), or logged once it has returned
            if not self._ready.is_set():
                self._failed = exc
                self._ready.set()
            else:
                log.exception("metrics_server_failed")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self.sock, limit=self.policy.max_head_bytes,
                                            backlog=self.policy.accept_backlog)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for conn in list(self._conns):
                conn.writer.transport.abort()
            self._conns.clear()

    def _admit(self, conn: _Conn) -> bool:
        """Room for ``conn`` under the cap: the oldest connection still waiting for its head gives way (an
        idle client that never sends one would otherwise keep out everyone after it); if every open
        connection is being answered, ``conn`` is the one refused."""
        if len(self._conns) >= self.policy.max_connections:
            victim = next((c for c in self._conns if c.reading), None)
            self.refused += 1
            if victim is None:
                return False
            del self._conns[victim]
            victim.writer.transport.abort()
        self._conns[conn] = None
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        peer = writer.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._admit(conn):
            writer.transport.abort()
            return
        try:
            try:
                answer = await asyncio.wait_for(self._read_request(reader, client), self.policy.head_timeout_s)
            except (TimeoutError, asyncio.TimeoutError):
                self.timed_out += 1
                log.debug("metrics_client_timed_out", client=client, waited_s=self.policy.head_timeout_s)
                return
            if answer is None:  # gone (or displaced) before its head was whole
                return
            conn.reading = False
            if isinstance(answer, Request):
                request_line = f"{answer.method} {answer.target}"
                answer = await self._answer(answer)
            else:
                request_line = "(bad request)"
            await self._write(writer, answer)
            log.debug("metrics_request", client=client, line=f'"{request_line}" {answer.status} {len(answer.body)}')
        except (ConnectionError, OSError):
            pass
        finally:
            self._conns.pop(conn, None)
            if not writer.transport.is_closing():
                writer.transport.abort()

    async def _read_request(self, reader: asyncio.StreamReader, client: str) -> Request | Response | None:
        buf = bytearray()
        while not (end := _head_end(buf)):
            if len(buf) > self.policy.max_head_bytes:
                return error_response(431, "Request head too long")
            chunk = await reader.read(4096)
            if not chunk:
                return None
            buf += chunk
        if end > self.policy.max_head_bytes:
            return error_response(431, "Request head too long")
        return parse_head(bytes(buf[:end]), client)

    async def _answer(self, request: Request) -> Response:
        try:
            routed = self.route(request)
        except Exception:
            log.exception("metrics_route_failed")
            return error_response(500, "request failed; see the daemon log")
        if isinstance(routed, Response):
            return routed
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._pool, routed), self.policy.render_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            log.warning("metrics_render_timed_out", timeout_s=self.policy.render_timeout_s)
            return error_response(503, f"no answer within {self.policy.render_timeout_s:g} s; see the daemon log")
        except RuntimeError:  # the pool is shut down: the server is closing
            return error_response(503, "shutting down")

    async def _write(self, writer: asyncio.StreamWriter, response: Response) -> None:
        status = HTTPStatus(response.status)
        lines = [f"HTTP/1.0 {status.value} {status.phrase}", "Server: rankwatch",
                 f"Date: {formatdate(usegmt=True)}",
                 *(f"{k}: {v}" for k, v in response.headers),
                 f"Content-Length: {len(response.body)}"]
        # the buffer drains to empty before drain() returns, so the deadline covers the client taking it all
        writer.transport.set_write_buffer_limits(high=0)
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body)
        try:
            await asyncio.wait_for(writer.drain(), self.policy.write_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            self.timed_out += 1
            log.debug("metrics_client_timed_out", waited_s=self.policy.write_timeout_s, writing=True)
            return
        writer.close()
