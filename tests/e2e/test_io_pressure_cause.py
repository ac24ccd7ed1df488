"""A straggler's I/O pressure, real: a 2-rank gloo job reads its input from a block device (a loop device over a
file, O_DIRECT: every read reaches the device), and rank 1's process is put in a cgroup whose I/O limit caps its
reads (cgroup v1 ``blkio.throttle.read_bps_device`` where the blkio controller is v1, as here; v2 ``io.max``
where the io controller is v2). Both ranks get a cgroup v2 group of their own, where the kernel keeps each
one's ``io.pressure``. The diagnosis must name rank 1 with ``io_pressure``.

Memory pressure has a test of its own (``test_memory_pressure_cause.py``: a file-backed working set over a
memory limit).
Needs root, ``losetup`` and a writable cgroup hierarchy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, free_port, rank_pid, rankwatch_cmd, wait_for
from rankwatch.watchdog.observe.signals import cgroup_mounts

pytestmark = pytest.mark.slow

JOB = str(REPO / "tests" / "jobs" / "device_input.py")
STEPS = 260  # the first steps, before the ranks are put in their cgroups, fall out of the 200 compared
READ_BPS = 1 << 20  # 64 KiB a step at 1 MiB/s: ~62 ms a step for rank 1, ~0.1 ms for rank 0


@pytest.fixture
def loop_device(tmp_path):
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("needs root and losetup")
    img = tmp_path / "input.img"
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    got = subprocess.run(["losetup", "-f", "--show", str(img)], capture_output=True, text=True, timeout=30)
    if got.returncode != 0:
        pytest.skip(f"no loop device here: {got.stderr.strip()}")
    dev = got.stdout.strip()
    try:
        st = os.stat(dev)
        yield dev, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    finally:
        subprocess.run(["losetup", "-d", dev], capture_output=True, timeout=30)


class Cgroups:
    """The groups this test makes (removed at teardown, once their processes are gone)."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def make(self, path: Path) -> Path:
        path.mkdir()
        self.made.append(path)
        return path

    def remove(self) -> None:
        for p in reversed(self.made):
            wait_for(lambda p=p: not (p / "cgroup.procs").read_text().strip(), timeout=30)
            p.rmdir()


@pytest.fixture
def cgroups():
    v2, _ = cgroup_mounts()
    if v2 is None:
        pytest.skip("no cgroup v2 hierarchy (io.pressure is kept there)")
    groups = Cgroups()
    try:
        yield Path(v2), groups
    finally:
        groups.remove()


def io_limit(groups: Cgroups, v2: Path, majmin: str, tag: str) -> Path:
    """A group whose reads of the device are capped: v1 blkio where that controller is v1, else v2 io.max."""
    v1 = Path("/sys/fs/cgroup/blkio")
    if (v1 / "blkio.throttle.read_bps_device").exists():
        g = groups.make(v1 / tag)
        (g / "blkio.throttle.read_bps_device").write_text(f"{majmin} {READ_BPS}\n")
        return g
    if "io" not in (v2 / "cgroup.controllers").read_text().split():
        pytest.skip("no I/O controller to cap a device's reads with")
    (v2 / "cgroup.subtree_control").write_text("+io")
    g = groups.make(v2 / f"{tag}-io")
    (g / "io.max").write_text(f"{majmin} rbps={READ_BPS}\n")
    return g


def test_a_rank_whose_input_reads_are_capped_is_io_pressure(procs, tmp_path, loop_device, cgroups):
    dev, majmin = loop_device
    v2, groups = cgroups
    tag = f"rankwatch-test-io-{os.getpid()}"
    own = [groups.make(v2 / f"{tag}-r{r}") for r in (0, 1)]  # each rank's io.pressure
    capped = io_limit(groups, v2, majmin, tag)
    out, shm, job = tmp_path / "out", tmp_path / "shm", "cause-io"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--quiet", "--",
                        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-id", job, "--monitor-interval", "0.2",
                        JOB, "--device", dev, "--steps", str(STEPS))
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        run = procs.start(cmd, stdout=so, stderr=se)
        pids = wait_for(lambda: (rank_pid(shm, job, 0), rank_pid(shm, job, 1))
                        if rank_pid(shm, job, 0) and rank_pid(shm, job, 1) else None, timeout=180, interval=0.05)
        assert pids, "the ranks' records never appeared"
        for r, pid in enumerate(pids):
            (own[r] / "cgroup.procs").write_text(str(pid))
        # v1 blkio: a hierarchy of its own beside v2; v2: the capped group keeps rank 1's io.pressure then
        (capped / "cgroup.procs").write_text(str(pids[1]))
        rc = run.wait(timeout=400)
    assert rc == 0, ((tmp_path / "stdout").read_text()[-2000:], (tmp_path / "stderr").read_text()[-3000:])
    s = json.loads((out / "summary.json").read_text())
    assert s["straggler_ranks"] == [1], (s["diagnosis"], s["why"], s["cause"])
    cause = s["cause"]
    assert cause["cause"] == "io_pressure", cause
    io = cause["signals"]["io_stall"]
    assert io["rank_ms"] > 10 * max(1.0, io["peers_ms"]), io
    text = (out / "summary.txt").read_text()
    assert "cause: io_pressure — rank 1 stalled" in text and "next:" in text, text
