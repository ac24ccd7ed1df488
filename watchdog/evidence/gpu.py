"""GPU use as evidence: NVML opened once per daemon, per-rank utilisation in the views, device health notes.

Reads through ``evidence.nvml`` (the probe); this module turns its samples into ``RankView.gpu_util`` /
``gpu_missing`` and XID lines. Nothing here raises into the daemon: a failing probe is one log line.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ..core.evidence_items import XID_MEANING, EvidenceItem, GpuEcc, GpuRemap, GpuXid, GpuXidsOlder
from ..core.host_signals import GpuState
from ..core.snapshot import RUNNING, STOPPED, RankView
from .nvml import DeviceSample, NvmlProbe, gpu_evidence

log = structlog.get_logger("rankwatch.evidence")

MAX_XIDS_KEPT = 64
"""XIDs remembered since start; a storm of one XID repeats the same line, the first ones tell the story."""



@dataclass(frozen=True)
class XidEvent:
    device: int
    xid: int
    age_s: float  # seconds after the watch started (monotonic)


def gpu_state(d: DeviceSample, xids: int) -> GpuState:
    """A device sample as the per-rank state ``core.straggler_cause`` compares between ranks."""
    return GpuState(
        device=d.index, sm_clock_mhz=d.sm_clock_mhz, sm_clock_max_mhz=d.sm_clock_max_mhz,
        mem_clock_mhz=d.mem_clock_mhz, mem_clock_max_mhz=d.mem_clock_max_mhz, reasons=d.clock_reasons,
        temperature_c=d.temperature_c, slowdown_c=d.slowdown_c, pcie_gen=d.pcie_gen, pcie_gen_max=d.pcie_gen_max,
        pcie_width=d.pcie_width, pcie_width_max=d.pcie_width_max, pcie_replay=d.pcie_replay,
        ecc_volatile=d.ecc_uncorrected_volatile, xids=xids,
    )


class GpuWatch:
    """NVML opened once for the daemon's lifetime; fills GPU fields of rank views and keeps device health.

    Without NVML (no driver, no library, ``enabled=False``) every call is a cheap no-op, logged once.
    """

    def __init__(
        self,
        nvml: Any = None,
        *,
        enabled: bool = True,
        probe: NvmlProbe | None = None,
        proc_root: str = "/proc",
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._t0 = time.monotonic()
        self._xids: deque[XidEvent] = deque(maxlen=MAX_XIDS_KEPT)
        self._xid_total = 0
        self._devices: dict[int, DeviceSample] = {}
        self._device_ranks: dict[int, set[int]] = {}
        # pid -> (NVML index, UUID) of the one GPU it has a context on (metrics' dcgm-exporter join labels)
        self._pid_devices: dict[int, tuple[str, str]] = {}
        # pid -> the state of its GPU at the last sample (clocks, throttle reasons, link): a straggler's cause
        self._pid_state: dict[int, GpuState] = {}
        self._xid_counts: dict[int, int] = {}  # device -> critical XIDs since start
        self.probe: NvmlProbe | None = probe
        if probe is None and enabled:
            try:
                self.probe = NvmlProbe.open(nvml=nvml, proc_root=proc_root, wall_clock=wall_clock)
            except Exception as exc:  # open() already catches; a broken stand-in must not stop the daemon
                log.warning("gpu_watch.open_failed", error=f"{type(exc).__name__}: {exc}")
                self.probe = None
        if self.probe is None:
            log.info("gpu_watch.disabled", reason="disabled" if not enabled else "NVML unavailable")
        else:
            log.info("gpu_watch.enabled", devices=self.probe.device_count)

    @property
    def available(self) -> bool:
        return self.probe is not None

    def apply(self, views: Sequence[RankView]) -> list[RankView]:
        """The views with ``gpu_util``/``gpu_missing`` from one NVML sample of their pids. Never raises.

        ``gpu_missing`` is set only while some other sampled rank has a fresh sample: when every rank is
        missing (nobody ran a kernel, or per-process samples unsupported) it singles nobody out.
        """
        out = list(views)
        if self.probe is None:
            return out
        try:
            pids = {v.rank: v.pid for v in views if v.pid > 0 and v.state in (RUNNING, STOPPED)}
            if not pids:
                return out
            sample = self.probe.sample(pids.values())
            self._note_devices(sample.devices)
            ev = gpu_evidence(sample, pids)
            someone_fresh = any(g.util is not None for g in ev.values())
            uuids = {d.index: d.uuid or "" for d in sample.devices}
            pid_devices = {}
            pid_state = {}
            by_index = {d.index: d for d in sample.devices}
            for g in ev.values():
                for d in g.devices:
                    self._device_ranks.setdefault(d, set()).add(g.rank)
                if len(g.devices) == 1:
                    pid_devices[g.pid] = (str(g.devices[0]), uuids.get(g.devices[0], ""))
                if g.devices and g.devices[0] in by_index:
                    dev = by_index[g.devices[0]]
                    st = gpu_state(dev, self._xid_counts.get(dev.index, 0))
                    # a steady GPU answers the same poll after poll: the job's signal history keeps one object
                    prev = self._pid_state.get(g.pid)
                    pid_state[g.pid] = prev if prev == st and prev is not None else st
            self._pid_devices = pid_devices
            self._pid_state = pid_state
            return [
                dataclasses.replace(v, gpu_util=ev[v.rank].util, gpu_missing=ev[v.rank].missing and someone_fresh)
                if v.rank in ev
                else v
                for v in views
            ]
        except Exception:
            log.exception("gpu_watch.apply_failed")
            return out

    def pid_devices(self) -> dict[int, tuple[str, str]]:
        """pid -> (GPU index, UUID) as NVML saw it at the last sample, for ranks on exactly one GPU."""
        return dict(self._pid_devices)

    def gpu_state(self, pid: int) -> GpuState | None:
        """The state of ``pid``'s GPU at the last sample (its first device); None without NVML or a context."""
        return self._pid_state.get(pid)

    def _note_devices(self, devices: Sequence[DeviceSample]) -> None:
        age = time.monotonic() - self._t0
        for d in devices:
            self._devices[d.index] = d
            for xid in d.xids:
                self._xid_total += 1
                self._xid_counts[d.index] = self._xid_counts.get(d.index, 0) + 1
                self._xids.append(XidEvent(d.index, xid, age))
                log.warning("gpu_xid", device=d.index, xid=xid, meaning=XID_MEANING.get(xid))

    def device_notes(self) -> list[EvidenceItem]:
        """XIDs since start and current ECC / row-remap trouble, as evidence items (empty when healthy)."""
        items: list[EvidenceItem] = []
        try:
            for e in self._xids:
                items.append(GpuXid(e.device, e.xid, round(e.age_s, 3), self._users(e.device)))
            if self._xid_total > len(self._xids):
                items.append(GpuXidsOlder(self._xid_total - len(self._xids)))
            for i, d in sorted(self._devices.items()):
                if d.ecc_uncorrected_volatile:
                    items.append(GpuEcc(i, d.ecc_uncorrected_volatile, self._users(i)))
                if d.remap_failed or d.remap_pending:
                    items.append(GpuRemap(i, failed=bool(d.remap_failed), ranks=self._users(i)))
        except Exception:
            log.exception("gpu_watch.notes_failed")
        return items

    def _users(self, device: int) -> tuple[int, ...]:
        """The job's ranks on ``device``."""
        return tuple(sorted(self._device_ranks.get(device, ())))

    def close(self) -> None:
        if self.probe is not None:
            try:
                self.probe.close()
            except Exception:
                log.exception("gpu_watch.close_failed")
