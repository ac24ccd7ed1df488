"""Jobs come and go: finished jobs are retired once, their files removed after a retention, bundles are
never lost (a full disk delays them, it does not drop them), and a killed daemon leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import LineReader, bundle_dirs, free_port, rankwatch_cmd, wait_for, wait_polls
from rankwatch.watchdog.report.bundle import prune_bundles
from test_safety import RANK, events, start_rank


def run_ranks_to_completion(shm: Path, job: str, world: int, steps: int = 5) -> None:
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world))
    ps = [subprocess.Popen([sys.executable, RANK, "--steps", str(steps)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                           stdout=subprocess.DEVNULL) for r in range(world)]
    for p in ps:
        assert p.wait(timeout=60) == 0


def daemon(procs, shm: Path, out: Path, *extra: str) -> subprocess.Popen:
    return procs.start(rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(out), "--stall-timeout", "1",
                                     "--poll-interval", "0.2", "--json-logs", *extra), text=True)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return err


def test_a_daemon_over_finished_jobs_logs_each_once_and_removes_their_files(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    for job in ("done-a", "done-b", "done-c"):
        run_ranks_to_completion(shm, job, 2)
    (shm / "done-c" / "watchdog.json").write_text("{}")  # as a watchdog that watched it to the end left it
    (shm / "done-a" / "notes.txt").write_text("not rankwatch's")
    (shm / "done-b" / "rank-7.hb").symlink_to("/etc/hostname")
    port = free_port()
    d = daemon(procs, shm, out, "--retain-finished", "3", "--metrics-port", str(port))
    assert wait_for(lambda: not (shm / "done-b" / "rank-0.hb").exists(), timeout=30)
    wait_polls(port, more=10)  # and then some polls more: none of them logs a finished job again
    log = events(stop(d))
    counts = Counter((e.get("event"), e.get("job")) for e in log)
    for job in ("done-a", "done-b"):
        assert counts[("job_restarted", job)] == 0, counts
        assert counts[("job_stale", job)] + counts[("job_retired", job)] == 1, counts
        assert counts[("rank_discovered", job)] <= 2, counts
        assert counts[("job_files_removed", job)] == 1, counts
        assert not (shm / job / "rank-0.hb").exists() and not (shm / job / "rank-1.hb").exists()
    assert not (shm / "done-a" / "job.json").exists() and not (shm / "done-a" / "rank-0.ctl").exists()
    assert wait_for(lambda: not (shm / "done-c").exists(), timeout=30)  # nothing else there: the dir goes too
    # what is not provably rankwatch's stays, and so does the job.json beside a record nobody verified
    assert (shm / "done-a" / "notes.txt").read_text() == "not rankwatch's"
    assert (shm / "done-b" / "rank-7.hb").is_symlink() and Path("/etc/hostname").exists()
    assert (shm / "done-b" / "job.json").exists()
    assert not any(e.get("event") in ("incident_detected", "verdict") for e in log)


def test_leftovers_of_a_killed_daemon_are_cleaned_at_start(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    incidents = out / "j" / "incidents"
    partial = incidents / ".tmp-20261201T000000Z-001-stall-abc123"
    finished = incidents / "20261201T000000Z-000-stall"
    for d in (partial / "stacks", finished):
        d.mkdir(parents=True)
    (finished / "verdict.json").write_text("{}")
    dumps = shm / "j" / "dumps" / "20261201T000000Z-001-stall"
    dumps.mkdir(parents=True)
    (dumps / "rank-0.stacks.json").write_text("{}")
    (dumps / "rank-0.done").write_text("")
    old = time.time() - 3600
    os.utime(dumps, (old, old))
    d = procs.run(rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(out), "--once"), timeout=60, text=True)
    assert d.returncode == 0, d.stderr
    assert not partial.exists() and not (shm / "j" / "dumps").exists()
    assert (finished / "verdict.json").exists()


def test_bundle_retention_keeps_the_newest(tmp_path):
    dirs = [tmp_path / "a" / "incidents", tmp_path / "b" / "incidents"]
    made = []
    for i in range(5):
        b = dirs[i % 2] / f"inc-{i}"
        b.mkdir(parents=True)
        (b / "verdict.json").write_text("{}")
        os.utime(b / "verdict.json", (1000 + i, 1000 + i))
        made.append(b)
    (dirs[0] / "not-a-bundle").mkdir()
    gone = prune_bundles([str(d) for d in dirs], keep=2)
    assert sorted(gone) == sorted(str(b) for b in made[:3])
    assert [b.exists() for b in made] == [False, False, False, True, True]
    assert (dirs[0] / "not-a-bundle").exists()


@pytest.fixture
def tiny_out(tmp_path):
    mnt = tmp_path / "out"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_delays_a_bundle_it_does_not_lose_it(procs, tmp_path, tiny_out):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    filler = tiny_out / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    d = daemon(procs, shm, tiny_out)
    assert d.stderr is not None
    daemon_log = LineReader(d.stderr)
    start_rank(procs, shm, "full", 0, 2)
    start_rank(procs, shm, "full", 1, 2, "--stall-after", "5")

    # detection, every attempt refused by the full disk, the verdict logged without a bundle (a fixed sleep
    # could run out first on a busy host)
    assert daemon_log.wait_for('"event": "verdict"', '"bundle": null', timeout=120), "no verdict without bundle"
    incidents = tiny_out / "full" / "incidents"
    assert not bundle_dirs(incidents)
    assert not (incidents.exists() and list(incidents.iterdir())), "temp files left on a full disk"
    filler.unlink()
    found = wait_for(lambda: bundle_dirs(incidents), timeout=30)
    assert found, "the bundle was not written once space returned"
    verdict = json.loads((found[0] / "verdict.json").read_text())
    assert verdict["initiating_ranks"] == [1]
    assert [p.name for p in incidents.iterdir()] == [found[0].name]  # no temp dirs beside it
    d.send_signal(signal.SIGTERM)
    d.wait(timeout=60)
    log = events(daemon_log.text())
    assert any(e.get("event") == "bundle_write_failed" for e in log)
    logged = [e for e in log if e.get("event") == "verdict" and e.get("bundle") is None]
    assert logged and logged[0]["initiating_ranks"] == [1] and logged[0]["evidence"], "verdict missing from the log"
    assert any(e.get("event") == "bundle_written_late" for e in log)


def read_steps(job_dir: Path) -> int:
    from rankwatch.hooks.record import RecordFormatError, read_record

    steps = []
    for p in job_dir.glob("rank-*.hb"):
        try:
            steps.append(read_record(str(p)).steps_done)
        except (RecordFormatError, OSError):
            return 0
    return min(steps) if len(steps) == 2 else 0


def test_sigterm_to_rankwatch_run_stops_the_job_without_an_incident(procs, tmp_path):
    from conftest import DEMO, torchrun_args

    out, shm = tmp_path / "out", tmp_path / "shm"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--stall-timeout", "5", "--",
                        *torchrun_args(2, "stopme", DEMO, "--steps", "100000", "--step-sleep-ms", "20"))
    run = procs.start(cmd, text=True)
    assert wait_for(lambda: any(p.name.startswith("rank-") for p in (shm / "stopme").glob("rank-*.hb")), timeout=120)
    assert wait_for(lambda: read_steps(shm / "stopme") >= 5, timeout=120), "training never started"
    run.send_signal(signal.SIGTERM)
    stdout, _ = run.communicate(timeout=120)
    assert "DEAD RANK" not in stdout, stdout
    assert not bundle_dirs(out / "incidents"), stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["incidents"] == [] and summary["steps"] > 0, summary


def test_a_healthy_run_beside_cpu_hogs_gets_a_complete_summary(procs, tmp_path):
    from conftest import DEMO, torchrun_args

    # one hog per core of the 2-core CI machine keeps every core busy (a third only burns the suite's CPU)
    hogs = [procs.start([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    out, shm = tmp_path / "out", tmp_path / "shm"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--quiet", "--",
                        *torchrun_args(2, "busy", DEMO, "--steps", "30"))
    result = procs.run(cmd, timeout=400, text=True)
    for h in hogs:
        procs.kill(h)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diagnosis"] != "NOT ENOUGH DATA" and summary["steps"] >= 20, summary
    assert sorted(summary["ranks"]) == ["0", "1"] and summary["incidents"] == []


def test_a_hostile_job_json_never_blinds_the_daemon_to_its_job(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    d = daemon(procs, shm, out)
    start_rank(procs, shm, "deep", 0, 2)
    start_rank(procs, shm, "deep", 1, 2, "--stall-after", "10")
    (shm / "deep" / "job.json").write_text("[" * 200_000 + "]" * 200_000)
    found = wait_for(lambda: bundle_dirs(out / "deep" / "incidents"), timeout=60)
    assert found, "the job with a hostile job.json was not watched"
    verdict = json.loads((found[0] / "verdict.json").read_text())
    assert verdict["initiating_ranks"] == [1]
    log = events(stop(d))
    assert not any(e.get("event") == "job_poll_failed" for e in log)
