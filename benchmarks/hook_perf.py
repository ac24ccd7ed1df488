"""The hook's and the flight recorder's share of the training thread from perf call chains (issue 25 item 1).

py-spy hides CPython's own native frames, so a sample in the call machinery between one of the hook's C
wrappers and the Python function it wraps lands on the wrapper's line, and a share from py-spy cannot tell
the hook's work from torch's work it merely calls (hook_shares.py). ``perf record --call-graph dwarf`` sees
every native frame. Same job as hook_shares.py (``ddp_timed.py``'s small steps, 2 ranks, arms ``hook`` and
``fr`` interleaved; the flight recorder on in both, as the hook switches it on in production); perf attaches
to both ranks once the loop runs (``--settle`` seconds after they start) and samples their CPU time
(cpu-clock). Only the ranks' main threads count. A sample is:

* the hook's own when a frame of its C core (``_fastpath``) is on the stack and no Python function runs
  below it (``_PyEval_EvalFrameDefault`` or torch's C engine entry leafward of the hook's innermost frame:
  the wrapped function, the training work, running through a wrapper);
* of which *the callee's frame set-up and teardown* when that leafward part is CPython pushing or clearing
  the wrapped function's frame under ``_PyEval_Vector`` (``_PyEvalFramePushAndInit``, ``_PyFrame_Clear``:
  the wrapped function's locals freed at its return). An unwrapped call does the same work inline in its
  caller's frame, so this is torch's work moved under the hook, reported apart rather than dropped;
* the flight recorder's when any ``c10d::FlightRecorder`` frame is on the stack.

Needs ``perf`` (linux-perf) with permission to attach (root, or ``perf_event_paranoid`` ≤ 1). Not part of
the CI smoke runs: what it measures is checked there by bench_hook.py's (a2) and (c); its attribution is
tested on recorded ``perf script`` output (tests/unit/hooks/test_hook_perf.py).

    python benchmarks/hook_perf.py --rounds 3            # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _util import Procs, free_port, torchrun_args, torchrun_cmd
from hook_shares import NATIVE_WORK, TIMED, job_args

Frame = tuple[str, str]  # (symbol, library file name)
Sample = tuple[int, int, list[Frame]]  # (pid, tid, frames leaf first)

_HEAD = re.compile(r"^\s*(\d+)/(\d+)\s*$")
_FRAME = re.compile(r"^\s+[0-9a-f]+\s+(.*?)\s+\(([^)]*)\)\s*$")
HOOK_LIB = "_fastpath"
FR_SYMBOL = "FlightRecorder"
PYTHON_RUNS = "_PyEval_EvalFrameDefault"
CALLEE_FRAME = ("_PyEvalFramePushAndInit", "_PyFrame_Clear")


def parse(text: str) -> Iterator[Sample]:
    """``perf script --no-inline -F pid,tid,ip,sym,dso`` output of a call-graph recording, sample by sample."""
    cur: Sample | None = None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            if cur is not None:
                yield cur
            cur = (int(head[1]), int(head[2]), [])
            continue
        frame = _FRAME.match(line)
        if frame and cur is not None:
            cur[2].append((frame[1], frame[2].rsplit("/", 1)[-1]))
    if cur is not None:
        yield cur


def attribute(samples: Iterator[Sample]) -> dict[str, Any]:
    """Main-thread samples, the hook's own (and of them the callee's frame set-up and teardown), the flight
    recorder's, and where the hook's own samples are."""
    main = own = callee = fr = 0
    where: Counter[str] = Counter()
    for pid, tid, frames in samples:
        if pid != tid or not frames:
            continue
        main += 1
        if any(FR_SYMBOL in sym for sym, _ in frames):
            fr += 1
        hook = next((i for i, (_, lib) in enumerate(frames) if lib.startswith(HOOK_LIB)), None)
        if hook is None:
            continue
        leafward = frames[:hook]
        if any(sym == PYTHON_RUNS or sym in NATIVE_WORK for sym, _ in leafward):
            continue  # a wrapper calling through to the training work (Python, or torch's C engine)
        own += 1
        if any(sym in CALLEE_FRAME for sym, _ in leafward):
            callee += 1
        where[frames[hook][0]] += 1
    pct = (lambda n: 100.0 * n / main) if main else (lambda n: 0.0)
    return {"samples": main, "hook_own": own, "hook_callee_frame": callee, "fr": fr,
            "hook_pct": pct(own), "hook_without_callee_pct": pct(own - callee), "fr_pct": pct(fr),
            "hook_frames": where.most_common(8)}


def record(arm: str, steps: int, freq: int, settle_s: float, work: Path) -> tuple[dict[str, Any], str]:
    """One job of ``arm`` under perf: ddp_timed's timing line and the ``perf script`` text of its ranks."""
    import psutil

    script = [str(TIMED), *job_args(), "--steps", str(steps), "--warmup", str(steps // 10)]
    run_id = f"perf-{arm}-{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", RANKWATCH_SHM_DIR=str(work / "shm"), TORCH_FR_BUFFER_SIZE="2000")
    if arm == "hook":
        script = ["-m", "rankwatch.hooks", *script]
        env["RANKWATCH_JOB_ID"] = run_id
    data = work / f"{arm}.data"
    with Procs() as procs:
        job = procs.start(torchrun_cmd(*torchrun_args(2, run_id, *script)), env=env, text=True)
        ranks: list[int] = []
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and job.poll() is None:
            for kid in psutil.Process(job.pid).children(recursive=True):
                try:
                    if kid.pid not in ranks and "LOCAL_RANK" in kid.environ():
                        ranks.append(kid.pid)
                except psutil.Error:
                    pass
            time.sleep(0.05)
        time.sleep(settle_s)  # past torch's import and the warm-up steps
        perf = procs.start(["perf", "record", "--call-graph", "dwarf,16384", "-F", str(freq), "-o", str(data),
                            "-p", ",".join(map(str, ranks))], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        stdout, _ = job.communicate(timeout=900)
        _, perf_err = perf.communicate(timeout=120)
    line = next((ln for ln in stdout.splitlines() if ln.startswith("{")), None)
    if line is None or not data.exists():
        raise RuntimeError(f"{arm}: no timing line or no perf data ({job.returncode}): {perf_err[-500:]}")
    text = subprocess.run(["perf", "script", "--no-inline", "-F", "pid,tid,ip,sym,dso", "-i", str(data)],
                          capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(line), text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 2,000 steps")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds of (hook, fr) (default 3, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 4,000, quick 2,000)")
    p.add_argument("--freq", type=int, default=999, help="perf's sampling rate, Hz")
    p.add_argument("--settle", type=float, default=8.0, help="seconds from the ranks' start to perf's")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (2000 if args.quick else 4000)
    if shutil.which("perf") is None:
        print("hook_perf: perf is not installed (apt-get install linux-perf)", file=sys.stderr)
        return 2
    rows: dict[str, list[dict[str, Any]]] = {"hook": [], "fr": []}
    for i in range(args.rounds):
        for arm in ("hook", "fr") if i % 2 == 0 else ("fr", "hook"):
            with tempfile.TemporaryDirectory(prefix="rw-perf-") as tmp:
                timing, text = record(arm, args.steps, args.freq, args.settle, Path(tmp))
            r = {**attribute(parse(text)), "thread_cpu_ms": timing["thread_cpu_ms"]}
            rows[arm].append(r)
            print(f"  round {i + 1}/{args.rounds} {arm:<4} {r['samples']} main-thread samples: hook own "
                  f"{r['hook_pct']:.2f} % (without the callee's frame {r['hook_without_callee_pct']:.2f} %), "
                  f"FR {r['fr_pct']:.2f} %; thread CPU {r['thread_cpu_ms']:.3f} ms/step", flush=True)
    pooled = {arm: {k: 100.0 * sum(r[n] for r in runs) / max(1, sum(r["samples"] for r in runs))
                    for k, n in (("hook_pct", "hook_own"), ("fr_pct", "fr"))}
              for arm, runs in rows.items()}
    hook_runs = rows["hook"]
    pooled["hook"]["hook_without_callee_pct"] = 100.0 * sum(r["hook_own"] - r["hook_callee_frame"]
                                                            for r in hook_runs) / max(1, sum(r["samples"]
                                                                                             for r in hook_runs))
    print(f"pooled: hook arm — hook own {pooled['hook']['hook_pct']:.2f} % (without the callee's frame "
          f"{pooled['hook']['hook_without_callee_pct']:.2f} %); fr arm — FR {pooled['fr']['fr_pct']:.2f} %")
    if args.json:
        args.json.write_text(json.dumps({"runs": rows, "pooled": pooled}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
