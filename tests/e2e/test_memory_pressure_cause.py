"""A straggler's memory pressure, real: a 2-rank gloo job touches a file-backed working set of 96 MB per rank every
step (``tests/jobs/working_set.py``), and rank 1's process is put in a memory cgroup whose limit (64 MB) is below
it, so every step the kernel reclaims the pages it touched last and faults them back in: thrashing. Both ranks
get a cgroup v2 group of their own, where the kernel keeps each one's ``memory.pressure``. The diagnosis must
name rank 1 with ``memory_pressure``; the control run (the same groups, no limit) must not.

Why a file and not anonymous memory: this host has no swap, so anonymous memory over a limit cannot be
reclaimed at all — the rank is OOM-killed (measured: an 80 MB ``bytearray`` under a 60 MB v1 limit, killed on
its first step, 18 ms of memory stall) — and ``memory.high``, which throttles an allocation instead of killing,
is a cgroup v2 knob while the memory controller here is bound to the v1 hierarchy. A file's pages can always be
reclaimed and re-read, and the kernel counts the reclaim and the re-read of a page it evicted as a memory stall
(measured: a 90 MB working set under a 60 MB limit, 34 ms of memory stall and 26 ms of I/O stall per pass, a
pass 102 ms against 22 ms without the limit). The cache must be dropped and the pages first touched *after*
the move: a page stays charged to the cgroup that first faulted it in (the previous try re-read a file whose
cache was charged elsewhere: the limit never reclaimed anything, ``memory.pressure`` stayed at 0).

Needs root and a writable cgroup hierarchy with a memory controller (v2 ``memory.high`` where it is v2, v1
``memory.limit_in_bytes`` where it is v1, as here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, free_port, rankwatch_cmd, wait_for
from rankwatch.hooks.record import read_record
from rankwatch.watchdog.observe.signals import cgroup_mounts
from test_io_pressure_cause import Cgroups

pytestmark = pytest.mark.slow

JOB = str(REPO / "tests" / "jobs" / "working_set.py")
STEPS = 260  # the first steps, before the working set is touched, fall out of the 200 compared
WS_MB = 96  # each rank's working set ...
LIMIT_MB = 64  # ... and rank 1's memory limit: a third of its working set is re-read every step


@pytest.fixture
def cgroups():
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    v2, _ = cgroup_mounts()
    if v2 is None:
        pytest.skip("no cgroup v2 hierarchy (memory.pressure is kept there)")
    groups = Cgroups()
    try:
        yield Path(v2), groups
    finally:
        groups.remove()


def memory_group(groups: Cgroups, v2: Path, tag: str, limit: int | None) -> Path:
    """A memory cgroup for rank 1, limited to ``limit`` bytes (None: the control, no limit): v2 ``memory.high``
    where the memory controller is v2, else v1 ``memory.limit_in_bytes``."""
    if "memory" in (v2 / "cgroup.controllers").read_text().split():
        (v2 / "cgroup.subtree_control").write_text("+memory")
        g = groups.make(v2 / f"{tag}-mem")
        if limit is not None:
            (g / "memory.high").write_text(f"{limit}\n")
        return g
    v1 = Path("/sys/fs/cgroup/memory")
    if not (v1 / "memory.limit_in_bytes").exists():
        pytest.skip("no memory controller to limit a rank with")
    g = groups.make(v1 / tag)
    if limit is not None:
        (g / "memory.limit_in_bytes").write_text(f"{limit}\n")
    return g


def training(shm: Path, job: str) -> tuple[int, int] | None:
    """Both ranks' pids once each has finished a few steps."""
    got = []
    for r in (0, 1):
        try:
            rec = read_record(str(shm / job / f"rank-{r}.hb"))
        except Exception:  # not published yet (or half written): asked again
            return None
        if rec.pid <= 0 or rec.steps_done < 3:
            return None
        got.append(rec.pid)
    return got[0], got[1]


def working_set(d: Path) -> None:
    """Each rank's file, written and then dropped from the page cache: its pages are charged to the rank's
    memory cgroup when the rank first faults them in, not to this test's."""
    d.mkdir()
    block = os.urandom(1 << 20)
    for r in (0, 1):
        fd = os.open(d / f"rank-{r}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for _ in range(WS_MB):
                os.write(fd, block)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("limited", [True, False], ids=["limited", "control"])
def test_a_rank_whose_working_set_is_over_its_memory_limit_is_memory_pressure(procs, tmp_path, cgroups, limited):
    v2, groups = cgroups
    tag = f"rankwatch-test-mem-{os.getpid()}-{int(limited)}"
    own = [groups.make(v2 / f"{tag}-r{r}") for r in (0, 1)]  # each rank's memory.pressure
    mem = memory_group(groups, v2, tag, LIMIT_MB << 20 if limited else None)
    ws = tmp_path / "ws"
    working_set(ws)
    out, shm, job = tmp_path / "out", tmp_path / "shm", f"cause-mem-{int(limited)}"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--quiet", "--",
                        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{free_port()}", "--rdzv-id", job, "--monitor-interval", "0.2",
                        JOB, "--ws-dir", str(ws), "--steps", str(STEPS))
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        run = procs.start(cmd, stdout=so, stderr=se)
        # moved once training runs: what a rank allocates while it starts (torch, gloo: hundreds of MB) would be
        # charged to the limited group and OOM-kill it; what it had allocated before stays charged where it was
        pids = wait_for(lambda: training(shm, job), timeout=180, interval=0.05)
        assert pids, "the ranks never started training"
        for r, pid in enumerate(pids):
            (own[r] / "cgroup.procs").write_text(str(pid))
        # v1: a hierarchy of its own beside v2; v2: the memory group keeps rank 1's memory.pressure then
        (mem / "cgroup.procs").write_text(str(pids[1]))
        (ws / "go").touch()
        rc = run.wait(timeout=400)
    assert rc == 0, ((tmp_path / "stdout").read_text()[-2000:], (tmp_path / "stderr").read_text()[-3000:])
    s = json.loads((out / "summary.json").read_text())
    stalls = {r: row.get("memory_stall") for r, row in (s.get("signals") or {}).items()}
    if not limited:
        assert (s.get("cause") or {}).get("cause") != "memory_pressure", (s["diagnosis"], s["cause"], stalls)
        assert 1 not in s["straggler_ranks"] or s["cause"]["cause"] != "memory_pressure", s["cause"]
        return
    assert s["straggler_ranks"] == [1], (s["diagnosis"], s["why"], s["cause"], stalls)
    cause = s["cause"]
    assert cause["cause"] == "memory_pressure", cause
    stall = cause["signals"]["memory_stall"]
    assert stall["rank_ms"] > 10 * max(1.0, stall["peers_ms"]), stall
    text = (out / "summary.txt").read_text()
    assert "cause: memory_pressure — rank 1 stalled" in text and "next:" in text, text
