"""A slow network path as a cause: each rank's TCP sockets from the kernel's sock_diag (what ``ss -ti`` reads),
set against its peers'.

``fixtures/proc/inet-diag-tcp4.bin`` is a real netlink answer of this host's kernel to the dump the reader
sends (AF_INET, established, ``INET_DIAG_INFO``), recorded with a loopback connection that had sent 2 MB;
``inet-diag-tcp4.ss.txt`` is ``ss -tin`` of that very socket right after, the figures the parser must agree
with. The end-to-end test runs a real 2-node gloo job, each node in a network namespace of its own joined by
a bridge in a third (only these namespaces carry traffic), one watchdog on node 0 seeing both ranks' records,
node 1's link capped by ``tc ... tbf`` (netem does not work here); the control runs the same job uncapped.
Needs root (namespaces, ``tc``) and ``ip``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEMO, free_port, rankwatch_cmd, wait_for
from rankwatch.watchdog.core.host_signals import MISSING, NetCounters, RankCounters, net_counters, parse_inet_diag
from rankwatch.watchdog.core.policy import ReaderPolicy
from rankwatch.watchdog.core.straggler import StragglerDiagnosis
from rankwatch.watchdog.core.straggler_cause import Window, attribute_cause, explain
from rankwatch.watchdog.observe import signals
from rankwatch.watchdog.observe.signals import counters_from_doc, read_ranks, tcp_sockets
from rankwatch.watchdog.privsep.registry import Worker

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "proc"


def test_the_recorded_dump_parses_as_ss_reads_it():
    infos, done = parse_inet_diag((FIX / "inet-diag-tcp4.bin").read_bytes())
    assert done
    ss = (FIX / "inet-diag-tcp4.ss.txt").read_text()
    inode = int(ss.split("inode ")[1].split(",")[0])
    (mine,) = [i for i in infos if i.inode == inode]
    # ss: rtt:0.032/0.001 bytes_sent:2000000 bytes_acked:2000001 delivery_rate 523864000000bps minrtt:0.001
    assert (mine.rtt_us, mine.rttvar_us, mine.min_rtt_us) == (32, 1, 1)
    assert (mine.bytes_sent, mine.bytes_acked, mine.total_retrans) == (2_000_000, 2_000_001, 0)
    assert mine.delivery_rate * 8 == 523_864_000_000 and mine.remote == "127.0.0.1:56727" and mine.same_host
    # a cut message ends the parse without an error
    assert parse_inet_diag((FIX / "inet-diag-tcp4.bin").read_bytes()[:100]) == ([], True)


def test_a_live_process_sockets_are_read_and_a_path_to_itself_is_no_path():
    srv = socket.create_server(("127.0.0.1", 0))
    c = socket.create_connection(srv.getsockname())
    a, _ = srv.accept()
    try:
        c.sendall(b"x" * 200_000)
        got = 0
        while got < 200_000:
            got += len(a.recv(1 << 20))
        assert tcp_sockets() is not None
        signals._dumped_at.clear()
        net = read_ranks([os.getpid()])[os.getpid()].net
        assert net is not None and net.sockets >= 2 and net.bytes_sent >= 200_000
        assert net.rtt_us == MISSING and net.delivery_bps == MISSING  # loopback: another rank of its node
        # the dump walks the kernel's whole socket hash: once per NET_EVERY_S, the polls between carry no net
        assert read_ranks([os.getpid()])[os.getpid()].net is None
        # and through the owner's reader and back over the wire
        signals._dumped_at.clear()
        out = Worker(ReaderPolicy(), None).handle({"op": "signals", "pids": [os.getpid()]}, [])
        assert counters_from_doc(out["ranks"][str(os.getpid())]).net.bytes_sent >= 200_000
    finally:
        for s in (a, c, srv):
            s.close()


HOLDER = """
import socket, sys
srv = socket.create_server(("127.0.0.1", 0))
keep = []
for n in range(4):
    c = socket.create_connection(srv.getsockname())
    keep += [c, srv.accept()[0]]
    c.sendall(b"x" * (n + 1) * 10_000)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_ranks_sockets_asked_through_its_own_fds_read_as_the_dump_reads_them(procs):
    """Another process's TCP sockets, read through duplicates of its fds (pidfd_getfd: no walk of the kernel's
    socket table), give each socket's figures as the sock_diag dump does; only its TCP sockets."""
    holder = procs.start([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    mine = signals.tcp_sockets_of_pid(holder.pid)
    assert mine is not None, "pidfd_getfd refused (a kernel before 5.6, or no ptrace access)"
    dump = {i.inode: i for i in tcp_sockets() or [] if i.inode in signals.socket_inodes(holder.pid)}
    assert len(mine) == 8 and {i.inode for i in mine} == set(dump)  # 4 pairs; the listening socket is no path
    for i in mine:
        d = dump[i.inode]
        assert (i.bytes_sent, i.bytes_acked, i.total_retrans, i.remote, i.same_host) == (
            d.bytes_sent, d.bytes_acked, d.total_retrans, d.remote, d.same_host), (i, d)
    assert sorted(i.bytes_sent for i in mine if i.bytes_sent > 1000) == [10_000, 20_000, 30_000, 40_000]
    # and the poll's reading of it is the same whichever way it is read
    signals._dumped_at.clear()
    by_fd = read_ranks([holder.pid])[holder.pid].net
    signals._dumped_at.clear()
    signals.NET_BY_FD = False
    try:
        by_dump = read_ranks([holder.pid])[holder.pid].net
    finally:
        signals.NET_BY_FD = True
    assert by_fd is not None and by_fd.bytes_sent == by_dump.bytes_sent == 100_000 + sum(
        d.bytes_sent for d in dump.values() if d.bytes_sent < 1000)
    holder.stdin.close()


def test_the_busiest_path_to_another_host_is_the_ranks_path():
    infos, _ = parse_inet_diag((FIX / "inet-diag-tcp4.bin").read_bytes())
    remote = [i.__class__(**{**i.__dict__, "same_host": False}) for i in infos]
    net = net_counters(remote, {i.inode for i in infos})
    assert (net.rtt_us, net.delivery_bps) == (32, 65_483_000_000)  # the one that sent 2 MB, not the idle ones
    assert net_counters(infos, {123}) is None


# -- the rule ---------------------------------------------------------------------------------------------
POLL_NS, STEP_NS = 500_000_000, 100_000_000


def rank_at(t_ns: int, rate_bps: int = 1_000_000_000, rtt_us: int = 200, retrans_per_s: float = 0.0) -> RankCounters:
    s = t_ns / 1e9
    return RankCounters(start_ticks=7, run_ns=int(0.5e9 * s), wait_ns=int(1e6 * s), cpu_ticks=0, majflt=0, nvcsw=0,
                        net=NetCounters(sockets=3, bytes_sent=int(1e7 * s), bytes_acked=int(1e7 * s),
                                        retrans=int(retrans_per_s * s), busy_us=0, rtt_us=rtt_us,
                                        delivery_bps=rate_bps))


def samples(slow: int | None = None, **kw):
    return [(10**9 + i * POLL_NS, {r: rank_at(10**9 + i * POLL_NS, **(kw if r == slow else {})) for r in range(3)})
            for i in range(40)]


def wins():
    return {r: (10**9, 10**9 + 200 * STEP_NS, 200) for r in range(3)}


def bound(label: str = "COMMUNICATION-BOUND") -> StragglerDiagnosis:
    return StragglerDiagnosis(label, [], None, "", 200, {}, {}, {}, windows=wins())


def test_a_communication_bound_job_names_the_rank_whose_data_leaves_slowly():
    d = explain(bound(), samples(slow=2, rate_bps=2_400_000, rtt_us=20_000))
    assert d.cause["cause"] == "network_path" and d.cause["rank"] == 2, d.cause
    assert ("rank 2: the data it sends to another node was delivered at 19.2 Mbit/s, its peers' at 8000.0 Mbit/s; "
            "round trip 20.00 ms, its peers' 0.20 ms") == d.cause["text"]
    assert "iperf3" in d.cause["next"] and d.signals["2"]["tcp_delivery_mbps"] == 19.2


def test_retransmits_alone_name_a_path():
    d = explain(bound(), samples(slow=1, retrans_per_s=40.0))
    assert d.cause["cause"] == "network_path" and "4.0 retransmits/step, its peers 0.0" in d.cause["text"]


def test_paths_alike_name_nobody_and_only_communication_bound_jobs_look():
    assert explain(bound(), samples()).cause is None
    # a rate within the peers' ordinary spread (a few x) is no path's fault
    assert explain(bound(), samples(slow=0, rate_bps=300_000_000)).cause is None
    assert explain(bound("COMPUTE-BOUND"), samples(slow=2, rate_bps=2_400_000)).cause is None


def test_a_straggler_whose_path_is_slow_and_no_host_counter_explains_it():
    w = {r: Window(*x) for r, x in wins().items()}
    doc = attribute_cause(samples(slow=1, rate_bps=2_400_000), w, 1, 30.0)
    assert doc["cause"] == "network_path" and doc["signals"]["tcp"]["delivery_mbps"] == 19.2


# -- end to end: two simulated nodes, one capped link --------------------------------------------------
STEPS = 100


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Network namespaces n0, n1 (10.77.X.1/.2) joined by a bridge in a third; removed at teardown."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root, ip and tc")
    tag = f"rw{os.getpid() % 100000}"
    net = f"10.77.{os.getpid() % 250}"
    made: list[str] = []
    try:
        try:
            sh("ip", "netns", "add", f"{tag}sw")
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
        made.append(f"{tag}sw")
        sh("ip", "netns", "exec", f"{tag}sw", "ip", "link", "add", "br0", "type", "bridge")
        sh("ip", "netns", "exec", f"{tag}sw", "ip", "link", "set", "br0", "up")
        for i in (0, 1):
            ns, dev, peer = f"{tag}n{i}", f"{tag}v{i}", f"{tag}p{i}"
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", f"{tag}sw")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.{i + 1}/24", "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", f"{tag}sw", "ip", "link", "set", peer, "master", "br0")
            sh("ip", "netns", "exec", f"{tag}sw", "ip", "link", "set", peer, "up")
        yield tag, net
    finally:
        for ns in reversed(made):  # deleting a namespace deletes its veth ends (and the other end with them)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def run_two_node_job(procs, tmp_path: Path, tag: str, net: str, steps: int = STEPS) -> dict:
    """The demo, 1 rank per node: node 1's rank under plain torchrun with the hook, node 0's under `rankwatch
    run`, whose watchdog reads both ranks' records (one host: one shm dir) and signals (its reader dumps each
    rank's network namespace). Returns summary.json."""
    shm, out = tmp_path / "shm", tmp_path / "out"
    port = free_port()
    demo = [DEMO, "--scenario", "balanced", "--steps", str(steps), "--hidden", "128", "--layers", "4",
            "--compute-extra-matmuls", "5", "--input-sleep-ms", "0", "--step-sleep-ms", "60"]

    def torchrun(node: int) -> list[str]:
        return ["--nproc-per-node", "1", "--nnodes", "2", f"--node-rank={node}", f"--master-addr={net}.1",
                f"--master-port={port}", "--monitor-interval", "0.2"]

    tmp_path.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GLOO_SOCKET_IFNAME=f"{tag}v1", RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="netjob")
    with open(tmp_path / "node1.log", "w") as log1:
        node1 = procs.start(["ip", "netns", "exec", f"{tag}n1", sys.executable, "-m", "torch.distributed.run",
                             *torchrun(1), "-m", "rankwatch.hooks", *demo], env=env, stdout=log1, stderr=log1)
        node0 = procs.run(["ip", "netns", "exec", f"{tag}n0", *rankwatch_cmd(
            "run", "--out", str(out), "--shm-dir", str(shm), "--run-name", "netjob", "--quiet", "--poll-interval",
            "0.25", "--", *torchrun(0), *demo)], timeout=400, text=True,
            env=dict(os.environ, GLOO_SOCKET_IFNAME=f"{tag}v0"))
        rc1 = node1.wait(timeout=120)
    assert node0.returncode == 0 and rc1 == 0, (node0.stderr[-3000:], (tmp_path / "node1.log").read_text()[-3000:])
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_capped_link_of_one_node_is_its_ranks_network_path(procs, tmp_path, two_nodes):
    tag, net = two_nodes
    sh("ip", "netns", "exec", f"{tag}n1", "tc", "qdisc", "add", "dev", f"{tag}v1", "root", "tbf", "rate", "20mbit",
       "burst", "32kbit", "latency", "400ms")
    capped = run_two_node_job(procs, tmp_path, tag, net)
    cause = capped["cause"]
    assert cause and cause["cause"] == "network_path" and cause["rank"] == 1, (capped["diagnosis"], cause)
    tcp = cause["signals"]["tcp"]
    # measured here: 20-150 Mbit/s (the rate tcp_info estimates over the bursts between the steps' sleeps,
    # the 20 Mbit/s of the cap when the link is kept busy), its peer's 100 Gbit/s (a veth, memory to memory)
    assert tcp["peers_delivery_mbps"] >= 10 * tcp["delivery_mbps"], tcp
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "cause: network_path — rank 1: the data it sends to another node was delivered at" in text, text


@pytest.mark.slow
def test_the_same_job_uncapped_names_no_path(procs, tmp_path, two_nodes):
    tag, net = two_nodes
    # 250 steps of ~70 ms: the 200 compared span 14 s, seven of the reader's TCP dumps (one per 2 s)
    control = run_two_node_job(procs, tmp_path, tag, net, steps=250)
    assert not control["cause"] or control["cause"]["cause"] != "network_path", control["cause"]
    # the link signal was read on both ranks all the same
    assert all("tcp_delivery_mbps" in control["signals"][r] for r in ("0", "1")), control["signals"]


# -- two nodes, each with its own watchdog: the leader compares ranks across nodes ---------------------------
def start_two_agents(procs, tmp_path: Path, tag: str, net: str, steps: int = STEPS, run: str = "netjob2",
                     extra: tuple[str, ...] = ()) -> list:
    """The demo, 1 rank per node, each node under a `rankwatch run` of its own (its own shm dir: each watchdog
    sees only its own node's rank and reads its TCP sockets in its own namespace), one store on node 0. Node 1's
    rank's figures reach the leader only through the store. Returns [(agent, its log file)] of nodes 0 and 1."""
    port, store = free_port(), free_port()
    demo = [DEMO, "--scenario", "balanced", "--steps", str(steps), "--hidden", "128", "--layers", "4",
            "--compute-extra-matmuls", "5", "--input-sleep-ms", "0", "--step-sleep-ms", "60"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    agents = []
    for node in (0, 1):
        cmd = ["ip", "netns", "exec", f"{tag}n{node}", *rankwatch_cmd(
            "run", "--out", str(tmp_path / f"out{node}"), "--shm-dir", str(tmp_path / f"shm{node}"), "--run-name",
            run, "--quiet", "--poll-interval", "0.25", "--store", f"{net}.1:{store}", *extra, "--",
            "--nproc-per-node", "1", "--nnodes", "2", f"--node-rank={node}", f"--master-addr={net}.1",
            f"--master-port={port}", "--monitor-interval", "0.2", *demo)]
        log = open(tmp_path / f"node{node}.log", "w")  # closed by wait_agents, once the agent exits
        agents.append((procs.start(cmd, env=dict(os.environ, GLOO_SOCKET_IFNAME=f"{tag}v{node}"), stdout=log,
                                   stderr=log), log))
    return agents


def wait_agents(tmp_path: Path, agents: list) -> list[int]:
    try:
        return [p.wait(timeout=400) for p, _ in agents]
    finally:
        for _, log in agents:
            log.close()


def run_two_agents(procs, tmp_path: Path, tag: str, net: str, steps: int = STEPS) -> dict:
    """``start_two_agents`` to the end of the job: the leader's summary.json."""
    rcs = wait_agents(tmp_path, start_two_agents(procs, tmp_path, tag, net, steps))
    assert rcs == [0, 0], [(tmp_path / f"node{k}.log").read_text()[-3000:] for k in (0, 1)]
    return json.loads((tmp_path / "out0" / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("capped", [True, False], ids=["capped", "control"])
def test_a_capped_link_on_another_node_is_named_by_the_leader(procs, tmp_path, two_nodes, capped):
    tag, net = two_nodes
    if capped:
        sh("ip", "netns", "exec", f"{tag}n1", "tc", "qdisc", "add", "dev", f"{tag}v1", "root", "tbf", "rate", "20mbit",
           "burst", "32kbit", "latency", "400ms")
    s = run_two_agents(procs, tmp_path, tag, net, steps=250)
    # both ranks' link figures in the leader's summary: rank 1's came from node 1's watchdog through the store
    assert all("tcp_delivery_mbps" in s["signals"].get(r, {}) for r in ("0", "1")), s["signals"]
    cause = s["cause"]
    if not capped:
        assert not cause or cause["cause"] != "network_path", (s["diagnosis"], cause, s["signals"])
        return
    assert cause and cause["cause"] == "network_path" and cause["rank"] == 1, (s["diagnosis"], cause, s["signals"])
    tcp = cause["signals"]["tcp"]
    assert tcp["peers_delivery_mbps"] >= 10 * tcp["delivery_mbps"], tcp


@pytest.mark.slow
def test_the_leader_names_another_nodes_capped_link_while_the_job_runs(procs, tmp_path, two_nodes):
    """Live: node 1's watchdog shares its rank's recent steps and TCP figures every few seconds
    (``cluster.live_share``), so node 0's `rankwatch status`, its state file and its metrics name rank 1 — a rank
    node 0's watchdog never sees — and its network_path cause while both nodes still train."""
    tag, net = two_nodes
    sh("ip", "netns", "exec", f"{tag}n1", "tc", "qdisc", "add", "dev", f"{tag}v1", "root", "tbf", "rate", "20mbit",
       "burst", "32kbit", "latency", "400ms")
    metrics = free_port()
    # steps enough for minutes under load: the job is stopped as soon as the leader named the path
    agents = start_two_agents(procs, tmp_path, tag, net, steps=3000, run="livenet",
                              extra=("--metrics-port", str(metrics), "--metrics-addr", "127.0.0.1"))
    state = tmp_path / "shm0" / "livenet" / "watchdog.json"

    def named() -> dict | None:
        assert all(p.poll() is None for p, _ in agents), [(tmp_path / f"node{k}.log").read_text()[-3000:]
                                                          for k in (0, 1)]
        try:
            diag = json.loads(state.read_text()).get("diagnosis") or {}
        except (OSError, ValueError):
            return None
        return diag if diag.get("cause") == "network_path" and diag.get("cause_rank") == 1 else None

    try:
        diag = wait_for(named, timeout=240, interval=0.5)  # inside the suite's 300 s per test
        assert diag, "the leader's live diagnosis never named rank 1's path"
        assert diag["remote_ranks"] == {"1": diag["remote_ranks"]["1"]} and "network_path — rank 1:" in diag[
            "cause_text"], diag
        out = subprocess.run(rankwatch_cmd("status", "--json", "--shm-dir", str(tmp_path / "shm0"), "--job",
                                           "livenet"), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        (job,) = json.loads(out.stdout)["jobs"]
        assert (job["diagnosis_from"], job["cause"], job["cause_rank"]) == ("watchdog", "network_path", 1), job
        assert [r["rank"] for r in job["ranks"]] == [0] and "1" in job["remote_ranks"], job  # rank 1 is not here
        text = subprocess.run(rankwatch_cmd("status", "--shm-dir", str(tmp_path / "shm0"), "--job", "livenet"),
                              capture_output=True, text=True, timeout=120).stdout
        assert "cause: network_path — rank 1: the data it sends to another node was delivered at" in text, text
        # node 0's metrics listen in its own network namespace
        scrape = subprocess.run(["ip", "netns", "exec", f"{tag}n0", sys.executable, "-c",
                                 "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
                                 f"'http://127.0.0.1:{metrics}/metrics', timeout=30).read().decode())"],
                                capture_output=True, text=True, timeout=120).stdout
        assert re.search(r'rankwatch_straggler_cause\{[^}]*cause="network_path"[^}]*rank="1"', scrape), scrape
        assert all(p.poll() is None for p, _ in agents)  # all of it while the job still ran
    finally:
        for p, _ in agents:  # enough seen: the job is stopped as a user stops it
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        wait_agents(tmp_path, agents)
