"""A straggler's cause on a real 2-rank gloo job with a real fault: a rank sharing its CPU with two busy
processes (cpu_contention). (The cgroup-quota job and the balanced control are not here: the machine's own
load decided them; see the notes at the end.)

The job pins rank 0 to one CPU and rank 1 to another (``taskset -a``, every thread) as soon as their records
name their pids, so the fault is what differs between the ranks; 150 steps (~2 s each: every wakeup of rank
1's gloo threads waits for a slice beside the two hogs), the few before the pinning a small share of them.
The hogs are this test's processes (``procs``: killed at teardown).
Needs root and two CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import demo_job_cmd, skip_if_gloo_teardown_abort, wait_for
from rankwatch.hooks.record import read_record

pytestmark = pytest.mark.slow

STEPS = 150
HOG = [sys.executable, "-c", "while True: pass"]


def cpus() -> list[int]:
    got = sorted(os.sched_getaffinity(0))
    if len(got) < 2:
        pytest.skip("needs two CPUs")
    return got[:2]


def rank_pid(shm: Path, job: str, rank: int) -> int | None:
    path = shm / job / f"rank-{rank}.hb"
    try:
        pid = read_record(str(path)).pid
    except Exception:  # not published yet (or half written): asked again
        return None
    return pid if pid > 0 else None


def pin(pid: int, cpu: int) -> None:
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, capture_output=True)


def boost(pid: int) -> None:
    """Raise the weight of ``pid``'s autogroup (its session: the whole job, or one hog): on a test host that
    other people load to 15 runnable tasks on 2 cores, the scheduler's load balancer otherwise moves their
    tasks off the hogs' CPU onto the other rank's, and both ranks end up waiting alike (measured: 58 and
    69 ms/step of run-queue wait; no straggler, which is then the truth). Boosted, the job and the hogs
    are what shares the two CPUs, as on a node of one's own."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text("-15")


def hog(procs, cpu: int) -> None:
    p = procs.start(["taskset", "-c", str(cpu), *HOG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    boost(p.pid)


def run_job(procs, tmp_path: Path, job: str, on_pids) -> dict:
    """The demo job (2 ranks, CPU-bound steps) under ``rankwatch run``; ``on_pids(pid0, pid1)`` is called
    once both ranks' pids are known (the fault goes in there). Returns summary.json."""
    demo = ("--scenario", "balanced", "--steps", str(STEPS), "--compute-extra-matmuls", "60",
            "--input-sleep-ms", "0")
    cmd, out, shm = demo_job_cmd(tmp_path, job, 2, *demo)
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        run = procs.start(cmd, stdout=so, stderr=se)
        pids = wait_for(lambda: (rank_pid(shm, job, 0), rank_pid(shm, job, 1))
                        if rank_pid(shm, job, 0) and rank_pid(shm, job, 1) else None, timeout=180, interval=0.05)
        assert pids, "the ranks' records never appeared"
        boost(pids[0])
        on_pids(*pids)
        rc = run.wait(timeout=600)
    result = subprocess.CompletedProcess(cmd, rc, (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text())
    skip_if_gloo_teardown_abort(result, shm / job, STEPS)
    assert rc == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(660)  # the job's own wait (600 s): two hogs on rank 1's CPU take ~2 s a step, 5 min alone
def test_a_rank_sharing_its_cpu_with_two_busy_processes_is_cpu_contention(procs, tmp_path):
    c0, c1 = cpus()

    def fault(p0: int, p1: int) -> None:
        pin(p0, c0)
        pin(p1, c1)
        for _ in range(2):  # two busy processes of "another workload" on rank 1's CPU only
            hog(procs, c1)

    s = run_job(procs, tmp_path, "cause-contention", fault)
    assert s["straggler_ranks"] == [1], (s["diagnosis"], s["why"], s["cause"])
    # the label follows where the time went: measured here, rank 1 lost ~99 % of it in backward (forward
    # +35 %, the rest under 0.5 ms), a COMPUTE STRAGGLER in backward; slower by a like factor in every
    # phase it is RANK-WIDE. Either way the cause is the CPU it waits for
    assert s["diagnosis"] in ("RANK-WIDE STRAGGLER", "COMPUTE STRAGGLER"), s["why"]
    cause = s["cause"]
    assert cause["cause"] == "cpu_contention", cause
    assert cause["signals"]["run_queue_wait"]["rank_ms"] > 10 * max(1.0, cause["signals"]["run_queue_wait"]["peers_ms"])
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "cause: cpu_contention — rank 1 waited" in text and "next:" in text, text


# No real cgroup-quota job here either: it passed alone and in one full-suite run, then in the next (six
# workers' jobs on the 2 cores) the 25 % quota no longer set the rank apart ("no straggler … COMMUNICATION-BOUND")
# — a test the machine's load decides. The quota rule is held by tests/unit/observe/test_host_signals.py on
# counters of the shape measured here (throttled time beside the run-queue wait it causes); a quota that
# dominates whatever the load (and a job short enough for the suite) is left to issue 41.


# No control test of a balanced job here: under the suite's own load (six workers' jobs on 2 cores, host CPU
# pressure ~80 %) one of two pinned, balanced ranks falls behind by itself and is named (CI, 2026-12-05: rank 1
# +3.1 ms/step in backward, cause cpu_contention), as beside two hogs (583-615 vs 12-17 ms/step CPU wait).
# That is issue 41's open target ("no straggler on a host-wide slowdown"), measured in the closing note, not
# a test that fails by the load of the machine it runs on.
