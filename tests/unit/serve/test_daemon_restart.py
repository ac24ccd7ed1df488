"""One incident per hang across daemon restarts (issue 43, item 4): a `rankwatch daemon` restarted while a job
it already reported is still hung resumes that incident — no second bundle, no second firing alert — and the
resolved notice the first daemon's alert is owed still comes when the job ends.

Real processes: two hook-instrumented ranks without torch (``tests/procs/rank.py``) that stop making progress
in ``forward``, two successive real daemons, and a webhook receiver on loopback that counts what it is sent."""

from __future__ import annotations

import json
import signal

from conftest import LineReader, bundle_dirs, free_port, start_daemon, stop_daemon, wait_for, wait_polls
from test_alerts import Receiver
from test_safety import start_rank


def notices(receiver: Receiver) -> list[dict]:
    return [json.loads(body) for _, _, body in receiver.requests]


def test_a_daemon_restarted_mid_incident_resumes_it(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    hook = Receiver()
    try:
        ranks = [start_rank(procs, shm, "rs", r, 2, "--stall-after", "5") for r in (0, 1)]
        first = start_daemon(procs, shm, out, "--notify", hook.url)
        log1 = LineReader(first.stderr)
        assert log1.wait_for('"bundle_written"', timeout=120), log1.lines[-20:]
        assert wait_for(lambda: len(notices(hook)) == 1, timeout=60)
        state = out / "rs" / "state.json"

        def reported() -> bool:  # the first daemon's state file says which incident is open, and its bundle
            try:
                inc = json.loads(state.read_text())["open_incident"]
            except (OSError, ValueError, KeyError):
                return False
            return bool(inc and inc.get("bundle") and inc.get("notified"))

        assert wait_for(reported, timeout=60)
        stop_daemon(first, log1)

        port = free_port()
        second = start_daemon(procs, shm, out, "--notify", hook.url, "--metrics-port", str(port))
        log2 = LineReader(second.stderr)
        resumed = log2.wait_for('"incident_resumed"', timeout=60)
        assert resumed, log2.lines[-20:]
        wait_polls(port, more=6)  # it has looked at the hung job again and again since
        assert len(bundle_dirs(out / "rs" / "incidents")) == 1
        assert [n["status"] for n in notices(hook)] == ["firing"]
        incident = notices(hook)[0]["incident_id"]
        assert incident in resumed
        assert json.loads(state.read_text())["open_incident"]["incident_id"] == incident

        for r in ranks:  # the job ends: the alert that fired before the restart is resolved, once
            r.send_signal(signal.SIGKILL)
        assert wait_for(lambda: len(notices(hook)) == 2, timeout=90), log2.lines[-20:]
        last = notices(hook)[1]
        assert (last["status"], last["incident_id"]) == ("resolved", incident)
        stop_daemon(second, log2)
        assert len(notices(hook)) == 2 and len(bundle_dirs(out / "rs" / "incidents")) == 1
        assert '"incident_detected"' not in log2.text()
    finally:
        hook.close()
