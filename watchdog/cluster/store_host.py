"""The job store a `rankwatch daemon` offers its jobs, hosted in a process of its own, never in the daemon's.

A TCPStore has no authentication and no limits on keys, value sizes or connections: hosted inside the root
daemon, any local user could grow root's memory and file descriptors without bound (200 × 8 MiB values and a
few thousand idle connections left the daemon at 1.8 GiB and out of fds, no new job discovered). So the
daemon decides from its own configuration only (``--store-port``), at start and never from a job's
``job.json``, to run this host beside it, and the host runs:

* as an unprivileged user (``nobody`` when started by root): what it holds is any user's anyway;
* under ``RLIMIT_NOFILE`` (``StoreHostPolicy.max_fds``): the connections it accepts are bounded;
* under ``RLIMIT_AS`` of its start-up footprint plus ``StoreHostPolicy.memory_bytes``: a client whose value
  would pass it gets its connection dropped (torch's server survives the failed allocation), so what the
  store holds — and therefore the largest value any daemon can ever read from it — is bounded;
* with the parent-death signal set: it never outlives its daemon, which restarts it if it exits.

Run as ``python -m rankwatch.watchdog.cluster.store_host --port PORT`` (the daemon does this).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import structlog

log = structlog.get_logger("rankwatch.store_host")


@dataclass(frozen=True)
class StoreHostPolicy:
    """Limits of the store host process (each applies to the host, never to the daemon)."""

    # bytes the store may hold beyond its start-up footprint: a node snapshot of 4,096 ranks is ~2 MiB and a
    # job has one per node plus one evidence value per node and incident (4 MiB at most each), so 256 MiB
    # keeps dozens of large multi-node jobs; beyond it a writer's connection is dropped, the host lives on
    memory_bytes: int = 256 << 20
    # file descriptors, i.e. connections: two per node daemon and job (the polls and the waits), one per
    # `rankwatch inspect`; 1,024 is 256 multi-node jobs' worth on one leader node
    max_fds: int = 1024
    # the daemon restarts a host that exited after this long, doubling up to ``restart_max_s`` while it
    # keeps exiting (a port another process took would otherwise be retried in a tight loop)
    restart_s: float = 1.0
    restart_max_s: float = 60.0
    # the host signals it is listening within this long (a torch import on a loaded node takes seconds)
    start_timeout_s: float = 120.0
    user: str = "nobody"


def _drop_privileges(user: str) -> None:
    if os.geteuid() != 0:
        return
    import pwd

    try:
        pw = pwd.getpwnam(user)
        uid, gid = pw.pw_uid, pw.pw_gid
    except KeyError:
        uid = gid = 65534  # nobody/nogroup where the name is missing (minimal containers)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(port: int, policy: StoreHostPolicy) -> int:
    """The host process: limits first, then the server, then the memory cap over what it started with."""
    _die_with_parent()
    # torch is loaded first (root's interpreter may live where ``nobody`` cannot read), nothing else runs
    # as root: the server, every connection and every value are handled after the privileges are gone
    import torch.distributed as dist

    _drop_privileges(policy.user)
    resource.setrlimit(resource.RLIMIT_NOFILE, (policy.max_fds, policy.max_fds))

    # every node's daemon connects here: the store listens on all interfaces, as torchrun's own does
    store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, use_libuv=True,  # noqa: S104
                          timeout=datetime.timedelta(seconds=30))
    with open("/proc/self/statm") as f:
        vsz = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = vsz + policy.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    print(f"ready {port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    del store
    return 0


class StoreHost:
    """The daemon's side: starts the host, restarts it when it exits, stops it with the daemon."""

    def __init__(self, port: int, policy: StoreHostPolicy | None = None) -> None:
        self.port = port
        self.policy = policy or StoreHostPolicy()
        self.proc: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._supervise, name="rankwatch-store-host", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _spawn(self) -> subprocess.Popen[str] | None:
        cmd = [sys.executable, "-m", "rankwatch.watchdog.cluster.store_host", "--port", str(self.port),
               "--memory-mib", str(self.policy.memory_bytes >> 20), "--max-fds", str(self.policy.max_fds),
               "--user", self.policy.user]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, close_fds=True, start_new_session=True)
        except OSError as exc:
            log.warning("store_host_failed", port=self.port, error=str(exc))
            return None
        with self._lock:
            self.proc = proc
        return proc

    def _supervise(self) -> None:
        delay = self.policy.restart_s
        while not self._stop.is_set():
            proc = self._spawn()
            if proc is None:
                self._stop.wait(delay)
                delay = min(delay * 2, self.policy.restart_max_s)
                continue
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            started = time.monotonic()
            if line.startswith("ready"):
                log.info("store_host_started", port=self.port, pid=proc.pid, user=self.policy.user,
                         memory_mib=self.policy.memory_bytes >> 20, max_fds=self.policy.max_fds)
            err = ""
            while chunk := proc.stderr.read(4096):  # until it exits; only its tail is kept
                err = (err + chunk)[-4096:]  # (any client can make torch's server print warnings)
            code = proc.wait()
            if self._stop.is_set():
                return
            log.warning("store_host_exited", port=self.port, pid=proc.pid, exit_code=code,
                        error=err.strip().splitlines()[-1][:300] if err.strip() else None, restart_in_s=delay)
            if time.monotonic() - started > self.policy.restart_max_s:
                delay = self.policy.restart_s  # it ran a good while: a fresh failure, not a crash loop
            self._stop.wait(delay)
            delay = min(delay * 2, self.policy.restart_max_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        self._thread.join(timeout=timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rankwatch store host")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--memory-mib", type=int, default=StoreHostPolicy.memory_bytes >> 20)
    p.add_argument("--max-fds", type=int, default=StoreHostPolicy.max_fds)
    p.add_argument("--user", default=StoreHostPolicy.user)
    args = p.parse_args(argv)
    return serve(args.port, StoreHostPolicy(memory_bytes=args.memory_mib << 20, max_fds=args.max_fds, user=args.user))


if __name__ == "__main__":
    sys.exit(main())
