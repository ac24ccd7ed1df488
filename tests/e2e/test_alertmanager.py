"""Alerts end to end against a REAL Alertmanager (Debian ``prometheus-alertmanager``, started here on a
loopback port): a real ``rankwatch daemon`` watching a real job of rank processes (tests/procs/alert_job.py)
notifies Alertmanager's v2 API when the job hangs, and again when it recovers; Alertmanager's own API shows
the alert firing and then gone, and Alertmanager's webhook notifications (to a receiver here) say
``firing`` then ``resolved``. Beside it: a plain JSON webhook, a webhook that trickles, ``--on-incident``."""

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
from conftest import REPO, alive, free_port, rankwatch_cmd, wait_for
from test_alerts import Receiver, Trickler

AM_BIN = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
JOB_PROC = REPO / "tests" / "procs" / "alert_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(AM_BIN is None, reason="prometheus-alertmanager not installed")]


@pytest.fixture
def alertmanager(tmp_path):
    """A real Alertmanager whose one receiver is a webhook here (what it notifies, firing and resolved)."""
    notified = Receiver()
    port = free_port()
    cfg = tmp_path / "alertmanager.yml"
    cfg.write_text(
        "route:\n  receiver: here\n  group_by: [alertname, job_id, incident_id]\n"
        "  group_wait: 0s\n  group_interval: 1s\n  repeat_interval: 1h\n"
        f"receivers:\n  - name: here\n    webhook_configs:\n      - url: {notified.url}\n"
        "        send_resolved: true\n"
    )
    log = open(tmp_path / "alertmanager.log", "w")
    proc = subprocess.Popen(
        [AM_BIN, f"--config.file={cfg}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _get(f"{base}/-/ready") is not None, 60), (tmp_path / "alertmanager.log").read_text()
        yield base, notified
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        notified.close()


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read()
        return json.loads(body) if body.strip().startswith((b"[", b"{")) else body
    except OSError:
        return None


def am_alerts(base: str) -> list[dict]:
    return [a for a in _get(f"{base}/api/v2/alerts") or [] if a["labels"].get("alertname") == "RankwatchIncident"]


def am_notifications(notified: Receiver) -> list[tuple[str, dict]]:
    """(status, labels) of each alert in Alertmanager's webhook notifications, in order."""
    out = []
    for _, _, body in list(notified.requests):
        doc = json.loads(body)
        out += [(a["status"], a["labels"]) for a in doc["alerts"]]
    return out


def start_job(tmp_path: Path, shm: Path, job: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": job}
    proc = subprocess.Popen([sys.executable, str(JOB_PROC), *args], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def start_daemon(tmp_path: Path, shm: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    err = tmp_path / "daemon.log"
    cmd = rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(tmp_path / "out"), "--stall-timeout", "2",
                        "--poll-interval", "0.3", "--json-logs", *extra)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(err, "w"), start_new_session=True), err


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_hang_fires_in_alertmanager_and_resolves_when_the_job_recovers(tmp_path, alertmanager):
    base, notified = alertmanager
    plain, trickler = Receiver(), Trickler()
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    env_log, child_pid = tmp_path / "env.log", tmp_path / "child.pid"
    hook = tmp_path / "on-incident.sh"
    # the command leaves a child in a session of its own: the reaper must take it down anyway
    hook.write_text("#!/bin/sh\nenv | grep ^RANKWATCH_ | sort > " + str(env_log) + "\n"
                    f"setsid sleep 300 & echo $! > {child_pid}\nexit 0\n")
    hook.chmod(0o700)
    job = start_job(tmp_path, shm, "amjob", "--ranks", "2", "--stall-rank", "1")
    daemon, log = start_daemon(tmp_path, shm, "--notify", f"{base}/api/v2/alerts", "--notify", plain.url,
                               "--notify", trickler.url, "--on-incident", str(hook))
    try:
        firing = wait_for(lambda: am_alerts(base), 120)
        assert firing, log.read_text()[-3000:]
        (alert,) = firing
        labels = alert["labels"]
        assert alert["status"]["state"] == "active"
        # the labels are the verdict's (what the bundle says; which rank the engine names is not tested here)
        verdict = json.loads((Path(alert["annotations"]["bundle"]) / "verdict.json").read_text())
        ranks = ",".join(map(str, verdict["initiating_ranks"]))
        assert (labels["job_id"], labels["kind"], labels["initiating_ranks"], labels["phase"]) == \
            ("amjob", verdict["kind"], ranks, verdict["phase"] or ""), labels
        assert labels["node"] == socket.gethostname() and labels["incident_id"] == verdict["incident_id"]
        assert alert["annotations"]["summary"].startswith("rankwatch [amjob]: ")
        assert wait_for(lambda: ("firing", labels) in am_notifications(notified), 60)
        # the plain webhook got the JSON document, the trickling one held only its own sender
        assert wait_for(lambda: plain.requests, 30)
        doc = json.loads(plain.requests[0][2])
        assert (doc["status"], doc["incident_id"], doc["initiating_ranks"]) == \
            ("firing", verdict["incident_id"], verdict["initiating_ranks"])
        # its own sender reached it too (on loaded cores it may connect after the plain one was answered)
        assert wait_for(trickler.holding.is_set, 30)
        # --on-incident: phase, confidence and the one-line reason in its environment; its setsid child reaped
        env = dict(line.split("=", 1) for line in wait_for(lambda: env_log.exists() and env_log.read_text(), 60)
                   .splitlines())
        assert (env["RANKWATCH_KIND"], env["RANKWATCH_PHASE"], env["RANKWATCH_INITIATING_RANKS"]) == \
            (verdict["kind"], verdict["phase"] or "", ranks)
        assert env["RANKWATCH_CONFIDENCE"] == verdict["confidence"] and env["RANKWATCH_REASON"]
        assert "\n" not in env["RANKWATCH_REASON"] and env["RANKWATCH_BUNDLE"] == alert["annotations"]["bundle"]
        child = int(wait_for(lambda: child_pid.exists() and child_pid.read_text().strip(), 30))
        assert wait_for(lambda: not alive(child), 30), "the command's setsid child outlived it"

        job.send_signal(signal.SIGUSR1)  # rank 1 goes on: the job recovers
        assert wait_for(lambda: ("resolved", labels) in am_notifications(notified), 90), log.read_text()[-3000:]
        assert am_alerts(base) == []  # Alertmanager holds it as resolved, no longer active
        resolved = wait_for(lambda: [json.loads(b) for _, _, b in plain.requests if b"resolved" in b], 30)
        assert resolved[0]["status"] == "resolved" and resolved[0]["resolved_because"] == "job recovered"
        assert resolved[0]["incident_id"] == labels["incident_id"]

        # SIGTERM: the daemon exits while the trickling webhook is still trickling (cut, not waited for)
        assert not trickler.closed.is_set()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        assert not trickler.closed.is_set()
    finally:
        _stop(daemon)
        _stop(job)
        plain.close()
        trickler.close()


def test_resolved_when_the_job_ends_and_straggler_alerts_are_opt_in(tmp_path, alertmanager):
    base, _ = alertmanager
    plain = Receiver()
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    job = start_job(tmp_path, shm, "slowjob", "--ranks", "2", "--slow-rank", "1", "--step-s", "0.04")
    daemon, log = start_daemon(tmp_path, shm, "--notify", plain.url, "--notify", f"{base}/api/v2/alerts",
                               "--notify-stragglers")
    try:
        def docs() -> list[dict]:
            return [json.loads(b) for _, _, b in list(plain.requests)]

        started = wait_for(lambda: [d for d in docs() if d.get("schema") == "rankwatch.straggler/1"], 120)
        assert started, log.read_text()[-3000:]
        assert (started[0]["status"], started[0]["rank"], started[0]["job_id"]) == ("firing", 1, "slowjob")
        in_am = wait_for(lambda: [a for a in _get(f"{base}/api/v2/alerts") or []
                                  if a["labels"]["alertname"] == "RankwatchStraggler"], 60)
        assert in_am and in_am[0]["labels"]["rank"] == "1"
        job.send_signal(signal.SIGUSR2)  # rank 1 catches up
        ended = wait_for(lambda: [d for d in docs() if d.get("schema") == "rankwatch.straggler/1"
                                  and d["status"] == "resolved"], 120)
        assert ended and ended[0]["rank"] == 1, log.read_text()[-3000:]

        # then the job hangs, and ends without recovering: the incident resolves as "job ended"
        _stop(job)
        job = start_job(tmp_path, shm, "endjob", "--ranks", "2", "--stall-rank", "0")
        fired = wait_for(lambda: [d for d in docs() if d.get("job_id") == "endjob" and d["status"] == "firing"], 120)
        assert fired, log.read_text()[-3000:]
        _stop(job)
        gone = wait_for(lambda: [d for d in docs() if d.get("job_id") == "endjob" and d["status"] == "resolved"], 120)
        assert gone and gone[0]["resolved_because"] == "job ended", log.read_text()[-3000:]
        assert gone[0]["incident_id"] == fired[0]["incident_id"]
        assert wait_for(lambda: not [a for a in am_alerts(base) if a["labels"]["job_id"] == "endjob"], 30)
    finally:
        _stop(daemon)
        _stop(job)
        plain.close()
