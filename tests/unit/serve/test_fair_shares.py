"""Per-owner shares of what the daemon keeps for everyone (issue 42): one user's volume drops only their own."""

from __future__ import annotations

import os
import subprocess
import sys

import structlog
from conftest import REPO, wait_for
from rankwatch.watchdog.observe.process import ProcessTable
from rankwatch.watchdog.serve.incident import admit


def owner(item: tuple[int, str]) -> int:
    return item[0]


def test_one_users_quick_incidents_on_a_full_disk_push_out_only_that_users_bundles():
    queue: list[tuple[int, str]] = [(1002, "victim")]
    lost = []
    for i in range(18):  # the 18 quick incidents of one user, each bundle refused by the disk
        lost += admit(queue, (1001, f"flood-{i}"), owner, per_owner=8, total=32)
    assert (1002, "victim") in queue
    assert [x for x in queue if x[0] == 1001] == [(1001, f"flood-{i}") for i in range(10, 18)]
    assert lost == [(1001, f"flood-{i}") for i in range(10)]


def test_a_full_queue_of_many_users_drops_from_whoever_holds_the_most():
    queue: list[tuple[int, str]] = []
    for uid in range(1000, 1004):
        for i in range(3):
            admit(queue, (uid, f"{uid}-{i}"), owner, per_owner=3, total=12)
    lost = admit(queue, (2000, "new"), owner, per_owner=3, total=12)
    assert lost == [(1000, "1000-0")] and (2000, "new") in queue and len(queue) == 12


def test_one_users_many_children_hold_only_that_users_share_of_pidfds(procs, tmp_path):
    """A rank with 6 children (DataLoader workers, say), its owner's share of descendant pidfds set to 4: 4 are
    tracked for --on-stall kill, the rest left (logged once), so one user's thousand children never take the
    fds another user's jobs need."""
    shm = tmp_path / "shm"
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="kids", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    rank = procs.start([sys.executable, str(REPO / "tests" / "procs" / "rank.py"), "--children", "6"], env=env,
                       text=True, stderr=subprocess.DEVNULL)
    assert rank.stdout.readline().startswith("ready")
    record = os.stat(shm / "kids" / "rank-0.hb")
    table = ProcessTable(protected={1})
    try:
        ident = table.verify(rank.pid, record.st_dev, record.st_ino, os.geteuid())
        assert not hasattr(ident, "reason"), ident
        table.descendants_per_owner = 4
        with structlog.testing.capture_logs() as logs:
            assert wait_for(lambda: table.track_descendants([ident]) >= 4, 30)
            assert table.track_descendants([ident]) == 4
        assert [e["event"] for e in logs].count("descendants_over_budget") == 1
    finally:
        table.close()
