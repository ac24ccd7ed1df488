"""`rankwatch status`: open incidents and stalled ranks from the watchdog's state file, with its age; the
records alone when no watchdog publishes one; hostile state files ignored; --watch until Ctrl-C."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import rankwatch_cmd, start_daemon, wait_for

RANK = str(Path(__file__).resolve().parents[2] / "procs" / "rank.py")


def status(shm: Path, *extra: str, daemon_out: Path | None = None) -> subprocess.CompletedProcess:
    cmd = rankwatch_cmd("status", "--shm-dir", str(shm), "--daemon-out", str(daemon_out or shm / "none"), *extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def status_json(shm: Path, daemon_out: Path | None = None) -> dict:
    result = status(shm, "--json", daemon_out=daemon_out)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def start_ranks(procs, shm: Path, job: str, stall_rank: int, world: int = 2):
    for r in range(world):
        env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world))
        extra = ["--stall-after", "20"] if r == stall_rank else []
        procs.start([sys.executable, RANK, *extra], env=env, stdout=subprocess.DEVNULL)


def test_status_shows_the_open_incident_and_the_stalled_rank(procs, tmp_path, shm_dir):
    out = tmp_path / "out"
    daemon = start_daemon(procs, shm_dir, out, stall="3", poll="0.3")
    start_ranks(procs, shm_dir, "jobS", stall_rank=1)

    def open_incident():
        jobs = status_json(shm_dir)["jobs"]
        inc = jobs[0]["open_incident"] if jobs else None
        return jobs[0] if inc and inc["decided"] else None

    job = wait_for(open_incident, 90, interval=0.5)
    assert job, status_json(shm_dir)
    assert job["open_incident"]["kind"] == "hang" and job["open_incident"]["initiating_ranks"] == [1]
    assert job["open_incident"]["bundle"] and Path(job["open_incident"]["bundle"]).is_dir()
    assert job["stalled_ranks"] == [1]
    assert job["watchdog"]["state"] == "fresh" and job["watchdog"]["mode"] == "daemon"
    assert job["diagnosis_from"] == "watchdog"  # the daemon's one diagnosis of the job, not status' own
    assert [i["incident_id"] for i in job["incidents"]] == [job["open_incident"]["incident_id"]]
    # owner-only, beside the records, and a copy under the daemon's --out
    state = shm_dir / "jobS" / "watchdog.json"
    assert oct(state.stat().st_mode & 0o777) == "0o600"
    assert (out / "jobS" / "state.json").is_file()
    text = status(shm_dir)
    assert "OPEN INCIDENT" in text.stdout and "HANG" in text.stdout and "initiating rank 1" in text.stdout
    assert "STALLED: rank 1" in text.stdout
    # the daemon goes away (killed: nothing rewrites its files from here on)
    procs.kill(daemon)
    # a root daemon that cannot write into a user's job dir: status reads the copy under its --out
    state.unlink()
    assert status_json(shm_dir)["jobs"][0]["watchdog"]["state"] == "none"
    job = status_json(shm_dir, daemon_out=out)["jobs"][0]
    assert job["open_incident"]["initiating_ranks"] == [1] and job["watchdog"]["mode"] == "daemon"
    # an old state file is the watchdog's last word, shown as such, not as the present
    copy = out / "jobS" / "state.json"
    doc = json.loads(copy.read_text())
    doc["updated_unix"] -= 600
    copy.write_text(json.dumps(doc))
    job = status_json(shm_dir, daemon_out=out)["jobs"][0]
    assert job["watchdog"]["state"] == "stale" and job["watchdog"]["age_s"] >= 600
    assert job["diagnosis_from"] == "records"  # a silent watchdog's diagnosis is not the present either
    assert "silent for" in status(shm_dir, daemon_out=out).stdout


def one_rank(procs, shm: Path, job: str) -> None:
    start_ranks(procs, shm, job, stall_rank=-1, world=1)
    assert wait_for(lambda: status_json(shm)["jobs"], 60), "the rank never showed up"


def test_status_without_a_watchdog_says_so(procs, shm_dir):
    one_rank(procs, shm_dir, "lonely")
    job = status_json(shm_dir)["jobs"][0]
    assert job["watchdog"] == {"state": "none"} and job["open_incident"] is None
    assert job["diagnosis_from"] == "records"
    assert "no watchdog state" in status(shm_dir).stdout


def test_hostile_state_files_are_ignored(procs, tmp_path, shm_dir):
    one_rank(procs, shm_dir, "evil")
    job_dir = shm_dir / "evil"
    forged = {"schema": "rankwatch.state/1", "job_id": "evil", "updated_unix": time.time(), "watchdog_pid": 1,
              "open_incident": {"incident_id": "x", "kind": "hang", "initiating_ranks": "all of them"}}
    # a FIFO would block a naive reader forever; a symlink points elsewhere; a torn/ill-typed document
    os.mkfifo(job_dir / "watchdog.json")
    assert status_json(shm_dir)["jobs"][0]["watchdog"]["state"] == "none"
    os.unlink(job_dir / "watchdog.json")
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**forged, "open_incident": None}))
    os.symlink(elsewhere, job_dir / "watchdog.json")
    assert status_json(shm_dir)["jobs"][0]["watchdog"]["state"] == "none"
    os.unlink(job_dir / "watchdog.json")
    (job_dir / "watchdog.json").write_text(json.dumps(forged))
    job = status_json(shm_dir)["jobs"][0]
    assert job["watchdog"]["state"] == "none" and job["open_incident"] is None
    (job_dir / "watchdog.json").write_text('{"schema": "rankwatch.state/1", "job_id": "evil", ' + " " * (300 << 10))
    assert status_json(shm_dir)["jobs"][0]["watchdog"]["state"] == "none"
    # well-typed where it is checked, hostile inside: control characters, a numeric confidence and bundle
    hostile = {**forged, "open_incident": {"incident_id": "x\x1b[2J", "kind": "hang", "initiating_ranks": [1],
                                           "confidence": 3, "reason": "r\x07\nfake line", "bundle": 7}}
    (job_dir / "watchdog.json").write_text(json.dumps(hostile))
    inc = status_json(shm_dir)["jobs"][0]["open_incident"]
    assert inc["initiating_ranks"] == [1]
    assert "\x1b" not in inc["incident_id"] and "\x07" not in inc["reason"] and "\n" not in inc["reason"]
    assert (inc["confidence"], inc["bundle"], inc["decided"]) == (None, None, True)
    text = status(shm_dir).stdout
    assert "\x1b[2J" not in text and "\x07" not in text


def test_status_watch_refreshes_until_ctrl_c(procs, shm_dir):
    one_rank(procs, shm_dir, "watched")
    pid, fd = pty.fork()
    if pid == 0:
        # started as from a background shell (`cmd &` without job control): SIGINT inherited ignored, which
        # a plain Python program never turns into KeyboardInterrupt — --watch must still stop on Ctrl-C
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.execv(sys.executable, rankwatch_cmd("status", "--shm-dir", str(shm_dir), "--watch", "--interval", "0.3"))
    try:
        seen = b""

        def read_for(seconds: float, done) -> bool:
            """Read the pty as a terminal does until ``done()`` or the deadline (a writer blocked on a full
            pty buffer would otherwise never get to act on Ctrl-C)."""
            nonlocal seen
            deadline = time.monotonic() + seconds
            while not done() and time.monotonic() < deadline:
                if select.select([fd], [], [], 0.2)[0]:
                    try:
                        seen += os.read(fd, 65536)
                    except OSError:  # EIO once the child is gone
                        time.sleep(0.05)
            return bool(done())

        assert read_for(60, lambda: seen.count(b"job watched") >= 3), seen[-2000:]  # redrawn, not printed once
        os.kill(pid, signal.SIGINT)
        exited: list[int] = []

        def reaped() -> bool:
            if exited:
                return True
            done, status_code = os.waitpid(pid, os.WNOHANG)
            if done:
                exited.append(status_code)
            return bool(exited)

        read_for(60, reaped)
        code = exited[0] if exited else None
        if code is None:  # say where it is stuck before the cleanup kills it
            dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            raise AssertionError(f"status --watch did not exit on Ctrl-C:\n{dump.stdout[-3000:]}{dump.stderr[-500:]}")
        assert os.waitstatus_to_exitcode(code) == 0
        assert b"Traceback" not in seen
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
