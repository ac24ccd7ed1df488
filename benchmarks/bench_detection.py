"""Detection latency: stall onset → verdict.json written, for ``rankwatch run --on-stall kill``.

Each repetition runs the real demo under rankwatch, 4 ranks on gloo, rank 2 hanging in its dataloader
at step ``--fault-step`` (``examples/ddp_demo.py --scenario input-hang``):

    rankwatch run --stall-timeout T --on-stall kill --shm-dir TMP -- torchrun … ddp_demo.py --scenario input-hang

Method (all times from this one machine's clocks):

* onset = the culprit's last progress, read after the run from its own shm record
  (``last_progress_ns``, CLOCK_MONOTONIC): the moment it entered the dataloader call that never
  returned. The record survives the kill, and nothing writes it afterwards (the training thread is stuck).
* verdict = ``st_mtime_ns`` of ``incidents/<id>/verdict.json`` (CLOCK_REALTIME; written just before the
  bundle's rename).
* the two clocks are tied by ``time.time_ns() - time.monotonic_ns()`` sampled in this process right
  after each run (same host, same kernel clocks; NTP slew over seconds is negligible; file timestamps
  are kernel-tick coarse, ~4 ms).

latency = verdict − onset. It splits into ``detected_after_s`` (onset → the poll that saw the stall,
from verdict.json: ≥ T, up to T + one poll interval) and the rest (py-spy of every rank, dump
responder, verdict, bundle write). Target: latency ≤ T + 2 s.

    python benchmarks/bench_detection.py            # 6 runs, T = 3 s  (~2.5 min)
    python benchmarks/bench_detection.py --quick    # 2 runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import DEMO, Procs, median, rankwatch_cmd, spread, torchrun_args


def one_run(procs: Procs, i: int, timeout_s: float, nproc: int, fault_rank: int, fault_step: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="rw-bench-det-"))
    job = f"bench-det-{os.getpid()}-{i}"
    try:
        out, shm = tmp / "out", tmp / "shm"
        cmd = rankwatch_cmd(
            "run",
            "--out",
            str(out),
            "--shm-dir",
            str(shm),
            "--quiet",
            "--stall-timeout",
            str(timeout_s),
            "--on-stall",
            "kill",
            "--",
            *torchrun_args(
                nproc,
                job,
                DEMO,
                "--scenario",
                "input-hang",
                "--fault-rank",
                str(fault_rank),
                "--fault-step",
                str(fault_step),
                "--steps",
                "100000",
            ),
        )
        # `rankwatch run` removes the job's records when it exits: keep the newest snapshot of each while it runs
        from rankwatch.hooks.record import RecordFormatError, read_record

        records: dict[int, object] = {}
        with open(tmp / "stdout.txt", "w+") as so, open(tmp / "stderr.txt", "w+") as se:
            proc = procs.start(cmd, stdout=so, stderr=se, text=True)
            deadline = time.monotonic() + 180
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out after 180 s: {cmd}")
                for r in range(nproc):
                    try:
                        records[r] = read_record(str(shm / job / f"rank-{r}.hb"))
                    except RecordFormatError:
                        pass
                time.sleep(0.05)
            so.seek(0)
            se.seek(0)
            res = subprocess.CompletedProcess(cmd, proc.returncode, so.read(), se.read())
        if len(records) != nproc:
            raise RuntimeError(f"saw records of ranks {sorted(records)} only\n{res.stderr[-3000:]}")
        offset_ns = time.time_ns() - time.monotonic_ns()
        incidents = sorted(p for p in (out / "incidents").iterdir() if not p.name.startswith("."))
        if len(incidents) != 1:
            raise RuntimeError(f"expected one incident, got {incidents}\n{res.stdout}\n{res.stderr[-3000:]}")
        vpath = incidents[0] / "verdict.json"
        verdict = json.loads(vpath.read_text())
        culprit: Any = records[fault_rank]
        others: list[Any] = [records[r] for r in range(nproc) if r != fault_rank]
        onset_ns = culprit.last_progress_ns + offset_ns
        latency = (vpath.stat().st_mtime_ns - onset_ns) / 1e9
        right = verdict["initiating_ranks"] == [fault_rank] and verdict["phase"] == "dataloader"
        return {
            "latency_s": latency,
            "detected_after_s": float(verdict["detected_after_s"]),
            "capture_to_verdict_s": latency - float(verdict["detected_after_s"]),
            "culprit_step": culprit.step,
            "culprit_phase": culprit.phase,
            # how much later than the culprit the last other rank moved (they block in DDP's all-reduce)
            "others_lag_s": max(o.last_progress_ns for o in others) / 1e9 - culprit.last_progress_ns / 1e9,
            "verdict_right": right,
            "kind": verdict["kind"],
            "exit_code": res.returncode,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 runs instead of 6")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--stall-timeout", type=float, default=3.0)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--fault-rank", type=int, default=2)
    p.add_argument("--fault-step", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    args = p.parse_args()
    runs = args.runs or (2 if args.quick else 6)
    T = args.stall_timeout
    results = []
    with Procs() as procs:
        for i in range(runs):
            r = one_run(procs, i, T, args.nproc, args.fault_rank, args.fault_step)
            results.append(r)
            print(
                f"  run {i + 1}/{runs}: latency {r['latency_s']:.2f} s = detected_after {r['detected_after_s']:.2f} s"
                f" + capture→verdict {r['capture_to_verdict_s']:.2f} s; culprit step {r['culprit_step']} "
                f"phase {r['culprit_phase']}; verdict right: {r['verdict_right']}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    lat = [r["latency_s"] for r in results]
    det = [r["detected_after_s"] for r in results]
    cap = [r["capture_to_verdict_s"] for r in results]
    ok = sum(r["verdict_right"] for r in results)
    med = median(lat)
    print("\n| what | median | target | met? |\n|---|---|---|---|")
    print(
        f"| detection latency, stall onset → verdict.json, {args.nproc} ranks input-hang, T = {T:g} s, "
        f"{runs} runs | **{med:.2f} s** = T + {med - T:.2f} s (range {spread(lat)} s) | ≤ T + 2 s | "
        f"{'yes' if med <= T + 2 else 'NO'} (worst {'≤' if max(lat) <= T + 2 else '>'} T + 2 s) |"
    )
    print(
        f"| … of which onset → stall seen (`detected_after_s`) | {median(det):.2f} s (range {spread(det)}) | "
        f"T … T + poll 0.5 s | — |"
    )
    print(
        f"| … of which capture of {args.nproc} ranks + verdict + bundle | {median(cap):.2f} s "
        f"(range {spread(cap)}) | — | — |"
    )
    print(
        f"| verdict named rank {args.fault_rank} in 'dataloader' | {ok}/{runs} runs | all | "
        f"{'yes' if ok == runs else 'NO'} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
