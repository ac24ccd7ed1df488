"""Every benchmark still runs at the current code: each script in benchmarks/ (the accuracy suite aside,
it has its own tests) with ``--quick --json FILE`` exits 0 and writes the raw figures it promises. No
timing is asserted here (targets live in benchmarks/README.md); what is checked is that the run worked:
its own correctness checks passed (a benchmark exits non-zero when its verdict or diagnosis is wrong) and
the JSON holds the measurement."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"

pytestmark = pytest.mark.slow


def _rows(doc: Any) -> None:
    assert isinstance(doc, list) and doc and all(isinstance(r, dict) for r in doc)


def _hook(doc: Any) -> None:
    assert doc["micro"]["phase_pair_ns"] > 0 and doc["micro"]["step_ns"] > 0
    shares = doc["shares"]["summary"]
    assert set(shares) >= {"none", "fr", "hook"}
    assert all(s["samples"] > 0 for s in shares.values())
    assert {"none", "all", "all/off", "backward"} <= set(doc["breakdown"])  # (a3): each group of points ran


def _store(doc: Any) -> None:
    _rows(doc)
    assert all(r["complete"] for r in doc)
    assert all(r["correlate"]["held_after_last_evidence_ms_median"] is not None for r in doc)


def _verdict(doc: Any) -> None:
    _rows(doc)
    assert all(r["as_expected"] for r in doc)


def _diagnose(doc: Any) -> None:
    _rows(doc)
    assert all(r["diagnose"] and r["grep_c_mbps"] for r in doc)


def _traceml(doc: Any) -> None:
    assert "skipped" in doc or (isinstance(doc, list) and doc)


def _instructions(doc: Any) -> None:
    # blocks are whole training steps (millions of instructions each; the switches between blocks are a few
    # hundred: a block mixed up with a switch shows here), and the hook is a fraction of a percent of a step.
    # Its sign is not asserted: a quick run's median over 2 pairs moves by ±10k instructions a step (one pair's
    # allocator or cache-resize path), more than the hook's own ~+6k; the 200-step run in benchmarks/README is
    # the figure.
    assert doc["pairs"] >= 1 and doc["ir_step_off"] > 1_000_000
    assert abs(doc["ir_per_step"]) < 0.05 * doc["ir_step_off"], doc


def _gpu(doc: Any) -> None:
    assert doc["counts"]["FAIL"] == 0 and doc["checks"]


def _inspect_timing(doc: Any) -> None:
    assert doc["timing"] and not doc["classes"]


def _inspect_classes(names: tuple[str, ...]) -> Callable[[Any], None]:
    def check(doc: Any) -> None:
        assert not doc["timing"] and [r["fault"] for r in doc["classes"]] == list(names)

    return check


def _inspect_classes_of_the_script() -> tuple[str, ...]:
    """bench_inspect.py's CLASSES, read from its source (a script: importing it needs its own sys.path)."""
    tree = ast.parse((BENCH / "bench_inspect.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CLASSES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("bench_inspect.py has no CLASSES")


# bench_inspect runs a job per hang class, one after another. The classes tests/unit/cli/test_inspect.py already runs
# end to end under inspect, with the verdict asserted (the benchmark only proves it runs), are left out of
# the quick run here; the others go in two halves that run side by side beside the timing run.
INSPECT_CLASSES = _inspect_classes_of_the_script()
INSPECT_TESTED_ELSEWHERE = {
    "input-hang": "test_inspect.py::test_input_hang_in_a_dataloader_worker",
    "compute-hang": "test_inspect.py::test_compute_hang_in_forward",
    "stop": "test_inspect.py::test_stopped_rank_is_named_and_left_stopped",
    "dead": "test_inspect.py::test_dead_rank_inside_the_launchers_monitor_window",
}
_INSPECT_HERE = tuple(c for c in INSPECT_CLASSES if c not in INSPECT_TESTED_ELSEWHERE)
INSPECT_HALVES = (_INSPECT_HERE[: len(_INSPECT_HERE) // 2], _INSPECT_HERE[len(_INSPECT_HERE) // 2:])


def _nonempty(doc: Any) -> None:
    assert doc


# script (":part" where one script's run is split) → (extra arguments, what its JSON must hold), longest first
# (measured, --durations): xdist hands the tests out in this order, so the longest runs start first instead
# of ending the suite alone on one worker.
# A quick run here is a smoke run: the suite is CPU-bound (every torch process is ~1.6 s of CPU), so the
# extra arguments take each benchmark to its smallest size that still runs every one of its code paths
# once and checks its own result — fewer ranks, steps, sizes and repetitions, never a path. Its figures
# are not quoted anywhere (benchmarks/README.md quotes full runs).
CASES: dict[str, tuple[list[str], Callable[[Any], None]]] = {
    # the timing job at 3 ranks (quick's 4 less one torch start-up), no hang class: one inspect over several
    # ranks' py-spy at once
    "bench_inspect.py:timing": (["--timing-ranks", "3", "--classes"], _inspect_timing),
    **{f"bench_inspect.py:classes-{i}": (["--reps", "0", "--classes", *half], _inspect_classes(half))
       for i, half in enumerate(INSPECT_HALVES, 1)},
    # (c) at 200 steps of ~3 ms still gives every arm py-spy samples (100 Hz on both ranks inside the loop);
    # (a2)'s 2,000 steps are fixed by --quick (bench_hook.py is hookring's); (a3) at 400 steps runs each group once
    "bench_hook.py": (["--no-e2e", "--shares-steps", "200", "--breakdown", "--breakdown-steps", "400"], _hook),
    # under callgrind (valgrind, installed by .ci/run), instructions only; most of
    # its minutes are `import torch` under valgrind (quick: 40 steps, 2 pairs of 10-step blocks)
    "bench_hook_instructions.py": (["--no-cache-sim"], _instructions),
    # both footprint runs (2 s windows), each import once
    "bench_daemon.py": (["--seconds", "2", "--import-reps", "1"], _nonempty),
    # one pair (timing on, off) of 2-rank jobs at 40 steps, 10 of them warm-up
    "bench_ddp_timing.py": (["--steps", "40", "--warmup", "10"], _nonempty),
    # one 2-rank hang (every run is the same job; 2 ranks: a faulting rank and a peer that waits)
    "bench_detection.py": (["--runs", "1", "--nproc", "2", "--fault-rank", "1", "--fault-step", "4"], _nonempty),
    # two sizes (the per-size loop, a fresh store each), a worker process, a second incident generation
    "bench_store.py": (["--nodes", "4", "8", "--polls", "2", "--incidents", "2", "--poll-interval", "0.2",
                        "--procs", "1"], _store),
    "bench_footprint.py": (["--seconds", "1"], _nonempty),  # every arm once (quick: 1 rep)
    "gpu_check.py": ([], _gpu),
    "bench_flood.py": ([], _nonempty),
    # one job of 3 ranks (2 blocked in the collective, 1 outside), a capture and a second one of the same job
    "bench_capture.py": (["--ranks", "3", "--reps", "2"], _nonempty),
    "bench_diagnose.py": (["--sizes-mb", "20", "--rounds", "1"], _diagnose),  # diagnose, grep and start-up once
    "bench_verdict.py": ([], _verdict),
    "bench_fr_share.py": ([], _nonempty),  # quick: 2 nodes (a leader and a remote), 1 repeat
    "bench_live_share.py": ([], _nonempty),  # quick: 2 nodes, 1 repeat
    "bench_traceml.py": ([], _traceml),
    "bench_series.py": ([], _nonempty),
    "bench_signals.py": ([], _nonempty),  # quick: 2 ranks of 24 threads, 20 polls
}


# the tools a benchmark runs besides Python (the test skips, naming it, where it is missing)
NEEDS = {"bench_hook_instructions.py": "valgrind"}


def test_every_benchmark_is_listed() -> None:
    scripts = {p.name for p in BENCH.glob("bench_*.py")} | {"gpu_check.py"}
    assert scripts == {case.split(":")[0] for case in CASES}, "a benchmark without a --quick run here"
    assert sorted(sum(INSPECT_HALVES, ()) + tuple(INSPECT_TESTED_ELSEWHERE)) == sorted(INSPECT_CLASSES)
    assert all(INSPECT_HALVES)
    for test in INSPECT_TESTED_ELSEWHERE.values():  # a class left out here is still run there
        module, name = test.split("::")
        (path,) = (REPO / "tests").glob(f"*/**/{module}")
        assert f"def {name}(" in path.read_text(), test


def _kill_tagged(tag: str) -> None:
    """Whatever the run started and left (jobs in their own sessions included) carries its tag in its env."""
    for p in psutil.process_iter():
        try:
            if p.environ().get("RANKWATCH_BENCH_RUN") == tag:
                p.kill()
        except (psutil.Error, OSError):
            pass


# a quick run is minutes of real jobs on a busy machine: its own limit, below the test's, so that a run that
# hangs is stopped with SIGTERM (benchmarks unwind and kill their jobs) rather than killed mid-job
RUN_LIMIT_S = 1200


@pytest.mark.timeout(RUN_LIMIT_S + 120)
@pytest.mark.parametrize("case", list(CASES))
def test_benchmark_quick_run(case: str, tmp_path: Path) -> None:
    extra, check = CASES[case]
    script = case.split(":")[0]
    if script in NEEDS and shutil.which(NEEDS[script]) is None:
        pytest.skip(f"{NEEDS[script]} is not installed (.ci/run installs it)")
    out = tmp_path / "result.json"
    tag = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(tmp_path), RANKWATCH_BENCH_RUN=tag)
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), "--quick", "--json", str(out), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_LIMIT_S)
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    finally:
        _kill_tagged(tag)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    check(json.loads(out.read_text()))
