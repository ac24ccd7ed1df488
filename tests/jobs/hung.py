"""Start ``plain_ddp.py`` under plain torchrun and wait until its hang has set in (for tests and benchmarks).

"Set in" is observed, never slept for: the fault rank wrote its ``fault`` mark, every rank wrote the mark of
the step where it will wait, and every other rank's CPU time has stopped moving (it sleeps in a wait).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

JOB = str(Path(__file__).resolve().parent / "plain_ddp.py")
# the step where the others wait: the next one's backward for a hang after the step's last collective
WAIT_STEP_OFFSET = {"between-phases-hang": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_cmd(nproc: int, run_id: str, *job_args: str, nnodes: int = 1, node_rank: int = 0,
                 master_port: int | None = None, monitor_interval: float = 0.2) -> list[str]:
    if nnodes == 1:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id]
    else:
        rdzv = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--master-addr=127.0.0.1",
                f"--master-port={master_port}", "--rdzv-id", run_id]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval",
            str(monitor_interval), *rdzv, JOB, *job_args]


def cpu_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := pred()):
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def rank_pids(mark_dir: Path, world: int) -> dict[int, int]:
    """Each rank's pid, from the step-0 mark it wrote."""
    out = {}
    for r in range(world):
        p = mark_dir / f"rank-{r}.step-0"
        if p.exists() and (text := p.read_text().strip()).isdigit():
            out[r] = int(text)
    return out


def wait_hung(mark_dir: Path, world: int, fault: str, fault_rank: int, fault_step: int, timeout: float,
              proc: subprocess.Popen | None = None) -> dict[int, int]:
    """Block until the job hangs as ``fault`` makes it; returns rank -> pid."""
    def alive() -> None:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"torchrun ended (exit {proc.returncode}) before the hang set in")

    def faulted() -> bool:
        alive()
        return (mark_dir / "fault").exists()

    wait_until(faulted, timeout, f"rank {fault_rank} to fault ({fault})")
    step = fault_step + WAIT_STEP_OFFSET.get(fault, 0)
    others = [r for r in range(world) if r != fault_rank]
    wait_until(lambda: all((mark_dir / f"rank-{r}.step-{step}").exists() for r in others), timeout,
               f"ranks {others} to reach step {step}")
    pids = rank_pids(mark_dir, world)
    last: dict[int, int | None] = {}
    quiet = 0

    def settled() -> bool:
        nonlocal last, quiet
        alive()
        now = {r: cpu_ticks(pids[r]) for r in others}
        quiet = quiet + 1 if now == last else 0
        last = now
        return quiet >= 3  # CPU time unchanged over three reads: each one sleeps in its wait

    wait_until(settled, timeout, f"ranks {others} to block", interval=0.3)
    return pids


def kill_job(proc: subprocess.Popen) -> None:
    """The torchrun agent and every rank it started (they run in their own sessions), by pid."""
    import psutil

    try:
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        family = [proc.pid]
    for pid in family:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped rank is resumed so that it dies
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
