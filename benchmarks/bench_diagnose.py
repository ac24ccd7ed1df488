"""Throughput and memory of `rankwatch diagnose` on a large synthetic multi-rank log.

Writes a log of SIZE bytes to a temp file: torchrun --tee output of 8 ranks ("[defaultN]:[rankN]:"
training-progress lines, 1% NCCL INFO lines, Python logging lines), ending in a real-looking failure
(rank 5 CUDA error, the others' NCCL watchdog timeouts, torch elastic's failure report). Then runs the
installed `rankwatch diagnose --json` on it as a child process and reports wall time, MB/s and the
child's peak RSS (its own VmHWM), for a small and a large size, so constant memory shows as equal RSS.
Each round also times `grep -c` over the same file (the disk-speed reference; rounds interleaved, the
machine is shared) and `rankwatch diagnose` on a 2-line file (start-up: interpreter and imports), and the
figure is the median of the rounds and the ratio to grep's median. The package is byte-compiled first, as
an install leaves it (`--no-compile`: measure a source tree under PYTHONDONTWRITEBYTECODE=1, which
recompiles every module at each start).

    python benchmarks/bench_diagnose.py                 # 200 MB and 1 GB, 5 rounds
    python benchmarks/bench_diagnose.py --quick         # 200 MB, 3 rounds
    python benchmarks/bench_diagnose.py --quick --baseline-rev main~3   # + the code at that revision, same rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

RANKS = 8
REPO = Path(__file__).resolve().parent.parent
FAILURE = REPO / "tests/fixtures/logs/templated/slurm_cuda_illegal_r5.log"
# `rankwatch diagnose --json FILE` that prints its own peak RSS (VmHWM) on stderr at exit: wait4's ru_maxrss
# would also count this parent's memory (the child's high-water mark starts at its parent's at fork)
DIAGNOSE = (
    "import atexit, sys\n"
    "def hwm():\n"
    "    for line in open('/proc/self/status'):\n"
    "        if line.startswith('VmHWM:'): sys.stderr.write('rankwatch-bench-hwm ' + line.split()[1] + '\\n')\n"
    "atexit.register(hwm)\n"
    "from rankwatch.watchdog.cli.main import main\n"
    "sys.exit(main(['diagnose', '--json', sys.argv[1]]))\n"
)


def block(seed: int) -> bytes:
    """About 4 MB of ordinary output: what a healthy job prints most of the time."""
    out: list[str] = []
    step = seed * 4000
    n = 0
    while n < 4_000_000:
        step += 1
        n += len(out[-1]) * RANKS if out else 1
        for r in range(RANKS):
            out.append(
                f"[default{r}]:[rank{r}]:step {step} | loss {2.5 - (step % 997) / 1000:.4f} | lr 3.0e-04 | "
                f"grad_norm 0.{step % 97:02d} | tokens/s {400000 + step % 5000} | mem 61.2GB | dt 0.41s\n"
            )
            if step % 100 == r:
                out.append(
                    f"[default{r}]:gpu-node-3:4821{r}:4839{r} [{r}] NCCL INFO Channel 03/0 : {r}[{r}] -> "
                    f"{(r + 1) % RANKS}[{(r + 1) % RANKS}] via P2P/CUMEM/read\n"
                )
        if step % 50 == 0:
            out.append(f"[default0]:[rank0]:2026-11-30 10:00:00,123 - INFO - trainer - saved checkpoint step{step}\n")
    return "".join(out).encode()


def tail() -> bytes:
    """The failure, in torchrun --tee framing (rank 5 fails first; the others time out)."""
    lines = FAILURE.read_text().splitlines()[1:]
    return "".join(f"[default{ln.split(':', 1)[0].strip()}]:{ln.split(': ', 1)[1]}\n"
                   if ln[:1].isdigit() and ": " in ln else ln + "\n" for ln in lines).encode()


def write_log(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        blocks = [block(i) for i in range(4)]  # cycled: the scan cost does not depend on repetition
        written, i = 0, 0
        while written < size:
            b = blocks[i % len(blocks)]
            f.write(b)
            written += len(b)
            i += 1
        f.write(tail())


WORST_LINES = {
    # NCCL_DEBUG=INFO output: skipped by the prefilter itself
    "all NCCL INFO lines": "[default3]:gpu-node-3:48213:48390 [3] NCCL INFO Channel 03/0 : 3[3] -> 4[4] via P2P\n",
    # every line passes the prefilter and is parsed in Python: the slow path
    "every line mentions an Error": "[default3]:[rank3]: UserWarning: retrying after ConnectionError from the store\n",
}


def worst_case(d: str, mb: int = 30) -> None:
    from rankwatch.watchdog.diagnose import diagnose_logs

    for name, line in WORST_LINES.items():
        path = Path(d) / "worst.log"
        blk = (line * 40000).encode()
        with open(path, "wb") as f:
            for _ in range(mb * 1_000_000 // len(blk)):
                f.write(blk)
        t0 = time.perf_counter()
        diagnose_logs([str(path)])
        dt = time.perf_counter() - t0
        size = path.stat().st_size / 1e6
        print(f"{size:8.1f} MB  {dt:6.2f} s  {size / dt:6.1f} MB/s  ({name}, in-process)")
        path.unlink()


def export_rev(rev: str, d: str) -> dict[str, str]:
    """The package as it was at git revision ``rev``, byte-compiled, in ``d``: the environment that runs it."""
    root = Path(d) / "baseline"
    pkg = root / "rankwatch"
    pkg.mkdir(parents=True)
    archive = root / "src.tar"
    archive.write_bytes(subprocess.run(["git", "-C", str(REPO), "archive", rev, "watchdog", "hooks"],
                                       capture_output=True, check=True).stdout)
    with tarfile.open(archive) as tar:
        tar.extractall(pkg, filter="data")
    (pkg / "__init__.py").write_text("")
    import compileall

    compileall.compile_dir(str(pkg), quiet=2)
    return dict(os.environ, PYTHONPATH=str(root))


def measure(path: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", DIAGNOSE, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    assert p.stdout is not None and p.stderr is not None
    out = p.stdout.read()
    err = p.stderr.read()  # one line (a traceback at worst): cannot fill its pipe while stdout is read
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    doc = json.loads(out)
    assert doc["initiating_ranks"] == [5], doc["reason"]
    size = path.stat().st_size
    cpu = usage.ru_utime + usage.ru_stime  # its greps too: it waits for them
    hwm = [ln.split()[1] for ln in err.decode(errors="replace").splitlines() if ln.startswith("rankwatch-bench-hwm ")]
    hwm_kb = int(hwm[-1]) if hwm else usage.ru_maxrss
    return {"mb": size / 1e6, "s": wall, "mbps": size / 1e6 / wall, "rss_mb": hwm_kb / 1024, "cpu_s": cpu}


def startup(d: str) -> float:
    """Seconds of ``rankwatch diagnose`` on a 2-line log: interpreter start, imports, one verdict."""
    path = Path(d) / "tiny.log"
    path.write_bytes(b"[default0]:[rank0]:step 1\n[default1]:[rank1]:step 1\n")
    t0 = time.perf_counter()
    subprocess.run(["rankwatch", "diagnose", "--json", str(path)], capture_output=True, check=False, timeout=600)
    return time.perf_counter() - t0


def byte_compile() -> None:
    """Write the package's .pyc files (what pip does at install; a no-op where they exist or cannot be written)."""
    import compileall

    import rankwatch.watchdog

    compileall.compile_dir(str(Path(rankwatch.watchdog.__file__).parent), quiet=2)


def grep_count(path: Path) -> tuple[float, float]:
    """MB/s and CPU seconds of ``grep -c`` for a keyword of the failure (one pass in C: the reference speed)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(["grep", "-c", "Error", str(path)], stdout=subprocess.PIPE)
    assert p.stdout is not None
    p.stdout.read()
    _, _, usage = os.wait4(p.pid, 0)
    return path.stat().st_size / 1e6 / (time.perf_counter() - t0), usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=None, help="default 200 1000 (quick: 200)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per size (default 5, quick 3)")
    ap.add_argument("--dir", default=None, help="where to write the temp logs (default: $TMPDIR)")
    ap.add_argument("--worst-case", action="store_true", help="also time logs where every line is a candidate")
    ap.add_argument("--quick", action="store_true", help="200 MB, 3 rounds")
    ap.add_argument("--json", type=Path, default=None, help="also write raw results here")
    ap.add_argument("--no-compile", action="store_true", help="do not byte-compile the package first")
    ap.add_argument("--baseline-rev", default=None, help="also time the code at this git revision, same rounds")
    args = ap.parse_args()
    if not args.no_compile:
        byte_compile()
    sizes = args.sizes_mb or ([200] if args.quick else [200, 1000])
    rounds = args.rounds or (3 if args.quick else 5)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared)")
    rows, raw = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        base_env = export_rev(args.baseline_rev, d) if args.baseline_rev else None
        for mb in sizes:
            path = Path(d) / f"synthetic-{mb}MB.log"
            write_log(path, mb * 1_000_000)
            runs, greps, grep_cpu, starts, base = [], [], [], [], []
            for i in range(rounds):
                order = ("grep", "rw", "start", "base") if i % 2 == 0 else ("base", "start", "rw", "grep")
                for which in order:
                    if which == "base":
                        if base_env:
                            base.append(measure(path, base_env))
                        continue
                    if which == "grep":
                        g, c = grep_count(path)
                        greps.append(g)
                        grep_cpu.append(c)
                    elif which == "rw":
                        runs.append(measure(path))
                    else:
                        starts.append(startup(d))
                print(f"  round {i + 1}/{rounds} {mb} MB: diagnose {runs[-1]['mbps']:6.1f} MB/s "
                      f"(RSS {runs[-1]['rss_mb']:.1f} MB), grep -c {greps[-1]:6.1f} MB/s, "
                      f"start-up {starts[-1]:.3f} s", flush=True)
            mbps = statistics.median(r["mbps"] for r in runs)
            gmbps = statistics.median(greps)
            rss = max(r["rss_mb"] for r in runs)
            start_s = statistics.median(starts)
            cpu, gcpu = statistics.median(r["cpu_s"] for r in runs), statistics.median(grep_cpu)
            raw.append({"mb": runs[0]["mb"], "diagnose": runs, "grep_c_mbps": greps, "grep_c_cpu_s": grep_cpu,
                        "startup_s": starts, "baseline": base})
            load = os.getloadavg()[0]
            rows.append(f"| `rankwatch diagnose`, {runs[0]['mb']:.0f} MB synthetic 8-rank log, median of {rounds} "
                        f"interleaved rounds (load {load:.1f}) | **{mbps:.0f} MB/s** vs `grep -c` {gmbps:.0f} MB/s "
                        f"(= {100 * mbps / gmbps:.0f} % of grep), peak RSS {rss:.1f} MB, start-up {start_s:.2f} s; "
                        f"CPU {cpu:.2f} s vs grep's {gcpu:.2f} s "
                        f"| >= 300 MB/s | {'yes' if mbps >= 300 else 'NO (see grep: the machine)'} |")
            if base:
                bm, bc = statistics.median(r["mbps"] for r in base), statistics.median(r["cpu_s"] for r in base)
                brss = max(r["rss_mb"] for r in base)
                rows.append(f"| … the code at `{args.baseline_rev}`, same rounds | {bm:.0f} MB/s "
                            f"(= {100 * bm / gmbps:.0f} % of grep), peak RSS {brss:.1f} MB; CPU {bc:.2f} s | — | — |")
                print(f"{'':8} baseline {args.baseline_rev}: {bm:6.1f} MB/s  CPU {bc:.2f} s  peak RSS {brss:.1f} MB")
            print(f"{runs[0]['mb']:8.1f} MB  {mbps:6.1f} MB/s  grep -c {gmbps:6.1f} MB/s  peak RSS {rss:.1f} MB"
                  f"  start-up {start_s:.3f} s  CPU {cpu:.2f} s (grep -c {gcpu:.2f} s)  -> initiator rank 5 (correct)",
                  flush=True)
            path.unlink()
        if args.worst_case:
            worst_case(d)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    print("\n| what | median | target | met? |\n|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
