"""What `rankwatch run` prints and leaves behind, as a person at a terminal meets it: the verdict comes
last (after torchrun's own report, also after Ctrl-C), once with its why and where the initiating rank
stands in the user's code; a launch that cannot work is one line and a non-zero exit, not an empty
summary; nothing of the job stays in the shm dir."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import DEMO, REPO, Procs, bundle_dirs, free_port, rankwatch_cmd, torchrun_args

WHY = re.compile(r"^\s*why: (.+)$", re.M)


def last_block(stdout: str) -> list[str]:
    """The lines from the last verdict headline to the end."""
    lines = stdout.rstrip("\n").splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.startswith("rankwatch: HANG") or ln.startswith("rankwatch: "))
    return lines[start:]


def assert_final_verdict(stdout: str, out: Path, rank: int) -> None:
    block = last_block(stdout)
    assert block[0].startswith(f"rankwatch: HANG — initiating rank {rank} in phase 'dataloader'"), block
    assert block[1].startswith("why: "), block
    why = block[1].removeprefix("why: ")
    assert sum(1 for w in WHY.findall(stdout) if w == why) <= 2, stdout
    assert stdout.count(why) <= 2, stdout  # not inside a note either
    (bundle,) = bundle_dirs(out / "incidents")
    at = next(ln for ln in block if ln.startswith(f"rank {rank} is at: "))
    # the first frame of the user's code (the demo's collate function), not threading's Condition.wait
    assert "SlowCollate.__call__" in at and "ddp_demo.py:" in at and "threading.py" not in at, at
    stack_file = at.split("whole stack: ", 1)[1]
    assert Path(stack_file) == bundle / "stacks" / f"rank-{rank}.txt" and Path(stack_file).is_file()
    assert block[-1].startswith(f"bundle: {bundle}"), block
    assert "<g>" not in stdout


def assert_no_job_files(shm: Path, job: str) -> None:
    left = sorted(os.listdir(shm / job)) if (shm / job).exists() else []
    assert left == [], left


# The verdict as the last thing printed after torchrun's report (its "Root Cause" explained in one note, the why
# once, the initiating rank's place in the user's code, no job files left) is asserted on the input-hang jobs
# of test_watchdog_e2e.py::test_fault_is_attributed_to_the_injected_rank: the same `rankwatch run --quiet
# --on-stall kill` around the same demo, one job fewer. Below, the same words after Ctrl-C at a terminal.


def _read_until(fd: int, seen: bytearray, done, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # EIO once every writer is gone
                time.sleep(0.05)
    return bool(done())


@pytest.mark.slow
def test_after_ctrl_c_at_a_terminal_the_verdict_still_comes_last(tmp_path):
    out, shm = tmp_path / "out", tmp_path / "shm"
    job = "ctrl-c"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--quiet", "--stall-timeout", "3", "--",
                        *torchrun_args(2, job, DEMO, "--scenario", "input-hang", "--fault-rank", "0",
                                       "--fault-step", "4", "--steps", "400"))
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(REPO)
        os.execv(sys.executable, cmd)
    seen = bytearray()
    exited: list[int] = []

    def reaped() -> bool:
        if not exited:
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                exited.append(os.waitstatus_to_exitcode(code))
        return bool(exited)

    try:
        assert _read_until(fd, seen, lambda: b"bundle: " in seen, 240), bytes(seen[-3000:])
        os.write(fd, b"\x03")  # Ctrl-C: SIGINT to the terminal's foreground group (rankwatch, torchrun, ranks)
        assert _read_until(fd, seen, reaped, 120), bytes(seen[-3000:])
    finally:
        Procs.kill(SimpleNamespace(pid=pid))  # and every descendant still there (ranks have their own sessions)
        if not exited:
            os.waitpid(pid, 0)
        os.close(fd)
    text = seen.decode("utf-8", "replace").replace("\r\n", "\n")
    assert exited[0] != 0
    assert "Traceback" not in text.split("rankwatch summary")[-1]
    assert_final_verdict(text, out, 0)
    # a Root Cause note only where torchrun printed one
    assert ("note: torchrun's 'Root Cause" in text) == ("Root Cause (first observed failure)" in text)
    assert_no_job_files(shm, job)


def _run(procs, tmp_path, *torchrun: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None,
         timeout: float = 120):
    out = tmp_path / "out"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(tmp_path / "shm"), *options, "--", *torchrun)
    started = time.monotonic()
    result = procs.run(cmd, timeout=timeout, text=True, env=env)
    return result, out, time.monotonic() - started


def _no_empty_summary(result, out: Path) -> None:
    assert "0 ranks" not in result.stdout and "worst rank" not in result.stdout, result.stdout
    assert not (out / "summary.json").exists()


def test_a_taken_rendezvous_port_is_one_line_before_anything_starts(procs, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result, out, _ = _run(procs, tmp_path, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", f"127.0.0.1:{port}", DEMO)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port} is in use" in lines[0], result.stderr
    _no_empty_summary(result, out)


def _blocking_site(tmp_path: Path, code: str) -> dict[str, str]:
    """A sitecustomize for every Python the run starts (rankwatch, torchrun, the ranks)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def test_no_torch_for_the_ranks_interpreter_is_one_line(procs, tmp_path):
    # this venv has torch; an interpreter without it is what a fresh venv gives (torch not installable here)
    env = _blocking_site(tmp_path, "import sys\nsys.modules['torch'] = None\n")
    result, out, _ = _run(procs, tmp_path, "--nproc-per-node", "2", DEMO, env=env)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "torch is not importable by" in lines[0], result.stderr
    _no_empty_summary(result, out)


@pytest.mark.slow
def test_ranks_that_die_before_their_first_record_are_named_as_a_failed_launch(procs, tmp_path):
    env = _blocking_site(tmp_path, "import os\nif 'LOCAL_RANK' in os.environ:\n    os._exit(3)\n")
    result, out, _ = _run(procs, tmp_path, *torchrun_args(2, "die-early", DEMO), options=("--log-level", "warning"),
                          env=env)
    assert result.returncode != 0
    assert "nvml" not in result.stderr  # a CPU node (no NVIDIA device) is not warned about
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rankwatch run: torchrun exited with code") and "before any rank started" in last, last
    _no_empty_summary(result, out)
    assert_no_job_files(tmp_path / "shm", "die-early")


@pytest.mark.slow
def test_a_rendezvous_that_never_completes_stops_within_the_startup_timeout(procs, tmp_path):
    # two nodes expected, one started: torchrun would wait for the second for its whole rendezvous timeout
    port, store = free_port(), free_port()
    result, out, _ = _run(
        procs, tmp_path, "--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lonely", "--nproc-per-node", "1", DEMO,
        options=("--quiet", "--startup-timeout", "8", "--store", f"127.0.0.1:{store}"), timeout=180,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "no rank started within the startup timeout (8 s)" in last and "all 2 nodes started" in last, (
        f"exit {result.returncode}; stderr ends:\n{result.stderr[-2000:]}"
    )
    _no_empty_summary(result, out)


def test_a_torchrun_option_typo_is_refused_at_once_without_debug_noise(procs, tmp_path):
    result, out, _ = _run(procs, tmp_path, "--nproc-per-node", "2", "--no-such-option", "1", DEMO)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rankwatch run: torchrun has no option '--no-such-option' (torchrun --help lists them)"
    ]
    assert "[debug" not in result.stderr and not out.exists()


PACED = str(REPO / "tests" / "procs" / "paced_job.py")


def _paced(procs, tmp_path, scenario: str, job: str):
    result, out, _ = _run(procs, tmp_path, *torchrun_args(2, job, PACED, "--scenario", scenario),
                          options=("--quiet",), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_rank_slower_in_every_phase_is_named_a_rank_wide_straggler(procs, tmp_path):
    result, summary = _paced(procs, tmp_path, "rank-wide", "wide")
    assert (summary["diagnosis"], summary["straggler_ranks"]) == ("RANK-WIDE STRAGGLER", [1]), summary["why"]
    # each phase alone is below the threshold: the time lost is summed over them
    assert "s lost over" in summary["why"] and "slower across the phases" in summary["why"]
    assert "diagnosis: RANK-WIDE STRAGGLER — rank 1" in result.stdout


@pytest.mark.slow
def test_a_declared_checkpoint_is_reported_as_itself_not_as_communication(procs, tmp_path):
    result, summary = _paced(procs, tmp_path, "checkpoint", "ckpt")
    assert (summary["diagnosis"], summary["phase"]) == ("DECLARED-PHASE-BOUND", "checkpoint"), summary["why"]
    assert "the declared phase 'checkpoint'" in summary["why"] and "on rank 0" in summary["why"]
    assert "COMMUNICATION" not in result.stdout


@pytest.mark.slow
def test_the_same_error_on_every_rank_names_nobody(procs, tmp_path):
    script = tmp_path / "broken.py"
    # every rank raises at the same moment (a file barrier): ranks that start seconds apart on a busy host
    # would otherwise let torchrun tear the late one down before it reaches the error, a different job
    gate = tmp_path / "gate"
    gate.mkdir()
    script.write_text(
        "import os, time\n"
        f"gate = {str(gate)!r}\n"
        "open(os.path.join(gate, os.environ['RANK']), 'w').close()\n"
        "while len(os.listdir(gate)) < int(os.environ['WORLD_SIZE']):\n"
        "    time.sleep(0.002)\n"
        "raise ValueError('bad config: lr must be > 0')\n"
    )
    result, out, _ = _run(procs, tmp_path, *torchrun_args(2, "same-error", str(script)), options=("--quiet",))
    assert result.returncode != 0
    (bundle,) = bundle_dirs(out / "incidents")
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["initiating_ranks"] == [] and verdict["kind"] == "dead_rank", verdict
    assert "every rank (2) exited with the same error (ValueError: bad config" in verdict["reason"]
    assert "initiating no single rank" in last_block(result.stdout)[0]
