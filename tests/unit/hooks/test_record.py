"""The shm record: round trip, seqlock under a concurrent writer process, rejection of bad files."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
from conftest import REPO, new_tracker
from rankwatch.hooks.record import (
    RECORD_SIZE,
    RING_STEPS,
    VERSION,
    RecordFormatError,
    RecordReader,
    read_record,
)
from rankwatch.hooks.tracker import Tracker


@pytest.fixture(autouse=True)
def _each_core(hook_impl):
    """Every case here runs on the C core and on the Python one."""


def make_tracker(path: str, rank: int = 3) -> Tracker:
    return new_tracker(path, rank=rank, local_rank=1, world_size=8, local_world_size=4, job_id="jobX")


def test_round_trip_identity_live_state_and_ring(tmp_path):
    path = str(tmp_path / "rank-3.hb")
    t = make_tracker(path)
    ckpt = t.slot("checkpoint")
    for _ in range(3):
        t.enter(0)
        time.sleep(0.002)
        t.exit(0)
        t.enter(1)
        t.exit(1)
        t.step()
    t.collective_enter("all_reduce")
    t.enter(ckpt, budget_s=900)
    snap = read_record(path)
    assert (snap.global_rank, snap.local_rank, snap.world_size, snap.hostname, snap.job_id) == (
        3,
        1,
        8,
        "nodeA",
        "jobX",
    )
    assert snap.pid == os.getpid()
    assert snap.steps_done == 3 and snap.step == 3
    assert snap.phase == "checkpoint" and snap.budget_s == 900
    assert snap.coll_seq_entered == 1 and snap.coll_seq_completed == 0 and snap.coll_op == "all_reduce"
    assert [s.step for s in snap.recent_steps] == [0, 1, 2]
    for s in snap.recent_steps:
        assert s.phases_ms["dataloader"] >= 2.0
        # exclusive attribution: phases add up to the step's wall time
        assert abs(sum(s.phases_ms.values()) - s.duration_ms) < 1e-3
    # nested exit restores the parent phase and clears the budget
    t.exit(ckpt)
    snap = read_record(path)
    assert snap.phase == "collective" and snap.budget_s == 0
    t.collective_exit()
    assert read_record(path).coll_seq_completed == 1
    t.mark_exit()
    assert read_record(path).exited_normally


def test_record_is_owner_only(tmp_path):
    path = str(tmp_path / "rank-3.hb")
    make_tracker(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_since_step_cursor_returns_only_new_steps_and_ring_wraps(tmp_path):
    path = str(tmp_path / "rank-3.hb")
    t = make_tracker(path)
    for _ in range(RING_STEPS + 10):
        t.step()
    snap = read_record(path)
    assert len(snap.recent_steps) == RING_STEPS
    assert snap.recent_steps[0].step == 10 and snap.recent_steps[-1].step == RING_STEPS + 9
    assert [s.step for s in read_record(path, since_step=RING_STEPS + 7).recent_steps] == [
        RING_STEPS + 8,
        RING_STEPS + 9,
    ]


WRITER = r"""
import os, sys, time
sys.path[:0] = [{here!r}, {tests!r}]  # this module, and tests/ for its conftest
from test_record import make_tracker
t = make_tracker({path!r})
print("ready", flush=True)
end = time.monotonic() + {seconds}
def work():  # ~50 us of "training" per phase; real phases are far longer
    x = 0
    for i in range(1500):
        x += i
while time.monotonic() < end:
    for slot in (0, 1, 2, 3):
        t.enter(slot); work(); t.exit(slot)
    t.collective_enter("all_reduce"); t.collective_exit()
    t.step()
"""


def test_seqlock_never_returns_a_torn_record_under_a_concurrent_writer(tmp_path):
    path = str(tmp_path / "rank-3.hb")
    code = WRITER.format(here=os.path.dirname(__file__), tests=str(REPO / "tests"), path=path, seconds=4)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        reader = RecordReader(path)
        reads = 0
        last_done = 0
        deadline = time.monotonic() + 3
        cursor = -1
        while time.monotonic() < deadline:
            # the daemon's access pattern: only steps after its cursor; now and then a full read
            snap = reader.read(since_step=-1 if reads % 50 == 0 else cursor)
            reads += 1
            if snap.recent_steps:
                cursor = snap.recent_steps[-1].step
            # invariants the writer keeps inside each seqlock section
            assert snap.step == snap.steps_done
            assert snap.coll_seq_completed in (snap.coll_seq_entered, snap.coll_seq_entered - 1)
            assert snap.steps_done >= last_done
            last_done = snap.steps_done
            if snap.recent_steps:
                last = snap.recent_steps[-1]
                assert last.step == snap.steps_done - 1
                assert abs(sum(last.phases_ms.values()) - last.duration_ms) < 1e-3
        assert reads > 100 and last_done > 100
    finally:
        proc.kill()
        proc.wait()


def test_truncated_foreign_and_corrupt_files_are_rejected_clearly(tmp_path):
    good = str(tmp_path / "rank-0.hb")
    make_tracker(good, rank=0)
    data = open(good, "rb").read()

    truncated = tmp_path / "trunc.hb"
    truncated.write_bytes(data[:1000])
    with pytest.raises(RecordFormatError, match="truncated"):
        RecordReader(str(truncated))

    foreign = tmp_path / "foreign.hb"
    foreign.write_bytes(b"\x7fELF" + os.urandom(RECORD_SIZE))
    with pytest.raises(RecordFormatError, match="not a rankwatch record"):
        RecordReader(str(foreign))

    version = bytearray(data)
    version[8] = 99
    (tmp_path / "ver.hb").write_bytes(bytes(version))
    with pytest.raises(RecordFormatError, match="version 99"):
        RecordReader(str(tmp_path / "ver.hb"))

    # a record of the previous layout (version 3: per-phase times in a 512-step ring, no event ring) is
    # rejected by version, not decoded with the wrong offsets
    v3 = bytearray(data[:91_824])  # version 3's size
    v3[8:12] = (3).to_bytes(4, "little")
    v3[12:16] = len(v3).to_bytes(4, "little")
    (tmp_path / "v3.hb").write_bytes(bytes(v3))
    with pytest.raises(RecordFormatError, match=f"record version 3, expected {VERSION}"):
        RecordReader(str(tmp_path / "v3.hb"))

    corrupt = bytearray(data)
    from rankwatch.hooks.record import RecordLayout

    off = RecordLayout.n_phases.offset
    corrupt[off : off + 4] = (1000).to_bytes(4, "little")
    (tmp_path / "corrupt.hb").write_bytes(bytes(corrupt))
    with pytest.raises(RecordFormatError, match="corrupt"):
        RecordReader(str(tmp_path / "corrupt.hb"))

    os.symlink(good, tmp_path / "link.hb")
    with pytest.raises(RecordFormatError, match="symlink"):
        RecordReader(str(tmp_path / "link.hb"))


class ScriptedEventPool:
    """Stands in for cuda_timing.EventPool (no GPU here): pairs 'finish' one step after they are recorded."""

    def __init__(self):
        self.open, self.pending, self.log = {}, [], []

    def begin(self, slot):
        self.open[slot] = True
        self.log.append(("begin", slot))
        return True

    def end(self, slot):
        self.open.pop(slot)
        self.pending.append(slot)
        self.log.append(("end", slot))
        return True

    def poll(self):
        done, self.pending = [(s, 1.5) for s in self.pending], []
        return done


def test_gpu_phase_times_accumulate_from_event_pairs_without_blocking(tmp_path):
    path = str(tmp_path / "rank-3.hb")
    t = make_tracker(path)
    assert read_record(path).gpu_phase_ms == {}
    pool = ScriptedEventPool()
    t.attach_gpu_timing(pool)
    for _ in range(4):
        t.enter(0)  # dataloader: host-side, not GPU-timed
        t.exit(0)
        for slot in (1, 2, 3):  # forward, backward, optimizer
            t.enter(slot)
            t.exit(slot)
        t.step()
    snap = read_record(path)
    assert snap.gpu_phase_ms == {"forward": 6.0, "backward": 6.0, "optimizer": 6.0}
    assert ("begin", 0) not in pool.log
