"""Opt-in cost of each test: ``RANKWATCH_TEST_CPU=FILE python -m pytest ...`` appends one JSON line per test
to FILE (wall seconds, CPU seconds of the worker itself and of every process the test started, how many of
those imported torch) and prints the most expensive tests at the end. The suite is CPU-bound on 2 cores, so
CPU seconds, not wall time, say what to cut.

How the children are counted: ``getrusage(RUSAGE_CHILDREN)`` on the worker, before and after the test,
counts every descendant the worker (or a process under it) reaped. A rank whose torchrun agent was killed
would be re-parented to init and lost, so the worker makes itself a child subreaper: orphans become its own
children, and after each test it reaps the zombies that no ``subprocess.Popen`` of its own waits for. Still
running orphans are reported as ``left`` (a test that leaks a process). torch imports are counted by
``tests/child_site/sitecustomize.py``, on PYTHONPATH of every child that inherits the environment."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import time
from pathlib import Path

import psutil
import pytest

_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class CpuMeasure:
    """The plugin: registered by tests/conftest.py when RANKWATCH_TEST_CPU names a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.worker = os.environ.get("PYTEST_XDIST_WORKER")
        self.popen_pids: set[int] = set()
        self.torch_log = Path(f"{self.path}.torch.{self.worker or 'main'}")

    # -- set-up ----------------------------------------------------------------------------------------
    def pytest_configure(self, config) -> None:
        if self.worker is None:  # the controller (or -n 0): a fresh file for this run
            self.path.write_text("")
        if self.worker is not None or getattr(config.option, "numprocesses", 0) in (0, None):
            self._instrument_this_process()

    def _instrument_this_process(self) -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        self.torch_log.write_text("")
        os.environ["RANKWATCH_TEST_TORCH_LOG"] = str(self.torch_log)
        pids = self.popen_pids
        original = subprocess.Popen._execute_child  # type: ignore[attr-defined]

        def recording(popen, *args, **kwargs):
            original(popen, *args, **kwargs)
            pids.add(popen.pid)

        subprocess.Popen._execute_child = recording  # type: ignore[attr-defined]

    # -- per test --------------------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        t0, self0, child0 = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        torch0 = self.torch_log.stat().st_size if self.torch_log.exists() else 0
        yield
        left = self._reap_orphans()
        row = {
            "test": item.nodeid,
            "worker": self.worker,
            "wall": round(time.monotonic() - t0, 2),
            "cpu_self": round(_cpu(resource.RUSAGE_SELF) - self0, 2),
            "cpu_children": round(_cpu(resource.RUSAGE_CHILDREN) - child0, 2),
            "torch": self._torch_since(torch0),
            "left": left,
        }
        row["cpu"] = round(row["cpu_self"] + row["cpu_children"], 2)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _torch_since(self, offset: int) -> int:
        try:
            with open(self.torch_log, "rb") as f:
                f.seek(offset)
                return f.read().count(b"\n")
        except OSError:
            return 0

    def _reap_orphans(self) -> list[str]:
        """Reap re-parented zombies (their CPU lands in RUSAGE_CHILDREN); name orphans still running."""
        left = []
        for child in psutil.Process().children():
            if child.pid in self.popen_pids:
                continue
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
                elif cmdline := child.cmdline():  # empty: a process being torn down right now
                    left.append(" ".join(cmdline)[:120])
            except (psutil.Error, ChildProcessError):
                pass
        return left

    # -- summary (controller or -n 0) ------------------------------------------------------------------
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.worker is not None or not self.path.exists():
            return
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        if not rows:
            return
        tr = terminalreporter
        tr.section(f"CPU per test (RANKWATCH_TEST_CPU={self.path})")
        tr.write_line(f"{len(rows)} tests: {sum(r['cpu'] for r in rows):.0f} s CPU, "
                      f"{sum(r['wall'] for r in rows):.0f} s wall summed over workers, "
                      f"{sum(r['torch'] for r in rows)} torch imports")
        tr.write_line(f"{'cpu s':>7} {'wall s':>7} {'torch':>5}  test")
        for r in sorted(rows, key=lambda r: -r["cpu"])[:25]:
            tr.write_line(f"{r['cpu']:7.1f} {r['wall']:7.1f} {r['torch']:5d}  {r['test']}")
        leaks = [r for r in rows if r["left"]]
        for r in leaks[:10]:
            tr.write_line(f"left running after {r['test']}: {r['left']}")
