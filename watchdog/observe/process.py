"""Process probes: liveness, state, CPU use and exact exit times of rank processes (psutil + pidfds).

Exit order matters for the verdict (the first rank to die started it), and a 0.5 s poll cannot order
exits that happen within milliseconds. A watcher thread blocks in ``poll()`` on one pidfd per rank and
timestamps each exit the moment the kernel reports it.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from dataclasses import dataclass

import psutil
import structlog

log = structlog.get_logger("rankwatch.probes.process")


@dataclass(frozen=True)
class ProcInfo:
    alive: bool
    status: str  # psutil status string, "gone" when the process no longer exists
    cpu_percent: float | None
    owns_record: bool | None  # the process maps the record file (None: cannot tell)


class ExitWatcher:
    """Timestamps (CLOCK_MONOTONIC ns) rank process exits as they happen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # fd -> pid
        self._exits: dict[int, int] = {}  # pid -> exit monotonic ns
        self._order: list[int] = []
        self._poller = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poller.register(self._wake_r, select.POLLIN)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rankwatch-exit-watcher", daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> bool:
        """Start watching; False when the pid is already gone (or pidfds are unavailable)."""
        with self._lock:
            if pid in self._fds.values() or pid in self._exits:
                return True
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return False
        with self._lock:
            self._fds[fd] = pid
            self._poller.register(fd, select.POLLIN)
        os.write(self._wake_w, b"x")
        return True

    def exit_ns(self, pid: int) -> int | None:
        with self._lock:
            return self._exits.get(pid)

    def exit_index(self, pid: int) -> int | None:
        with self._lock:
            return self._order.index(pid) if pid in self._order else None

    def forget(self, pid: int) -> None:
        with self._lock:
            self._exits.pop(pid, None)
            if pid in self._order:
                self._order.remove(pid)
            for fd, p in list(self._fds.items()):
                if p == pid:
                    self._close(fd)

    def _close(self, fd: int) -> None:
        self._fds.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._poller.unregister(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def _run(self) -> None:
        while not self._stop:
            try:
                events = self._poller.poll(1000)
            except InterruptedError:
                continue
            now = time.monotonic_ns()
            for fd, _ in events:
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    pid = self._fds.get(fd)
                    if pid is None:
                        continue
                    self._exits[pid] = now
                    self._order.append(pid)
                    self._close(fd)
                log.info("rank_process_exited", pid=pid)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for fd in list(self._fds):
                self._close(fd)


def maps_file(pid: int, path: str) -> bool | None:
    """Whether ``pid`` has ``path`` mapped: proves it is the record's writer, not a recycled pid."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            needle = os.path.realpath(path).encode()
            return any(needle in line for line in f)
    except FileNotFoundError:
        return False
    except OSError:
        return None


class ProcessProbe:
    """psutil-based state per pid; keeps Process objects so cpu_percent measures between polls."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._owner: dict[tuple[int, str], bool | None] = {}

    def probe(self, pid: int, record_path: str) -> ProcInfo:
        key = (pid, record_path)
        if key not in self._owner or self._owner[key] is None:
            self._owner[key] = maps_file(pid, record_path)
        owns = self._owner[key]
        if owns is False:
            # the pid is alive but belongs to something else: the record's writer is gone
            return ProcInfo(alive=False, status="gone", cpu_percent=None, owns_record=False)
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
                proc.cpu_percent(None)
            with proc.oneshot():
                status = proc.status()
                cpu = proc.cpu_percent(None)
        except psutil.NoSuchProcess:
            self._procs.pop(pid, None)
            return ProcInfo(alive=False, status="gone", cpu_percent=None, owns_record=owns)
        except psutil.Error as exc:
            log.warning("process_probe_failed", pid=pid, error=str(exc))
            return ProcInfo(alive=True, status="unknown", cpu_percent=None, owns_record=owns)
        return ProcInfo(alive=status != psutil.STATUS_ZOMBIE, status=status, cpu_percent=cpu, owns_record=owns)

    def forget(self, pid: int) -> None:
        self._procs.pop(pid, None)
        for key in [k for k in self._owner if k[0] == pid]:
            del self._owner[key]
