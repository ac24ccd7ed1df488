"""Every store the daemon talks to is bounded, and only a store its own configuration names (issue 43, item 2).

A real `rankwatch daemon` correlating a one-rank job whose job.json says "node 1 of 2", against stores that
attack it: one that announces a 2 GiB value for every key (torch's client allocated it: the daemon's peak
memory grew by 2 GiB per read), one that accepts and never answers. And a job.json whose MASTER_ADDR names
another address: the daemon connects only where ``--store`` says, and with no store option nowhere."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

import psutil
from conftest import LineReader, free_port, start_daemon, stop_daemon, wait_for, wait_polls
from test_safety import start_rank

HOSTILE = str(Path(__file__).resolve().parents[2] / "procs" / "hostile_store.py")
RANK_PY = str(Path(__file__).resolve().parents[2] / "procs" / "rank.py")


def peak_rss(pid: int) -> int:
    """The process's high-water mark of resident memory (VmHWM): a 2 GiB buffer held for a moment counts."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def second_node_rank(procs, shm: Path, job: str, master: str):
    """A one-rank job whose job.json says it is node 1 of 2 (one rank per node), its master at ``master``."""
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, RANK="1", LOCAL_RANK="0",
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_RANK="1", MASTER_ADDR=master)
    proc = procs.start([sys.executable, RANK_PY], env=env, text=True)
    assert proc.stdout.readline().startswith("ready"), proc.stderr.read()
    return proc


def test_a_store_announcing_2gib_values_does_not_grow_the_daemon(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    store, metrics = free_port(), free_port()
    hostile = procs.start([sys.executable, HOSTILE, "huge", str(store)], text=True)
    announced = LineReader(hostile.stdout)
    assert announced.wait_for("ready", timeout=60)
    daemon = start_daemon(procs, shm, out, "--store", f"127.0.0.1:{store}", "--metrics-port", str(metrics))
    log = LineReader(daemon.stderr)
    wait_polls(metrics, more=2)
    before = peak_rss(daemon.pid)
    second_node_rank(procs, shm, "huge-values", "127.0.0.1")
    assert log.wait_for('"store_connected"', timeout=60), log.lines[-20:]
    # every poll reads the incident pointer: the store answers "2 GiB follow" each time
    assert announced.wait_for("announced 10", timeout=120), log.lines[-20:]
    wait_polls(metrics, more=3)  # and the daemon polls on
    grown = peak_rss(daemon.pid) - before
    assert grown < 64 << 20, f"peak RSS grew by {grown >> 20} MiB"
    assert log.wait_for('"store_value_rejected"', "2147483648 bytes", timeout=30), log.lines[-20:]
    assert psutil.Process(daemon.pid).num_threads() < 40
    stop_daemon(daemon, log)
    print(f"daemon peak RSS before {before >> 20} MiB, after 10+ 2 GiB announcements +{grown >> 20} MiB")


def test_a_store_that_accepts_and_never_answers_holds_nothing(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    store, metrics = free_port(), free_port()
    hostile = procs.start([sys.executable, HOSTILE, "silent", str(store)], text=True)
    assert LineReader(hostile.stdout).wait_for("ready", timeout=60)
    daemon = start_daemon(procs, shm, out, "--store", f"127.0.0.1:{store}", "--metrics-port", str(metrics))
    log = LineReader(daemon.stderr)
    second_node_rank(procs, shm, "silent-store", "127.0.0.1")
    # the connect's validation has a deadline (CorrelationPolicy.connect_timeout_s, 10 s)
    assert log.wait_for('"store_unreachable"', "within", timeout=90), log.lines[-20:]
    wait_polls(metrics, more=3)  # the poll loop never waited on it
    start_rank(procs, shm, "after-the-silent-store", 0, 1)
    assert log.wait_for('"job_discovered"', "after-the-silent-store", timeout=60), log.lines[-20:]
    p = psutil.Process(daemon.pid)
    assert p.num_fds() < 64 and p.num_threads() < 40
    stop_daemon(daemon, log)


class Listener:
    """Counts the connections made to ``addr``:``port`` (and answers nothing)."""

    def __init__(self, addr: str, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


def test_a_job_json_makes_the_daemon_connect_only_where_its_configuration_says(procs, tmp_path):
    port = free_port()
    configured, named = Listener("127.0.0.1", port), Listener("127.0.0.2", port)
    try:
        # no store option: a job claiming two nodes, its master on this host, makes no connection at all
        shm, out = tmp_path / "shm", tmp_path / "out"
        shm.mkdir(mode=0o700)
        metrics = free_port()
        daemon = start_daemon(procs, shm, out, "--metrics-port", str(metrics))
        log = LineReader(daemon.stderr)
        second_node_rank(procs, shm, "names-a-master", "127.0.0.2")
        assert log.wait_for('"job_discovered"', "names-a-master", timeout=60), log.lines[-20:]
        wait_polls(metrics, more=4)
        remote = [c for c in psutil.Process(daemon.pid).net_connections(kind="tcp") if c.raddr]
        # the metrics server's side of the scrapes wait_polls made (laddr: the metrics port, a scrape the scraper
        # closed may sit in CLOSE_WAIT a moment) is no connection the daemon made
        assert not [c for c in remote if metrics not in (c.raddr.port, c.laddr.port)], remote
        stop_daemon(daemon, log)
        assert not any('"correlating"' in line for line in log.lines)
        assert not configured.accepted and not named.accepted

        # --store HOST:PORT: that store, whatever MASTER_ADDR the job's job.json names
        shm2, out2 = tmp_path / "shm2", tmp_path / "out2"
        shm2.mkdir(mode=0o700)
        daemon = start_daemon(procs, shm2, out2, "--store", f"127.0.0.1:{port}")
        log = LineReader(daemon.stderr)
        second_node_rank(procs, shm2, "names-another-master", "127.0.0.2")
        assert log.wait_for('"correlating"', f"127.0.0.1:{port}", timeout=60), log.lines[-20:]
        assert wait_for(lambda: configured.accepted, timeout=60)
        stop_daemon(daemon, log)
        assert not named.accepted
    finally:
        configured.close()
        named.close()


# -- a real two-node job (two `rankwatch run` agents, one store), as tests/test_store_tamper.py ------------

BLOATER = str(Path(__file__).resolve().parents[2] / "procs" / "store_bloater.py")


def test_values_over_the_cap_in_a_real_job_are_refused_and_the_hung_rank_is_still_named(procs, tmp_path):
    """Rank 2 (node 1's local rank 0) hangs in its dataloader; a hostile local client keeps writing 16 MiB
    values into the keys the nodes read during the exchange (node 1's evidence, the leader's verdict). Node 1
    — a client of the store node 0 hosts — refuses them unread: its peak memory stays that of a process that
    never read one, and no node names an innocent rank."""
    from test_multinode import one_verdict_each, start_node

    master, store = free_port(), free_port()
    args = ["--scenario", "input-hang", "--fault-rank", "2", "--fault-step", "6", "--steps", "400"]
    nodes = [start_node(procs, tmp_path, k, master, store, args, ("--on-stall", "kill")) for k in (0, 1)]
    keys = [f"rankwatch/mn/{k}" for k in ("evidence/1/1", "verdict/1", "evidence/2/1", "verdict/2")]
    bloater = procs.start([sys.executable, BLOATER, "127.0.0.1", str(store), "16", *keys], text=True)
    rounds = LineReader(bloater.stdout)
    assert rounds.wait_for("round 1", timeout=120)
    node1 = nodes[1][0].pid
    peaks: list[int] = []

    def sample() -> None:  # node 1's high-water mark, while it lives
        while nodes[1][0].poll() is None:
            try:
                peaks.append(peak_rss(node1))
            except (OSError, AssertionError):
                return
            threading.Event().wait(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    logs = [LineReader(p.stderr) for p, _ in nodes]
    v0, v1 = one_verdict_each(nodes, timeout=240)
    sampler.join(timeout=10)
    bloater.kill()
    assert int(rounds.lines[-1].split()[1]) > 5  # it went on writing all along
    for v in (v0, v1):
        assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [2], "dataloader"), (
            "\n".join([v["reason"], *v["evidence"]]))
    refused = [line for log in logs for line in log.lines if '"store_value_rejected"' in line and "refused" in line]
    assert refused, [log.lines[-20:] for log in logs]
    assert peaks and max(peaks) < 256 << 20, f"node 1's peak RSS {max(peaks or [0]) >> 20} MiB"
    print(f"node 1 peak RSS {max(peaks) >> 20} MiB; refused: {len(refused)} line(s); v0 {v0['initiating_ranks']}")
