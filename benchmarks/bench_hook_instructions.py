"""The hook's cost per step in instructions and simulated cache misses (callgrind): a figure the load of
other jobs on shared cores cannot move.

On 2 shared cores the wall-clock and CPU-time A/Bs of ``bench_hook.py`` (a2, a3) swing by ±20 µs per step
with the load, more than the changes worth making to the hook. Under valgrind's callgrind every
instruction the training thread executes is counted, and with ``--cache-sim`` every simulated L1 and
last-level miss, so two versions of the hook can be compared in one run each. The loop is (a2)'s
(``bench_hook.py --step-child``: the demo's small-step DDP loop in one process, blocks of 10 steps with the
hook switched off and on alternately); ``step_child`` calls ``getppid()`` before and after each block and
callgrind (``--dump-before=getppid``) writes the counters of each block to its own file. The cost per step
is the median over pairs of adjacent blocks of (on − off) / 10 (with Python's cyclic collector off while
counting: its passes fall at allocation counts, in one block of a pair, ±15k instructions a step), for the
training thread only
(``--separate-threads``: the gloo and flight-recorder threads poll by wall time, which valgrind stretches).

Estimated cycles are callgrind's usual model, Ir + 10 × L1 misses + 100 × last-level misses; the µs figure
divides them by this machine's clock (``/proc/cpuinfo``) at one instruction per cycle, a rough scale, not a
measurement. Start-up under valgrind takes 1–4 minutes (``import torch``), the steps ~50 ms each.

    python benchmarks/bench_hook_instructions.py                      # 200 steps, cache simulation on
    python benchmarks/bench_hook_instructions.py --tracker-off        # the points on, no record writes
    python benchmarks/bench_hook_instructions.py --tree /tmp/base     # another checkout's hooks/ (A/B)
    python benchmarks/bench_hook_instructions.py --only backward      # one group of points (where the cost is)
    python benchmarks/bench_hook_instructions.py --quick              # 40 steps: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import REPO, Procs, median, print_results

BENCH_HOOK = REPO / "benchmarks" / "bench_hook.py"
PER_BLOCK = 10  # steps per block: bench_hook.step_child's
# callgrind's cycle estimate (callgrind_annotate's CEst): an L1 miss ~10 cycles, a last-level miss ~100
L1_MISS_CYCLES, LL_MISS_CYCLES = 10, 100


def cpu_mhz() -> float:
    """This machine's clock (the first core's current MHz; 3,000 where /proc/cpuinfo does not say)."""
    try:
        m = re.search(r"cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text())
        return float(m.group(1)) if m else 3000.0
    except OSError:
        return 3000.0


def parse_part(text: str) -> dict[str, int]:
    """One callgrind output file's totals by event name."""
    events = re.search(r"(?m)^events:\s*(.+)$", text)
    totals = re.search(r"(?m)^(?:totals|summary):\s*(.+)$", text)
    if not events or not totals:
        raise ValueError("no events/totals line")
    names, values = events.group(1).split(), [int(v) for v in totals.group(1).split()]
    return dict(zip(names, values + [0] * (len(names) - len(values)), strict=True))


def ll_misses(ev: dict[str, int]) -> int:
    return ev.get("ILmr", 0) + ev.get("DLmr", 0) + ev.get("DLmw", 0)


def est_cycles(ev: dict[str, int]) -> int:
    l1 = ev.get("I1mr", 0) + ev.get("D1mr", 0) + ev.get("D1mw", 0)
    return ev["Ir"] + L1_MISS_CYCLES * l1 + LL_MISS_CYCLES * ll_misses(ev)


def blocks_of(out_dir: Path, stem: str) -> list[dict[str, int]]:
    """The training thread's counters per interval between two marks, in order. Part 1 is everything
    before the first mark; then each block and each switch between blocks alternate."""
    parts: dict[int, Path] = {}
    for f in out_dir.iterdir():
        m = re.fullmatch(re.escape(stem) + r"\.(\d+)-01", f.name)
        if m:
            parts[int(m.group(1))] = f
    ordered = [parse_part(parts[k].read_text()) for k in sorted(parts)]
    return ordered[1::2]  # parts 2, 4, 6, …: the blocks


def run(steps: int, cache_sim: bool, tracker_off: bool, tree: Path | None, only: str | None = None,
        keep: Path | None = None) -> dict[str, float]:
    """One step_child under callgrind; per-step medians of the paired block differences. ``keep``: copy
    callgrind's per-block files there (for ``callgrind_annotate``: where the misses are, by function)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("bench_hook_instructions: valgrind is not installed (apt-get install valgrind)")
    tmp = Path(tempfile.mkdtemp(prefix="rw-bench-cg-"))
    shm = tempfile.mkdtemp(prefix="rw-bench-shm-")
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="2000", PYTHONHASHSEED="0",
               RANKWATCH_SHM_DIR=shm, RANKWATCH_JOB_ID="bench-cg", RANKWATCH_BENCH_MARKS="instr")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RANKWATCH_DDP_TIMING", "RANKWATCH_DISABLE"):
        env.pop(key, None)
    if tracker_off:
        env["RANKWATCH_BENCH_TRACKER_OFF"] = "1"
    if only:
        env["RANKWATCH_BENCH_ONLY"] = only
    if tree is not None:  # PYTHONPATH wins over the editable install: that tree's rankwatch package
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # --instr-atstart=no: `import torch` and the warm-up run uninstrumented (several times faster); step_child
    # switches instrumentation on (callgrind_control -i on) before its first block
    cmd = [valgrind, "--tool=callgrind", "--instr-atstart=no", "--dump-before=getppid", "--separate-threads=yes",
           f"--cache-sim={'yes' if cache_sim else 'no'}", f"--callgrind-out-file={tmp}/cg.out",
           sys.executable, str(BENCH_HOOK), "--step-child", str(steps)]
    try:
        with Procs() as procs:
            res = procs.run(cmd, timeout=1800, text=True, env=env)
        if res.returncode != 0:
            raise SystemExit(f"bench_hook_instructions: the child failed ({res.returncode}):\n"
                             f"{res.stderr[-3000:]}")
        blocks = blocks_of(tmp, "cg.out")
        if keep is not None:
            shutil.copytree(tmp, keep, dirs_exist_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), "{}")
    order = [bool(v) for v in json.loads(line).get("order", [])]
    if len(order) != len(blocks) or not order:
        raise SystemExit(f"bench_hook_instructions: {len(blocks)} marked blocks for {len(order)} in the loop")
    out: dict[str, float] = {"pairs": len(order) / 2}
    keys = {"ir": lambda ev: ev["Ir"]}
    if cache_sim:
        keys["cycles"] = est_cycles
        keys["ll_misses"] = ll_misses
        keys["i1_misses"] = lambda ev: ev.get("I1mr", 0)
        keys["d1_misses"] = lambda ev: ev.get("D1mr", 0) + ev.get("D1mw", 0)
    for name, f in keys.items():
        diffs, offs = [], []
        for i in range(0, len(order) - 1, 2):
            a, b = blocks[i], blocks[i + 1]
            on, off = (a, b) if order[i] else (b, a)
            diffs.append((f(on) - f(off)) / PER_BLOCK)
            offs.append(f(off) / PER_BLOCK)
        out[f"{name}_per_step"] = median(diffs)
        out[f"{name}_step_off"] = median(offs)
        out[f"{name}_spread"] = max(diffs) - min(diffs)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="steps in blocks of 10 (default 200, quick 40)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-cache-sim", action="store_true", help="instructions only (about twice as fast)")
    p.add_argument("--tracker-off", action="store_true", help="hooked blocks with the record not written")
    p.add_argument("--only", choices=("dataloader", "forward", "backward", "optimizer", "collective"),
                   help="hooked blocks with only this group of points on (bench_hook.HookSwitch.groups)")
    p.add_argument("--tree", type=Path, default=None,
                   help="a directory holding another version's rankwatch package (e.g. a git archive as pkg/rankwatch)")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep callgrind's per-block files here (callgrind_annotate them: misses by function)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    steps = args.steps or (40 if args.quick else 200)
    if steps < 2 * PER_BLOCK:
        print(f"bench_hook_instructions: --steps must be at least {2 * PER_BLOCK}", file=sys.stderr)
        return 2
    r = run(steps, not args.no_cache_sim, args.tracker_off, args.tree, args.only, args.keep)
    what = "the points on, tracker disabled" if args.tracker_off else "hook on"
    if args.only:
        what += f", only {args.only}"
    where = f" ({args.tree})" if args.tree else ""
    rows = [f"| hook instructions per step{where}, {what} vs off, training thread, median of {r['pairs']:.0f} "
            f"paired blocks (callgrind) | **{r['ir_per_step']:+,.0f} Ir** of {r['ir_step_off']:,.0f} per step "
            f"(spread {r['ir_spread']:,.0f}) | — | — |"]
    if "cycles_per_step" in r:
        us = r["cycles_per_step"] / cpu_mhz()
        rows.append(f"| … estimated cycles (Ir + 10 × L1 + 100 × LL misses) | **{r['cycles_per_step']:+,.0f}** "
                    f"(L1 misses: instruction {r['i1_misses_per_step']:+,.0f}, data {r['d1_misses_per_step']:+,.0f}; "
                    f"LL misses {r['ll_misses_per_step']:+,.0f}; ≈ {us:+.1f} µs at {cpu_mhz():,.0f} MHz) | "
                    f"≈ 20 µs | {'yes' if us <= 20 else 'NO'} |")
    return print_results(rows, {"steps": steps, **r}, args.json)


if __name__ == "__main__":
    sys.exit(main())
