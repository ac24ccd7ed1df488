"""NVML probe against a scripted NVML stand-in (the only mock: there is no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rankwatch.watchdog.evidence import nvml as nvml_probe
from rankwatch.watchdog.evidence.nvml import NvmlProbe, gpu_evidence, map_pids, read_nspid

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3)


class NVMLError_NotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(6)


class NVMLError_Timeout(NVMLError):
    def __init__(self) -> None:
        super().__init__(10)


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12)


class FakeNvml:
    """Scripted pynvml: same function names, structures as attribute objects, NVMLError subclasses."""

    NVMLError = NVMLError
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_AGGREGATE_ECC = 1
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, script: dict[str, Any], *, absent: bool = False) -> None:
        self.script = script
        self.absent = absent
        self.calls: list[tuple[str, Any]] = []
        self.handles = [SimpleNamespace(index=i) for i in range(len(script["devices"]))]
        self.pending_events: list[SimpleNamespace] = []
        self.shutdown = False

    def _dev(self, h: Any, fn: str) -> dict[str, Any]:
        d = self.script["devices"][h.index]
        if fn in d.get("unsupported", []):
            raise NVMLError_NotSupported()
        return d

    def nvmlInit(self) -> None:
        if self.absent:
            raise NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.handles)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return self.handles[i]

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        return self._dev(h, "nvmlDeviceGetUUID")["uuid"]

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        return SimpleNamespace(**self._dev(h, "nvmlDeviceGetUtilizationRates")["util"])

    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        return self._dev(h, "nvmlDeviceGetPowerUsage")["power_mw"]

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        m = self._dev(h, "nvmlDeviceGetMemoryInfo")["memory"]
        return SimpleNamespace(used=m["used"], total=m["total"], free=m["total"] - m["used"])

    def nvmlDeviceGetTotalEccErrors(self, h: Any, err_type: int, counter: int) -> int:
        e = self._dev(h, "nvmlDeviceGetTotalEccErrors")["ecc_uncorrected"]
        assert err_type == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return e["volatile"] if counter == self.NVML_VOLATILE_ECC else e["aggregate"]

    def nvmlDeviceGetRetiredPages(self, h: Any, cause: int) -> list[int]:
        r = self._dev(h, "nvmlDeviceGetRetiredPages")["retired_pages"]
        return r["single"] if cause == 0 else r["double"]

    def nvmlDeviceGetRemappedRows(self, h: Any) -> tuple[int, int, bool, bool]:
        return tuple(self._dev(h, "nvmlDeviceGetRemappedRows")["remapped_rows"])  # type: ignore[return-value]

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        return [
            SimpleNamespace(**p) for p in self._dev(h, "nvmlDeviceGetComputeRunningProcesses")["processes"]
        ]

    def nvmlDeviceGetProcessUtilization(self, h: Any, last_seen: int) -> list[Any]:
        self.calls.append(("util", (h.index, last_seen)))
        d = self._dev(h, "nvmlDeviceGetProcessUtilization")
        fresh = [SimpleNamespace(**s) for s in d["samples"] if s["timeStamp"] > last_seen]
        if not fresh:
            raise NVMLError_NotFound()
        return fresh

    # the straggler cause's GPU state: absent keys answer NotSupported, as an older GPU does
    def _get(self, h: Any, fn: str, key: str) -> Any:
        d = self._dev(h, fn)
        if key not in d:
            raise NVMLError_NotSupported()
        return d[key]

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        return self._get(h, "nvmlDeviceGetClockInfo", "clocks")[{1: "sm", 2: "mem"}[clock]]

    def nvmlDeviceGetMaxClockInfo(self, h: Any, clock: int) -> int:
        return self._get(h, "nvmlDeviceGetMaxClockInfo", "max_clocks")[{1: "sm", 2: "mem"}[clock]]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int:
        return self._get(h, "nvmlDeviceGetCurrentClocksEventReasons", "clock_event_reasons")

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return self._get(h, "nvmlDeviceGetTemperature", "temperature")

    def nvmlDeviceGetTemperatureThreshold(self, h: Any, which: int) -> int:
        return self._get(h, "nvmlDeviceGetTemperatureThreshold", "temperature_thresholds")[
            {0: "shutdown", 1: "slowdown"}[which]]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: Any) -> int:
        return self._get(h, "nvmlDeviceGetCurrPcieLinkGeneration", "pcie")["gen"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: Any) -> int:
        return self._get(h, "nvmlDeviceGetCurrPcieLinkWidth", "pcie")["width"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: Any) -> int:
        return self._get(h, "nvmlDeviceGetMaxPcieLinkGeneration", "pcie")["max_gen"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: Any) -> int:
        return self._get(h, "nvmlDeviceGetMaxPcieLinkWidth", "pcie")["max_width"]

    def nvmlDeviceGetPcieReplayCounter(self, h: Any) -> int:
        return self._get(h, "nvmlDeviceGetPcieReplayCounter", "pcie")["replay"]

    def nvmlEventSetCreate(self) -> Any:
        return SimpleNamespace(name="set")

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, es: Any) -> None:
        assert types == self.nvmlEventTypeXidCriticalError
        for xid in self._dev(h, "nvmlDeviceRegisterEvents").get("xid_events", []):
            self.pending_events.append(SimpleNamespace(device=h, eventType=types, eventData=xid))

    def nvmlEventSetWait(self, es: Any, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # never block the daemon
        if not self.pending_events:
            raise NVMLError_Timeout()
        return self.pending_events.pop(0)

    def nvmlEventSetFree(self, es: Any) -> None:
        self.calls.append(("free", es))


def script() -> dict[str, Any]:
    return json.loads((FIX / "two_gpus_one_idle.json").read_text())


def open_probe(fake: FakeNvml, **kw: Any) -> NvmlProbe:
    s = fake.script
    clock = kw.pop("wall_clock", lambda: s["now_s"])
    probe = NvmlProbe.open(nvml=fake, wall_clock=clock, **kw)
    assert probe is not None
    return probe


def test_device_fields_and_unsupported_fields_are_skipped():
    fake = FakeNvml(script())
    probe = open_probe(fake)
    s = probe.sample([1001, 1002])
    d0, d1 = s.devices
    assert (d0.gpu_util, d0.mem_util, d0.power_w) == (97.0, 41.0, 612.345)
    assert (d0.mem_used_bytes, d0.mem_total_bytes) == (60_000_000_000, 150_000_000_000)
    assert (d0.ecc_uncorrected_volatile, d0.ecc_uncorrected_aggregate, d0.retired_pages) == (0, 2, 0)
    assert d0.uuid.startswith("GPU-1111") and d0.xids == ()
    assert d1.power_w is None and d1.ecc_uncorrected_volatile is None and d1.retired_pages is None
    assert (d1.remapped_rows_uncorrectable, d1.remap_pending, d1.remap_failed) == (1, True, False)
    assert d1.xids == (79,)
    assert "dev1.power: NotSupported" in s.skipped
    assert any(x.startswith("dev1.ecc_volatile") for x in s.skipped)
    # XIDs are drained: the next sample does not repeat them
    assert probe.sample([]).devices[1].xids == ()


def test_per_process_util_missing_and_unresolved():
    fake = FakeNvml(script())
    probe = open_probe(fake)
    s = probe.sample([1001, 1002, 7777])
    (p1,) = s.procs[1001]
    assert (p1.device, p1.sm_util, p1.mem_util, p1.has_context, p1.missing) == (0, 98.0, 40.0, True, False)
    (p2,) = s.procs[1002]
    assert (p2.device, p2.sm_util, p2.has_context, p2.missing) == (1, None, True, True)
    assert s.missing == (1002,)
    assert s.unresolved == (7777,)
    assert 4242 not in s.procs  # not a requested pid
    # first call looks back the initial window (now 1000 s - 5 s), in NVML's microseconds
    assert ("util", (0, 995_000_000)) in fake.calls
    ev = gpu_evidence(s, {0: 1001, 1: 1002, 2: 7777})
    assert (ev[0].util, ev[0].missing, ev[0].devices) == (98.0, False, (0,))
    assert (ev[1].util, ev[1].missing, ev[1].mem_used_bytes) == (None, True, 29_000_000_000)
    assert (ev[2].util, ev[2].missing, ev[2].devices) == (None, False, ())


def test_last_seen_timestamp_is_kept_per_device():
    sc = script()
    fake = FakeNvml(sc)
    probe = open_probe(fake)
    probe.sample([1001])
    # no new samples: pid 1001 now has a context but nothing fresh → missing
    s = probe.sample([1001])
    assert ("util", (0, 999_500_000)) in fake.calls
    assert s.missing == (1001,)
    # a new driver sample arrives
    sc["devices"][0]["samples"].append(
        {"pid": 1001, "timeStamp": 1_000_200_000, "smUtil": 100, "memUtil": 50}
    )
    s = probe.sample([1001])
    assert s.procs[1001][0].sm_util == 100.0 and s.missing == ()


def test_every_call_failing_never_raises():
    sc = script()
    every = [
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceRegisterEvents",
    ]
    for d in sc["devices"]:
        d["unsupported"] = every
    fake = FakeNvml(sc)
    probe = open_probe(fake)
    s = probe.sample([1001])
    assert all(d.gpu_util is None and d.power_w is None and d.uuid is None for d in s.devices)
    assert s.unresolved == (1001,) and s.missing == ()
    assert len(s.skipped) >= 2 * 8
    assert [c for c in fake.calls if c[0] == "free"]  # event set freed when no device registered


@pytest.mark.parametrize("expected", [True, False])
def test_absent_nvml_returns_none_and_warns_once_where_a_gpu_was_expected(monkeypatch, expected):
    monkeypatch.setattr(nvml_probe, "_warned_absent", False)
    warnings: list[str] = []
    infos: list[str] = []
    monkeypatch.setattr(nvml_probe.log, "warning", lambda event, **kw: warnings.append(event))
    monkeypatch.setattr(nvml_probe.log, "info", lambda event, **kw: infos.append(event))
    assert NvmlProbe.open(nvml=FakeNvml(script(), absent=True), gpu_expected=expected) is None
    assert NvmlProbe.open(nvml=FakeNvml(script(), absent=True), gpu_expected=expected) is None
    assert (warnings, infos) == ((["nvml.unavailable"], []) if expected else ([], ["nvml.unavailable"]))


def test_a_gpu_is_expected_where_the_driver_or_a_device_node_is(tmp_path):
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the control node alone is no GPU
    assert not nvml_probe.nvidia_devices_present(str(proc), str(dev))
    (dev / "nvidia0").touch()
    assert nvml_probe.nvidia_devices_present(str(proc), str(dev))
    (dev / "nvidia0").unlink()
    (proc / "driver" / "nvidia").mkdir(parents=True)
    assert nvml_probe.nvidia_devices_present(str(proc), str(dev))


def test_real_pynvml_without_driver_returns_none():
    # this machine has pynvml but no NVIDIA driver: the real module must fail cleanly
    assert NvmlProbe.open() is None


def test_close_shuts_down_and_later_samples_are_empty():
    fake = FakeNvml(script())
    with open_probe(fake) as probe:
        pass
    assert fake.shutdown
    s = probe.sample([1001])
    assert s.devices == () and s.unresolved == (1001,)


# -- pid namespaces ----------------------------------------------------------------------------------


def write_status(root: Path, pid: int, nspid: str) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "status").write_text(f"Name:\tpython\nTgid:\t{pid}\nPid:\t{pid}\nNSpid:\t{nspid}\nPPid:\t1\n")


def test_read_nspid(tmp_path):
    write_status(tmp_path, 50001, "50001\t1001")
    assert read_nspid(50001, str(tmp_path)) == (50001, 1001)
    assert read_nspid(50002, str(tmp_path)) == ()


def test_container_pids_are_mapped_through_nspid(tmp_path):
    write_status(tmp_path, 50001, "50001\t1001")
    write_status(tmp_path, 50002, "50002\t1002")
    write_status(tmp_path, 60002, "60002\t1002")  # same inner pid in another container: ambiguous
    write_status(tmp_path, 70003, "70003\t1003")
    assert map_pids([50001, 50002, 60002, 70003, 999], [1001, 1002, 1003], str(tmp_path)) == {
        50001: 1001,
        70003: 1003,
    }
    sc = script()
    sc["devices"][0]["processes"][0]["pid"] = 50001
    sc["devices"][0]["samples"] = [{"pid": 50001, "timeStamp": 999_900_000, "smUtil": 77, "memUtil": 1}]
    sc["devices"][1]["processes"] = [{"pid": 70003, "usedGpuMemory": 5}]
    probe = open_probe(FakeNvml(sc), proc_root=str(tmp_path))
    s = probe.sample([1001, 1003])
    assert s.procs[1001][0].nvml_pid == 50001 and s.procs[1001][0].sm_util == 77.0
    assert s.missing == (1003,)
    assert gpu_evidence(s, {0: 1001, 1: 1003})[1].missing


def test_own_pid_maps_to_itself():
    import os

    assert map_pids([os.getpid()], [os.getpid()]) == {os.getpid(): os.getpid()}


@pytest.mark.parametrize("pids", [[], [1001]])
def test_sample_time_is_monotonic(pids):
    probe = open_probe(FakeNvml(script()))
    a = probe.sample(pids).time_s
    b = probe.sample(pids).time_s
    assert b >= a
