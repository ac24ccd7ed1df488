"""Shared helpers for the benchmarks: bounded child processes that are always cleaned up, torchrun
command lines on loopback, and small statistics. Not a benchmark itself."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import psutil

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "examples" / "ddp_demo.py")


def examples_module(name: str) -> ModuleType:
    """``examples/<name>.py`` (``fault_catalogue``: the faults and their right answers), loaded by its path under
    its own name, once per process: the demos' ranks import it by that name beside them, and this process gets
    the same module. Not by putting ``examples/`` on ``sys.path``: its folders (``kubernetes``, ``prometheus``…)
    would then import as namespace packages where the real one is missing."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while a class is made
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_args(nproc: int, run_id: str, *script: str) -> list[str]:
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id]
    return ["--nproc-per-node", str(nproc), "--monitor-interval", "0.2", *rdzv, *script]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def rankwatch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rankwatch.watchdog.cli", *args]


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill the process, its group and every descendant (torchrun puts ranks in their own sessions)."""
    try:
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        family = [proc.pid]
    for pid in family:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Procs:
    """Starts children in new sessions; ``cleanup()`` (also on exit via ``with``) kills every tree."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Procs:
        # a SIGTERM (the quick-run test's timeout, a user's kill) unwinds through __exit__: no job outlives us
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def start(self, cmd: list[str], **kw) -> subprocess.Popen:  # type: ignore[no-untyped-def]
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        proc = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
        proc = self.start(cmd, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            out, err = proc.communicate()
            raise RuntimeError(f"timed out after {timeout}s: {cmd}\nstdout:\n{out}\nstderr:\n{err}") from None
        finally:
            kill_tree(proc)  # stragglers left behind by a finished launcher
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_tree(proc)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        self.procs.clear()


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def spread(xs: Sequence[float]) -> str:
    """min–max as text, for the notes."""
    return f"{min(xs):.4g}–{max(xs):.4g}"


def print_results(rows: Sequence[str], raw: object, json_path: Path | None) -> int:
    """The benchmark's results table on stdout (and its raw data as JSON when asked); the exit code."""
    if json_path:
        json_path.write_text(json.dumps(raw, indent=1))
    print("\n| what | median | target | met? |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0
