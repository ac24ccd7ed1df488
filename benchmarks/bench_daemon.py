"""Daemon footprint, and what torch would cost it.

(1) ``rankwatch daemon`` (default poll interval 0.5 s, JSON logs to a file) watching one job of 8 ranks
    for ``--seconds``. The ranks are 8 lightweight *fake writers* (this script in ``--writer`` mode):
    real processes that create a real shm record through ``RecordWriter`` and tick it with
    ``rankwatch.hooks.tracker.Tracker`` exactly as the hook does — dataloader, forward, backward,
    optimizer, step(), one all_reduce per step — at ``--step-ms`` per step (time spent in sleeps).
    Chosen over 8 real DDP ranks because 8 torch processes saturate the 2 shared cores and would turn the
    daemon's CPU reading into a scheduler measurement; the daemon cannot tell the difference (it reads
    records and probes pids, and the writers map their record as ranks do). CPU % of one core =
    Δ(user+system CPU time) / Δwall from psutil on the daemon pid, after a warm-up; RSS sampled each
    second (median and max). At the end: does the daemon process map libtorch (``/proc/PID/maps``)?
(2) Import cost, interleaved, median of ``--import-reps``: wall time and peak RSS (``os.wait4``) of
    ``python -c pass``, ``python -c "import rankwatch.watchdog.serve.daemon"``, ``python -c "import torch"``.
(3) Does the daemon's import path load torch? A child process imports every module ``rankwatch daemon``
    loads (cli, cmd_daemon, daemon, its probes), builds a Daemon and polls a fake job once, with an
    import tracer that records the rankwatch frames importing ``torch``; same with ``--store-port``'s
    module (``correlate``), and a client ``JobStore`` construction (the daemon's: pure Python, no TCPStore).

    python benchmarks/bench_daemon.py            # 60 s at 50 ms steps + 30 s at 5 ms steps (~2.5 min)
    python benchmarks/bench_daemon.py --quick    # 6 s each after a 1 s warm-up, 2 import reps
    python benchmarks/bench_daemon.py --quick --seconds 2 --import-reps 1   # a smoke run (the test suite)
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
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import REPO, Procs, kill_tree, median, print_results, rankwatch_cmd, spread

N_RANKS = 8


# -- fake rank ------------------------------------------------------------------------------------
def writer_main(shm: str, job: str, rank: int, world: int, step_ms: float, max_s: float) -> int:
    from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, record_path, write_identity
    from rankwatch.hooks.tracker import Tracker

    os.makedirs(os.path.join(shm, job), mode=0o700, exist_ok=True)
    writer = RecordWriter(record_path(shm, job, rank))
    write_identity(
        writer,
        RankIdentity(
            pid=os.getpid(),
            global_rank=rank,
            local_rank=rank,
            world_size=world,
            local_world_size=world,
            node_rank=0,
            device=-1,
            hostname=os.uname().nodename,
            job_id=job,
            start_ns=time.monotonic_ns(),
        ),
        list(CANONICAL_PHASES),
    )
    tr = Tracker(writer)
    parent = os.getppid()
    slice_s = step_ms / 1000.0 / 5
    end = time.monotonic() + max_s
    slots = [CANONICAL_PHASES.index(p) for p in ("dataloader", "forward", "backward", "optimizer")]
    while time.monotonic() < end and os.getppid() == parent:
        for slot in slots:
            tr.enter(slot)
            time.sleep(slice_s)
            tr.exit(slot)
        tr.step()
        tr.collective_enter("all_reduce")
        time.sleep(slice_s)
        tr.collective_exit()
    tr.mark_exit()
    return 0


# -- (1) footprint --------------------------------------------------------------------------------
def maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any("libtorch" in line for line in f)
    except OSError:
        return False


def footprint(step_ms: float, seconds: float, warmup: float) -> dict:
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="rw-bench-daemon-"))
    shm, out = tmp / "shm", tmp / "out"
    shm.mkdir(mode=0o700)
    job = f"bench-daemon-{int(step_ms)}ms"
    try:
        with Procs() as procs:
            bound = seconds + warmup + 60
            for r in range(N_RANKS):
                procs.start(
                    [
                        sys.executable,
                        __file__,
                        "--writer",
                        str(shm),
                        job,
                        str(r),
                        str(N_RANKS),
                        str(step_ms),
                        str(bound),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            log = open(tmp / "daemon.log", "wb")  # noqa: SIM115
            daemon = procs.start(
                rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(out), "--json-logs"),
                stdout=log,
                stderr=log,
            )
            try:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    text = (tmp / "daemon.log").read_text(errors="replace")
                    if text.count('"rank_discovered"') >= N_RANKS:
                        break
                    if daemon.poll() is not None:
                        raise RuntimeError(f"daemon exited {daemon.returncode}:\n{text[-3000:]}")
                    time.sleep(0.2)
                else:
                    raise RuntimeError("the daemon did not discover 8 ranks in 60 s")
                time.sleep(warmup)
                p = psutil.Process(daemon.pid)
                c0, t0 = p.cpu_times(), time.monotonic()
                rss = []
                while time.monotonic() - t0 < seconds:
                    rss.append(p.memory_info().rss / 2**20)
                    time.sleep(1.0)
                c1, t1 = p.cpu_times(), time.monotonic()
                cpu = ((c1.user + c1.system) - (c0.user + c0.system)) / (t1 - t0) * 100
                torch_mapped = maps_torch(daemon.pid)
                threads = p.num_threads()
                text = (tmp / "daemon.log").read_text(errors="replace")
                incidents = text.count('"incident_detected"')
                alive = daemon.poll() is None
            finally:
                kill_tree(daemon)
                log.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "step_ms": step_ms,
        "seconds": seconds,
        "cpu_percent": cpu,
        "rss_median_mb": median(rss),
        "rss_max_mb": max(rss),
        "libtorch_mapped": torch_mapped,
        "threads": threads,
        "incidents": incidents,
        "alive": alive,
    }


def read_cost(reps: int = 200) -> dict[str, float]:
    """What one poll of one rank costs in RecordReader.read, by number of steps completed since the last poll
    (the ring entries are decoded in Python): explains how the daemon's CPU scales with the step rate."""
    from rankwatch.hooks.record import (
        CANONICAL_PHASES,
        RankIdentity,
        RecordReader,
        RecordWriter,
        record_path,
        write_identity,
    )
    from rankwatch.hooks.tracker import Tracker

    tmp = tempfile.mkdtemp(prefix="rw-bench-read-")
    try:
        os.makedirs(os.path.join(tmp, "job"), mode=0o700)
        w = RecordWriter(record_path(tmp, "job", 0))
        write_identity(
            w, RankIdentity(os.getpid(), 0, 0, 1, 1, 0, -1, "h", "job", time.monotonic_ns()), list(CANONICAL_PHASES)
        )
        tr = Tracker(w)
        for _ in range(1000):
            for slot in range(4):
                tr.enter(slot)
                tr.exit(slot)
            tr.step()
        reader = RecordReader(w.path)
        out = {}
        for new in (0, 100):
            ts = []
            for _ in range(reps):
                t = time.thread_time_ns()
                reader.read(since_step=999 - new)
                ts.append(time.thread_time_ns() - t)
            out[f"read_{new}_us"] = median(ts) / 1000
        reader.close()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- (2) import cost ------------------------------------------------------------------------------
def child_cost(code: str) -> tuple[float, float]:
    t = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{code!r} exited {proc.returncode}")
    return time.monotonic() - t, usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux


IMPORTS = {
    "python -c pass": "pass",
    "import rankwatch.watchdog.serve.daemon": "import rankwatch.watchdog.serve.daemon",
    "import torch": "import torch",
}


def import_costs(reps: int, warm: bool = True) -> dict[str, dict[str, list[float]]]:
    res: dict[str, dict[str, list[float]]] = {k: {"s": [], "mb": []} for k in IMPORTS}
    if warm:
        child_cost("import torch")  # page cache warm
    for _ in range(reps):
        for name, code in IMPORTS.items():
            s, mb = child_cost(code)
            res[name]["s"].append(s)
            res[name]["mb"].append(mb)
    return res


# -- (3) who imports torch ------------------------------------------------------------------------
TRACE = r"""
import json, os, sys, tempfile, time, traceback

chains = []

class Tracer:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not chains:
            chains.append([f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.line}"
                           for f in traceback.extract_stack()[:-1]
                           if "rankwatch" in f.filename or ROOT in f.filename])
        return None

ROOT = __ROOT__
sys.meta_path.insert(0, Tracer())
step = __STEP__
out = {}
import rankwatch.watchdog.cli.main
import rankwatch.watchdog.cli.daemon as cmd_daemon
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig
from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, record_path, write_identity
from rankwatch.hooks.tracker import Tracker
tmp = tempfile.mkdtemp()
os.makedirs(os.path.join(tmp, "job"))
w = RecordWriter(record_path(tmp, "job", 0))
write_identity(w, RankIdentity(os.getpid(), 0, 0, 1, 1, 0, -1, "h", "job", time.monotonic_ns()), list(CANONICAL_PHASES))
tr = Tracker(w); tr.enter(0); tr.exit(0); tr.step()
d = Daemon(DaemonConfig(shm_dir=tmp, out_dir=os.path.join(tmp, "out")))
d.poll_once(); d.poll_once()
d.close()
out["daemon_path"] = "torch" in sys.modules
if step == "store":
    import rankwatch.watchdog.cluster.correlate
    out["correlate_import"] = "torch" in sys.modules
    from rankwatch.watchdog.cluster.store import JobStore
    try:  # a daemon is only ever a client (cluster.store_host hosts): its bounded client needs no torch
        JobStore("127.0.0.1", 1, "job", host_server=False, timeout_s=2.0)
    except Exception as exc:
        out["store_error"] = repr(exc)[:200]
    out["jobstore"] = "torch" in sys.modules
out["torch_modules"] = sum(1 for m in sys.modules if m == "torch" or m.startswith("torch."))
out["chain"] = chains[0] if chains else None
print(json.dumps(out))
"""


def torch_import_check(step: str) -> dict:
    code = TRACE.replace("__STEP__", repr(step)).replace("__ROOT__", repr(str(REPO)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": res.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--writer":
        shm, job, rank, world, step_ms, max_s = sys.argv[2:8]
        return writer_main(shm, job, int(rank), int(world), float(step_ms), float(max_s))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="6 s per footprint run, 2 import reps")
    p.add_argument("--seconds", type=float, default=None,
                   help="measurement window at 50 ms steps (default 60; with --quick: both windows)")
    p.add_argument("--import-reps", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    # --quick proves the benchmark still runs (the test suite runs it); its CPU figure is not one to quote
    long_s = args.seconds or (6.0 if args.quick else 60.0)
    short_s = (args.seconds or 6.0) if args.quick else 30.0
    warmup = 1.0 if args.quick else 5.0
    reps = args.import_reps or (2 if args.quick else 7)

    raw: dict = {"footprint": []}
    rows = []
    for step_ms, secs in ((50.0, long_s), (5.0, short_s)):
        print(f"(1) daemon watching {N_RANKS} fake ranks at {step_ms:g} ms/step for {secs:g} s", flush=True)
        f = footprint(step_ms, secs, warmup=warmup)
        raw["footprint"].append(f)
        print(f"  {f}", flush=True)
        ok = f["cpu_percent"] < 1.0
        rows.append(
            f"| `rankwatch daemon` CPU, 8 ranks (fake writers) at {step_ms:g} ms/step, poll 0.5 s, {secs:g} s | "
            f"**{f['cpu_percent']:.2f} % of one core** | < 1 % | {'yes' if ok else 'NO'} |"
        )
        rows.append(
            f"| `rankwatch daemon` RSS, same run | {f['rss_median_mb']:.1f} MiB (max {f['rss_max_mb']:.1f}); "
            f"{f['threads']} threads; libtorch mapped: {'YES' if f['libtorch_mapped'] else 'no'}; "
            f"false incidents: {f['incidents']} | — | — |"
        )
    rc = read_cost()
    raw["read_cost"] = rc
    per_step = (rc["read_100_us"] - rc["read_0_us"]) / 100
    rows.append(
        f"| RecordReader.read per rank per poll: nothing new → 100 new steps (in-process, CPU time) | "
        f"{rc['read_0_us']:.0f} µs → {rc['read_100_us']:.0f} µs ({per_step:.1f} µs per new step; 8 ranks at 5 ms "
        f"steps = {per_step * 8 * 200 / 1e4:.2f} % of a core for decoding alone) | — | — |"
    )
    print(f"(2) import cost, {reps} interleaved reps", flush=True)
    costs = import_costs(reps, warm=not args.quick)  # a quick run's import times are not quoted
    raw["imports"] = costs
    for name, c in costs.items():
        rows.append(
            f"| `{name}`: wall time, peak RSS ({reps} reps) | {median(c['s']) * 1000:.0f} ms "
            f"(range {spread([x * 1000 for x in c['s']])}), {median(c['mb']):.0f} MiB | — | — |"
        )
    print("(3) does the daemon's import path load torch?", flush=True)
    plain = torch_import_check("plain")
    store = torch_import_check("store")
    raw["torch_check"] = {"plain": plain, "store": store}
    print(f"  daemon path: {plain}\n  with the store: {store}", flush=True)
    chain = " → ".join(store.get("chain") or []) or "none"
    chain = re.sub(r"\s+", " ", chain)
    rows.append(
        f"| `rankwatch daemon` (cli → cmd_daemon → daemon, a Daemon polling a job) imports torch? | "
        f"{'**YES**: ' + ' → '.join(plain.get('chain') or []) if plain.get('daemon_path') else 'no'} | no | "
        f"{'NO' if plain.get('daemon_path') else 'yes'} |"
    )
    rows.append(
        f"| … with `--store-port`/`--store` (cross-node): importing correlate → torch? / building its store client → "
        f"torch? | {'yes' if store.get('correlate_import') else 'no'} / "
        f"{'yes' if store.get('jobstore') else 'no'} (first import: `{chain}`) | — | — |"
    )
    return print_results(rows, raw, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
