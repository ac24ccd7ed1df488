"""`/healthz` on the metrics port: what a Kubernetes liveness probe asks (examples/kubernetes/)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

from conftest import free_port, start_daemon, wait_for
from rankwatch.watchdog.core.policy import ServePolicy
from rankwatch.watchdog.observe.process import ProcessTable
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig
from rankwatch.watchdog.serve.metrics import serve_metrics


def get(url: str) -> tuple[int, dict | None]:
    """(status, JSON body or None); status 0 while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            code, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        code, body = exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, None
    try:
        return code, json.loads(body)
    except ValueError:
        return code, None


def test_real_daemon_is_healthy_while_its_loop_polls_even_past_planted_fifos(procs, shm_dir, tmp_path):
    # a user of the node plants FIFOs where the daemon reads a record and job.json: opening them for
    # reading would block the root daemon's poll loop forever (every job on the node unwatched)
    job = shm_dir / "hostile"
    job.mkdir(mode=0o700)
    os.mkfifo(job / "rank-0.hb")
    os.mkfifo(job / "job.json")
    port = free_port()
    daemon = start_daemon(procs, shm_dir, tmp_path / "out", "--metrics-port", str(port), poll="0.2")
    url = f"http://127.0.0.1:{port}/healthz"
    first = wait_for(lambda: (r := get(url))[0] == 200 and r, timeout=60)
    assert first, f"no healthy answer; daemon stderr:\n{daemon.stderr.read() if daemon.poll() is not None else ''}"
    assert first[1]["status"] == "ok" and first[1]["polls"] >= 1
    later = wait_for(lambda: (r := get(url))[0] == 200 and r[1]["polls"] > first[1]["polls"] + 2 and r, timeout=60)
    assert later, "the poll loop made no progress"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert b"rankwatch_daemon_polls_total" in resp.read()
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0


def test_healthz_is_503_before_the_first_poll_and_once_the_loop_stops_polling(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    policy = ServePolicy(health_max_poll_age_s=0.3, health_max_poll_intervals=1)
    daemon = Daemon(DaemonConfig(shm_dir=str(shm), out_dir=str(tmp_path / "out"), poll_interval_s=0.1, serve=policy),
                    procs=ProcessTable(protected={1}))
    server = serve_metrics(daemon, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}/healthz"
    try:
        code, doc = get(url)
        assert (code, doc["status"], doc["last_poll_age_s"]) == (503, "starting", None)
        daemon.poll_once()
        code, doc = get(url)
        assert (code, doc["status"], doc["polls"]) == (200, "ok", 1)
        time.sleep(0.6)  # no poll for twice the limit: the loop is wedged as far as a probe can tell
        code, doc = get(url)
        assert (code, doc["status"]) == (503, "stale")
        assert doc["last_poll_age_s"] > doc["limit_s"] == 0.3
        daemon.poll_once()
        assert get(url)[0] == 200
        assert get(f"http://127.0.0.1:{server.port}/nope")[0] == 404
    finally:
        server.close()
        daemon.close()
