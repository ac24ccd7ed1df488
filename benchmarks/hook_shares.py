"""Side-by-side sampling of the training thread: what share of it each watching tool takes, at small steps.

Used by bench_hook.py (part c). One job per arm, the same DDP loop (``ddp_timed.py``, 2 ranks, ~3 ms
steps on the shared cores), py-spy attached to both ranks, arms interleaved round by round. The flight
recorder arm and the hook's are sampled with ``--native`` (their frames are C++ and C: without it, time in
the hook's C core called straight from torch — the optimizer step hooks — would count as torch's); TraceML
without it by default (native unwinding pauses the ranks far longer per sample and, on loaded cores, slows
the steps several fold; ``native=True`` samples every arm natively):

* ``none``: no tool (the share is 0 by definition; its samples calibrate the step's cost);
* ``fr``: torch's flight recorder alone (``TORCH_FR_BUFFER_SIZE=2000``): frames ``c10d::FlightRecorder``;
* ``hook``: ``-m rankwatch.hooks`` (which also switches the flight recorder on, as in production):
  frames of ``rankwatch/hooks``;
* ``traceml``: ``traceml run`` with TraceML's ``trace_step`` around each step (``--traceml-python``, a
  Python with ``traceml-ai`` and torch): frames of ``traceml_ai``.

A sample counts for a tool when its innermost frame of that tool has none of the training work below
it (the loop's own code, module forwards, the autograd engine, DataLoader fetches, collectives,
optimizer steps): a wrapper that merely calls through to the training work is not the tool's time, the
tool's own bookkeeping, and the torch helpers it calls (hook handles, event objects), are. Only samples
of the training thread inside the step loop count (the stack holds ``ddp_timed.py``'s loop lines).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _util import REPO, Procs, free_port, median, torchrun_args, torchrun_cmd

TIMED = REPO / "benchmarks" / "ddp_timed.py"
SMALL_STEPS = ["--hidden", "128", "--layers", "3", "--batch-size", "32"]  # ~3 ms per step, 2 ranks, 2 cores
NATIVE_ARMS = ("fr", "hook")  # tools with native frames of their own
TOOL_FRAMES = {
    # an editable install reports paths relative to the repo; the C core's native frames name its library
    "hook": ("rankwatch/hooks/", "(hooks/", "_fastpath"),
    "fr": ("FlightRecorder",),
    "traceml": ("traceml_ai/", "traceml/"),
}
# native frames of the training work: torch's C engine entry, below the hook's wrapper of it (instrument.backward_entry)
NATIVE_WORK = ("THPEngine_run_backward",)
# frames of the training work itself: a tool frame above one of these is a pass-through wrapper
WORK_FRAMES = (
    "ddp_timed.py",
    "torch/nn/modules/",
    "torch/nn/parallel/",  # DDP's own forward (_pre_forward, _post_forward): below a forward wrapper
    "_engine_run_backward",
    *NATIVE_WORK,
    "torch/utils/data/",
    "torch/distributed/",
    "torch/autograd/__init__.py",
    "torch/autograd/graph.py",
    "torch/_tensor.py",
    "torch/optim/",
)


def job_args(hidden: int | None = None) -> list[str]:
    """ddp_timed.py's model: the small steps, or their layers at another width (a longer step of the same
    kind: the hook's points per step are the same, its share scales as one over the step's CPU time)."""
    return SMALL_STEPS if hidden is None else ["--hidden", str(hidden), *SMALL_STEPS[2:]]


def loop_lines() -> range:
    """Line numbers of ``ddp_timed.main``'s step loop (read from the file, so edits do not break this)."""
    tree = ast.parse(TIMED.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == "step":
            return range(node.lineno, (node.end_lineno or node.lineno) + 1)
    raise RuntimeError("ddp_timed.py has no `for step in ...` loop")


def in_loop(frame: str, lines: range) -> bool:
    if not frame.startswith("main (") or "ddp_timed.py:" not in frame:
        return False
    try:
        return int(frame.rsplit(":", 1)[1].rstrip(")")) in lines
    except ValueError:
        return False


def attribute(raw: str, tool: str | None, lines: range) -> tuple[int, int, Counter[str]]:
    """(training-thread samples in the loop, of them the tool's own, the tool's innermost frames)."""
    marks = TOOL_FRAMES.get(tool or "", ())
    total = own = 0
    where: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        if not any(in_loop(f, lines) for f in frames):
            continue
        n = int(count)
        total += n
        if not marks:
            continue
        hits = [i for i, f in enumerate(frames) if any(m in f for m in marks)]
        if not hits:
            continue
        below = frames[hits[-1] + 1 :]
        if any(w in f for f in below for w in WORK_FRAMES):
            continue  # a wrapper calling through to the training work
        own += n
        where[frames[hits[-1]]] += n
    return total, own, where


def run_arm(procs: Procs, arm: str, steps: int, work: Path, pyspy: str, native: bool, rate: int,
            traceml_python: str | None, hidden: int | None = None) -> dict[str, Any]:
    out = work / f"{arm}.txt"
    script = [str(TIMED), *job_args(hidden), "--steps", str(steps), "--warmup", str(steps // 10)]
    env = dict(os.environ, OMP_NUM_THREADS="1", RANKWATCH_SHM_DIR=str(work / "shm"))
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    run_id = f"share-{arm}-{free_port()}"
    if arm == "traceml":
        assert traceml_python
        traceml = str(Path(traceml_python).parent / "traceml")
        target = [traceml, "run", script[0], "--nproc-per-node", "2", "--logs-dir", str(work / "tml"),
                  "--run-name", run_id, "--aggregator-port", str(free_port()), "--master-port", str(free_port()),
                  "--args", *script[1:], "--traceml"]
    else:
        if arm == "fr":
            env["TORCH_FR_BUFFER_SIZE"] = "2000"
        if arm == "hook":
            script = ["-m", "rankwatch.hooks", *script]
            env["RANKWATCH_JOB_ID"] = run_id
        target = torchrun_cmd(*torchrun_args(2, run_id, *script))
    # py-spy attaches to the two ranks only (not to the launcher, TraceML's aggregator or torchrun): the
    # job's own start-up stays as fast as without sampling
    job = procs.start(target, env=env, text=True)
    samplers = attach(procs, job, pyspy, native, rate, out)
    try:
        stdout, stderr = job.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{arm} run timed out") from None
    for sp in samplers:
        try:
            sp.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            sp.kill()
    line = next((ln for ln in stdout.splitlines() if ln.startswith("{")), None)
    parts = [p for p in work.glob(f"{out.name}.*") if p.stat().st_size]
    if line is None or not parts:
        raise RuntimeError(f"{arm} run failed ({job.returncode}):\n{stdout[-1500:]}\n{stderr[-3000:]}")
    import json

    timing = json.loads(line)
    text = "".join(p.read_text() for p in parts)
    total, own, where = attribute(text, None if arm == "none" else arm, loop_lines())
    return {"samples": total, "own": own, "share_pct": 100.0 * own / total if total else 0.0,
            "median_step_ms": timing["median_step_ms"], "thread_cpu_ms": timing["thread_cpu_ms"],
            "top": where.most_common(6)}


def attach(procs: Procs, job: subprocess.Popen[str], pyspy: str, native: bool, rate: int,
           out: Path) -> list[subprocess.Popen[str]]:
    """One ``py-spy record --pid`` per rank of ``job`` (its descendants with LOCAL_RANK set)."""
    import psutil

    seen: dict[int, subprocess.Popen[str]] = {}
    deadline = time.monotonic() + 120
    while len(seen) < 2 and time.monotonic() < deadline and job.poll() is None:
        try:
            kids = psutil.Process(job.pid).children(recursive=True)
        except psutil.Error:
            kids = []
        for kid in kids:
            try:
                if kid.pid in seen or "LOCAL_RANK" not in kid.environ():
                    continue
            except psutil.Error:
                continue
            seen[kid.pid] = procs.start(
                [pyspy, "record", "--pid", str(kid.pid), "-r", str(rate), "-f", "raw", "-o", f"{out}.{kid.pid}",
                 *(["--native"] if native else [])], text=True)
        time.sleep(0.05)
    return list(seen.values())


def find_pyspy() -> str:
    """The py-spy binary itself (a pyenv shim resets PATH, and the ranks then miss the venv)."""
    found = shutil.which("py-spy")
    if not found:
        raise RuntimeError("py-spy not found")
    try:
        real = subprocess.run(["pyenv", "which", "py-spy"], capture_output=True, text=True, timeout=20)
        if real.returncode == 0 and real.stdout.strip():
            return real.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return found


def shares(rounds: int, steps: int, arms: list[str], native: bool = False, rate: int = 100,
           traceml_python: str | None = None, hidden: int | None = None) -> dict[str, list[dict[str, Any]]]:
    pyspy = find_pyspy()
    out: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    with Procs() as procs:
        for i in range(rounds):
            order = arms if i % 2 == 0 else arms[::-1]
            for arm in order:
                with tempfile.TemporaryDirectory(prefix="rw-share-") as tmp:
                    try:
                        r = run_arm(procs, arm, steps, Path(tmp), pyspy, native or arm in NATIVE_ARMS, rate,
                                    traceml_python, hidden)
                    except RuntimeError as exc:  # one arm's failed run (e.g. TraceML's aggregator) is reported
                        print(f"  round {i + 1}/{rounds} {arm:<8} FAILED: {str(exc)[:300]}", flush=True)
                        continue
                out[arm].append(r)
                print(f"  round {i + 1}/{rounds} {arm:<8} share {r['share_pct']:5.2f} % of {r['samples']} samples, "
                      f"median step {r['median_step_ms']:.2f} ms, thread CPU {r['thread_cpu_ms']:.3f} ms/step",
                      flush=True)
    return out


def summary(res: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per arm: median share, pooled share (own / samples over all rounds), median step and CPU."""
    s = {}
    for arm, runs in res.items():
        if not runs:
            continue
        samples = sum(r["samples"] for r in runs)
        s[arm] = {
            "share_pct": median([r["share_pct"] for r in runs]),
            "pooled_pct": 100.0 * sum(r["own"] for r in runs) / samples if samples else 0.0,
            "samples": float(samples),
            "median_step_ms": median([r["median_step_ms"] for r in runs]),
            "thread_cpu_ms": median([r["thread_cpu_ms"] for r in runs]),
        }
    return s
