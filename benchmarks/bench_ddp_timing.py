"""Added cost of the DDP backward timing (hooks/ddp_timing.py) on the demo's balanced run.

Runs ``examples/ddp_demo.py --scenario balanced`` under torchrun with the rankwatch hook, alternating
``RANKWATCH_DDP_TIMING=1`` and ``=0`` (interleaved, so drifting host load hits both), and reads each
rank's step ring from its shm record. Per run: median step time over the ranks' steps (step 0 and a
short warm-up dropped). Reported: ratio of the medians of the per-run medians, on/off, and the
absolute difference per step.

    python benchmarks/bench_ddp_timing.py --pairs 6 --steps 300 --nproc 2

On a shared, loaded host run-to-run noise (±30 % and more) swamps a 1 % effect. ``--mode interleaved``
is the low-noise estimate: one job, two identical demo models stepped alternately, one with its backward
split and one without (``--steps`` per model, ``--repeats`` jobs). ``--mode micro`` measures the CPU
overhead per backward in one process (world size 1), free of peer waits, for rankwatch's mechanism and
for the Python comm hook it replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = str(REPO / "examples" / "ddp_demo.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(timing: bool, args: argparse.Namespace, base: Path, idx: int) -> tuple[float, int]:
    """Median step time (ms) of one job and the number of steps it is taken over."""
    from rankwatch.hooks.record import read_record

    shm = base / f"shm{idx}"
    job = f"bench{idx}"
    env = dict(
        os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, RANKWATCH_DDP_TIMING="1" if timing else "0"
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        job,
        "-m",
        "rankwatch.hooks",
        DEMO,
        "--scenario",
        "balanced",
        "--steps",
        str(args.steps),
    ]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    durations: list[float] = []
    phase_names: set[str] = set()
    for r in range(args.nproc):
        snap = read_record(str(shm / job / f"rank-{r}.hb"))
        phase_names |= {p for t in snap.recent_steps for p in t.phases_ms}
        durations += [t.duration_ms for t in snap.recent_steps if t.step >= args.warmup]
    if timing != ("grad_sync" in phase_names):
        raise SystemExit(f"run {idx}: grad_sync presence {('grad_sync' in phase_names)} but timing={timing}")
    shutil.rmtree(shm, ignore_errors=True)
    return statistics.median(durations), len(durations)


WORKER = """
import statistics, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, sys.argv[1])
from ddp_demo import Model
steps = int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
plain = DDP(Model(256, 4))
plain._forward_pre_hooks.clear()  # rankwatch's arming pre-hook removed: this model's backward is not split
timed = DDP(Model(256, 4))  # backward split by rankwatch's end-of-graph callback
x, y = torch.randn(32, 256), torch.randn(32, 1)
from rankwatch.hooks import ddp_timing
timing = ddp_timing.active()
assert timing is not None and timed in timing.models
for m, want in ((plain, 0), (timed, 1)):
    before = timing.split_count
    nn.functional.mse_loss(m(x), y).backward()
    assert timing.split_count - before == want, (m is timed, timing.split_count - before)
opts = {m: torch.optim.SGD(m.parameters(), lr=1e-4) for m in (plain, timed)}
times = {plain: [], timed: []}
for i in range(2 * steps):
    m = plain if i % 2 else timed
    t = time.perf_counter_ns()
    loss = nn.functional.mse_loss(m(x), y)
    opts[m].zero_grad(set_to_none=True)
    loss.backward()
    opts[m].step()
    times[m].append(time.perf_counter_ns() - t)
if dist.get_rank() == 0:
    on, off = (statistics.median(times[m][10:]) / 1e6 for m in (timed, plain))
    print(f"RESULT {on:.4f} {off:.4f}")
dist.barrier()
dist.destroy_process_group()
"""


def interleaved(args: argparse.Namespace) -> tuple[float, float]:
    """One job, two identical DDP models stepped alternately: one with its backward split by rankwatch, one
    without. Host-load drift hits both equally; returns rank 0's medians (on, off) in ms."""
    with tempfile.TemporaryDirectory(prefix="rw-bench-ddp-") as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        env = dict(os.environ, RANKWATCH_SHM_DIR=str(Path(tmp) / "shm"), RANKWATCH_JOB_ID="benchi")
        env["RANKWATCH_DDP_TIMING"] = "1"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(args.nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--rdzv-id",
            "benchi",
            "-m",
            "rankwatch.hooks",
            str(script),
            str(REPO / "examples"),
            str(args.steps),
        ]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=300).stdout
        on, off = (float(v) for v in out.split("RESULT", 1)[1].split())
        return on, off


class _Stamp:
    ready_ns = 0


def _old_comm_hook(state: tuple[_Stamp, object], bucket: object) -> object:
    """The comm hook rankwatch used before (stamp, then DDP's default all-reduce in Python), for comparison."""
    import torch.distributed as dist

    stamp, group = state
    stamp.ready_ns = time.monotonic_ns()
    tensor = bucket.buffer()  # type: ignore[attr-defined]
    tensor.div_(dist.get_world_size(group))  # type: ignore[arg-type]
    work = dist.distributed_c10d.all_reduce(tensor, group=group, async_op=True)  # type: ignore[arg-type]
    return work.get_future().then(lambda fut: fut.value()[0])


def micro(steps: int) -> dict[str, float]:
    """CPU overhead per fwd+bwd in this process (world size 1, gloo, the demo's model), models stepped
    round-robin in a rotating order: DDP's C++ all-reduce alone, with the Python comm hook rankwatch used
    before, and with rankwatch's end-of-graph callback (``DDPTiming``: arming forward pre-hook, root
    pre-hook, engine callback, as instrument.py drives it around backward). Median µs."""
    import torch
    import torch.distributed as dist
    from rankwatch.hooks import ddp_timing
    from torch import nn
    from torch.autograd import Variable
    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(REPO / "examples"))
    from ddp_demo import Model

    class StubTracker:
        enabled = True

        def on_thread(self) -> bool:
            return True

        def slot(self, name: str) -> int:
            return 5

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        timing = ddp_timing.DDPTiming(StubTracker(), Variable._execution_engine.queue_callback)  # type: ignore[arg-type]
        models = {}
        for name in ("default", "callback", "old_comm_hook"):
            torch.manual_seed(0)
            m = DDP(Model(256, 4))
            if name == "old_comm_hook":
                dist._register_comm_hook(m.reducer, (_Stamp(), m.process_group), _old_comm_hook)
            elif name == "callback":
                timing.constructed(m)
            models[name] = m
        x, y = torch.randn(32, 256), torch.randn(32, 1)
        times: dict[str, list[int]] = {k: [] for k in models}
        names = list(models)
        for i in range(steps):
            # rotate the order: a fixed round-robin position costs or saves tens of µs by itself
            for name in names[i % 3 :] + names[: i % 3]:
                m = models[name]
                t = time.perf_counter_ns()
                loss = nn.functional.mse_loss(m(x), y)
                if name == "callback":  # instrument.py's backward wrapper, around the same call
                    split = timing.begin(loss)
                    loss.backward()
                    if split:
                        timing.end()
                else:
                    loss.backward()
                times[name].append(time.perf_counter_ns() - t)
        dist.destroy_process_group()
    if timing.split_count != steps or not timing.enabled:
        raise SystemExit(f"callback model split {timing.split_count} of {steps} backward passes")
    return {k: statistics.median(v[steps // 10 :]) / 1000 for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mode", choices=("runs", "interleaved", "micro"), default="runs")
    p.add_argument("--repeats", type=int, default=3, help="interleaved mode: jobs")
    p.add_argument("--quick", action="store_true", help="1 pair of 80 steps")
    p.add_argument("--json", type=Path, default=None, help="also write raw results here")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.steps = 1, 80  # proves the runs work (the test suite runs it), not a figure
    if args.mode == "micro":
        for i in range(args.repeats):
            res = micro(args.steps)
            base = res["default"]
            print(
                f"repeat {i}: fwd+bwd median " + ", ".join(f"{k} {v:.1f} us ({v - base:+.1f})" for k, v in res.items()),
                flush=True,
            )
        return 0
    if args.mode == "interleaved":
        ratios = []
        for i in range(args.repeats):
            on, off = interleaved(args)
            ratios.append(on / off)
            print(
                f"job {i}: median step with timing {on:.3f} ms, without {off:.3f} ms, ratio {on / off:.4f} "
                f"({1000 * (on - off):+.0f} us/step)",
                flush=True,
            )
        print(f"median ratio {statistics.median(ratios):.4f} over {args.repeats} jobs of {args.steps} steps per model")
        return 0
    base = Path(tempfile.mkdtemp(prefix="rw-bench-ddp-"))
    on: list[float] = []
    off: list[float] = []
    started = time.monotonic()
    try:
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            for timing in order:
                med, n = one_run(timing, args, base, len(on) + len(off))
                (on if timing else off).append(med)
                label = "on " if timing else "off"
                print(f"pair {i} timing={label} median step {med:.3f} ms over {n} steps", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    m_on, m_off = statistics.median(on), statistics.median(off)
    pair_ratios = [a / b for a, b in zip(on, off, strict=True)]
    print(
        f"\nmedian of run medians: on {m_on:.3f} ms, off {m_off:.3f} ms; ratio {m_on / m_off:.4f} "
        f"({100 * (m_on / m_off - 1):+.2f} %, {1000 * (m_on - m_off):+.0f} us/step)\n"
        f"per-pair ratios: {', '.join(f'{r:.3f}' for r in pair_ratios)} "
        f"(median {statistics.median(pair_ratios):.4f}); {args.pairs} pairs, {args.steps} steps, "
        f"{args.nproc} ranks, {time.monotonic() - started:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps({"on_ms": on, "off_ms": off, "ratio": m_on / m_off, "steps": args.steps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
