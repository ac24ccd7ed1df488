"""Root never hosts a user's store (issue 43, item 2).

A real `rankwatch daemon --store-port` (the documented systemd/Kubernetes multi-node setting) and a one-rank
job whose job.json says "node 0 of 2" — what used to make the daemon start a TCPStore server inside itself.
The daemon must open no listening socket of its own for it; the store on that port is its separate host
process. A hostile client then stores 8 MiB values and opens idle connections to it: the daemon's memory
and file descriptors do not move, it keeps polling, and it still discovers a new job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from conftest import LineReader, free_port, start_daemon, stop_daemon, wait_polls
from test_safety import start_rank

FLOOD = str(Path(__file__).resolve().parents[2] / "procs" / "store_flood.py")
RANK_PY = str(Path(__file__).resolve().parents[2] / "procs" / "rank.py")


def listening(pid: int) -> set[int]:
    return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def footprint(pid: int) -> tuple[int, int, int]:
    p = psutil.Process(pid)
    return p.memory_info().rss, p.num_fds(), p.num_threads()


def test_a_hostile_job_json_makes_the_daemon_host_nothing(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    store, metrics = free_port(), free_port()
    daemon = start_daemon(procs, shm, out, "--store-port", str(store), "--metrics-port", str(metrics))
    log = LineReader(daemon.stderr)
    assert log.wait_for('"store_host_started"', timeout=120), log.lines[-20:]
    host = [c for c in psutil.Process(daemon.pid).children() if store in listening(c.pid)]
    assert len(host) == 1, "the store host is a process of its own"
    # a one-rank job whose job.json says it is node 0 of 2 (one rank per node), its master on this host
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="claims-two-nodes", RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", GROUP_RANK="0", MASTER_ADDR="127.0.0.1")
    rank = procs.start([sys.executable, RANK_PY], env=env, text=True)
    assert rank.stdout.readline().startswith("ready"), rank.stderr.read()
    assert log.wait_for('"store_connected"', '"hosting": false', timeout=120), log.lines[-20:]
    wait_polls(metrics, more=3)
    assert listening(daemon.pid) == {metrics}, "the daemon listens on nothing but its metrics port"
    before = footprint(daemon.pid)

    # its stderr (torch's warnings with stack traces for every refused value) is not read: not a pipe
    flood = procs.start([sys.executable, FLOOD, "127.0.0.1", str(store), "200", "8", "1500"], text=True,
                        stderr=subprocess.DEVNULL)
    done = LineReader(flood.stdout).wait_for("done", timeout=200)
    assert done, "the flood never finished"
    wait_polls(metrics, more=4)  # the daemon polled on through it
    rss, fds, threads = footprint(daemon.pid)
    assert rss - before[0] < 64 << 20, (before, (rss, fds, threads))
    assert fds - before[1] <= 8 and threads - before[2] <= 4, (before, (rss, fds, threads))
    assert listening(daemon.pid) == {metrics}
    # the host held what its limits allow, no more: its memory stays under its cap
    for h in host:
        if h.is_running():
            assert h.memory_info().rss < (256 + 600) << 20
    # other users' new jobs are still discovered
    start_rank(procs, shm, "after-the-flood", 0, 1)
    assert log.wait_for('"job_discovered"', "after-the-flood", timeout=60), log.lines[-20:]
    flood.kill()
    stop_daemon(daemon, log)
    assert not [h for h in host if h.is_running() and h.status() != psutil.STATUS_ZOMBIE]
    print("daemon before", before, "after", (rss, fds, threads), done)
