"""A whole stall under an in-process daemon whose GPU evidence comes from a scripted NVML (no GPU here).

Real 2-rank gloo DDP job (examples/ddp_demo.py --scenario input-hang) under torchrun with the hooks; the
stand-in NVML reports the rank pids the hook recorded: the culprit at 0 % (stuck on the CPU in its
dataloader), its peer at 100 % (spinning in the collective). Skipped until daemon.py is wired to
evidence.GpuWatch (``Daemon.gpu``).

Both tests watch one job (module fixture): nothing kills it, so the hang is still there for the second
daemon, which makes its own incident into its own out dir. One job instead of two saves three torch
start-ups; each test still runs its own daemon through a whole stall (detection, capture, verdict, bundle).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import DEMO, Procs, examples_module, torchrun_args, wait_for
from rankwatch.hooks.record import RecordFormatError, RecordReader
from rankwatch.watchdog.core.policy import StallPolicy
from rankwatch.watchdog.evidence.gpu import GpuWatch
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig
from test_nvml_probe import FakeNvml
from test_nvml_probe import script as nvml_script

SCENARIO, FAULT_RANK = "input-hang", 1
# the right answer: the catalogue's (examples/fault_catalogue.py); the stand-in NVML idles the rank it names
EXPECT = examples_module("fault_catalogue").FAULTS[SCENARIO]
(CULPRIT,) = EXPECT.ranks(FAULT_RANK)


class LiveNvml(FakeNvml):
    """Scripted NVML with one GPU per rank pid and a fresh per-process sample on every call."""

    def __init__(self, util_by_pid: dict[int, float]) -> None:
        base = nvml_script()["devices"][0]
        devices = []
        for i, pid in enumerate(util_by_pid):
            d = copy.deepcopy(base)
            d["uuid"] = f"GPU-{i:08d}-0000-0000-0000-000000000000"
            d["processes"] = [{"pid": pid, "usedGpuMemory": 1 << 30}]
            d["samples"] = []
            devices.append(d)
        super().__init__({"now_s": time.time(), "devices": devices})
        self.util_by_pid = util_by_pid

    def nvmlDeviceGetProcessUtilization(self, h: Any, last_seen: int) -> list[Any]:
        pid = self.script["devices"][h.index]["processes"][0]["pid"]
        now_us = int(time.time() * 1_000_000)
        return [SimpleNamespace(pid=pid, timeStamp=now_us, smUtil=self.util_by_pid[pid], memUtil=0)]


def start_job(procs, shm: Path, job: str):
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job)
    return procs.start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *torchrun_args(
                2,
                job,
                "-m",
                "rankwatch.hooks",
                DEMO,
                "--scenario",
                SCENARIO,
                "--fault-rank",
                str(FAULT_RANK),
                "--fault-step",
                "3",
                "--steps",
                "400",
            ),
        ],
        env=env,
    )


def rank_pids(job_dir: Path) -> dict[int, int]:
    def read() -> dict[int, int] | None:
        out = {}
        for r in (0, 1):
            try:
                reader = RecordReader(str(job_dir / f"rank-{r}.hb"))
            except RecordFormatError:
                return None
            try:
                snap = reader.read()
            finally:
                reader.close()
            if snap.pid <= 0:
                return None
            out[r] = snap.pid
        return out

    pids = wait_for(read, timeout=90, interval=0.3)
    assert pids, "ranks never wrote their records"
    return pids


def run_daemon_until_bundle(shm: Path, out: Path, job: str, gpu: GpuWatch) -> dict[str, Any]:
    daemon = Daemon(
        DaemonConfig(
            shm_dir=str(shm), out_dir=str(out), poll_interval_s=0.3, stall=StallPolicy(timeout_s=3), job_filter=job
        ),
        gpu=gpu,
    )
    thread = threading.Thread(target=daemon.run, name="test-daemon", daemon=True)
    thread.start()
    inc = out / job / "incidents"
    try:
        found = wait_for(lambda: inc.exists() and [p for p in inc.iterdir() if not p.name.startswith(".")], timeout=120)
        assert found, "no incident bundle"
        return json.loads((found[0] / "verdict.json").read_text())
    finally:
        daemon.stop()
        thread.join(timeout=30)
        daemon.close()


pytestmark = pytest.mark.slow  # a real torchrun job (the module fixture starts it, not `procs`)


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """One job for both tests, hung in rank 1's DataLoader (no daemon here kills it); killed at teardown."""
    shm, job = tmp_path_factory.mktemp("gpujob") / "shm", "gpu"
    procs = Procs()
    try:
        start_job(procs, shm, job)
        pids = rank_pids(shm / job)
        yield shm, job, pids
    finally:
        procs.cleanup()


def test_cpu_stuck_culprit_at_zero_percent_is_named_with_gpu_evidence(hung_job, tmp_path):
    shm, job, pids = hung_job
    out = tmp_path / "out"
    nvml = LiveNvml({pid: (0.0 if r == CULPRIT else 100.0) for r, pid in pids.items()})
    gpu = GpuWatch(nvml=nvml)
    assert gpu.available
    verdict = run_daemon_until_bundle(shm, out, job, gpu)
    assert verdict["schema"] == "rankwatch.verdict/1"
    assert verdict["kind"] in EXPECT.kinds and verdict["phase"] == EXPECT.phase, verdict
    assert verdict["initiating_ranks"] == [CULPRIT]
    assert verdict["confidence"] == "high"
    assert verdict["ranks"][str(CULPRIT)]["gpu_util"] == 0.0
    assert verdict["ranks"][str(1 - CULPRIT)]["gpu_util"] == 100.0
    # the GPU reading backs the finding (its words: the renderer tests)
    assert verdict["finding"]["data"].get("gpu") == "agrees", verdict["finding"]


def test_without_nvml_the_verdict_stands_on_the_other_signals(hung_job, tmp_path):
    shm, job, _ = hung_job
    out = tmp_path / "out"
    gpu = GpuWatch()  # real pynvml, no driver here
    assert not gpu.available
    verdict = run_daemon_until_bundle(shm, out, job, gpu)
    assert verdict["kind"] in EXPECT.kinds and verdict["phase"] == EXPECT.phase, verdict
    assert verdict["initiating_ranks"] == [CULPRIT]
    assert all(r["gpu_util"] is None for r in verdict["ranks"].values())
    assert "gpu" not in verdict["finding"]["data"], verdict["finding"]
