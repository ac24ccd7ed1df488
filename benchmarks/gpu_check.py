"""One-shot check of the GPU/NCCL evidence modules on a real machine; prints PASS/FAIL/SKIP per check.

    python benchmarks/gpu_check.py [--ras HOST:PORT] [--keep DIR]

Checks (each bounded by a timeout; the whole run takes well under two minutes):
  nvml.open         NvmlProbe opens and samples every device
  nvml.process      a child CUDA matmul loop shows up in the per-process utilisation with util > 0
  nvml.cause        the straggler cause's GPU state of every device while a child computes: SM/memory clocks
                    and their maxima, clock-event reasons (decoded), temperature and slowdown threshold, PCIe
                    link generation/width against the maximum, replays, ECC; and the cause rule over a real
                    rank's GPU (idle peers are not compared: the check is that the state is read, real and
                    consistent: clocks <= max, a busy link at its maximum unless the host says otherwise)
  cuda.events       EventPool times a matmul on real CUDA events, harvested by non-blocking poll()
  fr.gloo           2 gloo ranks, real _dump_fr_trace_json dumps → load_dump → analyze (runs on CPU too)
  fr.nccl           min(2, GPUs) NCCL ranks, _dump_nccl_trace_json → load_dump → analyze
  nccl.ras          RAS status queried by rank 0 while its communicator is alive (NCCL ≥ 2.24)
``--record FILE`` writes the devices' real NVML answers as a fixture of ``tests/fixtures/nvml`` (the shape
of ``four_gpus_one_hot_one_narrow.json``), to replace the documented values there with recorded ones.
Exit status 0 when no check FAILed (SKIP is fine: e.g. no GPU, or NCCL older than 2.24).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RESULTS: list[tuple[str, str, str]] = []


def report(name: str, status: str, detail: str) -> None:
    RESULTS.append((name, status, detail))
    print(f"{status:4} {name}: {detail}", flush=True)


def run_check(name: str, fn: Callable[[], tuple[str, str]]) -> None:
    try:
        status, detail = fn()
    except Exception as exc:  # a check that crashes is a FAIL, and the others still run
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}"
    report(name, status, detail)


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# -- NVML ---------------------------------------------------------------------------------------------


def check_nvml_open() -> tuple[str, str]:
    from rankwatch.watchdog.evidence.nvml import NvmlProbe

    probe = NvmlProbe.open()
    if probe is None:
        return ("FAIL" if cuda_available() else "SKIP"), "NVML unavailable (no driver?)"
    with probe:
        s = probe.sample([os.getpid()])
    devs = "; ".join(
        f"gpu{d.index} util={d.gpu_util}% mem={d.mem_used_bytes}/{d.mem_total_bytes} power={d.power_w}W "
        f"ecc_unc={d.ecc_uncorrected_volatile} remap_pending={d.remap_pending} xids={list(d.xids)}"
        for d in s.devices
    )
    if not s.devices:
        return "FAIL", "NVML opened but reports no device"
    return "PASS", f"{len(s.devices)} device(s): {devs}; skipped={list(s.skipped)[:6]}"


def check_nvml_cause(record: str | None) -> tuple[str, str]:
    """Every device's cause state while a child computes on GPU 0 (a busy GPU's clocks and link, not an idle
    one's: an idle GPU drops its link to Gen1 and its clocks to idle)."""
    from rankwatch.watchdog.core.host_signals import link_degraded, slowing_reasons
    from rankwatch.watchdog.evidence.gpu import gpu_state
    from rankwatch.watchdog.evidence.nvml import NvmlProbe

    if not cuda_available():
        return "SKIP", "no CUDA"
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    try:
        time.sleep(3)  # the clock is the point: the child's kernels must be running when the device is read
        probe = NvmlProbe.open()
        if probe is None:
            return "FAIL", "NVML unavailable while CUDA is"
        with probe:
            s = probe.sample([child.pid])
    finally:
        child.wait(timeout=60)
    bad, lines = [], []
    for d in s.devices:
        g = gpu_state(d, 0)
        why = list(slowing_reasons(d.clock_reasons))
        lines.append(f"gpu{d.index} sm={d.sm_clock_mhz}/{d.sm_clock_max_mhz}MHz mem={d.mem_clock_mhz}/"
                     f"{d.mem_clock_max_mhz}MHz reasons=0x{(d.clock_reasons or 0):x}{why} "
                     f"temp={d.temperature_c}C slowdown={d.slowdown_c}C pcie=Gen{d.pcie_gen}x{d.pcie_width}/"
                     f"Gen{d.pcie_gen_max}x{d.pcie_width_max} replay={d.pcie_replay} degraded={link_degraded(g)}")
        if d.sm_clock_mhz is None or d.sm_clock_max_mhz is None or d.pcie_gen is None or d.clock_reasons is None:
            bad.append(f"gpu{d.index}: a cause field unread")
        elif d.sm_clock_mhz > d.sm_clock_max_mhz:
            bad.append(f"gpu{d.index}: SM clock above its maximum")
    if record:
        _record(record)
    detail = "; ".join(lines) + (f"; skipped={[x for x in s.skipped if 'util' not in x][:8]}" if s.skipped else "")
    return ("FAIL", "; ".join(bad) + " | " + detail) if bad else ("PASS", detail)


def _record(path: str) -> None:
    """The devices' raw NVML answers in the fixture shape of tests/fixtures/nvml (for the cause's tests)."""
    import json

    import pynvml as nv

    def ask(fn, *a):
        try:
            return fn(*a)
        except Exception:
            return None

    nv.nvmlInit()
    devices = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        devices.append({
            "uuid": ask(nv.nvmlDeviceGetUUID, h),
            "clocks": {"sm": ask(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM),
                       "mem": ask(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)},
            "max_clocks": {"sm": ask(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
                           "mem": ask(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM)},
            "clock_event_reasons": ask(fn, h),
            "temperature": ask(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "temperature_thresholds": {
                "slowdown": ask(nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                "shutdown": ask(nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)},
            "pcie": {"gen": ask(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                     "width": ask(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                     "max_gen": ask(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                     "max_width": ask(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
                     "replay": ask(nv.nvmlDeviceGetPcieReplayCounter, h)},
            "name": ask(nv.nvmlDeviceGetName, h),
            "driver": ask(nv.nvmlSystemGetDriverVersion),
        })
    nv.nvmlShutdown()
    with open(path, "w") as f:
        doc = {"_doc": "recorded by benchmarks/gpu_check.py --record", "devices": devices}
        json.dump(doc, f, indent=2, default=str)


CHILD = """
import time, torch
a = torch.randn(4096, 4096, device="cuda")
t = time.time()
while time.time() - t < 8:
    b = a @ a
torch.cuda.synchronize()
"""


def check_nvml_process() -> tuple[str, str]:
    from rankwatch.watchdog.evidence.nvml import NvmlProbe, gpu_evidence

    if not cuda_available():
        return "SKIP", "no CUDA"
    probe = NvmlProbe.open()
    if probe is None:
        return "FAIL", "CUDA works but NVML does not open"
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    seen: list[str] = []
    try:
        time.sleep(3.0)  # CUDA context + first kernels
        best = None
        for _ in range(4):
            s = probe.sample([child.pid])
            ev = gpu_evidence(s, {0: child.pid})[0]
            seen.append(f"util={ev.util} missing={ev.missing} devices={ev.devices}")
            if ev.util is not None and ev.util > 0:
                best = ev
                break
            time.sleep(1.0)
        if best is None:
            unresolved = child.pid in s.unresolved
            hint = " (pid not visible to NVML: container pid namespace?)" if unresolved else ""
            return "FAIL", f"child {child.pid} never showed util > 0{hint}: {seen}"
        return "PASS", f"child {child.pid}: {seen[-1]}"
    finally:
        child.kill()
        child.wait(timeout=10)
        probe.close()


# -- CUDA events ----------------------------------------------------------------------------------------


def check_events() -> tuple[str, str]:
    from rankwatch.hooks.cuda_timing import EventPool

    pool = EventPool.create()
    if pool is None:
        return ("FAIL" if cuda_available() else "SKIP"), "EventPool unavailable (no CUDA)"
    import torch

    a = torch.randn(4096, 4096, device="cuda")
    t0 = time.perf_counter()
    pool.begin("matmul")
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    pool.end("matmul")
    launch_ms = (time.perf_counter() - t0) * 1000
    got: list[tuple[object, float]] = []
    polls = 0
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        got = pool.poll()
        polls += 1
        time.sleep(0.002)
    if not got or got[0][1] <= 0:
        return "FAIL", f"no timing harvested after {polls} polls; stats={pool.stats()}"
    return "PASS", f"gpu_ms={got[0][1]:.2f} (CPU launch {launch_ms:.2f} ms, {polls} non-blocking polls)"


# -- flight recorder (gloo and NCCL) and RAS -----------------------------------------------------------


def worker(backend: str, out_dir: str, ras_addr: str) -> None:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group(backend)
    device = None
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    for i in range(5):
        t = torch.ones(1024, device=device) * (rank + i)
        dist.all_reduce(t)
    if device is not None:
        torch.cuda.synchronize()
    time.sleep(1.5)  # let the NCCL watchdog thread mark the entries completed
    from torch._C import _distributed_c10d as c10d

    fn = getattr(c10d, "_dump_nccl_trace_json" if backend == "nccl" else "_dump_fr_trace_json")
    data = fn(includeCollectives=True, onlyActive=False)
    Path(out_dir, f"rank-{rank}.fr.json").write_bytes(bytes(data))
    if backend == "nccl" and rank == 0:
        from rankwatch.watchdog.evidence.ras_client import query_ras
        from rankwatch.watchdog.evidence.ras_findings import ras_findings
        from rankwatch.watchdog.report.evidence_words import ras_text

        st = query_ras(ras_addr, ras_timeout_s=5, timeout_s=15)
        info = (
            {"ok": False}
            if st is None
            else {
                "ok": True,
                "format": st.format,
                "version": st.nccl_version,
                "comms": len(st.communicators),
                "complete": st.complete,
                "evidence": [ras_text(f) for f in ras_findings(None, st)],
                "head": st.raw[:400],
            }
        )
        Path(out_dir, "ras.json").write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(backend: str, world: int, out_dir: str, ras_addr: str, timeout: float = 120) -> str | None:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        TORCH_FR_BUFFER_SIZE="2000",
        TORCH_NCCL_TRACE_BUFFER_SIZE="2000",
        TORCH_NCCL_ENABLE_TIMING="1",
        OMP_NUM_THREADS="1",
    )
    procs = []
    for r in range(world):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", backend, out_dir, "--ras", ras_addr]
        procs.append(
            subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    deadline = time.monotonic() + timeout
    errors = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return f"{backend} workers timed out after {timeout:.0f}s"
        if p.returncode != 0:
            errors.append(f"rank exit {p.returncode}: {out[-600:]}")
    return "; ".join(errors) or None


def analyse(out_dir: str, world: int) -> tuple[str, str]:
    from rankwatch.watchdog.core.fr_analysis import analyze_fr
    from rankwatch.watchdog.evidence.fr_dump import load_dump

    traces = {}
    for r in range(world):
        t = load_dump(Path(out_dir, f"rank-{r}.fr.json"))
        traces[r] = t
    a = analyze_fr(traces)
    t0 = traces[0]
    states = sorted({e.state for e in t0.entries})
    ops = sorted({e.profiling_name for e in t0.entries})
    ok = len(t0.entries) >= 5 and not a.behind_ranks and not a.mismatches and not a.missing
    detail = (
        f"version={t0.version} lib={t0.comm_lib_version!r} entries={len(t0.entries)} ops={ops} "
        f"states={states} retired={sum(e.retired for e in t0.entries)} findings="
        f"{[ln for ln in a.summary_lines() if not ln.startswith('rank ')]}"
    )
    return ("PASS" if ok else "FAIL"), detail


def check_fr(backend: str, ras_addr: str, keep: str) -> tuple[str, str]:
    if backend == "nccl":
        import torch
        import torch.distributed as dist

        if not cuda_available():
            return "SKIP", "no CUDA"
        if not dist.is_nccl_available():
            return "SKIP", "torch built without NCCL"
        world = max(1, min(2, torch.cuda.device_count()))
    else:
        world = 2
    out_dir = os.path.join(keep, backend)
    os.makedirs(out_dir, exist_ok=True)
    err = launch(backend, world, out_dir, ras_addr)
    if err:
        return "FAIL", err
    status, detail = analyse(out_dir, world)
    return status, f"world={world} {detail} (dumps in {out_dir})"


def check_ras(keep: str) -> tuple[str, str]:
    if not cuda_available():
        return "SKIP", "no CUDA (RAS runs inside NCCL processes)"
    path = Path(keep, "nccl", "ras.json")
    if not path.exists():
        return "SKIP", "no RAS result (fr.nccl did not get that far)"
    info = json.loads(path.read_text())
    if not info.get("ok"):
        return "SKIP", "RAS port not reachable (NCCL < 2.24, NCCL_RAS_ENABLE=0, or another address)"
    return "PASS", (
        f"format={info['format']} nccl={info['version']} comms={info['comms']} complete={info['complete']} "
        f"evidence={info['evidence']} head={info['head'][:160]!r}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ras", default="localhost:28028", help="NCCL RAS address (NCCL_RAS_ADDR)")
    ap.add_argument("--keep", default=None, help="directory to keep the dumps in")
    ap.add_argument("--worker", nargs=2, metavar=("BACKEND", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="accepted for symmetry with the benchmarks (one pass)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--record", default=None, help="write the devices' NVML answers (cause fields) as a fixture here")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.ras)
        return 0
    keep = args.keep or tempfile.mkdtemp(prefix="gpu_check_")
    run_check("nvml.open", check_nvml_open)
    run_check("nvml.process", check_nvml_process)
    run_check("nvml.cause", lambda: check_nvml_cause(args.record))
    run_check("cuda.events", check_events)
    run_check("fr.gloo", lambda: check_fr("gloo", args.ras, keep))
    run_check("fr.nccl", lambda: check_fr("nccl", args.ras, keep))
    run_check("nccl.ras", lambda: check_ras(keep))
    counts = {s: sum(1 for _, st, _ in RESULTS if st == s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"summary: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP", flush=True)
    if args.json:
        import json

        doc = {"counts": counts, "checks": [{"check": c, "status": st, "detail": d} for c, st, d in RESULTS]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
