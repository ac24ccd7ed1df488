"""The v4 record: the training thread appends one event word per transition, the reader rebuilds per-phase
times and the live state. Exact totals on a scripted clock; wrapped, torn and corrupt rings; a reader racing
a writer thread."""

from __future__ import annotations

import os
import random
import sys
import threading

import pytest
from conftest import new_tracker
from rankwatch.hooks import tracker as tracker_mod
from rankwatch.hooks.record import (
    EVENTS,
    RECORD_SIZE,
    RING_STEPS,
    RecordFormatError,
    RecordLayout,
    RecordReader,
    decode,
    read_record,
)

START = 10**12
US = 1000


class Clock:
    """``tracker._now``: each read returns ``now``, then advances by ``tick`` (deterministic times)."""

    def __init__(self, tick: int = 0) -> None:
        self.now, self.tick = START, tick

    def __call__(self) -> int:
        t = self.now
        self.now += self.tick
        return t

    def at(self, us: int) -> Clock:
        self.now = START + us * US
        return self


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(tracker_mod, "_now", c)
    return c


@pytest.fixture(autouse=True)
def _each_core(hook_impl):
    """Every case here runs on the C core and on the Python one."""


def tracker(tmp_path, name: str = "rank-0.hb"):
    return new_tracker(str(tmp_path / name), start_ns=START)


def ms(us: int) -> float:
    return us * US / 1e6


def test_exact_exclusive_times_of_a_scripted_step(tmp_path, clock):
    t = tracker(tmp_path)
    ckpt = t.slot("checkpoint")
    sync = t.slot("grad_sync")
    clock.at(100)
    t.enter(0)  # idle 0-100
    clock.at(300)
    t.exit_batch(0, produced=True)  # dataloader 100-300, produced on this thread
    clock.at(350)
    t.enter(1)  # idle 300-350
    clock.at(400)
    t.collective_enter("all_reduce")  # forward 350-400
    clock.at(460)
    t.collective_exit()  # collective 400-460
    clock.at(500)
    t.exit(1)  # forward 460-500
    t.enter(2)
    clock.at(900)
    t.exit(2, split_ns=START + 700 * US, tail_slot=sync)  # backward 500-700, grad_sync 700-900
    clock.at(950)
    t.enter(ckpt, budget_s=30)  # idle 900-950
    clock.at(1000)
    t.enter(3)
    clock.at(1100)
    t.exit_step(3)  # optimizer 1000-1100 inside checkpoint; the step ends there, checkpoint still open
    snap = read_record(str(tmp_path / "rank-0.hb"))
    (step,) = snap.recent_steps
    assert (step.start_ns, step.end_ns) == (START, START + 1100 * US)
    assert step.phases_ms == {
        "idle": ms(100 + 50 + 50),
        "dataloader": ms(200),
        "forward": ms(50 + 40),
        "collective": ms(60),
        "backward": ms(200),
        "grad_sync": ms(200),
        "checkpoint": ms(50),
        "optimizer": ms(100),
    }
    assert step.input_ms == ms(200) and step.input_batches == 1 and step.input_workers == 0
    # the live state is rebuilt from the step's checkpoint: checkpoint still open, budget declared
    assert (snap.step, snap.phase, snap.phase_start_ns) == (1, "checkpoint", START + 950 * US)
    assert (snap.budget_s, snap.budget_start_ns) == (30, START + 950 * US)
    assert (snap.coll_seq_entered, snap.coll_seq_completed, snap.coll_op) == (1, 1, "all_reduce")
    assert snap.last_progress_ns == START + 1100 * US and snap.transitions == 12 + 1
    # the next step starts with the checkpoint phase open (it was open at the boundary)
    clock.at(1500)
    t.exit(ckpt)
    clock.at(1600)
    t.step()
    snap = read_record(str(tmp_path / "rank-0.hb"), since_step=0)
    assert [s.phases_ms for s in snap.recent_steps] == [{"checkpoint": ms(400), "idle": ms(100)}]
    assert snap.phase is None and snap.budget_s == 0


def test_a_failing_exit_keeps_its_phase_named_across_a_step_until_the_next_enter(tmp_path, clock):
    t = tracker(tmp_path)
    path = str(tmp_path / "rank-0.hb")
    clock.at(10)
    t.enter(1)
    t.enter(2)
    clock.at(30)
    t.exit(2, failing=True)
    t.exit(1, failing=True)
    assert (read_record(path).phase, read_record(path).phase_start_ns) == ("forward", START + 10 * US)
    t.step()
    assert read_record(path).phase == "forward"
    clock.at(50)
    t.enter(0)
    assert read_record(path).phase == "dataloader"


def test_an_exit_skipped_by_an_exception_unwinds_to_the_matching_phase(tmp_path, clock):
    t = tracker(tmp_path)
    clock.at(10)
    t.enter(1)
    clock.at(20)
    t.enter(2)  # its exit never comes
    clock.at(50)
    t.exit(1)  # forward 10-20 and 20-50 booked to... the innermost open phase until the unwind
    clock.at(60)
    t.exit(3)  # nothing open: unbalanced, books nothing
    clock.at(70)
    t.step()
    (step,) = read_record(str(tmp_path / "rank-0.hb")).recent_steps
    assert step.phases_ms == {"idle": ms(10 + 20), "forward": ms(10 + 30)}


def test_the_step_ring_wraps_and_the_cursor_returns_only_new_steps(tmp_path, clock):
    clock.tick = US
    t = tracker(tmp_path)
    for _ in range(RING_STEPS + 10):
        t.enter(0)
        t.exit(0)
        t.step()
    path = str(tmp_path / "rank-0.hb")
    snap = read_record(path)
    assert [s.step for s in snap.recent_steps] == list(range(10, RING_STEPS + 10))
    assert all(s.phases_ms == {"idle": ms(2), "dataloader": ms(1)} for s in snap.recent_steps)
    assert [s.step for s in read_record(path, since_step=RING_STEPS + 7).recent_steps] == [
        RING_STEPS + 8,
        RING_STEPS + 9,
    ]


def test_steps_whose_events_the_ring_overwrote_are_left_out_never_misreported(tmp_path, clock):
    clock.tick = US
    t = tracker(tmp_path)
    path = str(tmp_path / "rank-0.hb")
    per = 2 * 50 + 2  # events per step below: 50 collectives
    steps = EVENTS // per + 40  # more events than the ring holds, fewer steps than the step ring
    for _ in range(steps):
        for _ in range(50):
            t.collective_enter("broadcast")
            t.collective_exit()
        t.enter(0)
        t.exit(0)
        t.step()
    snap = read_record(path)
    assert snap.steps_done == steps < RING_STEPS
    kept = [s.step for s in snap.recent_steps]
    assert kept == list(range(steps - len(kept), steps)) and EVENTS // per - 2 <= len(kept) <= EVENTS // per
    want = {"idle": ms(1 + 50 + 1), "collective": ms(50), "dataloader": ms(1)}
    assert all(s.phases_ms == want for s in snap.recent_steps)
    assert snap.coll_seq_entered == snap.coll_seq_completed == 50 * steps


def test_a_step_longer_than_the_ring_is_dropped_and_the_live_state_survives_by_the_fold(tmp_path, clock):
    clock.tick = US
    t = tracker(tmp_path)
    path = str(tmp_path / "rank-0.hb")
    t.enter(0)
    t.exit(0)
    t.step()
    ev = t.slot("eval")
    t.enter(ev)
    for _ in range(EVENTS):  # an evaluation loop without optimizer steps: 2 * EVENTS events, no step end
        t.enter(1)
        t.exit(1)
    t.collective_enter("barrier")
    snap = read_record(path)
    assert (snap.phase, snap.coll_seq_entered, snap.coll_op, snap.in_collective) == ("collective", 1, "barrier", True)
    t.collective_exit()
    assert read_record(path).phase == "eval"
    t.exit(ev)
    t.step()
    t.enter(0)
    t.exit(0)
    t.step()
    snap = read_record(path)
    # step 1 had more events than the ring holds: not reported rather than reported with wrong times
    # (step 0's events are gone too: the ring has been round since)
    assert [s.step for s in snap.recent_steps] == [2] and snap.steps_done == 3
    assert snap.recent_steps[0].phases_ms == {"idle": ms(2), "dataloader": ms(1)}


def test_a_copy_overtaken_by_the_writer_uses_only_events_it_cannot_have_lost(tmp_path, clock):
    clock.tick = US
    t = tracker(tmp_path)
    path = str(tmp_path / "rank-0.hb")
    for _ in range(3):
        t.enter(0)
        t.exit(0)
        t.step()
    data = bytearray(open(path, "rb").read())
    count = int.from_bytes(data[RecordLayout.ev_count.offset :][:8], "little")
    # the writer's count read again after the copy: it wrote EVENTS - 3 more events meanwhile, so only the
    # last 3 events before the copy are certainly intact (the last step's two and nothing else)
    off = RecordLayout.ev_count_after.offset
    data[off : off + 8] = (count + EVENTS - 3).to_bytes(8, "little")
    snap = decode(bytes(data))
    assert [s.step for s in snap.recent_steps] == [2]
    # a live checkpoint the writer lapped: the copy is torn, never decoded into a wrong state
    data[off : off + 8] = (count + EVENTS + 1).to_bytes(8, "little")
    with pytest.raises(RecordFormatError, match="overran"):
        decode(bytes(data))


def test_corrupt_rings_and_counters_decode_or_fail_cleanly(tmp_path, clock):
    clock.tick = US
    t = tracker(tmp_path)
    for _ in range(20):
        for slot in (0, 1, 2, 3):
            t.enter(slot)
            t.exit(slot)
        t.collective_enter("all_reduce")
        t.collective_exit()
        t.step()
    t.enter(1)
    good = open(str(tmp_path / "rank-0.hb"), "rb").read()
    rng = random.Random(4)
    regions = [
        (RecordLayout.fold.offset, RecordLayout.ring.offset + 40 * 120),  # fold, counters, first entries
        (RecordLayout.events.offset, RecordLayout.events.offset + 8 * 200),  # the events written
    ]
    for i in range(300):
        data = bytearray(good)
        a, b = regions[i % 2]
        for _ in range(rng.choice((1, 8, 64))):
            pos = rng.randrange(a, b)
            data[pos] = rng.randrange(256)
        if i % 10 == 0:  # whole words of garbage: huge counts, depths, step numbers
            pos = rng.randrange(a, b - 8) & ~7
            data[pos : pos + 8] = os.urandom(8)
        try:
            snap = decode(bytes(data), since_step=rng.choice((-1, 5, 18)))
        except RecordFormatError:
            continue
        for s in snap.recent_steps:
            assert all(v >= 0 for v in s.phases_ms.values())
            assert set(s.phases_ms) <= set(snap.phase_names)
        assert snap.phase is None or snap.phase in snap.phase_names


def test_a_reader_racing_a_writer_thread_sees_only_exact_steps(tmp_path, monkeypatch):
    # the writer thread's clock ticks 1 us per read: every step's phases are known exactly whatever the
    # interleaving; the reader (this thread) uses the daemon's access pattern
    clock = Clock(tick=US)
    monkeypatch.setattr(tracker_mod, "_now", clock)
    path = str(tmp_path / "rank-0.hb")
    made = threading.Event()
    stop = threading.Event()
    box: dict = {}

    def write() -> None:
        t = box["t"] = tracker(tmp_path)
        made.set()
        while not stop.is_set():
            for slot in (0, 1, 2):
                t.enter(slot)
                t.exit(slot)
            t.collective_enter("all_reduce")
            t.collective_exit()
            t.enter(3)
            t.exit_step(3)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: the writer stops anywhere in its methods
    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    assert made.wait(10)
    want = {"dataloader": ms(1), "forward": ms(1), "backward": ms(1), "collective": ms(1), "optimizer": ms(1),
            "idle": ms(5)}
    reader = RecordReader(path)
    cursor, reads, seen = -1, 0, 0
    try:
        while seen < 2000 and reads < 20000:
            snap = reader.read(since_step=-1 if reads % 50 == 0 else cursor)
            reads += 1
            for s in snap.recent_steps:
                assert s.step == 0 or s.phases_ms == want, (s.step, s.phases_ms)  # step 0 began at the start
            if snap.recent_steps:
                seen += len(snap.recent_steps)
                cursor = snap.recent_steps[-1].step
            assert snap.coll_seq_completed in (snap.coll_seq_entered, snap.coll_seq_entered - 1)
    finally:
        stop.set()
        writer.join(10)
        reader.close()
        sys.setswitchinterval(interval)
    assert seen >= 2000 and box["t"].enabled


def test_the_record_stays_small_enough_to_copy_per_poll():
    assert RECORD_SIZE < 256 * 1024
