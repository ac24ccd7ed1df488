"""Never the reason a job fails (issue 42): metrics, the cross-node store and alert targets are optional parts
of `rankwatch run` and `rankwatch daemon`. One of them taken or down is one warning line; the job starts, runs
and ends with its own exit code, and the watchdog keeps deciding locally."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from pathlib import Path

from conftest import (
    REPO,
    LineReader,
    bundle_dirs,
    free_port,
    healthz_polls,
    rankwatch_cmd,
    start_daemon,
    stop_daemon,
    torchrun_args,
    wait_for,
)
from rankwatch.watchdog.core.evidence_items import STORE_UNREACHABLE, DecidedLocally

GATED = str(REPO / "tests" / "procs" / "gated_job.py")
MOVED = re.compile(r"^rankwatch run: warning: metrics port (\d+) on 127\.0\.0\.1 is taken; serving "
                   r"http://127\.0\.0\.1:(\d+)/metrics instead \(written to (.+)\)$", re.M)


def _listening() -> socket.socket:
    """A port held by a plain socket of another program (bound and listening, never answering)."""
    s = socket.socket()
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    return s


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return None


class Run:
    """A `rankwatch run` around the gated job, its stdout and stderr read as they come (a test waits for lines)."""

    def __init__(self, procs, tmp_path: Path, job: str, *options: str, pause: bool = False) -> None:
        self.out = tmp_path / job
        extra = ["--pause-at", "3", "--resume", str(tmp_path / "resume")] if pause else []
        cmd = rankwatch_cmd("run", "--out", str(self.out), "--shm-dir", str(tmp_path / "shm"), "--run-name", job,
                            *options, "--", *torchrun_args(1, job, GATED, "--gate", str(tmp_path / "gate"), *extra))
        self.proc = procs.start(cmd, text=True)
        self.stdout, self.stderr = LineReader(self.proc.stdout), LineReader(self.proc.stderr)

    def finish(self, timeout: float = 240) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once the run ended."""
        code = self.proc.wait(timeout=timeout)
        return code, self.stdout.text(), self.stderr.text()


def test_two_runs_with_one_metrics_port_both_run_and_the_second_says_where_it_serves(procs, tmp_path):
    """Two jobs on one node, both `rankwatch run --metrics-port P` (the Slurm example's default): the second
    used to exit 2 before launching. Now it serves the next free port, says which on stderr and in a file_sd
    file, and both jobs run to their end with exit 0."""
    port = free_port()
    first = Run(procs, tmp_path, "job-a", "--quiet", "--metrics-port", str(port))
    assert wait_for(lambda: healthz_polls(port) is not None or first.proc.poll() is not None, 120)
    assert first.proc.poll() is None, first.finish()
    # the server answers as soon as it is bound; the file naming it is written right after
    assert wait_for(lambda: (first.out / "metrics-target.json").exists(), 30)
    assert json.loads((first.out / "metrics-target.json").read_text()) == [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"rankwatch_run": "job-a"}}]

    second = Run(procs, tmp_path, "job-b", "--quiet", "--metrics-port", str(port))
    line = second.stderr.wait_for("rankwatch run: warning: metrics port", timeout=120)
    assert line is not None, second.stderr.lines
    m = MOVED.match(line.rstrip("\n"))
    assert m is not None, line
    asked, got, target_file = int(m.group(1)), int(m.group(2)), Path(m.group(3))
    assert asked == port and port < got < port + 16 and target_file == second.out / "metrics-target.json", line
    assert json.loads(target_file.read_text()) == [
        {"targets": [f"127.0.0.1:{got}"], "labels": {"rankwatch_run": "job-b"}}]
    # each endpoint is its own run's: job-b's rank on the port it moved to, job-a's on the one asked for
    assert wait_for(lambda: 'job_id="job-b"' in (_scrape(got) or ""), 120), _scrape(got)
    assert 'job_id="job-a"' not in (_scrape(got) or "")
    assert wait_for(lambda: 'job_id="job-a"' in (_scrape(port) or ""), 120)

    (tmp_path / "gate").touch()
    code_a, _, stderr_a = first.finish()
    code_b, _, stderr_b = second.finish()
    assert (code_a, code_b) == (0, 0), (stderr_a[-2000:], stderr_b[-2000:])
    assert "warning" not in stderr_a, stderr_a
    assert stderr_b.count("rankwatch run: warning:") == 1, stderr_b
    for run in (first, second):
        assert json.loads((run.out / "summary.json").read_text())["incidents"] == []
        # the run is over: a target still listed would be scraped as down
        assert not (run.out / "metrics-target.json").exists()
    assert _scrape(port) is None and _scrape(got) is None


def test_a_taken_metrics_port_an_unreachable_store_and_a_dead_webhook_never_fail_the_run(procs, tmp_path):
    """A job that stalls once and recovers, under a run whose metrics port is held by another program, whose
    store port is held too (this node would host the store: it cannot) and whose webhook refuses every
    connection: the job runs to exit 0, the incident is decided and bundled locally and says why, the
    webhook's failures are logged and nothing else."""
    metrics, store = _listening(), _listening()
    hook = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens there: every POST is refused
    with metrics, store:
        m_port, s_port = metrics.getsockname()[1], store.getsockname()[1]
        run = Run(procs, tmp_path, "job-c", "--metrics-port", str(m_port), "--store", f"127.0.0.1:{s_port}",
                  "--notify", hook, "--stall-timeout", "2", "--on-stall", "report", "--json-logs",
                  "--log-level", "warning", pause=True)
        moved = run.stderr.wait_for("rankwatch run: warning: metrics port", timeout=120)
        m = MOVED.match((moved or "").rstrip("\n"))
        assert m is not None and int(m.group(1)) == m_port, run.stderr.lines
        got = int(m.group(2))
        assert wait_for(lambda: bundle_dirs(run.out / "incidents"), 180), run.stderr.lines[-20:]
        assert wait_for(lambda: "rankwatch_open_incidents 1" in (_scrape(got) or ""), 60), _scrape(got)
        (tmp_path / "resume").touch()
        (tmp_path / "gate").touch()
        code, stdout, stderr = run.finish()
    assert code == 0, stderr[-3000:]
    (bundle,) = bundle_dirs(run.out / "incidents")
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert any(i["kind"] == DecidedLocally.KIND and i["why"] == STORE_UNREACHABLE
               for i in verdict["evidence_items"]), verdict.get("evidence_items")
    assert f"bundle: {bundle}" in stdout  # the verdict was printed as it happened
    events = [json.loads(ln) for ln in stderr.splitlines() if ln.startswith("{")]
    assert any(e["event"] == "store_unreachable" for e in events), stderr[-3000:]
    assert any(e["event"] == "notify_failed" for e in events), stderr[-3000:]
    assert "Traceback" not in stderr
    warnings = [ln for ln in stderr.splitlines() if ln.startswith("rankwatch run: warning:")]
    assert len(warnings) == 1, warnings
    assert json.loads((run.out / "summary.json").read_text())["incidents"], stdout


def test_the_daemon_watches_on_while_its_metrics_port_is_taken_and_serves_once_it_is_free(procs, tmp_path):
    """The daemon keeps its fixed port (scrape configs and liveness probes name it) but never stops for it:
    one warning, the jobs stay watched, and /metrics comes back on that port once the other program lets go."""
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    held = _listening()
    port = held.getsockname()[1]
    once = subprocess.run(rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(out), "--once",
                                        "--json-logs", "--metrics-port", str(port)),
                          capture_output=True, text=True, timeout=120)
    assert once.returncode == 0, once.stderr
    assert [json.loads(ln)["event"] for ln in once.stderr.splitlines()].count("metrics_unavailable") == 1

    daemon = start_daemon(procs, shm, out, "--metrics-port", str(port))
    log = LineReader(daemon.stderr)
    try:
        line = log.wait_for('"metrics_unavailable"', timeout=120)
        assert line is not None and "Address already in use" in line and f":{port}" in line, log.lines[-10:]
        assert log.wait_for('"daemon_start"', timeout=60), log.lines[-10:]
        held.close()  # the other program lets go of the port
        # the daemon's retry (MetricsPolicy.daemon_retry_s) takes it back: its own polls, counted since its start
        assert wait_for(lambda: (healthz_polls(port) or 0) > 1, 120), log.lines[-10:]
        assert log.wait_for('"metrics_available_again"', timeout=10)
        assert daemon.poll() is None
    finally:
        held.close()
        stop_daemon(daemon, log)
