"""Memory of the long-lived watchdog processes: ``rankwatch run`` (this node's watchdog around torchrun)
and ``rankwatch daemon``, while a small job runs.

The job: one rank under torchrun (``-m rankwatch.hooks``, gloo-free: the script only waits for a release
file), so the watchdog's own footprint is what is measured, not the job's. Per rep, interleaved:

* **run**: ``rankwatch run --quiet -- --nproc-per-node 1 … job.py``. Once the rank has started, the RSS of
  the ``rankwatch run`` process is sampled every 0.25 s for ``--seconds`` (median), plus its VmHWM (peak),
  whether it maps libtorch (``/proc/PID/maps``) and the time from launch to the rank running.
* **run + torch (before)**: the same command with ``torch.distributed.run`` imported into the watchdog
  first, which is what the old ``inject_hooks`` did to reach ``get_args_parser()``.
* **daemon**: ``rankwatch daemon`` started on the run arm's shm dir (watching the same job), sampled
  alongside the run arm; and ``rankwatch daemon --once`` over it: peak RSS (``os.wait4``) and wall time.

    python benchmarks/bench_footprint.py            # 3 reps, 8 s windows (~1.5 min)
    python benchmarks/bench_footprint.py --quick    # 1 rep, 3 s windows
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import REPO, Procs, kill_tree, median, print_results, rankwatch_cmd, spread, torchrun_args

JOB = """
import os, sys, time
marker, release = sys.argv[1], sys.argv[2]
open(marker, "w").close()
deadline = time.monotonic() + 300
while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.1)
"""

# `rankwatch run` with torch's parser module loaded into the watchdog, as before the no-torch parser
BEFORE = "import sys, torch.distributed.run; from rankwatch.watchdog.cli.main import main; sys.exit(main(sys.argv[1:]))"


def maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


def vm_hwm_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited {proc.returncode} before the rank started")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the rank did not start in {timeout:g} s")
        time.sleep(0.05)


def once_cost(shm: Path, out: Path) -> tuple[float, float]:
    t = time.monotonic()
    proc = subprocess.Popen(
        rankwatch_cmd("daemon", "--once", "--shm-dir", str(shm), "--out", str(out)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"rankwatch daemon --once exited {proc.returncode}")
    return time.monotonic() - t, usage.ru_maxrss / 1024


def one_run(arm: str, seconds: float, rep: int) -> dict:
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="rw-bench-footprint-"))
    script, marker, release = tmp / "job.py", tmp / "started", tmp / "release"
    script.write_text(JOB)
    shm, out = tmp / "shm", tmp / "out"
    job = f"bench-footprint-{arm.replace(' ', '')}-{rep}"
    run_args = ["run", "--out", str(out), "--shm-dir", str(shm), "--quiet", "--run-name", job, "--"]
    run_args += torchrun_args(1, job, str(script), str(marker), str(release))
    cmd = rankwatch_cmd(*run_args) if arm == "run" else [sys.executable, "-c", BEFORE, *run_args]
    res: dict = {"arm": arm}
    try:
        with Procs() as procs:
            log = open(tmp / "run.log", "wb")  # noqa: SIM115
            t0 = time.monotonic()
            run = procs.start(cmd, stdout=log, stderr=log, cwd=REPO)
            wait_file(marker, run, 120)
            res["startup_s"] = time.monotonic() - t0
            daemon = None
            if arm == "run":
                dlog = open(tmp / "daemon.log", "wb")  # noqa: SIM115
                daemon = procs.start(
                    rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(tmp / "dout")), stdout=dlog, stderr=dlog
                )
            time.sleep(1.0)  # the run's first polls; the daemon's start-up and discovery
            pr = psutil.Process(run.pid)
            pd = psutil.Process(daemon.pid) if daemon else None
            rss_run, rss_daemon = [], []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                rss_run.append(pr.memory_info().rss / 2**20)
                if pd is not None:
                    rss_daemon.append(pd.memory_info().rss / 2**20)
                time.sleep(0.25)
            res |= {
                "rss_mb": median(rss_run),
                "hwm_mb": vm_hwm_mb(run.pid),
                "libtorch": maps_torch(run.pid),
            }
            if daemon is not None and pd is not None:
                res |= {
                    "daemon_rss_mb": median(rss_daemon),
                    "daemon_hwm_mb": vm_hwm_mb(daemon.pid),
                    "daemon_libtorch": maps_torch(daemon.pid),
                    "daemon_alive": daemon.poll() is None,
                }
                kill_tree(daemon)
                res["once_s"], res["once_mb"] = once_cost(shm, tmp / "oout")
            release.touch()
            try:
                res["rc"] = run.wait(timeout=120)
            except subprocess.TimeoutExpired:
                res["rc"] = None
            log.close()
            if res["rc"] != 0:
                res["log_tail"] = (tmp / "run.log").read_text(errors="replace")[-2000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 rep, 3 s sampling windows")
    p.add_argument("--reps", type=int, default=None, help="reps per arm (default 3)")
    p.add_argument("--seconds", type=float, default=None, help="sampling window per run (default 8)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    seconds = args.seconds or (3.0 if args.quick else 8.0)

    raw: list[dict] = []
    for rep in range(reps):
        for arm in ("run", "run + torch"):
            print(f"rep {rep + 1}/{reps}: {arm}", flush=True)
            r = one_run(arm, seconds, rep)
            raw.append(r)
            print(f"  {r}", flush=True)

    def col(arm: str, key: str) -> list[float]:
        return [r[key] for r in raw if r["arm"] == arm and key in r]

    def fmt(arm: str, key: str) -> str:
        xs = col(arm, key)
        return f"{median(xs):.1f} MiB (range {spread(xs)})" if xs else "—"

    torch_now = any(col("run", "libtorch"))
    torch_before = all(col("run + torch", "libtorch"))
    failed = [r for r in raw if r.get("rc") != 0]
    rows = [
        f"| `rankwatch run` watchdog RSS during a 1-rank job (median of {reps} runs; each the median of "
        f"{seconds:g} s of 0.25 s samples) | **{fmt('run', 'rss_mb')}**; peak (VmHWM) {fmt('run', 'hwm_mb')}; "
        f"libtorch mapped: {'YES' if torch_now else 'no'} | — | — |",
        f"| … before: same with `torch.distributed.run` imported (as the old `inject_hooks` did) | "
        f"{fmt('run + torch', 'rss_mb')}; peak {fmt('run + torch', 'hwm_mb')}; libtorch mapped: "
        f"{'yes' if torch_before else 'NO'} | — | — |",
        f"| … launch → rank running, now / before | {median(col('run', 'startup_s')):.2f} s / "
        f"{median(col('run + torch', 'startup_s')):.2f} s | — | — |",
        f"| `rankwatch daemon` RSS watching the same job | {fmt('run', 'daemon_rss_mb')}; peak "
        f"{fmt('run', 'daemon_hwm_mb')}; libtorch mapped: {'YES' if any(col('run', 'daemon_libtorch')) else 'no'} "
        f"| — | — |",
        f"| `rankwatch daemon --once` over the job's shm dir: peak RSS, wall | {fmt('run', 'once_mb')}, "
        f"{median(col('run', 'once_s')):.2f} s | — | — |",
    ]
    if failed:
        rows.append(f"| runs where rankwatch run did not exit 0 | {len(failed)} of {len(raw)} | 0 | NO |")
    return print_results(rows, raw, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
