"""The systemd unit verifies, and the daemon speaks sd_notify on a real socket."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, rankwatch_cmd
from rankwatch.watchdog.cli.daemon import env_defaults
from rankwatch.watchdog.errors import UserError

UNIT = REPO / "systemd" / "rankwatch.service"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    exe = shutil.which("rankwatch")
    assert exe, "rankwatch entry point not installed"
    unit = tmp_path / "rankwatch.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/rankwatch", exe))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = UNIT.read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "CAP_SYS_PTRACE" in text
    assert "SystemCallFilter" not in text  # py-spy needs ptrace/process_vm_readv (@debug)


def test_daemon_sends_ready_and_watchdog_pings_to_notify_socket(procs, tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(30)
    env = {"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000", "PATH": "/usr/bin:/bin"}
    import os

    env = dict(os.environ, **env)
    env.pop("WATCHDOG_PID", None)
    daemon = procs.start(
        rankwatch_cmd(
            "daemon", "--shm-dir", str(tmp_path / "shm"), "--out", str(tmp_path / "out"), "--poll-interval", "0.1"
        ),
        env=env,
    )
    messages: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and sum(m == "WATCHDOG=1" for m in messages) < 3:
            messages.append(sock.recv(4096).decode())
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        sock.close()
    assert messages[0].startswith("READY=1")
    assert f"MAINPID={daemon.pid}" in messages[0]
    assert sum(m == "WATCHDOG=1" for m in messages) >= 3
    assert daemon.returncode == 0


def test_environment_file_arguments_are_split_not_executed():
    assert env_defaults({"RANKWATCH_DAEMON_ARGS": "--stall-timeout 30 --on-stall 'report'"}) == [
        "--stall-timeout",
        "30",
        "--on-stall",
        "report",
    ]
    assert env_defaults({"RANKWATCH_DAEMON_ARGS": "$(touch /tmp/pwned)"}) == ["$(touch", "/tmp/pwned)"]
    with pytest.raises(UserError):
        env_defaults({"RANKWATCH_DAEMON_ARGS": "--out 'unterminated"})
    assert not Path("/tmp/pwned").exists()
