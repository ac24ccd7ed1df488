"""Prometheus series per rank: what one rank costs a fleet's Prometheus.

A real ``rankwatch daemon --metrics-port P --metrics-detail jobs`` watches a real job of ``--ranks`` rank
processes (tests/procs/alert_job.py: the real hook API, canonical phases, a barrier per step like an
all-reduce); once every rank has completed steps, /metrics is scraped and every series that names the job
(per-rank and per-job ones) is counted and divided by the ranks. Once by default, once with
``--metrics-histograms``. Target: <= 60 series per rank by default (serve.metrics.SERIES_PER_RANK_BUDGET).

    python benchmarks/bench_series.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import REPO, free_port, kill_tree, print_results, rankwatch_cmd

JOB_PROC = REPO / "tests" / "procs" / "alert_job.py"
JOB = "series"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def count(text: str, ranks: int) -> tuple[float, dict[str, int]]:
    from prometheus_client.parser import text_string_to_metric_families

    per_family: Counter[str] = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("job_id") == JOB:
                per_family[fam.name] += 1
    return sum(per_family.values()) / ranks, {k: v // ranks for k, v in per_family.most_common()}


def measure(ranks: int, histograms: bool, tmp: Path) -> tuple[float, dict[str, int]]:
    shm = tmp / f"shm-{histograms}"
    shm.mkdir(mode=0o700)
    env = {**os.environ, "RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": JOB}
    job = subprocess.Popen([sys.executable, str(JOB_PROC), "--ranks", str(ranks)], env=env, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    port = free_port()
    cmd = rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(tmp / "out"), "--metrics-port", str(port),
                        "--metrics-detail", "jobs", "--poll-interval", "0.3", "--json-logs",
                        *(["--metrics-histograms"] if histograms else []))
    daemon = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(1)
            try:
                text = scrape(port)
            except OSError:
                continue
            # every rank has step medians, phase medians and (when asked) phase histograms
            if text.count("rankwatch_step_duration_median_seconds{") >= ranks:
                time.sleep(2)
                return count(scrape(port), ranks)
        raise SystemExit("the daemon never exported the job's steps")
    finally:
        kill_tree(daemon)
        kill_tree(job)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="2 ranks")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    ranks = 2 if args.quick else args.ranks
    with tempfile.TemporaryDirectory(prefix="rw-series-") as tmp:
        default, fams = measure(ranks, False, Path(tmp))
        hist, hist_fams = measure(ranks, True, Path(tmp))
    from rankwatch.watchdog.serve.metrics import SERIES_PER_RANK_BUDGET

    rows = [
        f"| series per rank, default ({ranks} ranks, canonical phases) | {default:.1f} | <= {SERIES_PER_RANK_BUDGET} "
        f"| {'yes' if default <= SERIES_PER_RANK_BUDGET else 'NO'} |",
        f"| series per rank, --metrics-histograms | {hist:.1f} | (opt-in) | - |",
        f"| series for a 1,024-node x 8-GPU job, default | {default * 8192 / 1e6:.2f} M | - | - |",
    ]
    print_results(rows, {"ranks": ranks, "default": default, "histograms": hist, "families": fams,
                         "families_histograms": hist_fams}, args.json)
    return 0 if default <= SERIES_PER_RANK_BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
