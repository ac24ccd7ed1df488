"""Alerts: the verdict POSTed to webhooks once per incident (retried, off the watchdog's loop) and the
--on-incident command run on the bundle — with a real job, a real local HTTP receiver and real processes."""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import bundle_dirs, examples_module, run_demo_job, wait_for
from rankwatch.watchdog.core.policy import AlertPolicy
from rankwatch.watchdog.serve.alert_docs import incident_text
from rankwatch.watchdog.serve.alerts import Alerter

# the right answer of the job's fault: the catalogue's (examples/fault_catalogue.py)
FAULTS = examples_module("fault_catalogue").FAULTS


class Receiver:
    """A webhook endpoint on loopback that answers the first ``fail_first`` requests with ``fail_status``."""

    def __init__(self, fail_first: int = 0, fail_status: int = 503, redirect: bool = False) -> None:
        self.requests: list[tuple[str, dict, bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests.append((self.path, dict(self.headers), body))
                if redirect:
                    self.send_response(307)
                    self.send_header("Location", "http://127.0.0.1:1/elsewhere")
                elif len(receiver.requests) <= fail_first:
                    self.send_response(fail_status)
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/secret-token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Trickler:
    """A webhook that accepts, reads the request, and answers one byte every second, never finishing: a
    per-read timeout never fires on it. ``holding`` is set while a connection is being trickled to."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/trickle"
        self.connections = 0
        self.holding = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 600:
                    self.holding.set()
                    conn.sendall(bytes([byte]))
                    if self.closed.wait(1.0):
                        return
            except OSError:
                return

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def receiver():
    r = Receiver(fail_first=1)
    yield r
    r.close()


def hook_script(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "hook.log"
    script = tmp_path / "on-incident.sh"
    script.write_text(
        "#!/bin/sh\n"
        'for a; do last="$a"; done\n'
        'printf "%s|%s|%s|%s|%s\\n" "$1" "$last" "$RANKWATCH_INCIDENT_ID" "$RANKWATCH_INITIATING_RANKS" "$#" '
        f">> {log}\n"
    )
    script.chmod(0o700)
    return script, log


def test_incident_is_posted_once_and_the_command_gets_the_bundle(procs, tmp_path, receiver):
    script, log = hook_script(tmp_path)
    scenario, fault_rank = "input-hang", 1
    expect = FAULTS[scenario]
    result, out, _ = run_demo_job(
        procs, tmp_path, "alerts", 2, "--scenario", scenario, "--fault-rank", str(fault_rank), "--fault-step", "4",
        "--steps", "400",
        options=("--stall-timeout", "3", "--on-stall", "kill", "--notify", receiver.url,
                 "--on-incident", f"{script} --from-rankwatch"),
    )
    found = bundle_dirs(out / "incidents")
    assert len(found) == 1, (result.stdout, result.stderr[-2000:])
    verdict = json.loads((found[0] / "verdict.json").read_text())
    # the receiver answered 503 once: the alert was retried, and delivered exactly once; then, the job
    # killed by --on-stall kill, its resolved notice
    assert len(receiver.requests) == 3, receiver.requests
    resolved = json.loads(receiver.requests[2][2])
    assert (resolved["status"], resolved["incident_id"]) == ("resolved", verdict["incident_id"])
    assert resolved["resolved_because"] == "job killed by --on-stall kill"
    path, headers, body = receiver.requests[1]
    assert path == "/hooks/secret-token" and headers["Content-Type"] == "application/json"
    posted = json.loads(body)
    assert posted["schema"] == "rankwatch.verdict/1" and posted["status"] == "firing"
    assert posted["incident_id"] == verdict["incident_id"]
    assert posted["initiating_ranks"] == expect.ranks(fault_rank) and posted["kind"] in expect.kinds, posted
    # the one line a chat message shows is the renderer's line for this verdict (its words: the renderer tests)
    assert posted["text"] == incident_text(verdict) and "\n" not in posted["text"]
    assert posted["bundle"] == str(found[0])
    # the command ran once, without a shell, with its own words first and the bundle path last
    lines = log.read_text().splitlines()
    ranks = ",".join(map(str, expect.ranks(fault_rank)))
    assert lines == [f"--from-rankwatch|{found[0]}|{verdict['incident_id']}|{ranks}|2"], lines
    # the URL's secret path is never logged
    assert "secret-token" not in result.stderr


def test_failing_webhooks_and_commands_never_block_the_caller(tmp_path):
    """A receiver that accepts and never answers, one that refuses with 4xx (not retried) and one that
    redirects (not followed); a command that hangs with a child: all bounded, all logged, none fatal."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    refusing, redirecting = Receiver(fail_first=99, fail_status=400), Receiver(redirect=True)
    pidfile = tmp_path / "child.pid"
    hang = tmp_path / "hang.sh"
    hang.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    hang.chmod(0o700)
    policy = AlertPolicy(notify_timeout_s=0.5, notify_attempts=2, notify_backoff_s=0.1, command_timeout_s=1.0)
    urls = [f"http://127.0.0.1:{silent.getsockname()[1]}/x", refusing.url, redirecting.url]
    alerts = Alerter(urls, [str(hang)], policy)
    try:
        verdict = {"schema": "rankwatch.verdict/1", "incident_id": "i-1", "kind": "hang", "initiating_ranks": [0],
                   "confidence": "high", "reason": "r", "job_id": "j"}
        alerts.submit(verdict, str(tmp_path))
        assert refusing.requests == []  # submit only queued it
        alerts.close(timeout_s=60)
        assert len(refusing.requests) == 1  # a 400 is not retried
        assert len(redirecting.requests) == 2  # a redirect is a failure (retried), never followed
        child = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 10))
        # the timed-out command's whole process group was killed, its child included
        assert wait_for(lambda: not _alive(child), 10), "the command's child survived its timeout"
    finally:
        silent.close()
        refusing.close()
        redirecting.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_alert_queue_is_bounded():
    gate, entered = threading.Event(), threading.Event()
    sent: list[str] = []

    def post(url: str, body: bytes, timeout_s: float) -> int:
        entered.set()
        gate.wait(30)  # a webhook that takes its time
        sent.append(json.loads(body)["incident_id"])
        return 200

    # every incident pages here (no per-job summary): the queue's bound is what is tested
    alerts = Alerter(["http://127.0.0.1:9/x"], None, AlertPolicy(max_queued=3, job_page_every_s=0), post=post)
    alerts.submit({"incident_id": "i-0", "kind": "hang", "initiating_ranks": []}, None)
    assert entered.wait(30)
    for i in range(1, 10):
        alerts.submit({"incident_id": f"i-{i}", "kind": "hang", "initiating_ranks": []}, None)
    gate.set()
    alerts.close(timeout_s=30)
    # the first was in flight; of the rest only the newest 3 were kept
    assert sent[0] == "i-0" and sent[-3:] == ["i-7", "i-8", "i-9"] and len(sent) == 4, sent


def test_a_trickling_webhook_holds_only_itself_and_not_the_shutdown():
    """4 incidents: the healthy webhook gets all 4 while the trickling one still holds its first POST, and
    close() returns while it is still trickling (each POST has a total deadline, each target its thread)."""
    trickler, healthy = Trickler(), Receiver()
    alerts = Alerter([trickler.url, healthy.url], None, AlertPolicy(job_page_every_s=0))
    try:
        with structlog.testing.capture_logs() as logs:
            for i in range(4):
                alerts.submit({"incident_id": f"i-{i}", "job_id": "j", "kind": "hang", "initiating_ranks": [i]},
                              None)
            assert wait_for(lambda: len(healthy.requests) == 4, 30), healthy.requests
            assert wait_for(trickler.holding.is_set, 30) and trickler.connections == 1  # each target its own thread
            alerts.close(timeout_s=30)
        events = [e["event"] for e in logs]
        assert events.count("notified") == 4 and "alert_failed" not in events, events
        assert any(e["event"] == "alerts_unfinished" for e in logs)  # the trickler's, cut at close
        assert not trickler.closed.is_set() and trickler.connections <= 2
        assert [json.loads(b)["incident_id"] for _, _, b in healthy.requests] == ["i-0", "i-1", "i-2", "i-3"]
    finally:
        trickler.close()
        healthy.close()


def gated_webhook() -> tuple[threading.Event, threading.Event, list[tuple[str, str]], Any]:
    """A webhook that holds each POST until ``gate`` is set: (gate, entered, sent (job, incident), post)."""
    gate, entered = threading.Event(), threading.Event()
    sent: list[tuple[str, str]] = []

    def post(url: str, body: bytes, timeout_s: float) -> int:
        entered.set()
        gate.wait(30)
        doc = json.loads(body)
        sent.append((doc["job_id"], doc["incident_id"]))
        return 200

    return gate, entered, sent, post


def test_one_jobs_alert_storm_never_drops_another_jobs_alert():
    gate, entered, sent, post = gated_webhook()

    alerts = Alerter(["http://127.0.0.1:9/x"], None,
                     AlertPolicy(max_queued=8, max_queued_per_job=4, job_page_every_s=0), post=post)
    alerts.submit({"incident_id": "first", "job_id": "quiet", "kind": "hang", "initiating_ranks": []}, None)
    assert entered.wait(30)
    alerts.submit({"incident_id": "q-1", "job_id": "quiet", "kind": "hang", "initiating_ranks": []}, None)
    for i in range(50):
        alerts.submit({"incident_id": f"f-{i}", "job_id": "flood", "kind": "hang", "initiating_ranks": []}, None)
    gate.set()
    alerts.close(timeout_s=30)
    assert ("quiet", "q-1") in sent, sent
    assert [i for j, i in sent if j == "flood"] == ["f-46", "f-47", "f-48", "f-49"]


def test_one_users_many_jobs_never_starve_another_users_alert():
    """User 1001 floods with 10 jobs (each within its job share) while the webhook is busy: user 1002's one
    alert is sent next all the same, and user 1001 keeps only their own share of the queue."""
    gate, entered, sent, post = gated_webhook()

    policy = AlertPolicy(max_queued=16, max_queued_per_job=4, max_queued_per_owner=8, job_page_every_s=0)
    alerts = Alerter(["http://127.0.0.1:9/x"], None, policy, post=post)
    alerts.submit({"incident_id": "a-first", "job_id": "a-0", "kind": "hang", "initiating_ranks": []}, None,
                  owner=1001)
    assert entered.wait(30)
    with structlog.testing.capture_logs() as logs:
        for job in range(10):
            for i in range(3):
                alerts.submit({"incident_id": f"a-{job}-{i}", "job_id": f"a-{job}", "kind": "hang",
                               "initiating_ranks": []}, None, owner=1001)
        alerts.submit({"incident_id": "b-1", "job_id": "b", "kind": "hang", "initiating_ranks": []}, None,
                      owner=1002)
    gate.set()
    alerts.close(timeout_s=30)
    assert sent[:2] == [("a-0", "a-first"), ("b", "b-1")], sent  # next in line, not behind 1001's backlog
    assert len(sent) == 1 + 8 + 1, sent  # 1001's share of the queue: the newest 8 of their 30
    assert [i for j, i in sent[2:]] == [f"a-{j}-{i}" for j in range(7, 10) for i in range(3)][-8:]
    dropped = [e for e in logs if e["event"] == "alert_dropped"]
    assert len(dropped) == 22 and {e["owner_uid"] for e in dropped} == {1001}


def test_a_crash_looping_job_pages_once_then_summarises_and_never_holds_another_jobs_page():
    """25 incidents of one job within its page window: the first pages at once, the other 24 are held and go
    out as one summary (the newest, saying how many it stands for) when the window ends; another job's
    incident meanwhile pages at once."""
    gate, _, sent, post = gated_webhook()
    gate.set()
    bodies: list[dict[str, Any]] = []

    def keep(url: str, body: bytes, timeout_s: float) -> int:
        bodies.append(json.loads(body))
        return post(url, body, timeout_s)

    alerts = Alerter(["http://127.0.0.1:9/x"], None, AlertPolicy(job_page_every_s=1.0), post=keep)
    for i in range(25):
        alerts.submit({"incident_id": f"loop-{i}", "job_id": "loop", "kind": "dead_rank", "initiating_ranks": [0]},
                      None, owner=1001)
    alerts.submit({"incident_id": "other-0", "job_id": "other", "kind": "hang", "initiating_ranks": [1]}, None,
                  owner=1002)
    assert wait_for(lambda: len(sent) >= 3, 30), sent  # the window's end sends the summary by itself
    alerts.close(timeout_s=30)
    assert sent == [("loop", "loop-0"), ("other", "other-0"), ("loop", "loop-24")], sent
    summary = bodies[-1]
    assert summary["summarised"] == 24 and "+23 more of this job" in summary["text"], summary


KILLED_OWNER = """
import sys, time
from rankwatch.watchdog.serve.alerts import Alerter
alerts = Alerter([], [sys.argv[1]])
alerts.submit({"incident_id": "i", "job_id": "j", "kind": "hang", "initiating_ranks": [0]}, "/nonexistent")
time.sleep(300)
"""


@pytest.mark.slow
def test_nothing_the_command_started_outlives_a_killed_daemon(procs, tmp_path):
    """The command setsids a child and hangs; the process that runs the alerter is SIGKILLed: the command
    and its escaped child still go (the reaper is a subreaper with a parent-death signal)."""
    pids = tmp_path / "pids"
    cmd = tmp_path / "hang.sh"
    cmd.write_text(f"#!/bin/sh\nsetsid sleep 300 &\necho $$ $! > {pids}\nsleep 300\n")
    cmd.chmod(0o700)
    owner = procs.start([sys.executable, "-c", KILLED_OWNER, str(cmd)])
    found = wait_for(lambda: pids.exists() and pids.read_text().split(), 60)
    assert found, owner.stderr.read() if owner.poll() is not None else "the command never ran"
    owner.kill()  # SIGKILL: no clean-up code runs in the owner
    owner.wait()
    for pid in map(int, found):
        assert wait_for(lambda pid=pid: not _alive(pid), 30), f"{pid} outlived the daemon"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["daemon", "--notify-stragglers"], "--notify-stragglers"),
        (["daemon", "--metrics-port", "9", "--metrics-token-file", "/nonexistent/token"], "--metrics-token-file"),
        (["run", "--notify-stragglers", "--", "--nproc-per-node", "2", "train.py"], "--notify-stragglers"),
    ],
)
def test_bad_alert_and_metrics_options_are_one_line_and_exit_2(tmp_path, args, needle):
    from test_cli_errors import assert_one_line_exit_2, run

    (tmp_path / "train.py").write_text("raise SystemExit('must never run')\n")
    result = run(args + (["--out", str(tmp_path / "o")] if args[0] == "daemon" else []), tmp_path)
    assert_one_line_exit_2(result, needle)
    assert "must never run" not in result.stderr


def test_alert_documents_for_alertmanager_and_plain_webhooks():
    from rankwatch.watchdog.serve.alert_docs import (
        alertmanager_alert,
        command_env,
        incident_notice,
        is_alertmanager,
    )

    assert is_alertmanager("http://am:9093/api/v2/alerts") and is_alertmanager("https://x/am/api/v2/alerts/")
    assert not is_alertmanager("http://am:9093/api/v1/alerts") and not is_alertmanager("https://hooks.slack.com/x")
    verdict = {"schema": "rankwatch.verdict/1", "job_id": "j\x1b[31m", "incident_id": "i-1", "kind": "hang",
               "initiating_ranks": [3, 5], "phase": "forward", "confidence": "high",
               "reason": "rank 3 stopped\nin forward", "ranks": {"3": {"node": "n2"}, "5": {"node": "n3"}}}
    fired = incident_notice(verdict, "/b/i-1", 1000.0)
    assert fired.labels == {"alertname": "RankwatchIncident", "severity": "critical", "job_id": "j?[31m",
                            "incident_id": "i-1", "kind": "hang", "initiating_ranks": "3,5", "phase": "forward",
                            "node": "n2,n3"}
    am = alertmanager_alert(fired, 2000.0, 300.0)
    assert (am["startsAt"], am["endsAt"]) == ("1970-01-01T00:16:40.000Z", "1970-01-01T00:38:20.000Z")
    assert am["annotations"]["bundle"] == "/b/i-1" and "\n" not in am["annotations"]["description"]
    resolved = incident_notice(verdict, "/b/i-1", 1000.0, "resolved", "job ended")
    assert resolved.key == fired.key and resolved.labels == fired.labels
    assert alertmanager_alert(resolved, 2000.0, 300.0)["endsAt"] == "1970-01-01T00:33:20.000Z"
    doc = json.loads(resolved.body())
    assert (doc["status"], doc["resolved_because"], doc["schema"]) == ("resolved", "job ended", "rankwatch.verdict/1")
    assert doc["text"].startswith("RESOLVED (job ended): rankwatch [j?[31m]: ")
    env = command_env(fired)
    assert (env["RANKWATCH_PHASE"], env["RANKWATCH_CONFIDENCE"], env["RANKWATCH_INITIATING_RANKS"]) == \
        ("forward", "high", "3,5")
    assert "\n" not in env["RANKWATCH_REASON"] and env["RANKWATCH_REASON"].startswith("rank 3 stopped")
