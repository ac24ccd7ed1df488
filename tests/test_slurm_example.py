"""examples/slurm/rankwatch.sbatch end to end without Slurm: fake `srun`/`scontrol` on PATH launch the
per-node command once per simulated node (both on 127.0.0.1, separate shm dirs) with the SLURM_* environment
srun sets; the per-node command is the real `rankwatch run` around a real 2-node torchrun job (gloo)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import DEMO, REPO, bundle_dirs, free_port

SBATCH = REPO / "examples" / "slurm" / "rankwatch.sbatch"
JOB_ID = "4242"

# srun: one task per node (this example's contract: --ntasks-per-node=1), each with srun's per-task variables
# and its own shm dir (a node's /dev/shm is its own); --kill-on-bad-exit=1 ends the others when one fails.
FAKE_SRUN = """\
import os, subprocess, sys, time
args = sys.argv[1:]
opts = []
while args and args[0].startswith("-"):
    opts.append(args.pop(0))
if "--ntasks-per-node=1" not in opts:
    sys.exit(f"fake srun: expected --ntasks-per-node=1, got {opts}")
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
tasks = []
for node in range(nodes):
    shm = os.path.join(os.environ["FAKE_SLURM_SHM"], f"node-{node}")
    os.makedirs(shm, mode=0o700, exist_ok=True)
    env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0",
           "SLURM_NTASKS": str(nodes), "RANKWATCH_SHM_DIR": shm}
    tasks.append(subprocess.Popen(args, env=env))
codes = [t.wait() for t in tasks]
sys.exit(max(codes, key=abs))
"""
FAKE_SCONTROL = """\
import sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(sys.argv[3].split(",")))
"""
RANKWATCH = """\
import sys
from rankwatch.watchdog.cli.main import main
sys.exit(main())
"""


def shim(bin_dir: Path, name: str, source: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim(bin_dir, "srun", FAKE_SRUN)
    shim(bin_dir, "scontrol", FAKE_SCONTROL)
    shim(bin_dir, "rankwatch", RANKWATCH)  # the rankwatch of this checkout, whatever is on PATH
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM_SHM": str(shm),
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_JOB_NUM_NODES": "2",
            "MASTER_PORT": str(free_port()), "STORE_PORT": str(free_port()), "NPROC_PER_NODE": "1",
            "RANKWATCH_OUT": str(tmp_path / "out"), "RANKWATCH_STALL_TIMEOUT": "3", "OMP_NUM_THREADS": "1"}


def summaries(out: Path) -> dict[str, dict]:
    return {node: json.loads((out / node / "summary.json").read_text()) for node in ("node-0", "node-1")
            if (out / node / "summary.json").exists()}


def test_sbatch_runs_one_watched_torchrun_per_node_with_the_slurm_job_id(procs, tmp_path, fake_slurm):
    result = procs.run(["bash", str(SBATCH), DEMO, "--steps", "15", "--hidden", "64", "--layers", "2"],
                       timeout=240, text=True, env=fake_slurm, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = summaries(tmp_path / "out")
    assert sorted(found) == ["node-0", "node-1"], result.stderr[-3000:]
    assert {s["job_id"] for s in found.values()} == {f"slurm-{JOB_ID}"}
    # node 0's summary covers every rank of the job (step rings shared through the store it hosts)
    assert sorted(int(r) for r in found["node-0"]["ranks"]) == [0, 1]


def test_sbatch_hang_on_node_1_is_named_in_both_nodes_bundles(procs, tmp_path, fake_slurm):
    result = procs.run(["bash", str(SBATCH), DEMO, "--steps", "1000", "--hidden", "64", "--layers", "2",
                        "--scenario", "input-hang", "--fault-rank", "1", "--fault-step", "5"],
                       timeout=240, text=True, env=fake_slurm, cwd=tmp_path)
    assert result.returncode != 0  # --on-stall kill (the script's default) ended the job
    verdicts = {}
    for node in ("node-0", "node-1"):
        found = bundle_dirs(tmp_path / "out" / node / "incidents")
        assert len(found) == 1, f"{node}: {found}\n{result.stderr[-3000:]}"
        verdicts[node] = json.loads((found[0] / "verdict.json").read_text())
    assert {(v["job_id"], v["incident_id"]) for v in verdicts.values()} == {(f"slurm-{JOB_ID}",
                                                                           verdicts["node-0"]["incident_id"])}
    for v in verdicts.values():
        assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [1], "dataloader"), v["reason"]
