"""NCCL RAS client against a real local socket server replaying recorded protocol exchanges."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from rankwatch.watchdog.evidence.ras_client import parse_ras_addr, query_ras
from rankwatch.watchdog.evidence.ras_findings import ras_findings
from rankwatch.watchdog.evidence.ras_report import parse_ras_reply

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "ras"


class RasServer:
    """One-connection RAS stand-in on 127.0.0.1:<ephemeral>; stops by itself after one exchange or 5 s."""

    def __init__(
        self, reply: bytes, *, json_ok: bool = True, silent: bool = False, greeting: bytes | None = None
    ):
        self.reply = reply
        self.json_ok = json_ok
        self.silent = silent
        self.greeting = greeting
        self.commands: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.sock.settimeout(5.0)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RasServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=6)
        self.sock.close()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        conn.settimeout(5.0)
        buf = b""
        try:
            while True:
                if self.silent:
                    time.sleep(1.5)
                    return
                chunk = conn.recv(4096)
                if not chunk:
                    return
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    cmd = line.decode().strip()
                    self.commands.append(cmd)
                    low = cmd.lower()
                    if low.startswith("client protocol "):
                        conn.sendall(self.greeting or b"SERVER PROTOCOL 2\n")
                    elif low.startswith("timeout "):
                        conn.sendall(b"OK\n")
                    elif low.startswith("set format "):
                        conn.sendall(b"OK\n" if self.json_ok else f"ERROR: Unknown command {cmd}\n".encode())
                    elif low in ("status", "verbose status"):
                        # the real server streams the report in several messages, then closes
                        for i in range(0, len(self.reply), 700):
                            conn.sendall(self.reply[i : i + 700])
                        return
                    else:
                        conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())
        except OSError:
            return
        finally:
            conn.close()


def fixture(name: str) -> bytes:
    return (FIX / name).read_bytes()


def test_json_exchange_and_exact_protocol_strings():
    with RasServer(fixture("json_missing.json")) as srv:
        st = query_ras(srv.addr, ras_timeout_s=3, timeout_s=5)
    assert srv.commands == ["CLIENT PROTOCOL 2", "TIMEOUT 3", "SET FORMAT json", "VERBOSE STATUS"]
    assert st is not None and st.format == "json" and st.complete
    assert st.nccl_version == "2.29.1"
    (c,) = st.communicators
    assert c.hash == "ae94423cfbb2ef4a" and c.size == 2
    assert [r.rank for r in c.ranks] == [0]
    assert c.ranks[0].collective_counts["AllReduce"] == 0 and c.ranks[0].pid == 1524344
    (m,) = c.missing_ranks
    assert (m.rank, m.pid, m.unresponsive, m.dead) == (1, 1524345, True, False)
    f = ras_findings(None, st)
    assert [(x.what, x.ranks) for x in f] == [("unresponsive", (1,))]


def test_old_nccl_without_json_falls_back_to_text():
    with RasServer(fixture("text_dead.txt"), json_ok=False) as srv:
        st = query_ras(srv.addr, timeout_s=5, verbose=False)
    assert srv.commands[-2:] == ["SET FORMAT json", "STATUS"]
    assert st is not None and st.format == "text"
    assert st.nccl_version == "2.27.3+cuda12.9"
    assert [(p.pid, p.host, p.gpus) for p in st.dead_processes] == [(3487984, "172.16.64.213", "5")]
    assert [p.pid for p in st.missing_processes] == [3487990]
    assert st.timeouts == 2
    (row,) = st.groups
    assert (row.ranks_per_node, row.ranks_per_comm, row.status, row.errors) == (
        "7-8",
        32,
        "RUNNING",
        "INCOMPLETE,ERROR",
    )
    (c,) = st.communicators
    assert c.hash == "cf264af53edbe986" and c.label == "#0-0"
    assert c.errors == ("INCOMPLETE", "ERROR")
    assert [(m.rank, m.pid) for m in c.missing_ranks] == [(21, 3487984), (22, 3487990)]
    assert c.rank_errors == {9: "Remote process error"}
    kinds = {f.what for f in ras_findings(None, st)}
    assert {"dead", "incomplete", "timeout", "unresponsive", "error"} <= kinds
    assert any(f.what == "dead" and f.pids == (3487984,) for f in ras_findings(None, st))


def test_text_counts_that_do_not_move_are_stuck():
    a = parse_ras_reply(fixture("text_lagging_q1.txt").decode(), prefer="text")
    b = parse_ras_reply(fixture("text_lagging_q2.txt").decode(), prefer="text")
    (c,) = b.communicators
    assert c.label == "#0-0" and c.errors == ("MISMATCH",)
    assert [(g.op, g.count, g.n_ranks, g.ranks) for g in c.count_groups] == [
        ("AllReduce", 6650, 7, ()),
        ("AllReduce", 6649, 1, (5,)),
    ]
    assert c.ranks[0].pid == 483077 and c.ranks[0].host == "172.16.64.211"
    # one query: lagging only (normal while running)
    assert [f.what for f in ras_findings(None, b)] == ["lagging"]
    # two identical queries: stuck, naming rank 5
    f = ras_findings(a, b)
    assert [(x.what, x.ranks) for x in f] == [("lagging", (5,)), ("stuck", (5,))]
    assert f[0].frozen and (f[0].op, f[0].count, f[0].top) == ("AllReduce", 6649, 6650)


def test_text_counts_that_moved_are_not_stuck():
    a = parse_ras_reply(fixture("text_lagging_q1.txt").decode(), prefer="text")
    b = parse_ras_reply(fixture("text_moving_q2.txt").decode(), prefer="text")
    (c,) = b.communicators
    assert c.count_groups[1].ranks == (2, 6)  # the outlier group lists its ranks under its count line
    f = ras_findings(a, b)
    assert [x.what for x in f] == ["lagging"]
    assert f[0].ranks == (2, 6)


def test_json_stuck_and_error_across_queries():
    with RasServer(fixture("json_stuck_q1.json")) as srv:
        a = query_ras(srv.addr, timeout_s=5)
    with RasServer(fixture("json_stuck_q2.json")) as srv:
        b = query_ras(srv.addr, timeout_s=5)
    assert a is not None and b is not None
    (c,) = b.communicators
    assert c.errors == ("ERROR", "MISMATCH")
    assert [(g.count, g.ranks) for g in c.count_groups] == [(503, (0, 1, 3)), (502, (2,))]
    f = ras_findings(a, b)
    assert {(x.what, x.ranks) for x in f} == {("error", (2,)), ("lagging", (2,)), ("stuck", (2,))}
    assert [x.what for x in ras_findings(None, a)] == ["lagging"]  # one query: no "stuck" yet


def test_connection_refused_returns_none():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert query_ras(f"127.0.0.1:{port}", timeout_s=2) is None


def test_silent_server_times_out_to_none():
    with RasServer(b"", silent=True) as srv:
        t0 = time.monotonic()
        assert query_ras(srv.addr, timeout_s=0.5) is None
        assert time.monotonic() - t0 < 2.0


def test_not_a_ras_server_returns_none():
    with RasServer(b"", greeting=b"HTTP/1.1 400 Bad Request\n") as srv:
        assert query_ras(srv.addr, timeout_s=2) is None


def test_truncated_reply_is_partial(monkeypatch):
    big = fixture("text_dead.txt")
    with RasServer(big, json_ok=False) as srv:
        st = query_ras(srv.addr, timeout_s=5, max_bytes=200)
    assert st is not None and not st.complete
    assert st.nccl_version == "2.27.3+cuda12.9"


@pytest.mark.parametrize("addr", ["10.0.0.1:28028", "example.com:28028", "localhost", "localhost:0", "::1"])
def test_non_loopback_or_malformed_address(addr):
    with pytest.raises(ValueError):
        parse_ras_addr(addr)
    assert query_ras(addr, timeout_s=0.2) is None


def test_loopback_addresses_accepted():
    assert parse_ras_addr("localhost:28028") == ("localhost", 28028)
    assert parse_ras_addr("127.0.0.2:1") == ("127.0.0.2", 1)
    assert parse_ras_addr("[::1]:28028") == ("::1", 28028)
