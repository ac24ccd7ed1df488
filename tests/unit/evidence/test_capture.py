"""Capture plumbing: where py-spy is found, and the dump responder's socket protocol from both ends."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import alive, wait_for
from rankwatch.hooks.responder import DumpResponder, ctl_path
from rankwatch.watchdog.evidence import capture
from rankwatch.watchdog.evidence.capture import DumpRequest, RankCapture, collect_dump, request_dump


# -- py-spy lookup ----------------------------------------------------------------------------------------
def fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_pyspy_is_found_next_to_the_python_first_then_on_path(tmp_path, monkeypatch):
    venv_python = tmp_path / "venv" / "bin" / "python"
    fake_exe(venv_python)
    on_path = fake_exe(tmp_path / "path" / "py-spy")
    monkeypatch.setattr(sys, "executable", str(venv_python))
    monkeypatch.setenv("PATH", str(on_path.parent))
    # systemd's PATH has no venv bin: PATH alone would find another py-spy (or none)
    assert capture.pyspy_available() == str(on_path)
    beside = fake_exe(tmp_path / "venv" / "bin" / "py-spy")
    assert capture.pyspy_available() == str(beside)
    beside.chmod(0o644)  # not executable: ignored
    assert capture.pyspy_available() == str(on_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert capture.pyspy_available() is None
    assert capture.run_pyspy(capture.pyspy_available(), 1, 1.0, False, False, 1 << 20) == (None, "py-spy not installed")


# -- the responder protocol -------------------------------------------------------------------------------
@pytest.fixture
def job_dir(tmp_path):
    d = tmp_path / "job"
    d.mkdir(mode=0o700)
    return d


def test_request_and_collect_over_the_socket(job_dir):
    responder = DumpResponder(str(job_dir), 3)
    responder.start()
    try:
        st = os.lstat(ctl_path(str(job_dir), 3))
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666  # the 0700 dir is the gate
        req = request_dump(str(job_dir), 3, "tok", os.getpid())
        assert isinstance(req, DumpRequest), req
        cap = RankCapture(rank=3, pid=os.getpid())
        collect_dump(req, time.monotonic() + 10, cap)
        assert cap.responder_error is None
        assert cap.responder_stacks["pid"] == os.getpid() and cap.responder_stacks["rank"] == 3
        assert any(t["thread_name"] == "MainThread" for t in cap.responder_stacks["threads"])
        assert cap.fr_json is None and cap.notes and cap.notes[0].startswith("flight recorder: ")
        assert sorted(os.listdir(job_dir)) == ["rank-3.ctl"]  # nothing written for the daemon to read
    finally:
        responder.close()
    assert not os.path.exists(ctl_path(str(job_dir), 3))  # close removes its own socket
    assert request_dump(str(job_dir), 3, "tok") == "dump responder not listening (no control socket)"


def test_a_stale_socket_is_not_listening(job_dir):
    path = ctl_path(str(job_dir), 0)
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()  # bound, never listening: what a killed rank leaves
    assert request_dump(str(job_dir), 0, "tok") == "dump responder not listening"


def test_a_symlink_or_a_fifo_is_never_connected_to(job_dir, tmp_path):
    other = tmp_path / "other.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(other))
    srv.listen(1)
    try:
        os.symlink(other, ctl_path(str(job_dir), 0))
        assert "not a socket" in str(request_dump(str(job_dir), 0, "tok"))
        os.mkfifo(ctl_path(str(job_dir), 1))  # a hook older than this watchdog
        assert "not a socket" in str(request_dump(str(job_dir), 1, "tok"))
    finally:
        srv.close()


def test_sockets_in_deep_job_dirs_still_work(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    assert len(ctl_path(str(deep), 0)) > 108
    responder = DumpResponder(str(deep), 0)
    responder.start()
    try:
        req = request_dump(str(deep), 0, "tok", os.getpid())
        assert isinstance(req, DumpRequest), req
        cap = RankCapture(rank=0, pid=os.getpid())
        collect_dump(req, time.monotonic() + 10, cap)
        assert cap.responder_error is None and cap.responder_stacks
    finally:
        responder.close()


def fake_responder(job_dir: Path, reply: bytes, hold_s: float = 0.0) -> threading.Thread:
    """A listener that answers every request with ``reply`` (malformed, oversized, or never finished)."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(ctl_path(str(job_dir), 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(256)
        conn.sendall(reply)
        time.sleep(hold_s)
        conn.close()
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    ("reply", "hold_s", "error"),
    [
        (b"garbage\n", 0.0, "malformed answer"),
        (b"stacks 999999999999\n", 0.0, "answer too large"),
        (b"stacks 2\n{}", 3.0, "stacks but not the flight recorder in time"),  # then nothing, no done frame
        (b"stacks 10\n{}", 0.0, "did not answer in time"),  # closed mid-frame
    ],
)
def test_bad_answers_are_bounded_and_reported(job_dir, reply, hold_s, error):
    t = fake_responder(job_dir, reply, hold_s)
    req = request_dump(str(job_dir), 0, "tok", os.getpid())  # the listener is this process
    assert isinstance(req, DumpRequest), req
    cap = RankCapture(rank=0, pid=os.getpid())
    t0 = time.monotonic()
    collect_dump(req, time.monotonic() + 1.0, cap)
    assert time.monotonic() - t0 < 2.5
    assert error in str(cap.responder_error)
    t.join(5)


def test_a_peer_that_is_not_the_rank_is_refused(job_dir):
    responder = DumpResponder(str(job_dir), 0)
    responder.start()
    try:
        assert "not by the rank" in str(request_dump(str(job_dir), 0, "tok", os.getpid() + 1))
        assert responder.allowed(0) and responder.allowed(os.geteuid()) and not responder.allowed(54321)
    finally:
        responder.close()


# -- a rank whose GIL is held by a C call --------------------------------------------------------------
HOLDER = """
import ctypes, sys, time
from rankwatch.hooks.responder import DumpResponder
r = DumpResponder(sys.argv[1], 0)
r.start()
print("ready", flush=True)
if sys.argv[2] == "gil":
    ctypes.PyDLL(None).sleep(60)  # PyDLL keeps the GIL through the call: no other thread runs
else:
    while True:  # a Python loop holds the GIL too, but yields it every switch interval
        pass
"""


@pytest.mark.skipif(capture.pyspy_available() is None, reason="py-spy not installed")
@pytest.mark.parametrize("mode", ["gil", "loop"])
def test_a_gil_held_in_a_c_call_does_not_hold_up_the_capture(job_dir, procs, mode):
    proc = procs.start([sys.executable, "-c", HOLDER, str(job_dir), mode], text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # let the child reach the C call / the loop
    # a responder timeout far longer than the test may take: waiting it out would show
    policy = capture.CapturePolicy(responder_timeout_s=120.0)
    t0 = time.monotonic()
    cap = capture._capture_one(0, proc.pid, False, str(job_dir), "tok", policy)
    took = time.monotonic() - t0
    assert cap.pyspy_threads, cap.pyspy_error
    if mode == "gil":
        # py-spy's stack stands; the responder, which cannot run, is not waited for
        assert cap.responder_stacks is None and "holds the GIL in a C call" in str(cap.responder_error)
        assert took < 60
    else:
        # the normal case keeps the responder's answer
        assert cap.responder_error is None and cap.responder_stacks["pid"] == proc.pid
        assert "GIL" not in " ".join(cap.notes)


# -- nothing a capture started outlives it (issue 42) ------------------------------------------------------
# A py-spy that is really a wrapper script: it records its pid, starts a child that lives on (holding the
# pipes py-spy answers on), one more in a process group of its own (`set -m`: still in the session), then
# either hangs or answers and exits.
WRAPPER = """#!/bin/bash
echo $$ > {d}/wrapper.pid
sleep 300 &
echo $! > {d}/child.pid
set -m
sleep 300 < /dev/null > /dev/null 2>&1 &
echo $! > {d}/grouped.pid
set +m
{last}
"""
HANGS = "sleep 300"
ANSWERS = "echo '[]'; exit 0"


def _fake_pyspy_on_path(tmp_path: Path, monkeypatch, last: str) -> Path:
    """The wrapper as `py-spy` on PATH, nothing beside this Python: where the capture code looks it up."""
    d = tmp_path / "pids"
    d.mkdir()
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text(WRAPPER.format(d=d, last=last))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_exe(tmp_path / "venv" / "bin" / "python")))
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    assert capture.pyspy_available() == str(fake)
    return d


def _started(d: Path) -> dict[str, int]:
    pids = {name: int((d / f"{name}.pid").read_text()) for name in ("wrapper", "child", "grouped")
            if (d / f"{name}.pid").exists() and (d / f"{name}.pid").read_text().strip()}
    assert len(pids) == 3, f"the wrapper did not start its children within the capture's timeout: {pids}"
    return pids


def _kill_leftovers(d: Path) -> None:
    """Whatever a failing test leaves is not left to the next one."""
    for f in d.glob("*.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(f.read_text()), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["inspect", "reader"])
def test_a_capture_that_times_out_leaves_no_process_it_started(tmp_path, monkeypatch, path):
    """py-spy (a wrapper that forks, then hangs) is killed at the capture's timeout together with its child
    and a grandchild in a process group of its own: the capture's whole session goes."""
    d = _fake_pyspy_on_path(tmp_path, monkeypatch, HANGS)
    try:
        if path == "inspect":  # `rankwatch inspect`: py-spy run in this process
            threads, err = capture.pyspy_dump(os.getpid(), 3.0, nonblocking=False, include_locals=False)
        else:  # the daemon's reader (in-process where the daemon is not root), as a capture asks it
            from rankwatch.watchdog.privsep.readers import local_worker

            answer = local_worker().handle({"op": "pyspy", "pid": os.getpid(), "timeout_s": 3.0}, [])
            threads, err = answer["threads"], answer["error"]
        assert (threads, err) == (None, "py-spy timed out after 3.0s")
        pids = _started(d)
        assert wait_for(lambda: not any(alive(p) for p in pids.values()), 10), \
            {name: pid for name, pid in pids.items() if alive(pid)}
    finally:
        _kill_leftovers(d)


@pytest.mark.slow
def test_a_capture_that_answers_leaves_no_process_it_started_and_does_not_wait_for_them(tmp_path, monkeypatch):
    """A wrapper that answers and exits while its child still holds the pipes: the answer is taken when the
    wrapper exits (not when the child lets go of the pipes, here: the timeout), and the child goes with it."""
    d = _fake_pyspy_on_path(tmp_path, monkeypatch, ANSWERS)
    try:
        assert capture.pyspy_dump(os.getpid(), 60.0, nonblocking=False, include_locals=False) == ([], None)
        pids = _started(d)
        assert wait_for(lambda: not any(alive(p) for p in pids.values()), 10), \
            {name: pid for name, pid in pids.items() if alive(pid)}
    finally:
        _kill_leftovers(d)
