"""The hook in real torchrun jobs (gloo, loopback): zero-code instrumentation and the dump responder."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from conftest import DEMO, skip_if_gloo_teardown_abort, torchrun_args, wait_for
from rankwatch.hooks.record import read_record
from rankwatch.watchdog.evidence.capture import DumpRequest, RankCapture, collect_dump, request_dump


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def test_input_straggler_shows_in_its_dataloader_phase_only(procs, shm_dir):
    steps = 30
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm_dir))
    cmd = torchrun(
        *torchrun_args(
            2,
            "hookjob",
            "-m",
            "rankwatch.hooks",
            DEMO,
            "--scenario",
            "input-straggler",
            "--straggler-rank",
            "1",
            "--input-sleep-ms",
            "40",
            "--steps",
            str(steps),
        )
    )
    result = procs.run(cmd, timeout=180, env=env, text=True)
    skip_if_gloo_teardown_abort(result, shm_dir / "hookjob", steps)
    assert result.returncode == 0, result.stderr[-3000:]
    # read only once, after the run: the ring still holds every step
    recs = {r: read_record(str(shm_dir / "hookjob" / f"rank-{r}.hb")) for r in (0, 1)}
    for r, rec in recs.items():
        assert rec.steps_done == steps and rec.step == steps
        assert [s.step for s in rec.recent_steps] == list(range(steps))
        assert rec.exited_normally and not rec.crashed
        assert rec.world_size == 2 and rec.global_rank == r
        # the demo's metrics all_reduce per step + the final barrier, from Python
        assert rec.coll_seq_entered == rec.coll_seq_completed == steps + 1
        assert rec.coll_op == "barrier"
    med = {
        r: statistics.median(s.phases_ms.get("dataloader", 0.0) for s in rec.recent_steps[1:])
        for r, rec in recs.items()
    }
    assert med[1] >= 40.0, med
    assert med[0] < 10.0, med
    for rec in recs.values():
        for s in rec.recent_steps:
            assert s.phases_ms.get("forward", 0) > 0 and s.phases_ms.get("backward", 0) > 0
            assert s.phases_ms.get("optimizer", 0) > 0
    info = json.loads((shm_dir / "hookjob" / "job.json").read_text())
    assert info["job_id"] == "hookjob" and info["world_size"] == 2
    assert oct((shm_dir / "hookjob").stat().st_mode & 0o777) == "0o700"


BLOCKED = r"""
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(600)            # never joins the second all_reduce
dist.all_reduce(t)
"""


def test_dump_responder_answers_from_a_rank_blocked_in_allreduce(procs, shm_dir, tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED)
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm_dir))
    procs.start(torchrun(*torchrun_args(2, "blocked", "-m", "rankwatch.hooks", str(script))), env=env)
    job_dir = str(shm_dir / "blocked")
    rec_path = os.path.join(job_dir, "rank-0.hb")

    def blocked():
        if not os.path.exists(rec_path):
            return False
        rec = read_record(rec_path)
        return rec.coll_seq_entered == 2 and rec.phase == "collective"

    assert wait_for(blocked, timeout=90), "rank 0 never reached its second all_reduce"
    time.sleep(0.5)
    pid = read_record(rec_path).pid
    req = request_dump(job_dir, 0, "tok1", pid)
    assert isinstance(req, DumpRequest), req
    cap = RankCapture(rank=0, pid=pid)
    collect_dump(req, time.monotonic() + 20, cap)
    assert cap.responder_error is None
    main = next(t for t in cap.responder_stacks["threads"] if t["thread_name"] == "MainThread")
    assert main["frames"][0]["name"] == "all_reduce"
    assert all("locals" not in f for f in main["frames"])
    fr = json.loads(cap.fr_json)
    entries = fr["entries"]
    assert entries[-1]["profiling_name"] == "gloo:all_reduce"
    # gloo leaves entries "scheduled"; completion is tracked per process group in pg_status
    status = fr["pg_status"]["0"]
    assert int(status["last_enqueued_collective"]) == entries[-1]["collective_seq_id"]
    assert int(status["last_completed_collective"]) < int(status["last_enqueued_collective"])
    # a request for a rank with no responder is refused immediately
    assert isinstance(request_dump(job_dir, 7, "tok2"), str)
    # only the rank itself may answer: a request naming another pid is refused after connecting
    assert "not by the rank" in str(request_dump(job_dir, 0, "tok3", pid + 100000))
    # the answer came over the socket: nothing was left in the job dir
    assert not os.path.exists(os.path.join(job_dir, "dumps"))
