"""EventPool logic with a fake CUDA event (no GPU here), and real unavailability on CPU-only torch."""

from __future__ import annotations

import subprocess
import sys

from rankwatch.hooks.cuda_timing import EventPool


class FakeGpu:
    """A stream that executes recorded events in order when the test advances it."""

    def __init__(self) -> None:
        self.queue: list[FakeEvent] = []
        self.clock_ms = 0.0
        self.synchronize_calls = 0

    def run(self, n: int, ms_each: float = 1.5) -> None:
        for _ in range(min(n, len(self.queue))):
            self.clock_ms += ms_each
            ev = self.queue.pop(0)
            ev.done_at = self.clock_ms


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.done_at: float | None = None
        self.records = 0

    def record(self) -> None:
        self.records += 1
        self.done_at = None
        self.gpu.queue.append(self)

    def query(self) -> bool:
        return self.done_at is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done_at is not None and end.done_at is not None, "elapsed_time on unfinished events"
        return end.done_at - self.done_at

    def synchronize(self) -> None:  # pragma: no cover - must never be called
        self.gpu.synchronize_calls += 1


def make_pool(
    capacity: int = 4, capturing: list[bool] | None = None
) -> tuple[EventPool, FakeGpu, list[FakeEvent]]:
    gpu = FakeGpu()
    made: list[FakeEvent] = []

    def factory() -> FakeEvent:
        ev = FakeEvent(gpu)
        made.append(ev)
        return ev

    flag = capturing if capturing is not None else [False]
    return EventPool(factory, capacity=capacity, is_capturing=lambda: flag[0]), gpu, made


def test_poll_harvests_only_finished_pairs_without_blocking():
    pool, gpu, _ = make_pool()
    assert pool.begin("forward") and pool.end("forward")
    assert pool.begin("backward") and pool.end("backward")
    assert pool.poll() == []  # GPU has not run anything yet
    gpu.run(2)  # forward start+end done
    assert pool.poll() == [("forward", 1.5)]
    assert pool.in_flight == 1
    gpu.run(1)  # backward start only
    assert pool.poll() == []
    gpu.run(1)
    assert pool.poll() == [("backward", 1.5)]
    assert gpu.synchronize_calls == 0
    assert pool.stats()["harvested"] == 2 and pool.in_flight == 0


def test_pairs_are_reused():
    pool, gpu, made = make_pool(capacity=2)
    for _ in range(10):
        pool.begin(0)
        pool.end(0)
        gpu.run(2)
        assert len(pool.poll()) == 1
    assert len(made) == 2  # one pair created, reused ten times
    assert made[0].records == 10


def test_exhausted_pool_drops_and_counts():
    pool, gpu, made = make_pool(capacity=2)
    assert pool.begin("a") and pool.begin("b")
    assert not pool.begin("c")  # third pair does not exist
    assert not pool.end("c")
    assert pool.dropped == 1 and len(made) == 4
    pool.end("a")
    pool.end("b")
    gpu.run(4)
    assert sorted(s for s, _ in pool.poll()) == ["a", "b"]
    assert pool.begin("c")  # freed pairs are available again


def test_unbalanced_begin_recycles_and_end_without_begin_is_ignored():
    pool, gpu, _ = make_pool(capacity=1)
    assert pool.begin("x")
    assert pool.begin("x")  # the first begin's end was skipped by an exception
    assert pool.dropped == 0
    assert not pool.end("never")
    assert pool.end("x")
    gpu.run(3)
    assert [s for s, _ in pool.poll()] == ["x"]


def test_no_recording_while_capturing_a_cuda_graph():
    flag = [True]
    pool, gpu, _ = make_pool(capturing=flag)
    assert not pool.begin("fwd")
    assert gpu.queue == [] and pool.in_flight == 0
    flag[0] = False
    assert pool.begin("fwd")
    flag[0] = True
    assert not pool.end("fwd")  # capture began in between: the measurement is abandoned
    assert pool.in_flight == 0


def test_event_errors_never_escape():
    class Broken(FakeEvent):
        def record(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gpu = FakeGpu()
    pool = EventPool(lambda: Broken(gpu), capacity=2)
    assert not pool.begin(1)
    assert not pool.end(1)
    assert pool.poll() == []
    assert pool.errors == 1
    assert not pool.begin(2) and pool.errors == 2 and pool.stats()["created"] == 1  # the pair was recycled

    class BadQuery(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("device lost")

    pool2 = EventPool(lambda: BadQuery(gpu), capacity=2)
    pool2.begin(1)
    pool2.end(1)
    assert pool2.poll() == []
    assert pool2.errors == 1 and pool2.in_flight == 0


def test_unavailable_on_cpu_only_torch():
    import torch

    assert not torch.cuda.is_available()
    assert EventPool.create() is None


def test_import_does_not_import_torch():
    code = "import sys, rankwatch.hooks.cuda_timing; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
