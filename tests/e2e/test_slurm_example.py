"""examples/slurm/rankwatch.sbatch under a REAL Slurm (Debian ``slurm-wlm`` + ``munge``): a munged, a
slurmctld and two slurmd on this host (NodeName rw1/rw2, each its own port; proctrack/linuxproc, no
cgroups), all started here with their own key, socket, config and state in a temp dir. The node names do
not resolve (NodeAddr=127.0.0.1): the script must take MASTER_ADDR the way Slurm reaches the node. Each
node's ``rankwatch run`` gets its own shm dir and metrics port (RANKWATCH_ONE_HOST=1: both "nodes" share
this host's /dev/shm and ports)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import DEMO, REPO, bundle_dirs, examples_module, free_port, wait_for

# the right answer of the job's fault: the catalogue's (examples/fault_catalogue.py)
FAULTS = examples_module("fault_catalogue").FAULTS

SBATCH = REPO / "examples" / "slurm" / "rankwatch.sbatch"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
MISSING = [b for b in BINARIES if shutil.which(b) is None]
NODES = ("rw1", "rw2")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"Slurm/munge not installed: {' '.join(MISSING)}"),
              # slurmd launches every task as its user: it runs as root (SlurmdUser=root), as on a cluster
              pytest.mark.skipif(os.geteuid() != 0, reason="slurmd needs root (it launches tasks as their user)")]

CONF = """\
ClusterName=rwtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d1_port}
AuthType=auth/munge
AuthInfo=socket={d}/munge/sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
KillWait=30
InactiveLimit=0
MinJobAge=30
NodeName=rw1 NodeHostname={host} NodeAddr=127.0.0.1 Port={d1_port} CPUs=1 State=UNKNOWN
NodeName=rw2 NodeHostname={host} NodeAddr=127.0.0.1 Port={d2_port} CPUs=1 State=UNKNOWN
PartitionName=test Nodes=rw1,rw2 Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    def __init__(self, d: Path) -> None:
        self.d = d
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(d / "slurm.conf")}

    def start(self, *cmd: str) -> None:
        log = open(self.d / f"{Path(cmd[0]).name}-{len(self.procs)}.out", "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                           start_new_session=True))

    def run(self, *cmd: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", self.env), timeout=timeout,
                              **kw)

    def idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        return sorted(line.split()[1] for line in states if line.strip()) == ["idle", "idle"]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(self.d.glob("*.log")))

    def stop(self) -> None:
        with_jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
        if with_jobs:
            self.run("scancel", *with_jobs)
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    (d / "munge").mkdir(mode=0o700)
    (d / "state").mkdir()
    key = d / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ports = {"ctld_port": free_port(), "d1_port": free_port(), "d2_port": free_port()}
    (d / "slurm.conf").write_text(CONF.format(d=d, host=socket.gethostname(), **ports))
    cluster = Cluster(d)
    try:
        cluster.start("munged", "-F", "-f", f"--key-file={key}", f"--socket={d}/munge/sock",
                      f"--pid-file={d}/munge/pid", f"--log-file={d}/munge.log", f"--seed-file={d}/munge/seed")
        assert wait_for(lambda: (d / "munge" / "sock").exists(), 30), cluster.logs()
        cluster.start("slurmctld", "-D", "-c", "-f", str(d / "slurm.conf"))
        for node in NODES:
            cluster.start("slurmd", "-D", "-N", node, "-f", str(d / "slurm.conf"))
        assert wait_for(cluster.idle, 60), cluster.logs()
        yield cluster
    finally:
        cluster.stop()


def job_env(slurm: Cluster, tmp_path: Path, **extra: str) -> dict[str, str]:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700, exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)  # this checkout's rankwatch and torchrun
    return {**slurm.env, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RANKWATCH_ONE_HOST": "1",
            "RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_OUT": str(tmp_path / "out"), "NPROC_PER_NODE": "1",
            "MASTER_PORT": str(free_port()), "STORE_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **extra}


def sbatch(slurm: Cluster, tmp_path: Path, env: dict[str, str], *args: str, wait: bool) -> str:
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", f"--output={tmp_path}/slurm-%j.out",
           *(["--wait"] if wait else []), str(SBATCH), DEMO, "--hidden", "64", "--layers", "2", *args]
    result = slurm.run(*cmd, env=env, timeout=400, cwd=tmp_path)
    job_id = result.stdout.strip().split(";")[0]
    assert job_id.isdigit(), result.stdout + result.stderr + slurm.logs()
    return job_id


def records_left(tmp_path: Path, job_id: str) -> list[Path]:
    return [p for node in NODES for p in [tmp_path / "shm" / node / f"slurm-{job_id}"] if p.exists()]


def test_hang_on_node_1_is_named_in_both_nodes_bundles_under_real_slurm(slurm, tmp_path):
    env = job_env(slurm, tmp_path, RANKWATCH_STALL_TIMEOUT="3")
    scenario, fault_rank = "input-hang", 1
    expect = FAULTS[scenario]
    job_id = sbatch(slurm, tmp_path, env, "--steps", "1000", "--scenario", scenario, "--fault-rank", str(fault_rank),
                    "--fault-step", "5", wait=True)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    verdicts = {}
    for node in ("node-0", "node-1"):
        found = bundle_dirs(tmp_path / "out" / node / "incidents")
        assert len(found) == 1, f"{node}: {found}\n{output[-4000:]}"
        verdicts[node] = json.loads((found[0] / "verdict.json").read_text())
    assert {(v["job_id"], v["incident_id"]) for v in verdicts.values()} == {
        (f"slurm-{job_id}", verdicts["node-0"]["incident_id"])}
    for v in verdicts.values():
        assert v["kind"] in expect.kinds, v["finding"]
        assert (v["initiating_ranks"], v["phase"]) == (expect.ranks(fault_rank), expect.phase), v["finding"]
    # MASTER_ADDR is the node's address (rw1 resolves nowhere), output lines carry srun's task label
    assert "master 127.0.0.1:" in output, output[-2000:]
    assert any(line.startswith("0: ") for line in output.splitlines()), output[-2000:]
    assert any(line.startswith("1: ") for line in output.splitlines()), output[-2000:]
    # the job's records are gone from both nodes' shm dirs
    assert records_left(tmp_path, job_id) == []


def test_running_job_serves_metrics_per_node_and_scancel_removes_its_records(slurm, tmp_path):
    base = free_port()
    env = job_env(slurm, tmp_path, RANKWATCH_METRICS_PORT=str(base))
    job_id = sbatch(slurm, tmp_path, env, "--steps", "100000", wait=False)

    def steps_on(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return False
        return f'rankwatch_rank_steps_total{{job_id="slurm-{job_id}"' in text

    try:
        ok = wait_for(lambda: steps_on(base) and steps_on(base + 1), 240)
        out = tmp_path / f"slurm-{job_id}.out"
        assert ok, (out.read_text()[-4000:] if out.exists() else "") + slurm.logs()
        assert len(records_left(tmp_path, job_id)) == 2  # the records exist while the job runs
    finally:
        slurm.run("scancel", job_id)
    assert wait_for(lambda: not slurm.run("squeue", "-h", "-j", job_id).stdout.strip(), 120)
    assert wait_for(lambda: records_left(tmp_path, job_id) == [], 60), records_left(tmp_path, job_id)
