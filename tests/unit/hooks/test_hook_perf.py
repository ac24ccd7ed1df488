"""benchmarks/hook_perf.py's attribution, on real ``perf script`` output of a hook-arm recording
(tests/fixtures/perf/hook_arm_script.txt: two or three samples of each kind, kept in the order perf wrote
them): which samples are the hook's own, which are its wrappers calling through to torch, which are the
callee's frame moved under a wrapper, which are the flight recorder's, and that other threads do not count."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))
import hook_perf  # noqa: E402

TEXT = (REPO / "tests" / "fixtures" / "perf" / "hook_arm_script.txt").read_text()


def test_every_sample_of_the_recording_is_read_whole():
    samples = list(hook_perf.parse(TEXT))
    assert len(samples) == 13
    assert all(frames for _, _, frames in samples)
    assert sum(1 for pid, tid, _ in samples if pid != tid) == 2  # the two from other threads
    # frames are leaf first, each with its library's file name
    assert samples[0][2][0] == ("dict_merge", "libpython3.11.so.1.0")


def test_the_hook_owns_only_what_runs_under_it_without_python():
    r = hook_perf.attribute(hook_perf.parse(TEXT))
    assert r["samples"] == 11  # main threads only
    # 3 own + 2 callee-frame samples; the 2 pass-through (a Python function below the wrapper) are not its
    assert (r["hook_own"], r["hook_callee_frame"], r["fr"]) == (5, 2, 2)
    assert abs(r["hook_pct"] - 100 * 5 / 11) < 1e-9
    assert abs(r["hook_without_callee_pct"] - 100 * 3 / 11) < 1e-9
    assert all(name for name, _ in r["hook_frames"])


def test_a_wrapper_calling_through_is_not_the_hooks_time():
    first = next(hook_perf.parse(TEXT))  # the fixture's first sample: dict_merge under a wrapped function
    frames = first[2]
    hook = next(i for i, (_, lib) in enumerate(frames) if lib.startswith(hook_perf.HOOK_LIB))
    assert any(sym == hook_perf.PYTHON_RUNS for sym, _ in frames[:hook])
    assert hook_perf.attribute(iter([first]))["hook_own"] == 0
    # the same stack cut at the hook's frame (nothing runs below it) is the hook's own
    assert hook_perf.attribute(iter([(first[0], first[1], frames[hook:])]))["hook_own"] == 1


def test_an_empty_or_foreign_recording_counts_nothing():
    assert hook_perf.attribute(hook_perf.parse(""))["samples"] == 0
    assert hook_perf.attribute(hook_perf.parse("not perf output\n  at all\n"))["hook_pct"] == 0.0


def test_torchs_c_engine_below_the_hooks_engine_wrapper_is_training_work():
    """The backward wrapper sits around torch's C engine (instrument.backward_entry): no Python runs between
    them, so the engine's entry marks the training work (tests/fixtures/perf/hook_engine_script.txt, from a
    hook-arm recording: DDP's bucket all-reduce under the engine, and the hook's engine callback
    stamping the graph's end under the same engine: its own)."""
    samples = list(hook_perf.parse((REPO / "tests" / "fixtures" / "perf" / "hook_engine_script.txt").read_text()))
    assert len(samples) == 2
    for _, _, frames in samples:  # no Python function runs anywhere below the engine
        assert any(sym in hook_perf.NATIVE_WORK for sym, _ in frames)
        engine = next(i for i, (sym, _) in enumerate(frames) if sym in hook_perf.NATIVE_WORK)
        assert not any(sym == hook_perf.PYTHON_RUNS for sym, _ in frames[:engine])
    r = hook_perf.attribute(iter(samples))
    assert (r["samples"], r["hook_own"]) == (2, 1)
    assert r["hook_frames"] == [("PhaseState_stamp", 1)]
