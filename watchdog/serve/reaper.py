"""Runs the ``--on-incident`` command so that nothing it starts outlives it, its timeout or the daemon.

    python -m rankwatch.watchdog.serve.reaper TIMEOUT_S -- CMD [ARGS...]

A process group or a session is not enough: a command may ``setsid`` (or double-fork) a child, which then
is in neither. This small process makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every
descendant that loses its parent is re-parented here, never to init, however it detached. When the
command exits, times out, or this process is told to stop (SIGTERM from the alerter; SIGTERM too through
``PR_SET_PDEATHSIG`` when the daemon thread that started it dies, even by SIGKILL), every descendant is
SIGKILLed and reaped until none is left. Exit status: the command's, 124 on its timeout, 143 when stopped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PARENT_ENV = "RANKWATCH_REAPER_PARENT"
SWEEP_S = 10.0  # killing and reaping every descendant: bounded even against a fork bomb


class _Stop(Exception):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stop


def _prctl(option: int, value: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0)) == 0


def _children() -> set[int]:
    """This process's children (re-parented orphans included), from every thread's children list."""
    me, kids = os.getpid(), set[int]()
    try:
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/children") as f:
                kids.update(int(p) for p in f.read().split())
    except OSError:  # no children file: find them by parent pid
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            kids.add(int(name))
                except (OSError, ValueError, IndexError):
                    continue
    return kids


def sweep() -> None:
    """SIGKILL every child and reap it; their children become ours and go in the next round."""
    end = time.monotonic() + SWEEP_S
    while time.monotonic() < end:
        for pid in _children():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            return  # nobody left
        time.sleep(0.005)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: reaper TIMEOUT_S -- CMD [ARGS...]", file=sys.stderr)
        return 2
    timeout_s, cmd = float(argv[0]), argv[2:]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    code = 143
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        parent = os.environ.pop(PARENT_ENV, "")
        if parent.isdigit() and os.getppid() != int(parent):
            return 143  # the daemon died before the death signal was armed
        proc = subprocess.Popen(cmd)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"rankwatch: --on-incident command timed out after {timeout_s:g}s", file=sys.stderr)
            code = 124
    except _Stop:
        code = 143
    except OSError as exc:
        print(f"rankwatch: --on-incident command could not start: {exc}", file=sys.stderr)
        code = 127
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the sweep finishes whatever arrives now
        sweep()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
