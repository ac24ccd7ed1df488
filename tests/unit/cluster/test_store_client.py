"""The bounded TCPStore client (``cluster/store_client.py``, issue 43 item 2): every operation rankwatch uses
against torch's real TCPStore servers — libuv and the classic backend — and the limits that hold whatever a
store sends: a value over the cap refused unread, a deadline per call, a key cap.

Servers are real: torch's TCPStore in this process (no process started: fast tier) or, for the attacks,
``tests/procs/hostile_store.py``-style sockets in a thread."""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time

import psutil
import pytest
from rankwatch.watchdog.cluster.store_client import (
    KeyVanished,
    StoreClient,
    StoreClientError,
    StoreClientPolicy,
    ValueTooLarge,
)


def torch_server(libuv: bool):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv,
                         timeout=datetime.timedelta(seconds=10))


def flushed(server) -> None:
    """torch's set and append get no answer: one round trip on the same connection has the server done with
    them (it takes a connection's requests in order) before another connection reads."""
    server.add("flush", 0)


@pytest.fixture(params=[True, False], ids=["libuv", "classic"])
def server(request):
    srv = torch_server(request.param)
    assert srv.libuvBackend is request.param
    yield srv
    del srv


def test_every_operation_interoperates_with_torchs_own_client(server):
    c = StoreClient("127.0.0.1", server.port)
    try:
        c.set("k/a", b"from rankwatch")
        assert server.get("k/a") == b"from rankwatch"  # the same keys as torch's Python client
        server.set("k/b", b"from torch")
        flushed(server)
        assert c.get("k/b") == b"from torch"
        assert c.check(["k/a", "k/b"]) and not c.check(["k/a", "k/none"])
        assert c.multi_get(["k/a", "k/b"]) == [b"from rankwatch", b"from torch"]
        # compare-and-set: b"" claims an absent key; a wrong expectation leaves the value and returns it
        assert c.compare_set("k/c", b"", b"first") == b"first"
        assert c.compare_set("k/c", b"", b"second") == b"first"
        assert c.compare_set("k/c", b"first", b"third") == b"third" == server.get("k/c")
        assert c.add("k/n", 2) == 2 and c.add("k/n", 0) == 2 and server.add("k/n", 1) == 3
        assert c.delete_key("k/a") and not c.check(["k/a"])
        # a wait that times out is cancelled on the server and the connection goes on
        t0 = time.monotonic()
        assert c.wait(["k/later"], 0.3) is False
        assert 0.25 < time.monotonic() - t0 < 2.0
        assert c.get("k/b") == b"from torch"
        woke = threading.Timer(0.2, lambda: server.set("k/later", b"1"))
        woke.start()
        assert c.wait(["k/later"], 10.0) is True
        woke.join()
        # a key deleted after it was seen: the libuv server answers empty, the classic one hangs up
        with pytest.raises(KeyVanished):
            c.get("k/none")
        assert c.get("k/b") == b"from torch"  # the next call has a fresh connection where needed
    finally:
        c.close()


def test_a_value_over_the_cap_is_refused_and_the_client_goes_on(server):
    server.set("big", b"x" * (3 << 20))
    server.append("big", b"x" * (3 << 20))  # 6 MiB: libuv takes 8 MiB per request, appends grow beyond
    server.set("small", b"ok")
    flushed(server)
    c = StoreClient("127.0.0.1", server.port, StoreClientPolicy(max_value_bytes=4 << 20))
    try:
        with pytest.raises(ValueTooLarge, match="6291456 bytes"):
            c.get("big")
        assert not c.connected  # the rest of that value is never read: the connection went with it
        with pytest.raises(ValueTooLarge):
            c.multi_get(["small", "big"])
        assert c.get("small") == b"ok"
        with pytest.raises(ValueTooLarge):
            c.set("mine", b"y" * (5 << 20))  # nor does it write one
    finally:
        c.close()


def test_a_multi_key_read_stops_at_its_byte_budget(server):
    for k in range(4):
        server.set(f"v{k}", b"z" * (1 << 20))
    flushed(server)
    c = StoreClient("127.0.0.1", server.port, StoreClientPolicy(max_read_bytes=(3 << 20) - 1))
    try:
        with pytest.raises(ValueTooLarge, match="read budget"):
            c.multi_get([f"v{k}" for k in range(4)])
        assert len(c.multi_get(["v0", "v1"])) == 2
        with pytest.raises(StoreClientError, match="over the limit"):
            StoreClient("127.0.0.1", server.port, StoreClientPolicy(max_keys=2)).check(["a", "b", "c"])
    finally:
        c.close()


# -- hostile servers -------------------------------------------------------------------------------------


class Hostile:
    """A listening socket whose connections get ``answer(conn)`` on a thread each."""

    def __init__(self, answer) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.answer = answer
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            self.answer(c)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def validating(then):
    """Answers the validation's ping (so the client connects), then ``then(conn)`` for the next request."""

    def answer(c: socket.socket) -> None:
        hello = b""
        while len(hello) < 10:
            hello += c.recv(10 - len(hello))
        c.sendall(hello[6:10])  # the ping's nonce back
        c.recv(65536)  # the request
        then(c)

    return answer


def test_a_two_gib_length_prefix_allocates_nothing():
    h = Hostile(validating(lambda c: (c.sendall(b"\x00"), c.recv(65536), c.sendall(struct.pack("<Q", 2 << 30)),
                                      time.sleep(30))))
    c = StoreClient("127.0.0.1", h.port)
    rss = psutil.Process().memory_info().rss
    try:
        assert c.check(["k"])
        t0 = time.monotonic()
        with pytest.raises(ValueTooLarge, match="2147483648 bytes"):
            c.get("k")
        assert time.monotonic() - t0 < 1.0  # refused on the prefix, not after waiting for the value
        assert psutil.Process().memory_info().rss - rss < 32 << 20
    finally:
        c.close()
        h.close()


@pytest.mark.parametrize("how", ["never-validates", "never-answers", "trickles"])
def test_every_call_has_a_deadline(how):
    def trickle(c: socket.socket) -> None:  # a byte every 0.3 s: each recv gets something, the whole never ends
        c.sendall(b"\x00")  # CHECK: the key exists
        c.recv(65536)
        for b in struct.pack("<Q", 100) + b"x" * 100:
            c.sendall(bytes((b,)))
            time.sleep(0.3)

    answers = {
        "never-validates": lambda c: time.sleep(30),
        "never-answers": validating(lambda c: time.sleep(30)),
        "trickles": validating(trickle),
    }
    h = Hostile(answers[how])
    c = StoreClient("127.0.0.1", h.port, StoreClientPolicy(op_timeout_s=1.0, connect_timeout_s=1.0))
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreClientError, match="within 1s"):
            c.check(["k"]) if how != "trickles" else (c.check(["k"]), c.get("k"))
        assert time.monotonic() - t0 < 4.0
        assert not c.connected
    finally:
        c.close()
        h.close()


def test_a_peer_that_is_no_tcpstore_is_refused():
    h = Hostile(lambda c: (c.recv(10), c.sendall(b"HTTP")))
    try:
        with pytest.raises(StoreClientError, match="not a TCPStore"):
            StoreClient("127.0.0.1", h.port).connect()
    finally:
        h.close()


def test_jobstore_takes_an_oversized_value_as_a_tampered_one(server):
    """Through the exchange's own reader: the key reads as a refused value, and unsealing it says why."""
    from rankwatch.watchdog.cluster.store import MAX_VALUE_BYTES, JobStore, ValueRejected

    server.set("rankwatch/j/node/1", b"x" * (MAX_VALUE_BYTES // 2))
    server.append("rankwatch/j/node/1", b"x" * (MAX_VALUE_BYTES // 2 + 1))
    flushed(server)
    s = JobStore("127.0.0.1", server.port, "j", host_server=False)
    try:
        raw = s.get_raw("node/1")
        assert raw is not None and raw == b""
        with pytest.raises(ValueRejected, match="refused"):
            s.unseal("node/1", raw)
        s.set_json("node/0", {"schema": "x"})
        assert s.get_raw("node/0") == b'{"schema":"x"}'  # the connection was opened again
    finally:
        s.close()
