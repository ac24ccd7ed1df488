"""`rankwatch run` on real gloo jobs with injected faults: the verdict names the right rank.

One hang runs on 4 ranks (the culprit among three that wait for it); a fault the culprit's own state shows
(dead, stopped, spinning in forward, the leader's rank hung) on 2; the collective mismatch on 3, so that two
ranks agree on the collective the odd one skipped. Every rank is a torch start-up (~1.6 s of CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import (
    DEMO,
    bundle_dirs,
    examples_module,
    free_port,
    new_tracker,
    run_demo_job,
    skip_if_gloo_teardown_abort,
    start_daemon,
    torchrun_args,
    wait_for,
    wait_polls,
)
from test_run_output import assert_final_verdict, assert_no_job_files

# the right kind and phase of each fault: the catalogue's (examples/fault_catalogue.py), as the accuracy suite's
FAULTS = examples_module("fault_catalogue").FAULTS
CASES = [
    # scenario, fault rank, ranks
    ("input-hang", 2, 4),
    ("compute-hang", 1, 2),
    ("dead-rank", 1, 2),
    ("stopped-rank", 1, 2),
    ("collective-mismatch", 1, 3),
    ("input-hang", 0, 2),
]


def run_job(
    procs, tmp_path, scenario: str, *demo_args: str, options: tuple[str, ...] = (), nproc: int = 4, timeout: float = 240
):
    result, out, _ = run_job_and_shm(procs, tmp_path, scenario, *demo_args, options=options, nproc=nproc,
                                     timeout=timeout)
    return result, out


def run_job_and_shm(procs, tmp_path, scenario: str, *demo_args: str, options: tuple[str, ...] = (), nproc: int = 4,
                    timeout: float = 240):
    return run_demo_job(procs, tmp_path, f"e2e-{scenario}", nproc, "--scenario", scenario, *demo_args,
                        options=options, timeout=timeout)


def bundles(out):
    return bundle_dirs(out / "incidents")


@pytest.mark.parametrize(("scenario", "rank", "nproc"), CASES, ids=[f"{c[0]}-r{c[1]}-of-{c[2]}" for c in CASES])
def test_fault_is_attributed_to_the_injected_rank(procs, tmp_path, scenario, rank, nproc):
    expect = FAULTS[scenario]
    result, out, shm = run_job_and_shm(
        procs,
        tmp_path,
        scenario,
        "--fault-rank",
        str(rank),
        "--fault-step",
        "4",
        "--steps",
        "400",
        options=("--stall-timeout", "3", "--on-stall", "kill"),
        nproc=nproc,
    )
    assert result.returncode != 0, "the job should have been stopped"
    found = bundles(out)
    assert len(found) == 1, (found, result.stdout, result.stderr[-2000:])
    verdict = json.loads((found[0] / "verdict.json").read_text())
    assert verdict["schema"] == "rankwatch.verdict/1"
    assert verdict["kind"] in expect.kinds, verdict
    assert verdict["initiating_ranks"] == expect.ranks(rank), verdict
    if expect.phase is not None:
        assert verdict["phase"] == expect.phase, verdict
    assert verdict["confidence"] == "high"
    assert set(verdict["ranks"]) == {str(r) for r in range(nproc)}
    # printed as it happened
    assert f"initiating rank {rank}" in result.stdout
    # torchrun failed and printed its own "Root Cause": the final output says what that is
    assert "torchrun's 'Root Cause (first observed failure)' above" in result.stdout
    assert f"rankwatch names rank {rank} as the initiator" in result.stdout
    # the verdict is the last thing printed, after torchrun's report
    tail = result.stdout.rstrip().splitlines()
    head = max(i for i, ln in enumerate(tail) if ln.startswith("rankwatch: "))
    assert f"initiating rank {rank}" in tail[head] and tail[-1].startswith("bundle: "), tail[head:]
    # stacks of every rank are in the bundle; a rank still alive at capture has real frames
    for r in range(nproc):
        stack = json.loads((found[0] / "stacks" / f"rank-{r}.json").read_text())
        if verdict["ranks"][str(r)]["state"] in ("running", "stopped"):
            assert stack["threads"], (r, stack)
        assert (found[0] / "stacks" / f"rank-{r}.txt").exists()
    assert (found[0] / "stacks" / "groups.txt").exists()
    assert (found[0] / "summary.txt").read_text().startswith("rankwatch: ")
    assert oct(found[0].stat().st_mode & 0o777) == "0o700"
    if verdict["kind"] == "hang":
        culprit = json.loads((found[0] / "stacks" / f"rank-{rank}.json").read_text())
        assert culprit["source"] == "py-spy"
        # the flight recorder came back through the dump responder
        assert (found[0] / "fr" / f"rank-{rank}.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["incidents"] == [found[0].name]
    if scenario == "input-hang":
        # what a person at the terminal reads last (this job was test_run_output's own "last words" job):
        # torchrun's failure report explained in exactly one note, then the verdict with its why once and
        # where the initiating rank stands in the user's code; nothing of the job left in the shm dir
        assert "Root Cause (first observed failure)" in result.stderr
        note = [ln for ln in result.stdout.splitlines() if ln.startswith("note: torchrun's 'Root Cause")]
        assert len(note) == 1 and f"rankwatch names rank {rank} as the initiator" in note[0], result.stdout
        assert_final_verdict(result.stdout, out, rank)
        assert_no_job_files(shm, f"e2e-{scenario}")


def test_slow_first_step_and_declared_long_phase_are_not_hangs(procs, tmp_path):
    result, out = run_job(
        procs,
        tmp_path,
        "balanced",
        "--steps",
        "30",
        "--first-step-sleep-s",
        "5",
        "--checkpoint-every",
        "10",
        "--checkpoint-s",
        "4.5",
        "--checkpoint-budget-s",
        "60",
        options=("--stall-timeout", "2", "--on-stall", "kill"),
        nproc=2,
    )
    skip_if_gloo_teardown_abort(result, tmp_path / "shm" / "e2e-balanced", 30)
    assert result.returncode == 0, result.stderr[-3000:]
    assert bundles(out) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["incidents"] == [] and summary["steps"] >= 20


def _fake_record(path, pid: int, rank: int = 0) -> None:
    new_tracker(path, pid=pid, rank=rank, world_size=2, local_world_size=2, hostname="x", job_id="fake", start_ns=1)


def test_daemon_survives_corrupt_records_and_recycled_pids(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    # a job whose record names a live, unrelated process
    (shm / "fake").mkdir(parents=True)
    sleeper = procs.start(["sleep", "300"])
    _fake_record(shm / "fake" / "rank-0.hb", sleeper.pid)
    # a real job with a fault, whose dir also gets garbage
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="real")
    job = procs.start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *torchrun_args(
                2,
                "real",
                "-m",
                "rankwatch.hooks",
                DEMO,
                "--scenario",
                "input-hang",
                "--fault-rank",
                "1",
                "--fault-step",
                "3",
                "--steps",
                "400",
            ),
        ],
        env=env,
    )
    assert wait_for(lambda: (shm / "real" / "rank-1.hb").exists(), timeout=90)
    (shm / "real" / "rank-7.hb").write_bytes(os.urandom(5000))
    (shm / "real" / "rank-8.hb").write_bytes(b"\0" * 100_000)
    daemon = start_daemon(procs, shm, out, poll="0.3")
    inc = out / "real" / "incidents"
    assert wait_for(lambda: bundle_dirs(inc), timeout=90)
    bundle = bundle_dirs(inc)[0]
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["initiating_ranks"] == [1] and verdict["phase"] == "dataloader"
    assert daemon.poll() is None, "daemon died"
    assert job.poll() is None, "the daemon must not touch the job without --on-stall kill"
    assert not (out / "fake").exists()
    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    rejected = {os.path.basename(e["path"]) for e in events if e["event"] == "record_rejected"}
    assert {"rank-7.hb", "rank-8.hb"} <= rejected
    assert any(e["event"] == "job_stale" and e["job"] == "fake" for e in events)
    assert any(e["event"] == "verdict" and e["initiating_ranks"] == [1] for e in events)
    assert sleeper.poll() is None, "an unrelated process was signalled"


def test_one_incident_per_stall_and_recovery_closes_it(procs, tmp_path):
    """A rank stopped, then resumed: one bundle (not one per poll), the incident closes, the job finishes."""
    shm, out = tmp_path / "shm", tmp_path / "out"
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="rec")
    job = procs.start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *torchrun_args(
                2,
                "rec",
                "-m",
                "rankwatch.hooks",
                DEMO,
                "--scenario",
                "stopped-rank",
                "--fault-rank",
                "1",
                "--fault-step",
                "5",
                "--steps",
                "120",
            ),
        ],
        env=env,
    )
    port = free_port()
    daemon = start_daemon(procs, shm, out, "--metrics-port", str(port), poll="0.2")
    inc = out / "rec" / "incidents"
    assert wait_for(lambda: bundle_dirs(inc), timeout=120)
    wait_polls(port, more=10)  # ten more polls while still stopped: still one incident
    bundles_now = bundle_dirs(inc)
    assert len(bundles_now) == 1
    verdict = json.loads((bundles_now[0] / "verdict.json").read_text())
    assert verdict["kind"] == "stopped_rank" and verdict["initiating_ranks"] == [1]
    os.kill(verdict["ranks"]["1"]["pid"], signal.SIGCONT)
    rc = job.wait(timeout=120)
    if rc != 0:
        finished = subprocess.CompletedProcess(job.args, rc, "", job.stderr.read().decode(errors="replace"))
        skip_if_gloo_teardown_abort(finished, shm / "rec", 120)
    assert rc == 0, "the resumed job should finish normally"
    wait_polls(port, more=5)  # the daemon has seen the job end
    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=30)
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert any(e["event"] == "incident_closed" for e in events)
    assert sum(e["event"] == "verdict" for e in events) == 1
    assert len(bundle_dirs(inc)) == 1
