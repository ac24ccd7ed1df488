"""A follower shows the job's straggler on another node while the job runs: two `rankwatch run` agents as two nodes
on 127.0.0.1 (one rank each, separate shm dirs, one store on node 0), the straggler on node 0 — its collate sleeps
on every batch. Node 1's watchdog never sees rank 0; the leader (node 0) merges both nodes' live steps, publishes
its diagnosis (``cluster.live_share``), and node 1's state file, `rankwatch status` and `/metrics` name rank 0 and
its node beside node 1's own diagnosis — while both nodes still train."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

from conftest import DEMO, examples_module, free_port, rankwatch_cmd, torchrun_args, wait_for

# the right answer: the catalogue's (examples/fault_catalogue.py)
EXPECT = examples_module("fault_catalogue").DDP_DEMO_FAULTS["input-straggler"]
RUN = "follow"


def start_agents(procs, tmp_path: Path, metrics_port: int) -> list:
    master, store = free_port(), free_port()
    demo = [DEMO, "--scenario", "input-straggler", "--straggler-rank", "0", "--input-sleep-ms", "40",
            "--steps", "5000", "--hidden", "64", "--layers", "2"]  # steps enough for minutes: stopped once seen
    agents = []
    for k in (0, 1):
        metrics = ("--metrics-port", str(metrics_port), "--metrics-addr", "127.0.0.1") if k == 1 else ()
        cmd = rankwatch_cmd("run", "--out", str(tmp_path / f"out{k}"), "--shm-dir", str(tmp_path / f"shm{k}"),
                            "--run-name", RUN, "--quiet", "--poll-interval", "0.25", "--store", f"127.0.0.1:{store}",
                            *metrics, "--", *torchrun_args(1, RUN, *demo, nnodes=2, node_rank=k, master_port=master))
        log = open(tmp_path / f"node{k}.log", "w")  # closed once the agents ended
        agents.append((procs.start(cmd, stdout=log, stderr=log), log))
    return agents


def test_the_other_nodes_status_names_the_straggler_while_the_job_runs(procs, tmp_path):
    port = free_port()
    agents = start_agents(procs, tmp_path, port)
    state = tmp_path / "shm1" / RUN / "watchdog.json"

    def logs() -> list[str]:
        return [(tmp_path / f"node{k}.log").read_text()[-3000:] for k in (0, 1)]

    def named() -> dict | None:
        assert all(p.poll() is None for p, _ in agents), logs()
        try:
            job = json.loads(state.read_text()).get("job_diagnosis") or {}
        except (OSError, ValueError):
            return None
        return job if job.get("straggler_ranks") == EXPECT.ranks(0) else None

    try:
        job = wait_for(named, timeout=150, interval=0.5)
        assert job, ("node 1 never showed the leader's diagnosis naming rank 0", logs())
        assert job["label"] in EXPECT.kinds and job["phase"] == EXPECT.phase, job
        assert job["from"] == "leader" and job["authenticated"] is False and "0" in job["nodes"], job
        out = subprocess.run(rankwatch_cmd("status", "--json", "--shm-dir", str(tmp_path / "shm1"), "--job", RUN),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        (st,) = json.loads(out.stdout)["jobs"]
        assert [r["rank"] for r in st["ranks"]] == [1], st  # rank 0 is not on this node
        d = st["job_diagnosis"]
        assert d and d["straggler_ranks"] == [0] and d["label"] in EXPECT.kinds and d["leader"], st
        assert st["diagnosis_from"] == "watchdog" and 0 not in st["straggler_ranks"], st  # its own: rank 1 alone
        text = subprocess.run(rankwatch_cmd("status", "--shm-dir", str(tmp_path / "shm1"), "--job", RUN),
                              capture_output=True, text=True, timeout=120).stdout
        leader_line = r"job diagnosis \(from leader node .*, unauthenticated\): INPUT STRAGGLER — rank 0 in dataloader"
        assert re.search(leader_line, text), text
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert re.search(r'rankwatch_leader_straggler\{[^}]*rank="0"', scrape), scrape
        assert all(p.poll() is None for p, _ in agents), logs()  # all of it while the job still ran
        # and the leader's diagnosis opened nothing on node 1
        assert not (tmp_path / "out1" / "incidents").exists() or not any((tmp_path / "out1" / "incidents").iterdir())
    finally:
        for p, _ in agents:  # enough seen: the job is stopped as a user stops it
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p, log in agents:
            try:
                p.wait(timeout=120)
            finally:
                log.close()
