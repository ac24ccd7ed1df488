"""The incident pipeline runs off the poll loop: a slow capture neither silences the systemd heartbeat nor
blinds the daemon to the node's other jobs.

Real records (this test process writes and maps them), a real ``$NOTIFY_SOCKET`` datagram socket read the way
systemd reads it, the real ``Notifier`` and the real capture (py-spy of this process); only the capture is
made slow, as py-spy is on a rank wedged in the kernel or on a host under load.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import bundle_dirs, stalled_record, wait_for
from rankwatch.watchdog.core.evidence_items import PipelineFailed
from rankwatch.watchdog.core.policy import CapturePolicy, StallPolicy
from rankwatch.watchdog.evidence.capture import capture_all
from rankwatch.watchdog.observe.process import ProcessTable, read_stat
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig
from rankwatch.watchdog.serve.sdnotify import Notifier

WATCHDOG_SEC = 4.0
SLOW_CAPTURE_S = 2.5 * WATCHDOG_SEC  # far longer than systemd would wait for a heartbeat


class NotifyListener:
    """systemd's side of sd_notify: a datagram socket, every message timestamped as it arrives."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.messages.append((time.monotonic(), data.decode()))

    def pings(self) -> list[float]:
        return [t for t, m in self.messages if "WATCHDOG=1" in m]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.mark.slow  # py-spy on this live process, a 10 s capture
def test_heartbeat_and_other_jobs_survive_a_capture_longer_than_watchdog_sec(tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    listener = NotifyListener(tmp_path / "notify.sock")
    notifier = Notifier(
        {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": str(int(WATCHDOG_SEC * 1e6))}
    )
    capture_spans: dict[str, tuple[float, float]] = {}

    def slow_capture(targets, job_dir, token, policy):
        start = time.monotonic()
        job = os.path.basename(os.path.realpath(job_dir))  # the held dir fd, as /proc/self/fd/N/.
        if job == "slow":
            time.sleep(SLOW_CAPTURE_S)
        try:
            return capture_all(targets, job_dir, token, policy)
        finally:
            capture_spans[job] = (start, time.monotonic())

    ranks = [stalled_record(shm, "slow")]
    daemon = Daemon(
        DaemonConfig(
            shm_dir=str(shm),
            out_dir=str(out),
            poll_interval_s=0.2,
            stall=StallPolicy(timeout_s=1.0),
            capture=CapturePolicy(responder_timeout_s=0.5),
        ),
        capture=slow_capture,
        procs=ProcessTable(protected={1}),  # the records are this test process's own
    )
    loop = threading.Thread(target=daemon.run, kwargs={"heartbeat": notifier.ping}, daemon=True)
    loop.start()
    try:
        # the first incident's capture starts; while it runs, a second job appears and stalls
        assert wait_for(lambda: "slow" in daemon.jobs and daemon.jobs["slow"].incident is not None, timeout=30)
        ranks.append(stalled_record(shm, "other"))
        other = wait_for(lambda: bundle_dirs(out / "other" / "incidents"), timeout=30)
        assert other, "a second job's incident waited for the first job's capture"
        slow = wait_for(lambda: bundle_dirs(out / "slow" / "incidents"), timeout=SLOW_CAPTURE_S + 30)
        assert slow
    finally:
        daemon.stop()
        loop.join(timeout=30)
        daemon.close()
        listener.close()

    s_start, s_end = capture_spans["slow"]
    _, o_end = capture_spans["other"]
    assert s_end - s_start >= SLOW_CAPTURE_S
    assert s_start < o_end < s_end, "the other job's incident was handled during the slow capture"
    # systemd kills the unit when no WATCHDOG=1 arrives for WatchdogSec; the daemon pings every half of it
    pings = [t for t in listener.pings() if s_start - WATCHDOG_SEC / 2 <= t <= s_end + WATCHDOG_SEC / 2]
    assert len(pings) >= SLOW_CAPTURE_S / (WATCHDOG_SEC / 2) - 1, pings
    gaps = [b - a for a, b in zip([s_start, *pings], [*pings, s_end])]
    assert max(gaps) < WATCHDOG_SEC / 2 + 1.0, gaps
    for bundle in (slow[0], other[0]):
        verdict = json.loads((bundle / "verdict.json").read_text())
        assert (verdict["kind"], verdict["initiating_ranks"], verdict["phase"]) == ("hang", [0], "dataloader")
        assert verdict["trigger"]["kind"] == "stall"
        assert (bundle / "stacks" / "rank-0.json").exists()


def test_a_failing_stage_still_records_the_incident(tmp_path):
    """A capture that raises (a probe bug, a dying host) must not lose the incident or stop the loop."""
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    rank = stalled_record(shm, "j")  # noqa: F841 - keeps the record mapped
    seen: list[dict] = []

    def broken_capture(targets, job_dir, token, policy):
        raise RuntimeError("py-spy exploded")

    daemon = Daemon(
        DaemonConfig(shm_dir=str(shm), out_dir=str(out), poll_interval_s=0.2, stall=StallPolicy(timeout_s=1.0)),
        on_incident=lambda verdict, path: seen.append(verdict),
        capture=broken_capture,
        procs=ProcessTable(protected={1}),
    )
    try:
        daemon.poll_once()
        time.sleep(1.2)  # past the 1 s stall timeout
        daemon.poll_once()
        assert daemon.drain(30)
        entry = daemon.jobs["j"]
        assert len(entry.verdicts) == 1 and seen == entry.verdicts
        verdict = entry.verdicts[0]
        assert verdict["initiating_ranks"] == [0]
        assert {"kind": PipelineFailed.KIND, "error_type": "RuntimeError", "error": "py-spy exploded"} in (
            verdict["evidence_items"])
        assert entry.incident is not None and not entry.incident.pending
        bundle = bundle_dirs(out / "j" / "incidents")
        assert len(bundle) == 1 and json.loads((bundle[0] / "verdict.json").read_text()) == verdict
    finally:
        daemon.close()


def test_a_rank_that_dies_during_capture_is_not_reported_running(procs, tmp_path):
    """torchrun stops a dead rank's survivors within 0.2 s, often while their stacks are being captured: the
    bundle then says the rank is gone (a user reads "running" with no stack as a capture bug)."""
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="j", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    rank_py = Path(__file__).resolve().parents[2] / "procs" / "rank.py"
    rank = procs.start([sys.executable, str(rank_py), "--stall-after", "1"], env=env, text=True)
    assert rank.stdout.readline().startswith("ready"), rank.stderr.read()

    def capture_while_it_dies(targets, job_dir, token, policy):
        os.kill(rank.pid, signal.SIGKILL)  # as torchrun's SIGTERM lands between detection and py-spy
        assert wait_for(lambda: (st := read_stat(rank.pid)) is not None and st.state == "Z", timeout=30)
        try:
            return capture_all(targets, job_dir, token, policy)
        finally:
            # a loop busy on a loaded host: its next poll (which sees the death) comes after the capture
            threading.Timer(0.5, daemon.poll_once).start()

    daemon = Daemon(
        DaemonConfig(shm_dir=str(shm), out_dir=str(out), poll_interval_s=0.2, stall=StallPolicy(timeout_s=1.0),
                     capture=CapturePolicy(responder_timeout_s=0.5)),
        capture=capture_while_it_dies,
        procs=ProcessTable(protected={1}),
    )
    try:
        daemon.poll_once()
        assert wait_for(lambda: daemon.poll_once() or daemon.jobs["j"].incident is not None, timeout=30)
        assert daemon.drain(60)
        (bundle,) = bundle_dirs(out / "j" / "incidents")
    finally:
        daemon.close()
    verdict = json.loads((bundle / "verdict.json").read_text())
    stack = json.loads((bundle / "stacks" / "rank-0.json").read_text())
    assert verdict["ranks"]["0"]["state"] not in ("running", "stopped"), (verdict["ranks"], stack)
    assert stack["state"] == verdict["ranks"]["0"]["state"]
