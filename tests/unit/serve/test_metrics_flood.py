"""The metrics port under attack (issue 43): idle connections, a slowloris, oversized heads.

Before, ``ThreadingHTTPServer`` gave each connection a thread and waited for its request forever: a few
hundred idle connections took the daemon to a thousand threads and every fd, and ``/healthz`` stopped
answering. Now the port is one event loop with a connection cap and deadlines (``EndpointPolicy``).
"""

from __future__ import annotations

import html
import os
import resource
import socket
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import free_port, start_daemon, wait_for, wait_polls
from rankwatch.watchdog.observe.process import ProcessTable
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig
from rankwatch.watchdog.serve.http_endpoint import ERROR_CONTENT_TYPE, ERROR_PAGE, EndpointPolicy, error_response
from rankwatch.watchdog.serve.metrics import serve_metrics

FD_LIMIT = 256  # the daemon's RLIMIT_NOFILE below: fewer fds than the idle connections the test opens
IDLE = 400
# fds a polling daemon holds for a moment besides its resting set (the shm dir it lists, a /proc file it reads)
TRANSIENT_FDS = 8


def get(url: str, timeout: float = 10, **headers: str) -> tuple[int, bytes, float]:
    """(status, body, seconds it took); status 0 when the server refused or dropped the connection."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            code, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        code, body = exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        code, body = 0, b""
    return code, body, time.monotonic() - t0


def open_idle(port: int, n: int) -> list[socket.socket]:
    """Up to ``n`` connections that never send a byte: until one is not accepted within 5 s (a server out
    of fds stops accepting and its listen queue fills)."""
    socks: list[socket.socket] = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    return socks


def closed_by_server(s: socket.socket) -> bool:
    """The server closed (or reset) this connection: a read returns end of file at once."""
    try:
        return s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def counts(pid: int) -> tuple[int, int]:
    """(threads, open fds) of a process, from /proc."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def slowloris(port: int, every_s: float, give_up_s: float) -> tuple[float, bool]:
    """Trickle a request head one header line at a time, never finishing it: (seconds until the server
    cut the connection off, whether it did before ``give_up_s``)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    t0 = time.monotonic()
    try:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(every_s)
        i = 0
        while time.monotonic() - t0 < give_up_s:
            try:
                if s.recv(1) == b"":
                    return time.monotonic() - t0, True
            except TimeoutError:
                pass
            except OSError:
                return time.monotonic() - t0, True
            try:
                s.sendall(f"X-Slow-{i}: {i}\r\n".encode())
            except OSError:
                return time.monotonic() - t0, True
            i += 1
        return time.monotonic() - t0, False
    finally:
        s.close()


def test_a_real_daemon_under_a_low_fd_limit_survives_hundreds_of_idle_connections_and_a_slowloris(
        procs, shm_dir, tmp_path):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < IDLE + 100:
        pytest.skip("this test process itself needs more fds than its limit allows")
    port = free_port()
    daemon = start_daemon(procs, shm_dir, tmp_path / "out", "--metrics-port", str(port), poll="0.2")
    # the daemon itself under a low RLIMIT_NOFILE (fewer fds than the idle clients): before, every
    # connection took an fd and a thread until the daemon had none left for its records
    resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    wait_polls(port)
    policy = EndpointPolicy()
    base = f"http://127.0.0.1:{port}"
    assert get(f"{base}/metrics")[0] == 200  # the render pool's first thread exists now
    threads0, fds0 = counts(daemon.pid)

    idle = open_idle(port, IDLE)
    try:
        # a fresh client (a liveness probe) is answered at once, not after the idle ones' deadline
        code, body, took = get(f"{base}/healthz")
        assert code == 200 and b'"ok"' in body, (code, body)
        assert took < policy.head_timeout_s, took
        code, body, _ = get(f"{base}/metrics")
        assert code == 200 and b"rankwatch_daemon_polls_total" in body
        assert len(idle) == IDLE, f"only {len(idle)} connections were accepted"
        threads, fds = counts(daemon.pid)
        assert threads <= threads0 + policy.render_workers, (threads0, threads)
        assert fds <= fds0 + TRANSIENT_FDS + policy.max_connections + policy.accept_backlog < FD_LIMIT, (fds0, fds)
        # the connections over the cap were closed by the server, not kept waiting
        assert wait_for(lambda: sum(map(closed_by_server, idle)) >= IDLE - policy.max_connections, timeout=30)

        # a slowloris trickling its head is cut off at the head deadline, counted from its accept
        cut_after, cut = slowloris(port, every_s=0.3, give_up_s=policy.head_timeout_s * 4)
        assert cut, f"still connected after {cut_after:.1f} s"
        assert cut_after >= policy.head_timeout_s * 0.9, cut_after

        # the idle ones reached their deadline too: the daemon is back to its own fds, still polling
        assert wait_for(lambda: all(map(closed_by_server, idle)), timeout=30)
        assert wait_for(lambda: counts(daemon.pid)[1] <= fds0, timeout=30), (fds0, counts(daemon.pid))
        wait_polls(port)
        print(f"threads {threads0} -> {threads} under {IDLE} idle connections; fds {fds0} -> {fds} "
              f"(limit {FD_LIMIT}); /healthz in {took * 1e3:.0f} ms; slowloris cut after {cut_after:.1f} s")
    finally:
        for s in idle:
            s.close()
    assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""


def test_the_cap_makes_room_for_a_fresh_client_and_bad_heads_get_http_servers_answers(tmp_path):
    """The real server object in this process, with a small cap and short deadlines."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    daemon = Daemon(DaemonConfig(shm_dir=str(shm), out_dir=str(tmp_path / "out")), procs=ProcessTable(protected={1}))
    daemon.poll_once()
    # the idle clients fit the kernel's accept queue (``accept_backlog``), so none waits for a SYN retry
    policy = EndpointPolicy(max_connections=4, head_timeout_s=3.0, max_head_bytes=1024)
    n_idle = policy.accept_backlog - 4
    server = serve_metrics(daemon, "127.0.0.1", 0, policy=policy)
    base = f"http://127.0.0.1:{server.port}"
    threads0 = threading.active_count()
    idle: list[socket.socket] = []
    try:
        idle = open_idle(server.port, n_idle)
        code, _, took = get(f"{base}/healthz")
        assert code == 200 and took < policy.head_timeout_s
        assert server.server.open_connections <= policy.max_connections
        refused = n_idle - policy.max_connections
        assert wait_for(lambda: server.server.refused >= refused, timeout=30), server.server.refused
        assert wait_for(lambda: sum(map(closed_by_server, idle)) >= refused, timeout=30)
        assert threading.active_count() <= threads0 + policy.render_workers
        assert get(f"{base}/metrics")[0] == 200

        def raw(data: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(data)
                chunks = []
                while chunk := s.recv(65536):
                    chunks.append(chunk)
                return b"".join(chunks)

        assert raw(b"GET /healthz HTTP/1.0\r\n" + b"X: " + b"a" * 2000 + b"\r\n\r\n").startswith(b"HTTP/1.0 431 ")
        assert raw(b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").startswith(b"HTTP/1.0 501 ")
        assert raw(b"HEAD /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 501 ")
        assert raw(b"hello\r\n\r\n").startswith(b"HTTP/1.0 400 ")
        assert raw(b"GET / HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.0 505 ")
        answer = raw(b"GET /nope HTTP/1.1\nHost: x\n\n")  # bare LF, as http.server accepted
        assert answer.startswith(b"HTTP/1.0 404 ") and b"try /metrics or /healthz" in answer
        assert b"Content-Type: text/html;charset=utf-8" in answer
        # the idle ones are cut off at the head deadline
        assert wait_for(lambda: all(map(closed_by_server, idle)), timeout=30)
        assert wait_for(lambda: server.server.open_connections == 0, timeout=30)
        assert server.server.timed_out >= 1
    finally:
        for s in idle:
            s.close()
        server.close()
        daemon.close()
    assert not [t for t in threading.enumerate() if t.name == "rankwatch-metrics"]



def test_error_pages_are_the_ones_http_server_writes():
    # the endpoint keeps http.server's page as its own copy (importing http.server cost every watchdog ~1 MB)
    assert (ERROR_PAGE, ERROR_CONTENT_TYPE) == (BaseHTTPRequestHandler.error_message_format,
                                                BaseHTTPRequestHandler.error_content_type)
    message = "try <this> & \"that\""
    page = error_response(404, message)
    assert page.status == 404 and f"<p>Message: {html.escape(message, quote=False)}.</p>".encode() in page.body
