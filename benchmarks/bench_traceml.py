"""Side by side with TraceML (``pip install traceml-ai``, runs on CPU): the same 2-rank gloo jobs under
``traceml run`` and under ``rankwatch run``, and what each one concludes.

Cases: TraceML's own demo (``examples/distributed/ddp_rank_straggler_demo.py`` of traceopt-ai/traceml,
not shipped here: pass its path with ``--traceml-demo``) in its three scenarios plus a periodic input
stall, and rankwatch's two cases from issue 13 (``examples/ddp_demo.py --traceml`` wraps each step in
TraceML's ``trace_step``): one rank's loader slow on every 4th batch, and every rank input-bound with
2 DataLoader workers. ``--baseline-rev REV`` also diagnoses each rankwatch run's records with
``watchdog/core/straggler.py`` as it was at git revision REV (the diagnosis before this change).

    python benchmarks/bench_traceml.py --traceml-demo /path/to/ddp_rank_straggler_demo.py \\
        --python /path/to/venv-with-traceml/bin/python --baseline-rev 046e1f9 --json traceml.json
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from _util import DEMO, REPO, Procs, free_port

# TraceML demo sizes for 2 shared CPU cores (its defaults are for a T4/L4 GPU): ~64 steps per rank
TRACEML_DEMO_SIZE = ("--num-samples", "4096", "--batch-size", "32", "--epochs", "1", "--input-dim", "128",
                     "--hidden-dim", "256", "--depth", "3", "--num-classes", "10", "--print-every", "0")
RANKWATCH_DEMO_SIZE = ("--steps", "80", "--traceml")

# name, script ("traceml" = their demo, "rankwatch" = examples/ddp_demo.py), args, what a user should be told
CASES: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("TraceML demo: balanced", "traceml", ("--scenario", "balanced"), "no straggler"),
    ("TraceML demo: input straggler (rank 1, +200 ms every batch)", "traceml",
     ("--scenario", "input-straggler", "--straggler-rank", "1"), "input straggler, rank 1"),
    ("TraceML demo: compute straggler (rank 1, 8 extra 512² matmuls in the optimizer)", "traceml",
     ("--scenario", "compute-straggler", "--straggler-rank", "1", "--compute-extra-dim", "512"),
     "compute straggler, rank 1"),
    ("TraceML demo: rank 1's loader +320 ms every 4th batch", "traceml",
     ("--scenario", "input-straggler", "--straggler-rank", "1", "--input-sleep-ms", "320",
      "--input-every-n-batches", "4"), "input straggler, rank 1, every 4 steps"),
    ("issue 13 case 1: rank 1's loader +320 ms every 4th batch (ddp_demo)", "rankwatch",
     ("--scenario", "input-straggler", "--straggler-rank", "1", "--input-sleep-ms", "320", "--input-every", "4"),
     "input straggler, rank 1, every 4 steps"),
    ("issue 13 case 2: every rank collate 60 ms, 2 workers, compute ~10 ms (ddp_demo)", "rankwatch",
     ("--scenario", "input-bound", "--num-workers", "2", "--input-sleep-ms", "60", "--hidden", "512"),
     "input-bound on every rank, no straggler"),
)


def run_traceml(procs: Procs, python: str, script: str, args: tuple[str, ...], work: Path, name: str) -> dict[str, Any]:
    logs = work / "traceml-logs"
    traceml_bin = str(Path(python).parent / "traceml")
    cmd = [traceml_bin, "run", script, "--nproc-per-node", "2", "--logs-dir", str(logs), "--run-name", name,
           "--aggregator-port", str(free_port()), "--master-port", str(free_port()), "--args", *args]
    t0 = time.monotonic()
    result = procs.run(cmd, timeout=900, text=True)
    wall = time.monotonic() - t0
    try:
        doc = json.loads((logs / name / "final_summary.json").read_text())
    except (OSError, ValueError):
        return {"verdict": f"no summary (exit {result.returncode})", "wall_s": wall,
                "stderr": result.stderr[-1500:]}
    primary = doc.get("primary_diagnosis") or {}
    ev = ((doc.get("step_time") or {}).get("diagnosis") or {}).get("evidence") or {}
    return {"verdict": primary.get("status"), "kind": primary.get("kind"), "summary": primary.get("summary"),
            "culprit_rank": ev.get("culprit_rank"), "wall_s": round(wall, 1)}


def run_rankwatch(procs: Procs, python: str, script: str, args: tuple[str, ...], work: Path,
                  name: str) -> tuple[dict[str, Any], Path]:
    out, shm = work / "rw-out", work / "rw-shm"
    cmd = [python, "-m", "rankwatch.watchdog.cli", "run", "--out", str(out), "--shm-dir", str(shm), "--quiet",
           "--run-name", name, "--", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", name, script, *args]
    t0 = time.monotonic()
    result = procs.run(cmd, timeout=900, text=True)
    wall = time.monotonic() - t0
    try:
        doc = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {"verdict": f"no summary (exit {result.returncode})", "wall_s": wall,
                "stderr": result.stderr[-1500:]}, shm / name
    return {"verdict": doc.get("diagnosis"), "ranks": doc.get("straggler_ranks"), "phase": doc.get("phase"),
            "why": doc.get("why"), "pattern": doc.get("pattern"), "wall_s": round(wall, 1)}, shm / name


def baseline_module(rev: str) -> ModuleType:
    """``watchdog/core/straggler.py`` at ``rev``, loaded into the package so its relative imports work."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:watchdog/core/straggler.py"],
                         capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "straggler_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("rankwatch.watchdog.core.straggler_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def baseline_diagnosis(mod: ModuleType, job_dir: Path) -> dict[str, Any]:
    from rankwatch.hooks.record import read_record

    per_rank = {}
    for p in glob.glob(str(job_dir / "rank-*.hb")):
        snap = read_record(p)
        per_rank[snap.global_rank] = list(snap.recent_steps)
    d = mod.diagnose_stragglers(per_rank)
    return {"verdict": d.label, "ranks": d.straggler_ranks, "why": d.why}


def cell_rankwatch(r: dict[str, Any]) -> str:
    who = f" rank {', '.join(map(str, r['ranks']))}" if r.get("ranks") else ""
    pattern = r.get("pattern") or {}
    extra = f", every {pattern['period']} steps" if pattern.get("kind") == "periodic" else ""
    return f"`{r['verdict']}`{who}{extra}"


def cell_traceml(r: dict[str, Any]) -> str:
    culprit = r.get("culprit_rank")
    named = culprit is not None and "STRAGGLER" in str(r["verdict"])
    return f"`{r['verdict']}`" + (f" rank {culprit}" if named else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traceml-demo", default=None,
                   help="path to TraceML's ddp_rank_straggler_demo.py (without it: the ddp_demo cases only)")
    p.add_argument("--python", default=sys.executable, help="a Python with traceml-ai, torch and rankwatch")
    p.add_argument("--baseline-rev", default=None, help="also diagnose with straggler.py at this git revision")
    p.add_argument("--quick", action="store_true", help="the two issue cases and TraceML's periodic case only")
    p.add_argument("--repeats", type=int, default=1, help="runs of each case (diagnoses can vary run to run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    probe = subprocess.run([args.python, "-c", "import traceml_ai"], capture_output=True, text=True)
    if probe.returncode != 0 or not (Path(args.python).parent / "traceml").exists():
        why = f"traceml-ai is not installed for {args.python} (pip install traceml-ai; pass --python)"
        print(f"SKIP: {why}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": why}))
        return 0
    base = baseline_module(args.baseline_rev) if args.baseline_rev else None
    cases = [c for c in CASES if not args.quick or "every 4th" in c[0] or "case 2" in c[0]]
    cases = [c for c in cases if c[1] != "traceml" or args.traceml_demo]
    rows, raw = [], []
    with Procs() as procs:
        for i, (name, which, case_args, truth) in enumerate(c for c in cases for _ in range(args.repeats)):
            script = args.traceml_demo if which == "traceml" else DEMO
            full = (*case_args, *(TRACEML_DEMO_SIZE if which == "traceml" else RANKWATCH_DEMO_SIZE))
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                tml = run_traceml(procs, args.python, script, full, work, f"case{i}")
                rw, job_dir = run_rankwatch(procs, args.python, script, full, work, f"case{i}")
                old = baseline_diagnosis(base, job_dir) if base is not None and job_dir.exists() else None
            raw.append({"case": name, "truth": truth, "traceml": tml, "rankwatch": rw, "baseline": old})
            cells = [name, truth, cell_traceml(tml), cell_rankwatch(rw)]
            if base is not None:
                cells.append(cell_rankwatch(old) if old else "–")
            rows.append("| " + " | ".join(cells) + " |")
            print(json.dumps(raw[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    head = ["case", "what is true", "TraceML 0.5.0", "rankwatch"]
    head += [f"rankwatch @ {args.baseline_rev}"] if base else []
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
