"""Straggler diagnosis: unit tests on constructed step rings, the backward/grad_sync split, the DDP
backward timing in one process, and a few real ``rankwatch run`` jobs (2 and 4 gloo ranks).

Real-job sizes, measured on the 2 shared CPU cores: a base demo step (batch 32, hidden 256, 4 layers)
is 3–6 ms on 2 ranks and under 15 ms on 4; ``--compute-extra-matmuls 80`` (256×256 matmuls, one
thread) adds ~27 ms; ``--input-sleep-ms 30`` adds 30 ms.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import (
    DEMO,
    bundle_dirs,
    demo_job_cmd,
    examples_module,
    new_tracker,
    rankwatch_cmd,
    run_demo_job,
    skip_if_gloo_teardown_abort,
    torchrun_args,
    wait_for,
)
from rankwatch.hooks.record import CANONICAL_PHASES, read_record
from rankwatch.hooks.tracker import Tracker
from rankwatch.watchdog.core.evidence_items import StragglerBefore
from rankwatch.watchdog.core.steps import StepTiming
from rankwatch.watchdog.core.straggler import StragglerPolicy, diagnose_stragglers
from rankwatch.watchdog.report.text import headline

BASE = {"dataloader": 1.0, "forward": 3.0, "backward": 4.0, "grad_sync": 1.0, "optimizer": 1.0, "idle": 0.5}


def ring(phases_per_step: list[dict[str, float]]) -> list[StepTiming]:
    out, t = [], 1_000_000_000
    for i, phases in enumerate(phases_per_step):
        dur = int(sum(phases.values()) * 1e6)
        out.append(StepTiming(step=i, start_ns=t, end_ns=t + dur, phases_ms=dict(phases)))
        t += dur
    return out


def job(n_ranks: int, n_steps: int, tweak=None, seed: int = 0) -> dict[int, list[StepTiming]]:
    """Ranks in lock step: every rank's step lasts as long as the slowest rank's own work; the rest is
    wait (grad_sync), as under DDP. ``tweak(rank, step, phases)`` adds own work or noise."""
    rng = random.Random(seed)
    per_rank: dict[int, list[dict[str, float]]] = {r: [] for r in range(n_ranks)}
    for s in range(n_steps):
        own = {}
        for r in range(n_ranks):
            phases = dict(BASE)
            if tweak:
                tweak(r, s, phases, rng)
            own[r] = phases
        longest = max(sum(p.values()) for p in own.values())
        for r in range(n_ranks):
            own[r]["grad_sync"] += longest - sum(own[r].values())
            per_rank[r].append(own[r])
    return {r: ring(steps) for r, steps in per_rank.items()}


# -- diagnose_stragglers() on constructed rings -------------------------------------------------------------------
def test_backward_straggler_is_named_not_the_waiting_ranks():
    def tweak(r, s, p, rng):
        if r == 2:
            p["backward"] += 25.0

    d = diagnose_stragglers(job(4, 40, tweak))
    assert (d.label, d.straggler_ranks, d.phase) == ("COMPUTE STRAGGLER", [2], "backward")
    assert "rank 2" in d.why


def test_input_and_optimizer_stragglers_on_two_ranks():
    def slow_input(r, s, p, rng):
        if r == 1:
            p["dataloader"] += 30.0

    def slow_opt(r, s, p, rng):
        if r == 0:
            p["optimizer"] += 20.0

    d = diagnose_stragglers(job(2, 30, slow_input))
    assert (d.label, d.straggler_ranks, d.phase) == ("INPUT STRAGGLER", [1], "dataloader")
    d = diagnose_stragglers(job(2, 30, slow_opt))
    assert (d.label, d.straggler_ranks, d.phase) == ("COMPUTE STRAGGLER", [0], "optimizer")


def test_one_slow_step_is_not_a_straggler():
    def tweak(r, s, p, rng):
        if r == 3 and s == 17:
            p["backward"] += 500.0

    d = diagnose_stragglers(job(4, 40, tweak))
    assert "STRAGGLER" not in d.label, d.why
    assert d.straggler_ranks == []


def test_random_jitter_on_four_ranks_is_not_a_straggler():
    def tweak(r, s, p, rng):
        for k in ("dataloader", "forward", "backward", "optimizer"):
            p[k] *= rng.uniform(0.6, 1.6)  # heavy scheduler noise on a shared host
        if rng.random() < 0.05:
            p["forward"] += rng.uniform(5, 30)  # occasional hiccup

    for seed in range(20):
        d = diagnose_stragglers(job(4, 60, tweak, seed=seed))
        assert "STRAGGLER" not in d.label, (seed, d.why)


def test_a_rank_that_only_waits_is_never_blamed():
    # rank 1 waits 40 ms per step in grad_sync and collective (e.g. on a slow link or a peer elsewhere)
    def tweak(r, s, p, rng):
        if r == 1:
            p["grad_sync"] += 40.0
            p["collective"] = 10.0

    d = diagnose_stragglers(job(2, 30, tweak))
    assert 1 not in d.straggler_ranks
    assert "STRAGGLER" not in d.label, d.why
    assert d.label == "COMMUNICATION-BOUND"


def test_without_grad_sync_backward_counts_as_wait():
    # rings from a hook without bucket timing: backward mixes own compute and the all-reduce wait, so a
    # backward straggler looks like everyone else and nobody is blamed (the reason for bucket timing)
    def tweak(r, s, p, rng):
        if r == 0:
            p["backward"] += 30.0

    merged = {}
    for r, steps in job(2, 20, tweak).items():
        rows = []
        for t in steps:
            p = dict(t.phases_ms)
            p["backward"] += p.pop("grad_sync")
            rows.append(p)
        merged[r] = ring(rows)
    d = diagnose_stragglers(merged)
    assert d.straggler_ranks == [] and "STRAGGLER" not in d.label, d.why


def test_policy_thresholds_are_documented_and_frozen():
    policy = StragglerPolicy()
    with pytest.raises(AttributeError):
        policy.abs_floor_ms = 0.0  # type: ignore[misc]
    # a 2 ms excess on a 10 ms step is noise (below the absolute floor) ...
    slow = job(2, 30, lambda r, s, p, g: p.update(forward=p["forward"] + 2 * r))
    assert "STRAGGLER" not in diagnose_stragglers(slow).label
    # ... unless a stricter policy says otherwise
    strict = StragglerPolicy(abs_floor_ms=1.0, rel_threshold=0.05)
    d = diagnose_stragglers(job(2, 30, lambda r, s, p, g: p.update(forward=p["forward"] + 2 * r)), strict)
    assert d.straggler_ranks == [1]


def test_a_rank_slow_every_fourth_step_is_named_with_its_period():
    # the issue's case: rank 1's loader stalls ~320 ms on every 4th batch; medians would call this BALANCED
    def tweak(r, s, p, rng):
        p["forward"] *= rng.uniform(0.8, 1.2)
        if rng.random() < 0.1:
            p["dataloader"] += rng.uniform(15.0, 40.0)  # a busy host's hiccups, on every rank
        if r == 1 and s % 4 == 3:
            p["dataloader"] += 320.0

    d = diagnose_stragglers(job(4, 200, tweak))
    assert (d.label, d.straggler_ranks, d.phase) == ("INPUT STRAGGLER", [1], "dataloader"), d.why
    assert d.pattern["kind"] == "periodic" and d.pattern["period"] == 4, d.pattern
    assert "every 4 steps" in d.why
    # the time lost is the excess summed over the window: ~50 slow steps × 320 ms
    assert 0.8 * 50 * 320 < d.time_lost_ms < 1.2 * 50 * 320


def test_a_rank_slow_from_some_step_on_and_in_bursts():
    def since(r, s, p, rng):
        if r == 2 and s >= 60:
            p["optimizer"] += 20.0

    d = diagnose_stragglers(job(4, 100, since))
    assert (d.label, d.straggler_ranks) == ("COMPUTE STRAGGLER", [2]), d.why
    assert d.pattern["kind"] == "since" and d.pattern["since_step"] == 60 and "since step 60" in d.why

    def bursts(r, s, p, rng):
        if r == 0 and s % 40 in (10, 11, 12, 13, 14):
            p["forward"] += 60.0

    d = diagnose_stragglers(job(2, 160, bursts))
    assert (d.label, d.straggler_ranks) == ("COMPUTE STRAGGLER", [0]), d.why
    assert d.pattern["kind"] == "bursts" and "bursts" in d.why


def test_two_slow_steps_are_still_not_a_straggler():
    def tweak(r, s, p, rng):
        if r == 1 and s in (9, 27):
            p["forward"] += 400.0

    d = diagnose_stragglers(job(2, 40, tweak))
    assert "STRAGGLER" not in d.label, d.why


def pipeline_job(n_ranks, n_steps, batch_ms, workers=2, waits=None):
    """Ranks whose DataLoader workers each need ``batch_ms[r]`` per batch; the training thread's
    ``dataloader`` wait is ``waits(r, s)`` (any split between dataloader and grad_sync the ranks fall into)."""
    per_rank = job(n_ranks, n_steps)
    for r, steps in per_rank.items():
        for t in steps:
            wait = waits(r, t.step) if waits else 0.0
            t.phases_ms["dataloader"] = wait
            t.phases_ms["grad_sync"] = max(0.0, 30.0 - wait)
            t.end_ns = t.start_ns + int(sum(t.phases_ms.values()) * 1e6)
            lumps = 2 if t.step % 2 else 0  # workers finish batches in lumps
            t.input_ms, t.input_batches, t.input_workers = batch_ms[r] * lumps, lumps, workers
    return per_rank


def test_every_rank_input_bound_is_not_an_input_straggler():
    # the issue's case: collate 60 ms in 2 workers on every rank, compute ~8 ms; one rank settles into
    # waiting in dataloader, the other in grad_sync
    d = diagnose_stragglers(pipeline_job(2, 60, {0: 60.0, 1: 60.0}, waits=lambda r, s: 18.0 if r == 1 else 1.4))
    assert d.label == "INPUT-BOUND" and d.straggler_ranks == [], d.why
    assert "every rank's input pipeline needs ~30" in d.why and "60.0 ms in each of 2 DataLoader workers" in d.why
    assert d.ranks["1"]["input_pipeline"]["batch_ms"] == pytest.approx(60.0)


def with_extra_backward(per_rank, rank, ms, wait_ms=None):
    """``rank`` computes ``ms`` longer in backward; with ``wait_ms`` its dataloader wait becomes that."""
    for t in per_rank[rank]:
        t.phases_ms["backward"] += ms
        if wait_ms is not None:
            t.phases_ms["dataloader"] = wait_ms
        t.end_ns = t.start_ns + int(sum(t.phases_ms.values()) * 1e6)
    return per_rank


def test_slower_compute_absorbed_by_a_shorter_input_wait_is_no_straggler():
    # the busy-host case: rank 1's compute is 8 ms slower, so its workers' next batch is ready 8 ms sooner
    # and it waits 8 ms less for input: the job is as input-bound as before, nobody waits for rank 1
    per_rank = with_extra_backward(pipeline_job(2, 60, {0: 60.0, 1: 60.0}, waits=lambda r, s: 14.0), 1, 8.0, 6.0)
    d = diagnose_stragglers(per_rank)
    assert (d.label, d.straggler_ranks) == ("INPUT-BOUND", []), d.why
    # the same slower compute with a wait it does not save (the pipeline is not the bottleneck) costs the job
    per_rank = with_extra_backward(pipeline_job(2, 60, {0: 10.0, 1: 10.0}, waits=lambda r, s: 1.0), 1, 8.0)
    d = diagnose_stragglers(per_rank)
    assert (d.label, d.straggler_ranks, d.phase) == ("COMPUTE STRAGGLER", [1], "backward"), d.why


def test_only_a_slower_pipeline_is_an_input_straggler():
    d = diagnose_stragglers(pipeline_job(4, 60, {0: 20.0, 1: 20.0, 2: 80.0, 3: 20.0}))
    assert (d.label, d.straggler_ranks, d.phase) == ("INPUT STRAGGLER", [2], "dataloader"), d.why
    assert d.input_pipeline and "rank 2's input pipeline needs 40" in d.why and "80.0 ms in each of 2" in d.why
    assert d.pattern["kind"] == "steady", d.pattern  # lumps of two batches are not "every 2 steps"


def test_summary_counts_every_step_and_separates_own_work_from_waiting():
    def tweak(r, s, p, rng):
        if r == 1:
            p["forward"] += 10.0

    per_rank = {r: steps[-2500:] for r, steps in job(2, 4800, tweak).items()}  # the daemon's history cap
    d = diagnose_stragglers(per_rank)
    doc = d.summary_doc("j", [], per_rank)
    assert doc["steps_total"] == 4800 and doc["ranks"]["0"]["steps"] == 4800
    assert doc["steps"] == StragglerPolicy().window_steps
    _step, total, own, wait = doc["timeline"]["1"][-1]
    assert own + wait == pytest.approx(total, abs=0.01)
    assert doc["ranks"]["1"]["own_ms"] > doc["ranks"]["0"]["own_ms"] + 9
    assert doc["ranks"]["0"]["wait_ms"] > doc["ranks"]["1"]["wait_ms"] + 9


# -- the tracker split -------------------------------------------------------------------------------------
def _tracker(path) -> Tracker:
    return new_tracker(path, hostname="h", start_ns=1_000)


def test_split_moves_the_tail_of_backward_to_grad_sync(tmp_path, monkeypatch):
    import rankwatch.hooks.tracker as tracker_mod

    clock = [1_000]
    monkeypatch.setattr(tracker_mod, "_now", lambda: clock[0])
    backward = CANONICAL_PHASES.index("backward")
    results = []
    for split in (0, 1_600_000, 99, 10**12):  # none, inside, before the phase, after its end
        t = _tracker(tmp_path / f"r{split}.hb")
        sync = t.slot("grad_sync")
        clock[0] = 1_000_000
        t.enter(backward)
        clock[0] = 3_000_000
        t.exit(backward, split, sync)
        clock[0] = 3_500_000
        t.step()
        (step,) = read_record(str(tmp_path / f"r{split}.hb")).recent_steps
        assert sum(step.phases_ms.values()) == pytest.approx(step.duration_ms)
        results.append(step.phases_ms)
    assert results[0]["backward"] == pytest.approx(2.0) and "grad_sync" not in results[0]
    assert results[1]["backward"] == pytest.approx(0.6) and results[1]["grad_sync"] == pytest.approx(1.4)
    assert results[1]["backward"] + results[1]["grad_sync"] == pytest.approx(results[0]["backward"])
    assert results[2] == results[0] and results[3] == results[0]


# -- DDP timing in one process (world size 1, gloo) --------------------------------------------------------
HOOK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import rankwatch.hooks as rw
    from rankwatch.hooks import api
    assert rw.instrument()
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    out = {}
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def grads(model):
        return [p.grad.clone() for p in model.parameters()]

    def train(ddp, steps=3):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            g = grads(ddp.module)
            opt.step()
        return g

    plain = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    ref = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    ref.load_state_dict(plain.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        want = grads(ref)
        opt.step()
    got = train(DDP(plain))
    out["same_grads"] = all(torch.allclose(a, b) for a, b in zip(got, want))
    from rankwatch.hooks import ddp_timing
    timing = ddp_timing.active()
    calls = []

    def user_hook(state, bucket):
        calls.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    early = DDP(nn.Linear(16, 1))
    early.register_comm_hook(None, user_hook)  # no comm hook of ours: the user's is registered untouched
    train(early, 1)
    late = DDP(nn.Linear(16, 1))
    train(late, 1)
    late.register_comm_hook(None, user_hook)  # after a backward: works as without rankwatch
    train(late, 2)
    out["user_hook_calls"] = len(calls)
    builtin = DDP(nn.Linear(16, 1))
    train(builtin, 1)
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    train(builtin, 1)
    out["ddp_hooks"] = [bool(m._comm_hooks) for m in (early, late)]
    splits = timing.split_count if timing else 0
    with early.no_sync():  # no all-reduce in this backward: not split
        nn.functional.mse_loss(early(x), y).backward()
    plain_model = nn.Linear(16, 1)  # not under DDP: not split
    nn.functional.mse_loss(plain_model(x), y).backward()
    out["splits"] = splits
    out["unsplit_extra"] = (timing.split_count if timing else 0) - splits
    tracker = api.current()
    out["phase_names"] = [tracker._rec.phase_names[i].value.decode() for i in range(tracker._rec.n_phases)]
    out["disabled"] = not tracker.enabled
    dist.destroy_process_group()
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.parametrize("env_value", ["1", "0"])
def test_ddp_timing_keeps_gradients_and_user_comm_hooks(procs, tmp_path, env_value):
    script = tmp_path / "hook_check.py"
    script.write_text(HOOK_SCRIPT)
    env = dict(
        os.environ,
        RANKWATCH_SHM_DIR=str(tmp_path / "shm"),
        RANKWATCH_JOB_ID="hookcheck",
        RANKWATCH_DDP_TIMING=env_value,
        OMP_NUM_THREADS="1",
    )
    result = procs.run([sys.executable, str(script), str(tmp_path / "store")], timeout=120, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.split("RESULT", 1)[1])
    assert out["same_grads"] and not out["disabled"]
    assert out["user_hook_calls"] == 3 and out["ddp_hooks"] == [True, True]
    # every DDP backward with an all-reduce is split (3 + 1 + 1 + 2 + 1 + 1); no_sync and plain ones are not
    assert out["splits"] == (9 if env_value == "1" else 0) and out["unsplit_extra"] == 0
    assert ("grad_sync" in out["phase_names"]) == (env_value == "1")
    assert "rankwatch" not in result.stderr  # no warning: nothing was disabled


# -- input pipeline timing in one process ------------------------------------------------------------------
INPUT_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import rankwatch.hooks as rw
    from rankwatch.hooks import api
    from rankwatch.hooks.record import read_record
    from torch.utils.data import DataLoader, Dataset

    class Items(Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            return torch.zeros(4)

    def slow_collate(batch):
        time.sleep(0.02)
        return torch.utils.data.default_collate(batch)

    def user_init(worker_id):
        open(os.path.join(os.environ["MARKS"], f"init-{worker_id}"), "w").close()

    def main():
        assert rw.instrument()
        workers, ctx = int(sys.argv[1]), sys.argv[2]
        kw = dict(num_workers=workers, worker_init_fn=user_init, multiprocessing_context=ctx) if workers else {}
        loader = DataLoader(Items(), batch_size=4, collate_fn=slow_collate, **kw)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = iter(loader)
        for _ in range(16):
            model(next(batches)).sum().backward()
            opt.step()
        snap = read_record(api.current()._writer.path)
        steps = [t for t in snap.recent_steps if t.step > 0]
        print("RESULT" + json.dumps({
            "batches": sum(t.input_batches for t in steps),
            "input_ms": sum(t.input_ms for t in steps),
            "workers": sorted({t.input_workers for t in steps}),
            "init_restored": loader.worker_init_fn is (user_init if workers else None),
            "disabled": not api.current().enabled,
        }))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize(("workers", "ctx"), [(0, "-"), (2, "fork"), (2, "spawn")])
def test_batch_production_is_timed_in_workers_and_on_the_training_thread(procs, tmp_path, workers, ctx):
    script = tmp_path / "input_check.py"
    script.write_text(INPUT_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(tmp_path / "shm"), RANKWATCH_JOB_ID="inputcheck",
               MARKS=str(marks), OMP_NUM_THREADS="1")
    result = procs.run([sys.executable, str(script), str(workers), ctx], timeout=180, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.split("RESULT", 1)[1])
    assert out["batches"] >= 10 and not out["disabled"]
    # each batch sleeps 20 ms in collate: what the pipeline reports per batch cannot be less
    assert out["input_ms"] / out["batches"] >= 20.0
    assert out["workers"] == [workers]
    assert out["init_restored"]
    if workers:  # the script's own worker_init_fn still ran in every worker
        assert sorted(p.name for p in marks.iterdir()) == ["init-0", "init-1"]


# -- real jobs ---------------------------------------------------------------------------------------------
# the right label, ranks and phase of each slow scenario: the catalogue's (examples/fault_catalogue.py)
demo_fault = examples_module("fault_catalogue").demo_fault
JOBS = [
    # scenario, ranks, straggler rank: one job on 4 ranks (the straggler among three that wait for it), the others
    # on 2 (the phase is their point; every rank is a torch start-up, ~1.6 s of CPU). The backward straggler
    # once, on the 4 ranks: the same label and phase on 2 ranks was the same code path again
    ("backward-straggler", 4, 2),
    ("compute-straggler", 2, 0),
    ("input-straggler", 2, 0),
]


def run_demo(procs, tmp_path, scenario: str, nproc: int, straggler: int, steps: int = 50):
    started = time.monotonic()
    demo_args = ("--scenario", scenario, "--straggler-rank", str(straggler), "--steps", str(steps),
                 "--compute-extra-matmuls", "80", "--input-sleep-ms", "30")
    result, out, shm = run_demo_job(procs, tmp_path, f"strag-{scenario}-{nproc}", nproc, *demo_args)
    skip_if_gloo_teardown_abort(result, shm / f"strag-{scenario}-{nproc}", steps)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    return summary, shm, time.monotonic() - started


@pytest.mark.parametrize(
    ("scenario", "nproc", "rank"), JOBS, ids=[f"{j[0]}-{j[1]}ranks-r{j[2]}" for j in JOBS]
)
def test_real_job_names_the_straggler(procs, tmp_path, scenario, nproc, rank):
    expect = demo_fault(scenario)
    summary, _, _ = run_demo(procs, tmp_path, scenario, nproc, rank)
    seen = (summary["diagnosis"], summary["straggler_ranks"], summary["phase"])
    assert expect.straggler and seen[0] in expect.kinds, (summary["why"], json.dumps(summary["ranks"]))
    assert seen[1:] == (expect.ranks(rank), expect.phase), (summary["why"], json.dumps(summary["ranks"]))


def test_balanced_job_splits_backward_and_keeps_step_totals(procs, tmp_path):
    # 120 steps (~2 s of steps): on 40 (0.7 s) a busy host's scheduler once gave one rank 7 bursts of +10 ms
    # in backward and the job a real 27 % excess on that rank; over more steps such luck evens out
    job, steps = "strag-balanced-2", 120
    demo = ("--scenario", "balanced", "--straggler-rank", "1", "--steps", str(steps), "--compute-extra-matmuls",
            "80", "--input-sleep-ms", "30")
    cmd, out, shm = demo_job_cmd(tmp_path, job, 2, *demo)
    # `rankwatch run` removes its records at exit: a hard link to each, made while the job runs, keeps the rings
    # the ranks wrote (the same inode, mapped by the rank until it exits) for the checks below
    kept = tmp_path / "kept"
    kept.mkdir()

    def keep_records() -> bool:
        for r in range(2):
            name = f"rank-{r}.hb"
            if not (kept / name).exists():
                try:
                    os.link(shm / job / name, kept / name)
                except FileNotFoundError:  # not published yet
                    return False
        return True

    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        run = procs.start(cmd, stdout=so, stderr=se)
        assert wait_for(keep_records, timeout=180), "the ranks' records never appeared"
        rc = run.wait(timeout=240)
    result = subprocess.CompletedProcess(cmd, rc, (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text())
    skip_if_gloo_teardown_abort(result, kept, steps)
    assert rc == 0, (result.stdout[-2000:], result.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert "STRAGGLER" not in summary["diagnosis"], summary["why"]
    assert summary["straggler_ranks"] == []
    assert "grad_sync" in summary["phases"]
    for r in range(2):
        snap = read_record(str(kept / f"rank-{r}.hb"))
        assert "grad_sync" in snap.phase_names
        ring = [t for t in snap.recent_steps if t.step > 0]
        assert len(ring) >= 30
        with_sync = [t for t in ring if "grad_sync" in t.phases_ms]
        assert len(with_sync) >= 0.9 * len(ring)
        for t in ring:
            # time is moved, never duplicated or lost: exclusive phases still add up to the step
            assert sum(t.phases_ms.values()) == pytest.approx(t.duration_ms, abs=1e-3)
            assert t.phases_ms.get("backward", 0.0) > 0


# the issue's two cases, as real jobs: a loader slow every 4th batch on one rank, and every rank input-bound
# (name, the demo's arguments, the straggler rank); the right answer is the scenario's in the catalogue
ISSUE_CASES = [
    ("periodic-input-straggler",
     ("--scenario", "input-straggler", "--straggler-rank", "1", "--input-every", "4", "--input-sleep-ms", "120"),
     1),
    # a batch takes 200 ms in each of 2 workers: 100 ms of input per step. With 60 ms (30 ms/step) a run on
    # 2 cores at load 23 had a 79 ms step, the rest stretched by the scheduler: truly no longer input-bound,
    # BALANCED was the right answer and the test failed; 100 ms is twice that rest
    ("input-bound",
     ("--scenario", "input-bound", "--num-workers", "2", "--input-sleep-ms", "200", "--compute-extra-matmuls", "0"),
     None),
]


@pytest.mark.parametrize(("name", "demo_args", "rank"), ISSUE_CASES, ids=[c[0] for c in ISSUE_CASES])
def test_real_job_time_lost_and_input_bound(procs, tmp_path, name, demo_args, rank):
    expect = demo_fault(demo_args[1])
    steps = 60
    result, out, shm = run_demo_job(procs, tmp_path, name, 2, *demo_args, "--steps", str(steps))
    skip_if_gloo_teardown_abort(result, shm / name, steps)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert expect.straggler and summary["diagnosis"] in expect.kinds, summary["why"]
    assert (summary["straggler_ranks"], summary["phase"]) == (expect.ranks(rank), expect.phase), summary["why"]
    assert summary["steps_total"] == steps
    if name == "periodic-input-straggler":
        assert summary["pattern"]["kind"] == "periodic" and summary["pattern"]["period"] == 4, summary["pattern"]
        assert "every 4 steps" in summary["why"]
    else:
        # measured in the workers: each batch sleeps 200 ms in collate, two workers per rank
        for r in ("0", "1"):
            pipe = summary["ranks"][r]["input_pipeline"]
            assert pipe["workers"] == 2 and pipe["batch_ms"] >= 200.0, pipe


def test_live_straggler_is_logged_shown_in_status_and_named_when_it_hangs(procs, tmp_path):
    # rank 1's loader is 40 ms slower on every batch for ~200 steps, then it hangs in its loader
    job_id = "live-strag"
    out, shm = tmp_path / "out", tmp_path / "shm"
    fault_rank, expect = 1, demo_fault("input-hang")  # the hang's right answer: the catalogue's
    demo = ("--scenario", expect.scenario, "--fault-rank", str(fault_rank), "--straggler-rank", "1",
            "--straggle-ms", "40", "--fault-step", "200", "--steps", "400")
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--json-logs", "--stall-timeout", "4",
                        "--on-stall", "kill", "--", *torchrun_args(2, job_id, DEMO, *demo))
    # the logs go to files: nobody reads a pipe while `rankwatch status` is polled beside the run
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        run = procs.start(cmd, stdout=so, stderr=se)

        def live_in_status():
            done = subprocess.run(rankwatch_cmd("status", "--shm-dir", str(shm), "--json"), capture_output=True,
                                  text=True, timeout=60)
            jobs = json.loads(done.stdout)["jobs"] if done.returncode == 0 else []
            return next((j["stragglers"] for j in jobs if j["stragglers"]), None) or (run.poll() is not None)

        seen = wait_for(live_in_status, 240, interval=1.0)
        run.wait(timeout=300)
    stderr = (tmp_path / "stderr").read_text()
    # `rankwatch status` showed it while the job ran, with the step it started at
    assert isinstance(seen, list), "status never showed the live straggler"
    assert (seen[0]["rank"], seen[0]["label"], seen[0]["phase"]) == (1, "INPUT STRAGGLER", "dataloader"), seen
    assert seen[0]["since_step"] >= 0 and "rank 1" in seen[0]["line"]
    events = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    detected = [e for e in events if e.get("event") == "straggler_detected"]
    assert detected, stderr[-3000:]
    assert (detected[0]["rank"], detected[0]["label"], detected[0]["phase"]) == (1, "INPUT STRAGGLER", "dataloader")
    (bundle,) = bundle_dirs(out / "incidents")
    verdict = json.loads((bundle / "verdict.json").read_text())
    assert verdict["initiating_ranks"] == expect.ranks(fault_rank) and verdict["kind"] in expect.kinds, verdict
    assert verdict["phase"] == expect.phase, verdict
    before = [(i["rank"], i["label"], i["phase"]) for i in verdict["evidence_items"]
              if i["kind"] == StragglerBefore.KIND]
    assert before == [(1, "INPUT STRAGGLER", "dataloader")], verdict.get("evidence_items")
    # the run's summary leads with the hang, not with a diagnosis of the steps before it
    text = (out / "summary.txt").read_text()
    assert text.startswith(f"rankwatch: {headline(verdict)}\n"), text


def test_a_rank_slightly_slower_in_every_phase_is_a_rank_wide_straggler():
    def tweak(r, s, p, rng):
        p["forward"] += rng.uniform(-0.3, 0.3)
        if r == 3:  # each phase below the threshold alone, together above it
            p["dataloader"] += 2.0
            p["forward"] += 2.0
            p["optimizer"] += 2.0

    d = diagnose_stragglers(job(4, 40, tweak))
    assert (d.label, d.straggler_ranks, d.phase) == ("RANK-WIDE STRAGGLER", [3], None), d.why
    assert d.time_lost_ms > 0 and "slower across the phases" in d.why

    def one_phase(r, s, p, rng):  # a little slower in one phase only: below the threshold, nobody
        if r == 3:
            p["dataloader"] += 2.0

    assert "STRAGGLER" not in diagnose_stragglers(job(4, 40, one_phase)).label


def test_a_rank_slower_in_every_phase_is_rank_wide_even_when_one_phase_clears_the_threshold():
    # the issue's case: a rank sharing its CPU with two busy processes is slower in every phase, backward
    # the most; the time lost is the sum over its phases, not backward's share of it
    def tweak(r, s, p, rng):
        p["forward"] += rng.uniform(-0.3, 0.3)
        if r == 1:
            p["dataloader"] += 8.0
            p["forward"] += 12.0
            p["backward"] += 20.0
            p["optimizer"] += 10.0

    d = diagnose_stragglers(job(2, 40, tweak))
    assert (d.label, d.straggler_ranks, d.phase) == ("RANK-WIDE STRAGGLER", [1], None), d.why
    assert d.excess_ms == pytest.approx(50.0, abs=1.0)
    # extra work in one phase (the others within noise) stays that phase's straggler
    def one(r, s, p, rng):
        p["forward"] += rng.uniform(-0.3, 0.3)
        if r == 1:
            p["backward"] += 20.0
            p["forward"] += 1.0

    d = diagnose_stragglers(job(2, 40, one))
    assert (d.label, d.straggler_ranks, d.phase) == ("COMPUTE STRAGGLER", [1], "backward"), d.why

    # extra work in one phase beside host load: every other phase of the rank is 30-50 % slower too (its
    # extra CPU work competes with them), but not by a like factor: still that phase's straggler (the ddp
    # slow-rank run beside a CI run read RANK-WIDE before ``rank_wide_like_factor``)
    def loaded(r, s, p, rng):
        p["forward"] += rng.uniform(-0.3, 0.3)
        if r == 1:
            p["optimizer"] += 30 * BASE["optimizer"]
            for other in ("dataloader", "forward", "backward"):
                p[other] += 0.45 * BASE[other]

    d = diagnose_stragglers(job(2, 40, loaded))
    assert (d.label, d.straggler_ranks, d.phase) == ("COMPUTE STRAGGLER", [1], "optimizer"), d.why

    # ... also when that phase is one its peers pass in a fraction of a millisecond (not compared for "slower
    # everywhere", yet evidence against it: the CI run's compute-straggler, optimizer 0.3 ms -> +98 ms)
    def short_phase(r, s, p, rng):
        p["dataloader"] = 0.3  # a DataLoader with workers: batches ready
        p["optimizer"] = 0.3 + (30.0 if r == 1 else 0.0)
        p["forward"] += rng.uniform(-0.3, 0.3)
        if r == 1:
            p["backward"] += 0.9 * BASE["backward"]
            p["forward"] += 0.5 * BASE["forward"]

    d = diagnose_stragglers(job(2, 40, short_phase))
    assert (d.label, d.straggler_ranks, d.phase) == ("COMPUTE STRAGGLER", [1], "optimizer"), d.why


def test_a_few_noisy_steps_do_not_name_a_straggler():
    # the issue's case: 7 steps before a hang, every rank noisy, one with a few large hiccups: not evidence
    def tweak(r, s, p, rng):
        p["forward"] *= rng.uniform(0.6, 1.6)
        if r == 1 and s in (2, 4, 6):
            p["backward"] += rng.uniform(20.0, 60.0)

    for seed in range(20):
        d = diagnose_stragglers(job(4, 8, tweak, seed=seed))
        assert "STRAGGLER" not in d.label, (seed, d.why)
    # the same rank slow on every one of those 7 steps is named
    def steady(r, s, p, rng):
        p["forward"] *= rng.uniform(0.8, 1.2)
        if r == 1:
            p["backward"] += 30.0

    d = diagnose_stragglers(job(4, 8, steady))
    assert (d.label, d.straggler_ranks) == ("COMPUTE STRAGGLER", [1]), d.why
    assert StragglerPolicy().min_evidence_t == 3.0
