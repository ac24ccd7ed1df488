"""`rankwatch status` as people read it: nobody is named while the verdict is pending, a pipe gets every
column and every word (and with --watch, every refresh as it happens), times count from the rank's start."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import rankwatch_cmd, wait_for
from test_status import start_ranks, status, status_json

pytestmark = pytest.mark.slow

LONG_WHY = "rank 1 is stuck in forward " + "because of a very long explanation " * 12 + "END"


def forge_state(shm: Path, job: str, *, decided: bool) -> None:
    doc = {"schema": "rankwatch.state/1", "job_id": job, "updated_unix": time.time(), "watchdog_pid": os.getpid(),
           "mode": "run", "on_stall": "report", "stall_timeout_s": 30.0, "stalled_ranks": [0, 1],
           "open_incident": {"incident_id": "20261201T000000Z-001-stall", "kind": "stall" if not decided else "hang",
                             "initiating_ranks": [0, 1] if not decided else [1], "phase": None if not decided
                             else "forward", "confidence": None if not decided else "high", "decided": decided,
                             "reason": "ranks 0, 1 made no progress" if not decided else LONG_WHY, "bundle": None},
           "incidents": [], "stragglers": []}
    (shm / job / "watchdog.json").write_text(json.dumps(doc))


def status_showing(shm: Path, needle: str, timeout: float = 60) -> str:
    """`rankwatch status`'s text once it shows ``needle`` (else its last answer): one look may miss a job at a
    load of 20, its ranks not read within the look's budget."""
    last = [""]

    def look() -> bool:
        last[0] = status(shm).stdout
        return needle in last[0]

    wait_for(look, timeout)
    return last[0]


def test_a_pending_verdict_names_nobody(procs, shm_dir):
    start_ranks(procs, shm_dir, "pending", stall_rank=-1)
    assert wait_for(lambda: len((status_json(shm_dir)["jobs"] or [{"ranks": []}])[0]["ranks"]) == 2, 60)
    forge_state(shm_dir, "pending", decided=False)
    text = status_showing(shm_dir, "deciding…")
    assert "deciding…" in text, text
    assert "◀" not in text and "initiating" not in text, text


def test_a_pipe_gets_every_column_and_word(procs, shm_dir):
    start_ranks(procs, shm_dir, "wide", stall_rank=-1)
    assert wait_for(lambda: len((status_json(shm_dir)["jobs"] or [{"ranks": []}])[0]["ranks"]) == 2, 60)
    forge_state(shm_dir, "wide", decided=True)
    text = status_showing(shm_dir, "why: ")
    assert f"why: {LONG_WHY}\n" in text, text  # on one line, not wrapped at 80 columns
    assert "…" not in text, text  # no column cut short
    assert "◀" in text  # a decided verdict marks its initiating rank


def test_watch_into_a_pipe_prints_each_refresh(procs, shm_dir):
    start_ranks(procs, shm_dir, "piped", stall_rank=-1, world=1)
    assert wait_for(lambda: status_json(shm_dir)["jobs"], 60)
    proc = procs.start(rankwatch_cmd("status", "--shm-dir", str(shm_dir), "--daemon-out", str(shm_dir / "none"),
                                     "--watch", "--interval", "0.3"))
    seen = b""
    deadline = time.monotonic() + 60
    while seen.count(b"job piped") < 3 and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            seen += os.read(proc.stdout.fileno(), 65536)
    assert seen.count(b"job piped") >= 3, seen[-2000:]  # written as it refreshes, not at exit
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0


RANK_BEFORE_INIT = """
import sys, time
import rankwatch.hooks as rw
assert rw.init()
print("ready", flush=True)
time.sleep(120)  # like a rank waiting before init_process_group: no phase entered, no step done
"""


def test_times_count_from_the_rank_start_never_from_boot(procs, shm_dir):
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm_dir), RANKWATCH_JOB_ID="early", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    started = time.monotonic()
    proc = procs.start([sys.executable, "-c", RANK_BEFORE_INIT], env=env, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    (row,) = status_json(shm_dir)["jobs"][0]["ranks"]
    alive = time.monotonic() - started
    # the machine has been up far longer than the rank: a time from boot would exceed this bound
    assert 0 <= row["in_phase_s"] <= alive and 0 <= row["since_progress_s"] <= alive, (row, alive)
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    assert uptime > alive  # the bound above is a real one


def test_a_follower_shows_the_leaders_job_diagnosis_beside_its_own(procs, shm_dir):
    """On a follower node the state file carries the leader's job-wide diagnosis (``job_diagnosis``) beside the
    node's own: status names the leader node it came from, that no secret sealed it, the node each named rank runs
    on, and says which diagnosis is this node's. Read back from a file anyone able to write the job dir may have
    replaced: its strings are cleaned again."""
    start_ranks(procs, shm_dir, "follow", stall_rank=-1)
    assert wait_for(lambda: len((status_json(shm_dir)["jobs"] or [{"ranks": []}])[0]["ranks"]) == 2, 60)
    own = {"label": "BALANCED", "straggler_ranks": [], "phase": None, "why": "ranks 2, 3 alike", "steps": 100,
           "cause": None, "cause_rank": None, "cause_text": "", "remote_ranks": {}}
    job = {"label": "INPUT STRAGGLER", "straggler_ranks": [0], "phase": "dataloader", "why": "rank 0 loads slowly",
           "steps": 100, "excess_ms": 31.25, "time_lost_ms": 3125.0, "cause": "own_work", "cause_rank": 0,
           "cause_text": "cause: own_work — rank 0's own work\x1b[31m; next: profile rank 0",
           "nodes": {"0": "node-a\x1b]0;x\x07"}, "from": "leader", "leader": "node-a", "authenticated": False}
    doc = {"schema": "rankwatch.state/1", "job_id": "follow", "updated_unix": time.time(),
           "watchdog_pid": os.getpid(), "mode": "run", "on_stall": "report", "stall_timeout_s": 30.0,
           "stalled_ranks": [], "open_incident": None, "incidents": [], "stragglers": [], "diagnosis": own,
           "job_diagnosis": job}
    (shm_dir / "follow" / "watchdog.json").write_text(json.dumps(doc))
    text = status_showing(shm_dir, "job diagnosis")
    assert ("job diagnosis (from leader node node-a, unauthenticated): INPUT STRAGGLER — rank 0 in dataloader on "
            "node-a?]0;x? (+31.2 ms/step)") in text, text
    assert "  cause: own_work — rank 0's own work?[31m; next: profile rank 0 [rank 0 runs on node-a?]0;x?]" in text
    assert "this node's diagnosis: BALANCED" in text and "\x1b" not in text, text
    (got,) = status_json(shm_dir)["jobs"]
    assert got["diagnosis"] == "BALANCED" and got["job_diagnosis"]["straggler_ranks"] == [0], got
    assert got["job_diagnosis"]["authenticated"] is False and got["job_diagnosis"]["leader"] == "node-a"
    # sealed with the store secret: no "unauthenticated"
    doc["job_diagnosis"] = {**job, "authenticated": True}
    doc["updated_unix"] = time.time()
    (shm_dir / "follow" / "watchdog.json").write_text(json.dumps(doc))
    text = status_showing(shm_dir, "job diagnosis (from leader node node-a):")
    assert "job diagnosis (from leader node node-a): INPUT STRAGGLER" in text, text
