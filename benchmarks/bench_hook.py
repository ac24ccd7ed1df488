"""Hook overhead: (a) the cost of the Tracker's record updates, (b) end-to-end slowdown of a DDP job.

(a) Micro: a Tracker over a real RecordWriter (mmap of a file in a temp dir, as in training). Each
    measurement is the median over many batches of the per-call cost (batch time / calls; the empty
    loop is *not* subtracted, so the numbers are an upper bound). Also measured: what a plain
    ``nn.Module`` call costs once ``instrument()`` has installed its global forward hooks (every module
    call then runs the pre/post hook), and the hook-only per-step cost of the demo's loop.
(a2) Per step, one process: the demo's small-step loop (DDP world size 1) under ``instrument()``, in blocks
    of 10 steps with the hook switched off and on alternately (``HookSwitch``): the median paired
    difference of the training thread's CPU time per step is the hook's cost inside real steps.
(a3) ``--breakdown``: the same loop, each group of points alone (dataloader, forward, backward,
    optimizer, collective) against every point off, once with the tracker recording and once with it
    disabled (the wrappers and torch's hook paths run, no record write): where the per-step cost lies.
(b) End-to-end: ``benchmarks/ddp_timed.py`` (the demo's balanced loop — same model, data, DDP,
    optimizer and per-step all_reduce as examples/ddp_demo.py, imported from it — plus a timer around
    the steps after a warm-up) under ``torchrun --nproc-per-node 2``, with and without
    ``-m rankwatch.hooks``, interleaved A/B/A/B…; the slowdown is the ratio of the medians of the
    per-step time (each run's median step, robust to moments a shared core was taken away; the mean-step
    ratio and the training thread's CPU time per step are printed beside it). ``--extra-arms`` adds
    arms that separate costs (DDP comm hook, flight recorder). No daemon runs during (b).
(c) Shares: py-spy samples of the training thread at ~3 ms steps, side by side: no tool, torch's flight
    recorder alone, the hook, TraceML (``--traceml-python``; skipped without it): the share of samples in
    each tool's own frames (``hook_shares.py``), and the hook's cost per step from it.

    python benchmarks/bench_hook.py            # ~5 min on 2 shared cores
    python benchmarks/bench_hook.py --quick    # ~1.5 min
    python benchmarks/bench_hook.py --quick --no-e2e --breakdown   # + (a3), without the wall-clock A/B
"""

from __future__ import annotations

import argparse
import gc
import inspect
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

from _util import REPO, Procs, median, print_results, torchrun_args, torchrun_cmd

TIMED = str(REPO / "benchmarks" / "ddp_timed.py")
INNER = 20
# module calls per training step of the demo's model: DDP, Model, body, 4 x (Sequential, Linear, ReLU), head
DEMO_MODULE_CALLS = 16

# step_child: mark each block for bench_hook_instructions.py; "instr": also switch callgrind's instrumentation
# on after the warm-up
MARKS_ENV = "RANKWATCH_BENCH_MARKS"
TRACKER_OFF_ENV = "RANKWATCH_BENCH_TRACKER_OFF"  # step_child: hooked blocks with the tracker disabled
ONLY_ENV = "RANKWATCH_BENCH_ONLY"  # step_child: the "on" blocks switch on only this group (HookSwitch.groups)

# step-size configurations, measured on the 2 shared cores (2 ranks, 1 thread each)
CONFIGS = {
    "5ms": ["--hidden", "256", "--layers", "4", "--batch-size", "32"],  # the demo's defaults
    "50ms": ["--hidden", "768", "--layers", "5", "--batch-size", "128"],
}


# -- (a) micro ------------------------------------------------------------------------------------
def timed(body, batches: int, calls: int) -> float:  # type: ignore[no-untyped-def]
    """Median over batches of the per-call cost. The clock is this thread's CPU time
    (CLOCK_THREAD_CPUTIME_ID): on cores shared with other jobs, wall time would also count the moments
    this process was descheduled. Batches are short (~1 ms) for the same reason."""
    clock = time.thread_time_ns
    body(calls)  # warm-up
    samples = []
    for _ in range(batches):
        t = clock()
        body(calls)
        samples.append((clock() - t) / calls)
    return median(samples)


def micro(batches: int, calls: int) -> dict[str, float]:
    from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, record_path, write_identity
    from rankwatch.hooks.tracker import Tracker

    tmp = tempfile.mkdtemp(prefix="rw-bench-hook-")
    try:
        os.makedirs(os.path.join(tmp, "job"), mode=0o700)
        writer = RecordWriter(record_path(tmp, "job", 0))
        write_identity(
            writer,
            RankIdentity(
                pid=os.getpid(),
                global_rank=0,
                local_rank=0,
                world_size=1,
                local_world_size=1,
                node_rank=0,
                device=-1,
                hostname="bench",
                job_id="job",
                start_ns=time.monotonic_ns(),
            ),
            list(CANONICAL_PHASES),
        )
        tr = Tracker(writer)
        fwd = CANONICAL_PHASES.index("forward")

        def per_call(body) -> float:  # type: ignore[no-untyped-def]
            return timed(body, batches, calls)

        def empty(n: int) -> None:
            for _ in range(n):
                pass

        def phase_pair(n: int) -> None:
            for _ in range(n):
                tr.enter(fwd)
                tr.exit(fwd)

        def nested_pair(n: int) -> None:  # a phase inside a phase (collective inside backward, etc.)
            tr.enter(fwd)
            for _ in range(n):
                tr.enter(2)
                tr.exit(2)
            tr.exit(fwd)

        def step(n: int) -> None:
            for _ in range(n):
                tr.step()

        def coll_pair(n: int) -> None:
            for _ in range(n):
                tr.collective_enter("all_reduce")
                tr.collective_exit()

        res = {
            "empty_loop_ns": per_call(empty),
            "phase_pair_ns": per_call(phase_pair),
            "nested_pair_ns": per_call(nested_pair),
            "step_ns": per_call(step),
            "collective_pair_ns": per_call(coll_pair),
        }
        assert tr.enabled, "tracker disabled itself during the benchmark"
        res.update(module_call_cost(batches, calls // 4, tr))
        writer.close()
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def module_call_cost(batches: int, calls: int, tr) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Per nn.Module call, before and after instrument.install() adds the global forward hooks."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    x = torch.zeros(1)
    one = nn.Identity()
    # an outer module holding INNER modules: only the outermost call is a phase, the inner ones pay
    # for the global hooks alone
    seq = nn.Sequential(*[nn.Identity() for _ in range(INNER)])

    def calls_of(mod):  # type: ignore[no-untyped-def]
        def body(n: int) -> None:
            for _ in range(n):
                mod(x)

        return body

    def run() -> tuple[float, float]:
        return timed(calls_of(one), batches, calls), timed(calls_of(seq), batches, max(calls // INNER, 20))

    before = run()
    from rankwatch.hooks.instrument import install

    install(tr)  # patches this (benchmark) process only
    after = run()
    return {
        "module_call_ns": before[0],
        "module_call_hooked_ns": after[0],
        "inner_module_hook_ns": ((after[1] - before[1]) - (after[0] - before[0])) / INNER,
    }


# -- (a2) per step, one process ------------------------------------------------------------------
class HookSwitch:
    """Switches ``instrument()``'s installed points off and on again in this process (benchmark only):
    the same loop, interleaved block by block with and without the hook, so the load of other jobs on
    shared cores drifts equally over both. Swaps the wrapped functions for their originals and empties /
    refills the hook dicts torch reads on each call (global optimizer hooks, the parameters'
    post-accumulate-grad hooks)."""

    def __init__(self, ddp) -> None:  # type: ignore[no-untyped-def]
        import torch
        import torch.distributed as dist
        import torch.optim.optimizer as optim_mod
        import torch.utils.data.dataloader as dl
        from rankwatch.hooks.instrument import COLLECTIVES

        try:
            from rankwatch.hooks.instrument import backward_point
        except ImportError:  # an older tree (bench_hook_instructions --tree): its wrapper is on torch.autograd
            from rankwatch.hooks.instrument import backward_entry

            def backward_point(autograd):  # type: ignore[no-untyped-def]
                return autograd, backward_entry(autograd)[0]
        from torch.nn.parallel import DistributedDataParallel

        owners = [(dl._BaseDataLoaderIter, "__next__"), (DistributedDataParallel, "forward"),
                  backward_point(torch.autograd),
                  *((dist, n) for n in COLLECTIVES if hasattr(dist, n))]
        # (owner, name, what the owner holds: a staticmethod for the engine's, the wrapped original)
        self.attrs = [(o, n, inspect.getattr_static(o, n), getattr(getattr(o, n), "__rankwatch_wrapped__", None))
                      for o, n in owners]
        dicts = [optim_mod._global_optimizer_pre_hooks, optim_mod._global_optimizer_post_hooks]
        dicts += [p._post_accumulate_grad_hooks for p in ddp.parameters() if p._post_accumulate_grad_hooks]
        self.dicts = [(d, dict(d)) for d in dicts]
        assert all(orig is not None for *_, orig in self.attrs[:3]), "instrument() not installed"
        # the points by what they time (breakdown_child): indices into attrs / dicts above
        ncoll = len(self.attrs) - 3
        self.groups: dict[str, tuple[list[int], list[int]]] = {
            "dataloader": ([0], []),  # __next__ wrapper: the dataloader phase and (no workers) batch production
            "forward": ([1], []),  # the DDP class's forward wrapper (the model's, after the first step)
            "backward": ([2], list(range(2, len(self.dicts)))),  # backward wrapper + DDP split hook
            "optimizer": ([], [0, 1]),  # global optimizer pre/post hooks: optimizer phase and step()
            "collective": (list(range(3, 3 + ncoll)), []),  # torch.distributed wrappers
        }

    def set(self, on: bool, only: str | None = None) -> None:
        """All points on or off; with ``only``, that group ``on`` and every other point off."""
        keep = self.groups[only] if only else None
        for i, (owner, name, held, orig) in enumerate(self.attrs):
            this = on if keep is None else i in keep[0]
            setattr(owner, name, held if this or orig is None else orig)
        for i, (d, saved) in enumerate(self.dicts):
            this = on if keep is None else i in keep[1]
            d.clear()
            if this:
                d.update(saved)


def step_child(steps: int, breakdown: bool = False) -> None:
    """The demo's small-step loop (ddp_timed.py's pieces) in one process (gloo, world size 1) under
    ``instrument()``, in blocks of steps alternately with the hook switched off and on (HookSwitch);
    prints the training thread's CPU time per step of each block, as JSON. ``breakdown``: instead, each
    group of points alone (``HookSwitch.groups``), with the tracker recording and with it disabled (the
    wrappers and torch's hook paths still run, the record is not written), as paired differences."""
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist
    from ddp_demo import Model, SlowCollate, SyntheticData, parse_args
    from rankwatch.hooks import ddp_timing, instrument
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    assert instrument(), "the hook did not start"
    args = parse_args(["--hidden", "128", "--layers", "3", "--batch-size", "32"])
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="rw-bench-store-")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Model(args.hidden, args.layers))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    batches = iter(DataLoader(SyntheticData(args, 0), batch_size=32, collate_fn=SlowCollate(args, 0, [0])))
    loss_sum = torch.zeros(1)
    clock = time.thread_time_ns

    def block(n: int) -> float:
        c = clock()
        for _ in range(n):
            x, y = next(batches)
            loss = nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum.copy_(loss.detach())
            dist.all_reduce(loss_sum)
        return (clock() - c) / n / 1e3

    block(30)  # warm-up, hooked: forward timing moves from the global hooks to DDP.forward at the first optimizer step
    switch = HookSwitch(ddp)
    if breakdown:
        print(json.dumps(breakdown_blocks(switch, block, steps)), flush=True)
        switch.set(True)
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
        return
    timing = ddp_timing.active()
    splits = timing.split_count if timing else 0
    per = 10
    # bench_hook_instructions.py: each block between two getppid() calls, where callgrind dumps its counters
    mark = os.getppid if os.environ.get(MARKS_ENV) else (lambda: 0)
    if os.environ.get(MARKS_ENV) == "instr":  # started with --instr-atstart=no: count from here on
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
        # the cyclic collector runs at allocation counts, so a pass lands in one block of a pair and not the
        # other: ±15k instructions per step of noise, as large as the hook. Off while counting (the hook's
        # few allocations per step are small ints, freed by reference counting).
        gc.collect()
        gc.disable()
    if os.environ.get(TRACKER_OFF_ENV):  # the points on, the record not written: wrappers and torch's paths
        from rankwatch.hooks import api

        tracker = api.current()
        assert tracker is not None
        tracker.enabled = False
    only = os.environ.get(ONLY_ENV) or None
    out: dict[str, list[float]] = {"off": [], "on": [], "order": []}
    for i in range(steps // (2 * per)):
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            switch.set(on, only if on else None)
            mark()
            out["on" if on else "off"].append(block(per))
            mark()
            out["order"].append(float(on))
    switch.set(True)
    dist.destroy_process_group()
    shutil.rmtree(tmp, ignore_errors=True)
    out["splits"] = [float((timing.split_count if timing else 0) - splits)]
    print(json.dumps(out), flush=True)


def breakdown_blocks(switch: HookSwitch, block, steps: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median paired difference (µs per step) of blocks with one group on (tracker recording, then
    disabled: ``/off``) against blocks with every point off; ``none`` (nothing on) is the noise floor."""
    from rankwatch.hooks import api

    tracker = api.current()
    assert tracker is not None
    per = 10
    out: dict[str, float] = {}
    for group in ["none", *switch.groups, "all"]:
        for recording in (True, False):
            if group == "none" and not recording:
                continue
            tracker.enabled = recording
            diffs = []
            for i in range(max(2, steps // (2 * per * (2 * len(switch.groups) + 3)))):
                t = {}
                for on in ((False, True) if i % 2 == 0 else (True, False)):
                    if not on:
                        switch.set(False)
                    elif group == "all":
                        switch.set(True)
                    elif group == "none":
                        switch.set(False)
                    else:
                        switch.set(True, only=group)
                    t[on] = block(per)
                diffs.append(t[True] - t[False])
            out[group if recording else f"{group}/off"] = median(diffs)
    tracker.enabled = True
    return out


def _step_child_json(steps: int, job_id: str, what: str, *extra: str) -> dict[str, Any]:
    """One step_child run in its own shm dir, without a launcher's rank environment; its JSON line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="2000")
    shm = tempfile.mkdtemp(prefix="rw-bench-shm-")
    env.update(RANKWATCH_SHM_DIR=shm, RANKWATCH_JOB_ID=job_id)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RANKWATCH_DDP_TIMING", "RANKWATCH_DISABLE"):
        env.pop(key, None)
    try:
        with Procs() as procs:
            cmd = [sys.executable, __file__, "--step-child", str(steps), *extra]
            res = procs.run(cmd, timeout=600, text=True, env=env)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), None)
    if res.returncode != 0 or line is None:
        raise RuntimeError(f"{what} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return dict(json.loads(line))


def breakdown(steps: int) -> dict[str, float]:
    """One child in breakdown mode (step_child): the hook's CPU per step by group of points."""
    return {k: float(v) for k, v in _step_child_json(steps, "bench-breakdown", "breakdown", "--breakdown").items()}


def breakdown_rows(bd: dict[str, float]) -> list[str]:
    groups = [g for g in bd if "/" not in g and g not in ("none", "all")]
    parts = ", ".join(f"{g} {bd[g]:+.0f} ({bd[g + '/off']:+.0f})" for g in groups)
    return [
        f"| hook CPU per step by group of points, one process (each group alone vs every point off, paired "
        f"blocks; in brackets: the tracker disabled, i.e. the wrappers and torch's hook paths without the "
        f"record writes) | {parts}; all {bd['all']:+.0f} ({bd['all/off']:+.0f}) µs; noise floor (nothing on) "
        f"{bd['none']:+.0f} µs | — | — |",
    ]


def per_step(steps: int) -> dict[str, float]:
    """One child (step_child): per-step training-thread CPU with the hook off / on, medians over the
    blocks, and the median of the paired (adjacent) block differences."""
    r = _step_child_json(steps, "bench-step", "per-step")
    off, on = r["off"], r["on"]
    paired = median([b - a for a, b in zip(off, on, strict=True)])
    return {"off_us": median(off), "on_us": median(on), "paired_us": paired,
            "blocks": float(len(on)), "splits": r["splits"][0], "steps_on": float(len(on) * 10)}


# -- (b) end to end -------------------------------------------------------------------------------
ARM_ENV = {
    "base": {},
    "hook": {},
    "hook-noddp": {"RANKWATCH_DDP_TIMING": "0"},  # without hooks/ddp_timing.py's comm hook
    "hook-nofr": {"TORCH_FR_BUFFER_SIZE": "0"},  # without the flight recorder the hook switches on
    "base-fr": {"TORCH_FR_BUFFER_SIZE": "2000"},  # no hook, flight recorder on
}


def one_run(procs: Procs, arm: str, cfg: list[str], steps: int, warmup: int, shm: str, n: int) -> dict[str, float]:
    env = dict(os.environ, RANKWATCH_SHM_DIR=shm, OMP_NUM_THREADS="1")
    for key in ("RANKWATCH_DDP_TIMING", "TORCH_FR_BUFFER_SIZE"):
        env.pop(key, None)
    env.update(ARM_ENV[arm])
    script = [TIMED, *cfg, "--steps", str(steps), "--warmup", str(warmup)]
    if arm.startswith("hook"):
        script = ["-m", "rankwatch.hooks", *script]
        env["RANKWATCH_JOB_ID"] = f"bench-hook-{n}"
    cmd = torchrun_cmd(*torchrun_args(2, f"bench-hook-{n}", *script))
    res = procs.run(cmd, timeout=300, text=True, env=env)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"{arm} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    if res.returncode != 0:
        # seen rarely with and without the hook: gloo aborts a rank in destroy_process_group ("terminate
        # called without an active exception") after the timed window; the measurement is complete
        print(f"  (note: {arm} run exited {res.returncode} after printing its result)", flush=True)
    return {k: float(v) for k, v in json.loads(line).items()}


def end_to_end(pairs: int, steps: dict[str, int], arms: list[str]) -> dict[str, dict[str, list[dict[str, float]]]]:
    shm = tempfile.mkdtemp(prefix="rw-bench-shm-")
    out: dict[str, dict[str, list[dict[str, float]]]] = {name: {a: [] for a in arms} for name in CONFIGS}
    n = 0
    try:
        with Procs() as procs:
            for i in range(pairs):
                for name, cfg in CONFIGS.items():
                    # alternate which arm goes first, so a drifting load does not favour one arm
                    order = arms if i % 2 == 0 else arms[::-1]
                    for arm in order:
                        n += 1
                        r = one_run(procs, arm, cfg, steps[name], steps[name] // 5, shm, n)
                        out[name][arm].append(r)
                        print(
                            f"  round {i + 1}/{pairs} {name:>4} {arm:<10} median step {r['median_step_ms']:8.3f} ms, "
                            f"mean {r['step_ms']:8.3f} ms, training-thread CPU {r['thread_cpu_ms']:7.3f} ms/step",
                            flush=True,
                        )
                        shutil.rmtree(os.path.join(shm, f"bench-hook-{n}"), ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def ratio_pct(runs: dict[str, list[dict[str, float]]], arm: str, key: str) -> tuple[float, float, float, float]:
    """(base median, arm median, slowdown % of the medians, median of the per-round paired slowdowns %)."""
    b = [r[key] for r in runs["base"]]
    h = [r[key] for r in runs[arm]]
    paired = [(y / x - 1) * 100 for x, y in zip(b, h, strict=False)]
    return median(b), median(h), (median(h) / median(b) - 1) * 100, median(paired)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer batches, 3 pairs, shorter runs")
    p.add_argument("--pairs", type=int, default=None, help="interleaved A/B rounds (default 6, quick 3)")
    p.add_argument("--micro-only", action="store_true")
    p.add_argument(
        "--extra-arms",
        nargs="*",
        default=[],
        choices=[a for a in ARM_ENV if a not in ("base", "hook")],
        help="more arms to separate costs: hook-noddp (RANKWATCH_DDP_TIMING=0), hook-nofr (flight recorder "
        "off), base-fr (no hook, flight recorder on)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    p.add_argument("--no-e2e", action="store_true", help="skip (b), the wall-clock A/B")
    p.add_argument("--shares-rounds", type=int, default=None, help="(c) interleaved rounds (default 4, quick 1)")
    p.add_argument("--shares-steps", type=int, default=None, help="(c) steps per run (default 3000, quick 800)")
    p.add_argument("--shares-hidden", type=int, default=None,
                   help="(c) the model's width (default 128: ~2-3 ms steps of 1.1-2.2 ms training-thread CPU here, "
                        "quiet to loaded; 512: 3.3-3.5 ms of CPU per step on a quiet host, the issue's measured step)")
    p.add_argument("--native", action="store_true", help="(c) every arm with --native (default: FR, hook)")
    p.add_argument("--traceml-python", default=None, help="(c) a Python with traceml-ai, for the TraceML arm")
    p.add_argument("--breakdown", action="store_true",
                   help="(a3) also the hook's CPU per step by group of points, with and without the record writes")
    p.add_argument("--breakdown-steps", type=int, default=None,
                   help="(a3) steps (default 8 x (a2)'s; the CI smoke run: a few hundred, every path once)")
    p.add_argument("--step-child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step_child:
        step_child(args.step_child, args.breakdown)
        return 0
    pairs = args.pairs or (3 if args.quick else 6)
    batches, calls = (100, 1000) if args.quick else (1000, 1000)
    steps = {"5ms": 300, "50ms": 60} if args.quick else {"5ms": 600, "50ms": 120}

    print(f"(a) micro: median of {batches} batches of {calls} calls", flush=True)
    m = micro(batches, calls)
    for k, v in m.items():
        print(f"  {k:<24} {v:8.1f} ns")
    transition = (m["phase_pair_ns"]) / 2
    # dataloader, forward, backward, optimizer (+ grad_sync split) pairs; step(); the loss all_reduce
    per_step_pairs = 4
    est = (
        per_step_pairs * m["phase_pair_ns"]
        + m["step_ns"]
        + m["collective_pair_ns"]
        + (DEMO_MODULE_CALLS - 1) * m["inner_module_hook_ns"]
        + (m["module_call_hooked_ns"] - m["module_call_ns"] - m["phase_pair_ns"])
    )
    raw: dict[str, object] = {"micro": m}

    rows = [
        f"| phase enter+exit (Tracker over a real mmap record) | {m['phase_pair_ns']:.0f} ns per pair = "
        f"**{transition:.0f} ns per transition** | < 2 µs per transition | {'yes' if transition < 2000 else 'NO'} |",
        f"| nested phase enter+exit | {m['nested_pair_ns']:.0f} ns per pair | < 4 µs | "
        f"{'yes' if m['nested_pair_ns'] < 4000 else 'NO'} |",
        f"| step() (ring entry + live state) | {m['step_ns']:.0f} ns | — | — |",
        f"| collective_enter + collective_exit | {m['collective_pair_ns']:.0f} ns | — | — |",
        f"| nn.Module call, without → with instrument()'s global forward hooks | "
        f"{m['module_call_ns']:.0f} → {m['module_call_hooked_ns']:.0f} ns "
        f"(+{m['module_call_hooked_ns'] - m['module_call_ns']:.0f} ns: one forward phase + the hooks) | — | — |",
        f"| nn.Module call nested inside the outermost one (global hooks only, no record write) | "
        f"+{m['inner_module_hook_ns']:.0f} ns per module call | — | — |",
        f"| estimated hook CPU per demo step (~{per_step_pairs} phase pairs, step(), 1 collective, "
        f"{DEMO_MODULE_CALLS} module calls) | {est / 1000:.1f} µs = {est / 50_000:.2f} % of 5 ms, "
        f"{est / 500_000:.3f} % of 50 ms | — | — |",
    ]
    if not args.micro_only:
        n_steps = 2000 if args.quick else 8000
        print(f"(a2) per step, one process: {n_steps} steps in blocks of 10, hook off / on alternately", flush=True)
        ps = per_step(n_steps)
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in ps.items()), flush=True)
        raw["per_step"] = ps
        rows += per_step_rows(ps)
        if args.breakdown:
            bd_steps = args.breakdown_steps or n_steps * 8
            print(f"(a3) breakdown: {bd_steps} steps, each group of points alone", flush=True)
            bd = breakdown(bd_steps)
            print("  " + ", ".join(f"{k} {v:.1f}" for k, v in bd.items()), flush=True)
            raw["breakdown"] = bd
            rows += breakdown_rows(bd)
    if not args.micro_only and not args.no_e2e:
        arms = ["base", "hook", *args.extra_arms]
        print(f"(b) end to end: {pairs} interleaved rounds of {arms}, 2 ranks", flush=True)
        e2e = end_to_end(pairs, steps, arms)
        raw["e2e"] = e2e
        targets = {"5ms": 3.0, "50ms": 1.0}
        for name in CONFIGS:
            for arm in arms[1:]:
                bw, hw, slow, paired = ratio_pct(e2e[name], arm, "median_step_ms")
                _, _, slow_mean, _ = ratio_pct(e2e[name], arm, "step_ms")
                bc, hc, slow_cpu, paired_cpu = ratio_pct(e2e[name], arm, "thread_cpu_ms")
                per_round = [
                    (h["median_step_ms"] / b["median_step_ms"] - 1) * 100
                    for b, h in zip(e2e[name]["base"], e2e[name][arm], strict=False)
                ]
                label = "hook" if arm == "hook" else arm
                met = "yes" if slow < targets[name] else "NO"
                rows.append(
                    f"| DDP step time at ~{name[:-2]} ms/step, 2 ranks, base → {label}, {pairs} interleaved rounds "
                    f"(wall, median step) | {bw:.2f} → {hw:.2f} ms = **{slow:+.1f} %** (paired {paired:+.1f} %, "
                    f"per round {min(per_round):+.0f} … {max(per_round):+.0f} %; mean-step ratio {slow_mean:+.1f} %) "
                    f"| < {targets[name]:.0f} % | {met} |"
                )
                rows.append(
                    f"| … same runs, training-thread CPU time per step | {bc:.3f} → {hc:.3f} ms = "
                    f"**{slow_cpu:+.1f} %** (paired {paired_cpu:+.1f} %, +{(hc - bc) * 1000:.0f} µs) | — | — |"
                )
    if not args.micro_only:
        rows += shares_rows(args, raw)
    return print_results(rows, raw, args.json)


def per_step_rows(ps: dict[str, float]) -> list[str]:
    split = "every hooked step split into backward/grad_sync" if ps["splits"] == ps["steps_on"] else (
        f"{ps['splits']:.0f} of {ps['steps_on']:.0f} hooked steps split")
    return [
        f"| hook CPU per step, one process (DDP world size 1, DataLoader, SGD, 1 all_reduce, FR on in both; "
        f"{ps['blocks']:.0f} blocks of 10 steps, hook switched off/on alternately; {split}): training-thread CPU "
        f"per step | {ps['off_us']:.1f} → {ps['on_us']:.1f} µs, **{ps['paired_us']:+.1f} µs** (median of paired "
        f"blocks) | <= 20 µs | {'yes' if ps['paired_us'] <= 20 else 'NO'} |"
    ]


def shares_rows(args: argparse.Namespace, raw: dict[str, object]) -> list[str]:
    import hook_shares

    rounds = args.shares_rounds or (1 if args.quick else 4)
    steps = args.shares_steps or (800 if args.quick else 3000)
    arms = ["none", "fr", "hook"]
    if args.traceml_python:
        arms.append("traceml")
    print(f"(c) shares: {rounds} interleaved rounds of {arms}, 2 ranks, py-spy 100 Hz"
          f"{' --native' if args.native else ' (--native for fr and hook)'}", flush=True)
    res = hook_shares.shares(rounds, steps, arms, native=args.native, traceml_python=args.traceml_python,
                             hidden=args.shares_hidden)
    summ = hook_shares.summary(res)
    raw["shares"] = {"runs": res, "summary": summ}
    arms = [a for a in arms if a in summ]
    if "hook" not in summ or "none" not in summ:
        return ["| training-thread sample shares | every hook or no-tool run failed | — | NO |"]
    hook = summ["hook"]
    # the hook's own CPU per step: its share of the training thread's active samples times that CPU time
    per_step_us = hook["pooled_pct"] / 100 * hook["thread_cpu_ms"] * 1000
    rows = []
    others = [summ[o]["share_pct"] for o in arms[1:] if o != "hook"]
    hook_met = "yes" if hook["share_pct"] <= 0.5 and all(hook["share_pct"] < o for o in others) else "NO"
    for arm in arms[1:]:
        a = summ[arm]
        rows.append(
            f"| training-thread samples in {arm}'s own frames, ~{summ['none']['median_step_ms']:.1f} ms steps"
            f"{f' (--hidden {args.shares_hidden})' if args.shares_hidden else ''}, "
            f"2 ranks, {rounds} interleaved rounds | **{a['share_pct']:.2f} %** (pooled {a['pooled_pct']:.2f} % of "
            f"{a['samples']:.0f} samples); median step {a['median_step_ms']:.2f} ms, thread CPU "
            f"{a['thread_cpu_ms']:.3f} ms/step (no tool: {summ['none']['thread_cpu_ms']:.3f}) | "
            f"{'<= 0.5 %, below FR and TraceML' if arm == 'hook' else '—'} | "
            f"{hook_met if arm == 'hook' else '—'} |"
        )
    rows.append(f"| hook CPU per step from its sample share (pooled share × thread CPU per step) | "
                f"**{per_step_us:.1f} µs** | <= 20 µs | {'yes' if per_step_us <= 20 else 'NO'} |")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
