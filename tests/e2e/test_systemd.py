"""The systemd unit verifies, and the daemon speaks sd_notify on a real socket."""

from __future__ import annotations

import os
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


def unit_settings() -> dict[str, str]:
    out = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


# cheap hardening that leaves ptrace alone (README "Running as a systemd service" gives the score)
HARDENING = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "read-only", "PrivateTmp": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes", "ProtectClock": "yes", "ProtectHostname": "yes", "RestrictNamespaces": "yes",
    "RestrictSUIDSGID": "yes", "RestrictRealtime": "yes", "LockPersonality": "yes",
    "SystemCallArchitectures": "native", "UMask": "0077", "RestartPreventExitStatus": "2",
}


def test_unit_is_hardened_and_keeps_only_the_capabilities_it_needs():
    unit = unit_settings()
    for key, value in HARDENING.items():
        assert unit.get(key) == value, f"{key}={unit.get(key)!r}, expected {value!r}"
    # ptrace for py-spy, DAC_READ_SEARCH for other users' records and responder sockets, KILL for
    # --on-stall kill, SETUID/SETGID for the per-owner readers; never DAC_OVERRIDE (the responder answers
    # over its socket, nothing to write)
    wanted = {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"}
    assert set(unit["CapabilityBoundingSet"].split()) == wanted
    assert set(unit["AmbientCapabilities"].split()) <= wanted
    assert unit["ReadWritePaths"].lstrip("-") == "/dev/shm/rankwatch"
    assert unit["StateDirectory"] == "rankwatch"  # /var/lib/rankwatch, writable under ProtectSystem=strict
    # no private /dev or /proc view: the ranks' records, /proc/<pid> and NVML devices must stay visible
    for key in ("PrivateDevices", "ProtectProc", "ProcSubset", "PrivateUsers", "SystemCallFilter"):
        assert key not in unit


def test_tmpfiles_entry_creates_the_shared_shm_dir_root_owned_and_sticky(tmp_path):
    conf = REPO / "systemd" / "rankwatch-tmpfiles.conf"
    entries = [line.split() for line in conf.read_text().splitlines() if line and not line.startswith("#")]
    assert entries == [["d", "/dev/shm/rankwatch", "1777", "root", "root", "-"]]
    env = (REPO / "systemd" / "rankwatch.env").read_text()
    assert "RANKWATCH_SHM_DIR=/dev/shm/rankwatch\n" in env
    if shutil.which("systemd-tmpfiles") is None or os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles (as root) not available")
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    result = subprocess.run(["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(conf)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    st = (tmp_path / "dev" / "shm" / "rankwatch").stat()
    assert oct(st.st_mode & 0o7777) == "0o1777" and st.st_uid == 0


def test_daemon_sends_ready_and_watchdog_pings_to_notify_socket(procs, tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(30)
    env = {"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000", "PATH": "/usr/bin:/bin"}

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


def test_daemon_stops_on_sigterm_when_the_notify_socket_is_not_read(procs, tmp_path):
    """A manager that stops reading (hung, or under load) fills the socket's queue: the pings and the
    SIGTERM handler's STOPPING=1 must not wait on it — the daemon still stops (was: deaf to SIGTERM)."""
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(60)
    env = dict(os.environ, NOTIFY_SOCKET=sock_path, WATCHDOG_USEC="100000", PATH="/usr/bin:/bin")
    env.pop("WATCHDOG_PID", None)
    daemon = procs.start(
        rankwatch_cmd(
            "daemon", "--shm-dir", str(tmp_path / "shm"), "--out", str(tmp_path / "out"), "--poll-interval", "0.05"
        ),
        env=env,
    )
    try:
        assert sock.recv(4096).decode().startswith("READY=1")
        # nothing read from here on: at a ping every 50 ms the queue (net.unix.max_dgram_qlen, 10 by default)
        # is full after about half a second; wait until it certainly is, and the daemon still polls
        time.sleep(3)
        assert daemon.poll() is None
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=20)
    finally:
        sock.close()
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
