"""NVML probe: per-device and per-process GPU use, plus XID/ECC health, as plain frozen data.

All NVML access goes through one injectable object, the ``pynvml`` module by default, so tests pass a
scripted stand-in. Every NVML call may raise ``NVMLError`` (unsupported on this GPU, no permission, GPU
lost); the field is then left ``None`` and named in ``GpuSample.skipped``. ``sample()`` never raises.

Per-process utilisation comes from ``nvmlDeviceGetProcessUtilization(handle, last_seen_us)``, which
returns the driver's samples newer than ``last_seen_us``. The probe keeps the newest timestamp per device,
so each call sees only fresh samples; the first call looks back ``initial_window_s``. A process that holds
a GPU context (``nvmlDeviceGetComputeRunningProcesses``) but has no fresh sample ran no kernel in that
window: it is reported in ``missing``.

Caution when reading utilisation: a rank waiting inside an NCCL collective reads ~100 % (the NCCL kernel
spins), a rank stuck on the CPU side (data loading, Python, a lock) reads ~0 % and tends to be ``missing``;
but a rank stuck *inside* a kernel (a deadlocked or endless kernel) also reads 100 %. Low utilisation
singles out a CPU-side straggler; high utilisation alone proves nothing.

PID namespaces: NVML reports pids in the *host* pid namespace. When ranks run in a container with its own
pid namespace, the pids the hook records differ from NVML's. The probe maps them through
``/proc/<nvml pid>/status`` ``NSpid:`` (outermost first, innermost last): an NVML pid whose innermost
NSpid equals a requested pid is that rank. This works when the daemon sees the host's /proc (host pid
namespace, e.g. ``hostPID: true``); a daemon confined to the container's namespace cannot see host pids
at all, and its ranks then show as not on any GPU (``GpuSample.unresolved``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger()

INITIAL_WINDOW_S = 5.0
"""Look-back for the first per-process sample; NVML keeps roughly this much sample history."""
MAX_XID_EVENTS = 64
"""Events drained per sample; an XID storm should not stall the daemon's poll loop."""

_warned_absent = False


@dataclass(frozen=True)
class DeviceSample:
    index: int
    uuid: str | None
    gpu_util: float | None  # % of time a kernel ran over the last sample period
    mem_util: float | None  # % of time device memory was read or written
    power_w: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    ecc_uncorrected_volatile: int | None  # since the last driver load
    ecc_uncorrected_aggregate: int | None  # lifetime
    retired_pages: int | None  # pre-Ampere page retirement (single- + double-bit causes)
    remapped_rows_uncorrectable: int | None  # Ampere+ row remapping
    remap_pending: bool | None
    remap_failed: bool | None
    xids: tuple[int, ...]  # critical XID events seen since the previous sample
    # why a rank's GPU may be slower than its peers' (``core.host_signals.GpuState``); None: NVML refused
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    clock_reasons: int | None = None  # nvmlClocksEventReasons bits
    temperature_c: int | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_replay: int | None = None  # the link's replay counter (cumulative: retried transfers)
    # the device's limits, read once at open
    sm_clock_max_mhz: int | None = None
    mem_clock_max_mhz: int | None = None
    slowdown_c: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None


@dataclass(frozen=True)
class ProcGpu:
    pid: int  # the requested pid (caller's namespace)
    nvml_pid: int  # the pid as NVML reports it (host namespace)
    device: int
    sm_util: float | None  # None: no fresh sample
    mem_util: float | None
    used_memory_bytes: int | None
    has_context: bool
    missing: bool  # has a GPU context but no fresh utilisation sample


@dataclass(frozen=True)
class GpuSample:
    time_s: float  # time.monotonic() at the end of the sample
    devices: tuple[DeviceSample, ...]
    procs: Mapping[int, tuple[ProcGpu, ...]]  # requested pid → its presence on each device
    missing: tuple[int, ...]  # requested pids with a GPU context but no fresh sample anywhere
    unresolved: tuple[int, ...]  # requested pids NVML does not show at all
    skipped: tuple[str, ...]  # "dev0.power: NotSupported" — fields NVML would not give


@dataclass(frozen=True)
class RankGpu:
    rank: int
    pid: int
    util: float | None  # highest SM utilisation over the rank's devices; None when unknown
    missing: bool
    devices: tuple[int, ...]
    mem_used_bytes: int | None


def read_nspid(pid: int, proc_root: str = "/proc") -> tuple[int, ...]:
    """The ``NSpid:`` chain of a process (outermost namespace first), or () when unreadable."""
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return tuple(int(x) for x in line.split()[1:] if x.isdigit())
    except OSError:
        pass
    return ()


def map_pids(nvml_pids: Iterable[int], wanted: Iterable[int], proc_root: str = "/proc") -> dict[int, int]:
    """NVML (host) pid → requested pid: equal pids first, else the innermost ``NSpid`` of the NVML pid.

    An innermost pid shared by processes of two containers is ambiguous and left unmapped.
    """
    want = set(wanted)
    out: dict[int, int] = {}
    by_inner: dict[int, list[int]] = {}
    for npid in set(nvml_pids):
        if npid in want:
            out[npid] = npid
            continue
        chain = read_nspid(npid, proc_root)
        if len(chain) > 1 and chain[-1] in want:
            by_inner.setdefault(chain[-1], []).append(npid)
    taken = set(out.values())
    for inner, hosts in by_inner.items():
        if len(hosts) == 1 and inner not in taken:
            out[hosts[0]] = inner
    return out


def nvidia_devices_present(proc_root: str = "/proc", dev_root: str = "/dev") -> bool:
    """Whether this node has NVIDIA GPUs (the kernel driver is loaded or a device node exists)."""
    if os.path.isdir(os.path.join(proc_root, "driver", "nvidia")):
        return True
    try:
        return any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir(dev_root))
    except OSError:
        return False


class NvmlProbe:
    """Open once, ``sample()`` at the daemon's poll rate, ``close()`` at exit."""

    def __init__(
        self,
        nvml: Any,
        handles: list[Any],
        proc_root: str = "/proc",
        wall_clock: Callable[[], float] = time.time,
        initial_window_s: float = INITIAL_WINDOW_S,
    ) -> None:
        self._nvml = nvml
        self._handles = handles
        self._proc_root = proc_root
        self._wall = wall_clock
        self._window = initial_window_s
        self._last_seen_us: dict[int, int] = {}
        self._events: Any = None
        self._closed = False
        self._uuids: dict[int, str | None] = {}
        self._limits: dict[int, dict[str, int | None]] = {}
        for i, h in enumerate(handles):
            uuid = self._try([], f"dev{i}.uuid", nvml.nvmlDeviceGetUUID, h)
            self._uuids[i] = _text(uuid) if uuid is not None else None
            self._limits[i] = self._read_limits(h)
        self._setup_events()

    def _read_limits(self, h: Any) -> dict[str, int | None]:
        """The device's maxima (clocks, PCIe link, slowdown temperature): fixed while the driver runs."""
        nv, no = self._nvml, list[str]()  # a maximum NVML will not give is simply unknown: nothing to note per poll
        get = getattr
        return {
            "sm_clock_max_mhz": _int(self._try(no, "", get(nv, "nvmlDeviceGetMaxClockInfo", None), h,
                                               get(nv, "NVML_CLOCK_SM", 1))),
            "mem_clock_max_mhz": _int(self._try(no, "", get(nv, "nvmlDeviceGetMaxClockInfo", None), h,
                                                get(nv, "NVML_CLOCK_MEM", 2))),
            "slowdown_c": _int(self._try(no, "", get(nv, "nvmlDeviceGetTemperatureThreshold", None), h,
                                         get(nv, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1))),
            "pcie_gen_max": _int(self._try(no, "", get(nv, "nvmlDeviceGetMaxPcieLinkGeneration", None), h)),
            "pcie_width_max": _int(self._try(no, "", get(nv, "nvmlDeviceGetMaxPcieLinkWidth", None), h)),
        }

    @classmethod
    def open(
        cls,
        nvml: Any = None,
        proc_root: str = "/proc",
        wall_clock: Callable[[], float] = time.time,
        initial_window_s: float = INITIAL_WINDOW_S,
        gpu_expected: bool | None = None,
    ) -> NvmlProbe | None:
        """Initialise NVML; None when the library or driver is absent — with one warning per process where
        this node has NVIDIA devices (``gpu_expected``, default: ``nvidia_devices_present()``), else a
        plain info line: a CPU node is not a problem to warn about on every start."""
        global _warned_absent
        try:
            if nvml is None:
                import pynvml as nvml_mod

                nvml = nvml_mod
            nvml.nvmlInit()
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # ImportError, NVMLError (library/driver missing), anything odd
            if not _warned_absent:
                _warned_absent = True
                expected = nvidia_devices_present(proc_root) if gpu_expected is None else gpu_expected
                (log.warning if expected else log.info)("nvml.unavailable", error=f"{type(exc).__name__}: {exc}",
                                                        gpu_expected=expected)
            return None
        return cls(
            nvml, handles, proc_root=proc_root, wall_clock=wall_clock, initial_window_s=initial_window_s
        )

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def _try(self, skipped: list[str], what: str, fn: Callable[..., Any] | None, *args: Any) -> Any:
        """``fn(*args)``, or None with ``what`` noted in ``skipped`` when NVML refuses (or an older pynvml
        lacks the function: ``fn`` None)."""
        if fn is None:
            skipped.append(f"{what}: not in this pynvml")
            return None
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            skipped.append(f"{what}: {_err_name(exc)}")
        except Exception as exc:  # a stand-in or driver returning odd data must not break sampling
            skipped.append(f"{what}: {type(exc).__name__}")
        return None

    def _setup_events(self) -> None:
        nv = self._nvml
        skipped: list[str] = []
        es = self._try(skipped, "events.create", nv.nvmlEventSetCreate)
        if es is None:
            return
        registered = 0
        for i, h in enumerate(self._handles):
            before = len(skipped)
            self._try(
                skipped,
                f"dev{i}.events",
                nv.nvmlDeviceRegisterEvents,
                h,
                nv.nvmlEventTypeXidCriticalError,
                es,
            )
            registered += len(skipped) == before
        if registered:
            self._events = es
        else:
            self._try(skipped, "events.free", nv.nvmlEventSetFree, es)

    def _drain_xids(self, skipped: list[str]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        if self._events is None:
            return out
        nv = self._nvml
        for _ in range(MAX_XID_EVENTS):
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except nv.NVMLError:
                break  # NVML_ERROR_TIMEOUT: no more events
            except Exception as exc:
                skipped.append(f"events.wait: {type(exc).__name__}")
                break
            idx = self._device_index(getattr(data, "device", None))
            xid = getattr(data, "eventData", None)
            if isinstance(xid, int):
                out.setdefault(idx, []).append(xid)
        return out

    def _device_index(self, handle: Any) -> int:
        for i, h in enumerate(self._handles):
            if h is handle or _handle_value(h) == _handle_value(handle):
                return i
        try:
            return int(self._nvml.nvmlDeviceGetIndex(handle))
        except Exception:
            return -1

    def sample(self, pids: Iterable[int] = ()) -> GpuSample:
        """One reading of every device and of the given pids. Never raises."""
        wanted = sorted(set(pids))
        skipped: list[str] = []
        devices: list[DeviceSample] = []
        # per device: NVML pid → (sm, mem) of the newest fresh sample; NVML pid → used memory
        fresh: dict[int, dict[int, tuple[float, float]]] = {}
        contexts: dict[int, dict[int, int | None]] = {}
        if self._closed:
            return GpuSample(time.monotonic(), (), {}, (), tuple(wanted), ("probe closed",))
        xids = self._drain_xids(skipped)
        for i, h in enumerate(self._handles):
            devices.append(self._device_sample(i, h, tuple(xids.get(i, ())), skipped))
            contexts[i] = self._contexts(i, h, skipped)
            fresh[i] = self._process_util(i, h)
        for idx in xids:
            if idx < 0 or idx >= len(self._handles):
                skipped.append(f"xid on unknown device: {xids[idx]}")

        all_nvml = {p for c in contexts.values() for p in c} | {p for f in fresh.values() for p in f}
        procs = self._proc_gpus(contexts, fresh, map_pids(all_nvml, wanted, self._proc_root))
        missing = tuple(
            p
            for p in wanted
            if p in procs and any(g.missing for g in procs[p]) and all(g.sm_util is None for g in procs[p])
        )
        unresolved = tuple(p for p in wanted if p not in procs)
        return GpuSample(
            time_s=time.monotonic(),
            devices=tuple(devices),
            procs={p: tuple(v) for p, v in procs.items()},
            missing=missing,
            unresolved=unresolved,
            skipped=tuple(skipped),
        )

    def _device_sample(self, i: int, h: Any, xids: tuple[int, ...], skipped: list[str]) -> DeviceSample:
        """One device's utilisation, power, memory and health counters (None where NVML refused)."""
        nv = self._nvml
        d = f"dev{i}"
        util = self._try(skipped, f"{d}.util", nv.nvmlDeviceGetUtilizationRates, h)
        power = self._try(skipped, f"{d}.power", nv.nvmlDeviceGetPowerUsage, h)
        mem = self._try(skipped, f"{d}.memory", nv.nvmlDeviceGetMemoryInfo, h)
        unc = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        ecc_v = self._try(
            skipped, f"{d}.ecc_volatile", nv.nvmlDeviceGetTotalEccErrors, h, unc, nv.NVML_VOLATILE_ECC
        )
        ecc_a = self._try(
            skipped, f"{d}.ecc_aggregate", nv.nvmlDeviceGetTotalEccErrors, h, unc, nv.NVML_AGGREGATE_ECC
        )
        retired = self._retired_pages(h, skipped, d)
        remap = self._try(skipped, f"{d}.remapped_rows", nv.nvmlDeviceGetRemappedRows, h)
        remap_t = tuple(remap) if isinstance(remap, list | tuple) and len(remap) >= 4 else None
        g = getattr
        sm = self._try(skipped, f"{d}.sm_clock", g(nv, "nvmlDeviceGetClockInfo", None), h, g(nv, "NVML_CLOCK_SM", 1))
        mc = self._try(skipped, f"{d}.mem_clock", g(nv, "nvmlDeviceGetClockInfo", None), h, g(nv, "NVML_CLOCK_MEM", 2))
        # the newer name first (R535+); drivers before it answer only to the older one (same bits)
        reasons_fn = g(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or g(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        reasons = self._try(skipped, f"{d}.clock_reasons", reasons_fn, h)
        temp = self._try(skipped, f"{d}.temperature", g(nv, "nvmlDeviceGetTemperature", None), h,
                         g(nv, "NVML_TEMPERATURE_GPU", 0))
        gen = self._try(skipped, f"{d}.pcie_gen", g(nv, "nvmlDeviceGetCurrPcieLinkGeneration", None), h)
        width = self._try(skipped, f"{d}.pcie_width", g(nv, "nvmlDeviceGetCurrPcieLinkWidth", None), h)
        replay = self._try(skipped, f"{d}.pcie_replay", g(nv, "nvmlDeviceGetPcieReplayCounter", None), h)
        lim = self._limits.get(i, {})
        return DeviceSample(
            index=i,
            uuid=self._uuids.get(i),
            gpu_util=_num(getattr(util, "gpu", None)),
            mem_util=_num(getattr(util, "memory", None)),
            power_w=power / 1000.0 if isinstance(power, int | float) else None,
            mem_used_bytes=_int(getattr(mem, "used", None)),
            mem_total_bytes=_int(getattr(mem, "total", None)),
            ecc_uncorrected_volatile=_int(ecc_v),
            ecc_uncorrected_aggregate=_int(ecc_a),
            retired_pages=retired,
            remapped_rows_uncorrectable=_int(remap_t[1]) if remap_t else None,
            remap_pending=bool(remap_t[2]) if remap_t else None,
            remap_failed=bool(remap_t[3]) if remap_t else None,
            xids=xids,
            sm_clock_mhz=_int(sm),
            mem_clock_mhz=_int(mc),
            clock_reasons=_int(reasons),
            temperature_c=_int(temp),
            pcie_gen=_int(gen),
            pcie_width=_int(width),
            pcie_replay=_int(replay),
            sm_clock_max_mhz=lim.get("sm_clock_max_mhz"),
            mem_clock_max_mhz=lim.get("mem_clock_max_mhz"),
            slowdown_c=lim.get("slowdown_c"),
            pcie_gen_max=lim.get("pcie_gen_max"),
            pcie_width_max=lim.get("pcie_width_max"),
        )

    def _contexts(self, i: int, h: Any, skipped: list[str]) -> dict[int, int | None]:
        """NVML pid → its used memory, for every compute context on the device."""
        running = self._try(skipped, f"dev{i}.processes", self._nvml.nvmlDeviceGetComputeRunningProcesses, h)
        ctx: dict[int, int | None] = {}
        for p in running or ():
            pid = _int(getattr(p, "pid", None))
            if pid is not None:
                ctx[pid] = _int(getattr(p, "usedGpuMemory", None))
        return ctx

    def _proc_gpus(
        self,
        contexts: dict[int, dict[int, int | None]],
        fresh: dict[int, dict[int, tuple[float, float]]],
        mapping: dict[int, int],
    ) -> dict[int, list[ProcGpu]]:
        """Per wanted pid (as this host sees it), its use of each device it has a context or samples on."""
        procs: dict[int, list[ProcGpu]] = {}
        for i in range(len(self._handles)):
            for npid in sorted(set(contexts.get(i, {})) | set(fresh.get(i, {}))):
                pid = mapping.get(npid)
                if pid is None:
                    continue
                util_pair = fresh.get(i, {}).get(npid)
                has_ctx = npid in contexts.get(i, {})
                procs.setdefault(pid, []).append(
                    ProcGpu(
                        pid=pid,
                        nvml_pid=npid,
                        device=i,
                        sm_util=util_pair[0] if util_pair else None,
                        mem_util=util_pair[1] if util_pair else None,
                        used_memory_bytes=contexts.get(i, {}).get(npid),
                        has_context=has_ctx,
                        missing=has_ctx and util_pair is None,
                    )
                )
        return procs

    def _retired_pages(self, h: Any, skipped: list[str], d: str) -> int | None:
        nv = self._nvml
        total = None
        for cause in (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ):
            pages = self._try(skipped, f"{d}.retired_pages", nv.nvmlDeviceGetRetiredPages, h, cause)
            if isinstance(pages, list | tuple):
                total = (total or 0) + len(pages)
        return total

    def _process_util(self, i: int, h: Any) -> dict[int, tuple[float, float]]:
        """Fresh per-process samples of device i: NVML pid → (sm %, mem %) of its newest sample."""
        nv = self._nvml
        last = self._last_seen_us.get(i)
        if last is None:
            last = max(0, int((self._wall() - self._window) * 1_000_000))
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(h, last)
        except Exception:
            # NVML_ERROR_NOT_FOUND means "no sample newer than last": not an error, just nothing fresh
            return {}
        newest: dict[int, tuple[int, float, float]] = {}
        top = last
        for s in samples or ():
            pid = _int(getattr(s, "pid", None))
            ts = _int(getattr(s, "timeStamp", None)) or 0
            if pid is None or ts <= last:
                continue
            top = max(top, ts)
            sm = _num(getattr(s, "smUtil", None)) or 0.0
            mu = _num(getattr(s, "memUtil", None)) or 0.0
            if pid not in newest or ts > newest[pid][0]:
                newest[pid] = (ts, sm, mu)
        self._last_seen_us[i] = top
        return {pid: (sm, mu) for pid, (_ts, sm, mu) in newest.items()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        nv = self._nvml
        skipped: list[str] = []
        if self._events is not None:
            self._try(skipped, "events.free", nv.nvmlEventSetFree, self._events)
        self._try(skipped, "shutdown", nv.nvmlShutdown)

    def __enter__(self) -> NvmlProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def gpu_evidence(sample: GpuSample, rank_pids: Mapping[int, int]) -> dict[int, RankGpu]:
    """Per global rank: its SM utilisation (highest over its devices) and whether it is missing.

    Pure. ``util`` is None when NVML has no fresh sample for the rank or does not show it at all. Read
    with the module's caution: ~0 % or missing suggests a CPU-side stall, ~100 % is either waiting in
    an NCCL collective or stuck inside a kernel.
    """
    out: dict[int, RankGpu] = {}
    for rank, pid in sorted(rank_pids.items()):
        entries = sample.procs.get(pid, ())
        utils = [g.sm_util for g in entries if g.sm_util is not None]
        mems = [g.used_memory_bytes for g in entries if g.used_memory_bytes is not None]
        out[rank] = RankGpu(
            rank=rank,
            pid=pid,
            util=max(utils) if utils else None,
            missing=pid in sample.missing,
            devices=tuple(sorted({g.device for g in entries})),
            mem_used_bytes=sum(mems) if mems else None,
        )
    return out


def _err_name(exc: BaseException) -> str:
    name = type(exc).__name__
    return name.removeprefix("NVMLError_") if name != "NVMLError" else str(exc)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def _handle_value(h: Any) -> Any:
    """ctypes handles compare by address; stand-ins by identity."""
    v = getattr(h, "value", None)
    if v is None:
        contents = getattr(h, "contents", None)
        if contents is not None:
            try:
                import ctypes

                return ctypes.addressof(contents)
            except Exception:
                return id(h)
        return id(h)
    return v
