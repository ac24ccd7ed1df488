"""A rank that ends between the poll's read of its record and its look at the process is judged on what it
wrote last: the crash mark its exception left, not "died, no mark" (seen in CI under load: a raised
exception's rank reported as killed, its message lost from the verdict and every alert).

Real pieces: a child process with the real hook writing a real record, the real ``JobWatch`` and
``ProcessTable``. The one thing the test arranges is the moment: the first time the watch asks about the
child's process, the child is told to raise, and the answer waits until it has become a zombie — the
widest form of the window a loaded host opens by chance."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import wait_for
from rankwatch.watchdog.observe.jobwatch import JobWatch
from rankwatch.watchdog.observe.process import Identity, ProcessTable, ProcInfo

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import sys, time
    import rankwatch.hooks as rw
    assert rw.init()
    for _ in range(3):
        with rw.phase("forward"):
            time.sleep(0.01)
        rw.step()
    print("ready", flush=True)
    sys.stdin.readline()
    with rw.phase("forward"):
        raise RuntimeError("boom in forward")
""")


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


class RaiseOnFirstLook(ProcessTable):
    """The real table; the first look at ``child`` is made after it raised and ended."""

    def __init__(self, child: subprocess.Popen) -> None:
        super().__init__(protected={1})
        self.child, self.fired = child, False

    def info(self, ident: Identity) -> ProcInfo:
        if not self.fired and ident.pid == self.child.pid:
            self.fired = True
            assert self.child.stdin is not None
            self.child.stdin.write("go\n")
            self.child.stdin.flush()
            assert wait_for(lambda: zombie(self.child.pid), timeout=30), "the child never ended"
        return super().info(ident)


def test_a_rank_that_ends_after_its_record_was_read_is_judged_on_its_crash_mark(procs, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="race", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", RANKWATCH_EXIT_DUMP="0")
    child = procs.start([sys.executable, "-c", CHILD], env=env, text=True, stdin=subprocess.PIPE)
    assert child.stdout.readline().startswith("ready"), child.stderr.read()
    table = RaiseOnFirstLook(child)
    watch = JobWatch(str(shm), "race", table)
    watch.refresh()
    assert watch.identities(), "the child's record was never proven to be its"
    started = time.monotonic()
    (view,) = watch.poll()
    assert table.fired, "the poll never looked at the process"
    assert view.state == "crashed", (view.state, view.exit_cause)
    assert view.exit_cause is not None and "boom in forward" in view.exit_cause, view
    assert view.step == 3 and time.monotonic() - started < 30
