"""A straggler's GPU cause: NVML's clocks, clock-event reasons, temperature and PCIe link, read through the
probe at its boundary (a scripted NVML answering as pynvml does: there is no GPU here; the only mock), carried
per rank by the daemon's GPU watch, and set against the rank's peers by ``core.straggler_cause``.

The fixture ``fixtures/nvml/four_gpus_one_hot_one_narrow.json`` says what each value is and where its
constants come from (nvml.h); ``benchmarks/gpu_check.py --record`` writes the same document on a real GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from rankwatch.watchdog.core.host_signals import CLOCK_REASONS, GpuState, RankCounters, link_degraded, slowing_reasons
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.core.straggler_cause import Window, attribute_cause
from rankwatch.watchdog.evidence.gpu import GpuWatch
from rankwatch.watchdog.evidence.nvml import NvmlProbe
from test_nvml_probe import FakeNvml

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "nvml" / "four_gpus_one_hot_one_narrow.json"
PIDS = {0: 2001, 1: 2002, 2: 2003, 3: 2004}


def probe(script: dict | None = None) -> tuple[NvmlProbe, FakeNvml]:
    fake = FakeNvml(script or json.loads(FIX.read_text()))
    p = NvmlProbe.open(nvml=fake, wall_clock=lambda: fake.script["now_s"])
    assert p is not None
    return p, fake


def test_the_reason_bits_are_nvmls():
    # nvml.h: SwPowerCap 0x4, HwSlowdown 0x8, SwThermalSlowdown 0x20, HwThermalSlowdown 0x40,
    # HwPowerBrakeSlowdown 0x80; GpuIdle 0x1, ApplicationsClocksSetting 0x2, SyncBoost 0x10 are no fault
    assert CLOCK_REASONS == {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal",
                             0x80: "hw_power_brake"}
    assert slowing_reasons(0x1 | 0x2 | 0x10) == ()
    assert slowing_reasons(0x68) == ("hw_slowdown", "sw_thermal", "hw_thermal")
    assert slowing_reasons(None) == ()


def test_the_probe_reads_clocks_reasons_temperature_and_the_link():
    p, _ = probe()
    s = p.sample(PIDS.values())
    d0, _d1, d2, d3 = s.devices
    assert (d0.sm_clock_mhz, d0.sm_clock_max_mhz, d0.mem_clock_mhz, d0.mem_clock_max_mhz) == (1980, 1980, 2619, 2619)
    assert (d0.clock_reasons, d0.temperature_c, d0.slowdown_c) == (0x4, 71, 87)
    assert (d2.sm_clock_mhz, d2.clock_reasons, d2.temperature_c) == (990, 0x68, 92)
    assert (d3.pcie_gen, d3.pcie_width, d3.pcie_gen_max, d3.pcie_width_max, d3.pcie_replay) == (3, 8, 5, 16, 1200)
    assert not [x for x in s.skipped if "clock" in x or "pcie" in x or "temperature" in x]


def test_a_gpu_that_does_not_answer_leaves_its_fields_unknown():
    script = json.loads(FIX.read_text())
    for d in script["devices"]:
        for key in ("clocks", "max_clocks", "clock_event_reasons", "temperature", "pcie"):
            d.pop(key)
    p, _ = probe(script)
    d0 = p.sample([2001]).devices[0]
    assert (d0.sm_clock_mhz, d0.sm_clock_max_mhz, d0.clock_reasons, d0.pcie_gen, d0.temperature_c) == (None,) * 5
    assert "dev0.clock_reasons: NotSupported" in p.sample([2001]).skipped


def view(rank: int) -> RankView:
    return RankView(rank=rank, node="n", pid=PIDS[rank], state="running", step=5, phase="forward", in_phase_s=0.1,
                    since_progress_s=0.1)


def test_the_gpu_watch_keeps_each_ranks_gpu_state():
    p, _ = probe()
    watch = GpuWatch(probe=p)
    watch.apply([view(r) for r in PIDS])
    g2 = watch.gpu_state(2003)
    assert g2 is not None and (g2.device, g2.sm_clock_mhz, g2.reasons, g2.temperature_c) == (2, 990, 0x68, 92)
    g3 = watch.gpu_state(2004)
    assert link_degraded(g3) is True and link_degraded(watch.gpu_state(2001)) is False
    assert watch.gpu_state(9999) is None


# -- the cause, over a window of polls ------------------------------------------------------------------
STEP_NS, POLL_NS = 100_000_000, 500_000_000


def host(t_ns: int) -> RankCounters:
    s = t_ns / 1e9
    return RankCounters(start_ticks=7, run_ns=int(0.5e9 * s), wait_ns=int(1e6 * s), cpu_ticks=0, majflt=0, nvcsw=0,
                        cgroup="/job")


def states(p: NvmlProbe, watch: GpuWatch, polls: int = 40, change=None):
    """``polls`` samples of the 4 ranks: host counters alike, each rank's GPU state as the watch read it."""
    out = []
    for i in range(polls):
        if change is not None:
            change(i, p)
        watch.apply([view(r) for r in PIDS])
        t = 10**9 + i * POLL_NS
        out.append((t, {r: RankCounters(**{**host(t).__dict__, "gpu": watch.gpu_state(pid)})
                        for r, pid in PIDS.items()}))
    return out


def windows(polls: int = 40):
    steps = polls * POLL_NS // STEP_NS
    return {r: Window(10**9, 10**9 + steps * STEP_NS, steps) for r in PIDS}


def test_a_hot_gpu_at_half_clock_is_gpu_throttled_with_its_figures():
    p, _ = probe()
    doc = attribute_cause(states(p, GpuWatch(probe=p)), windows(), 2, 40.0)
    assert doc["cause"] == "gpu_throttled", doc
    assert ("rank 2's GPU 2 ran its SM clock at 990 MHz (50 % of its 1980 MHz maximum), its peers' at 1980 MHz; "
            "slowed by hw_slowdown/hw_thermal/sw_thermal on 100 % of polls, its peers by sw_power_cap on 100 %, "
            "92 °C (slowdown at 87 °C)") in doc["text"], doc["text"]
    assert doc["signals"]["gpu_clock"]["sm_clock_mhz"] == 990.0 and "nvidia-smi" in doc["next"]


def test_a_link_below_its_maximum_is_gpu_link_degraded():
    p, _ = probe()
    replays = [1200]

    def more_replays(i: int, p: NvmlProbe) -> None:  # the narrow link also replays ~25 transfers a poll
        p._nvml.script["devices"][3]["pcie"]["replay"] = replays[0] + 25 * i

    doc = attribute_cause(states(p, GpuWatch(probe=p), change=more_replays), windows(), 3, 30.0)
    assert doc["cause"] == "gpu_link_degraded", doc
    assert "its PCIe link ran at Gen3 x8 (its maximum Gen5 x16) on 100 % of polls, its peers' on 0 %" in doc["text"]
    assert "replayed 5.0 PCIe transfers/step, its peers 0.0" in doc["text"]


def test_power_capped_busy_gpus_and_idle_links_are_nobodys_cause():
    script = json.loads(FIX.read_text())
    for d in script["devices"]:  # every GPU at its power cap, every link at Gen1 (as an idle GPU's): alike
        d.update(clocks={"sm": 1755, "mem": 2619}, clock_event_reasons=0x4, temperature=75)
        d["pcie"].update(gen=1, replay=0)
    p, _ = probe(script)
    for r in PIDS:
        doc = attribute_cause(states(p, GpuWatch(probe=p)), windows(), r, 30.0)
        assert doc["cause"] == "own_work", doc


def test_new_ecc_errors_or_xids_are_named_beside_the_cause():
    p, _ = probe()

    def ecc(i: int, p: NvmlProbe) -> None:
        p._nvml.script["devices"][2]["ecc_uncorrected"]["volatile"] = 0 if i < 20 else 2

    doc = attribute_cause(states(p, GpuWatch(probe=p), change=ecc), windows(), 2, 40.0)
    assert doc["cause"] == "gpu_throttled" and "2 new uncorrected ECC error(s) in the window" in doc["text"]


def test_a_host_counter_that_explains_the_loss_comes_before_the_gpu_state():
    p, _ = probe()
    got = states(p, GpuWatch(probe=p))
    waiting = [(t, {**by, 2: RankCounters(**{**by[2].__dict__, "wait_ns": int(0.5 * t)})}) for t, by in got]
    assert attribute_cause(waiting, windows(), 2, 40.0)["cause"] == "cpu_contention"


def test_too_few_polls_of_the_gpu_say_nothing():
    p, _ = probe()
    doc = attribute_cause(states(p, GpuWatch(probe=p), polls=3), windows(3), 2, 40.0)
    assert doc is None or doc["cause"] != "gpu_throttled"
    assert GpuState(device=0).reasons is None
