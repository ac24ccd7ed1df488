"""Capture time: ``rankwatch.watchdog.evidence.capture.capture_all`` over N live ranks, py-spy in parallel.

Starts ``benchmarks/blocked_job.py`` under ``torchrun --nproc-per-node N -m rankwatch.hooks`` (a real
gloo job: N-1 ranks blocked in an all_reduce, one rank waiting outside it), waits until every rank's
record shows that state, then calls ``capture_all`` directly with the default CapturePolicy — exactly
what the daemon does on an incident: per rank, a request to the hook's dump responder (flight recorder
+ stacks), ``py-spy dump --json``, and the collection of the responder's answer, all ranks in parallel.
Timed wall clock around the call; median of ``--reps``; every capture must yield a py-spy stack of the
training thread. The job is killed (whole process tree) at the end.

    python benchmarks/bench_capture.py            # 4 and 8 ranks, 7 reps each (~1.5 min)
    python benchmarks/bench_capture.py --quick    # 4 and 8 ranks, 5 reps
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _util import REPO, Procs, kill_tree, median, spread, torchrun_args, torchrun_cmd

JOB = str(REPO / "benchmarks" / "blocked_job.py")


def wait_blocked(job_dir: Path, n: int, timeout: float) -> list[tuple[int, int, bool]]:
    from rankwatch.hooks.record import RecordFormatError, read_record

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            snaps = [read_record(str(job_dir / f"rank-{r}.hb")) for r in range(n)]
        except (RecordFormatError, OSError):
            snaps = []
        # N-1 ranks inside the 6th all_reduce, the culprit done with 5 and outside any collective
        if snaps and all(
            (s.coll_seq_entered == 6 and s.in_collective) if s.global_rank < n - 1 else s.coll_seq_completed == 5
            for s in snaps
        ):
            time.sleep(0.5)  # let the culprit reach its Event.wait
            return [(s.global_rank, s.pid, False) for s in snaps]
        time.sleep(0.2)
    raise RuntimeError(f"the {n}-rank job did not reach its blocked state in {timeout}s")


def bench(n: int, reps: int) -> dict:
    from rankwatch.watchdog.core.policy import CapturePolicy
    from rankwatch.watchdog.core.stacks import waiting_on_peers
    from rankwatch.watchdog.evidence.capture import capture_all

    tmp = Path(tempfile.mkdtemp(prefix="rw-bench-cap-"))
    job = f"bench-cap-{n}"
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(tmp), RANKWATCH_JOB_ID=job, OMP_NUM_THREADS="1")
    times, ok, fr, waiting = [], [], [], []
    try:
        with Procs() as procs:
            proc = procs.start(
                torchrun_cmd(*torchrun_args(n, job, "-m", "rankwatch.hooks", JOB)),
                env=env,
                stdout=open(os.devnull, "wb"),  # noqa: SIM115
                stderr=open(os.devnull, "wb"),  # noqa: SIM115
            )
            try:
                targets = wait_blocked(tmp / job, n, timeout=180)
                policy = CapturePolicy()
                for i in range(reps):
                    t = time.monotonic()
                    caps = capture_all(targets, str(tmp / job), f"bench{i}", policy)
                    times.append(time.monotonic() - t)
                    ok.append(sum(1 for c in caps.values() if c.pyspy_threads and c.main_frames()))
                    fr.append(sum(1 for c in caps.values() if c.fr_json))
                    # sanity: the N-1 blocked ranks' stacks end in torch.distributed
                    waiting.append(sum(1 for c in caps.values() if waiting_on_peers(c.main_frames()) is True))
                    print(
                        f"  {n} ranks rep {i + 1}/{reps}: {times[-1]:.3f} s, py-spy stacks {ok[-1]}/{n}, "
                        f"flight-recorder dumps {fr[-1]}/{n}, "
                        f"stacks blocked in torch.distributed {waiting[-1]}/{n - 1}",
                        flush=True,
                    )
            finally:
                kill_tree(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"n": n, "times_s": times, "pyspy_ok": ok, "fr_ok": fr, "waiting": waiting}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="5 reps instead of 7")
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    reps = args.reps or (5 if args.quick else 7)
    results = [bench(n, reps) for n in args.ranks]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print("\n| what | median | target | met? |\n|---|---|---|---|")
    for r in results:
        n, t = r["n"], r["times_s"]
        target = "< 2 s" if n == 8 else "—"
        met = ("yes" if median(t) < 2 else "NO") if n == 8 else "—"
        print(
            f"| capture_all, {n} ranks (py-spy + dump responder in parallel), {len(t)} reps | **{median(t):.2f} s** "
            f"(range {spread(t)} s); py-spy stacks {min(r['pyspy_ok'])}/{n}, FR dumps {min(r['fr_ok'])}/{n} "
            f"(worst rep), blocked-in-collective stacks {min(r['waiting'])}/{n - 1} | {target} | {met} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
