"""Outside evidence for an incident: GPU use (NVML), flight-recorder analysis and NCCL RAS, ready for the verdict.

The probes (``probes/nvml.py``, ``flight_recorder.py``, ``nccl_ras.py``) read one source each; this module
turns their readings into what ``verdict.decide`` consumes — ``RankView.gpu_util``/``gpu_missing``,
``FrHints`` and evidence lines — so the daemon only calls three small objects. Nothing here raises into
the daemon: a failing probe becomes a log line and no evidence.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..core.snapshot import RUNNING, STOPPED, RankView
from ..core.verdict import FrBehind, FrHints
from .capture import RankCapture
from .flight_recorder import FlightRecorderFormatError, FrAnalysis, RankTrace, analyze_fr, load_dump
from .nccl_ras import DEFAULT_ADDR, DEFAULT_RAS_TIMEOUT_S, RasFinding, RasStatus, query_ras, ras_findings
from .nvml import DeviceSample, NvmlProbe, gpu_evidence

log = structlog.get_logger("rankwatch.evidence")

MAX_XIDS_KEPT = 64
"""XIDs remembered since start; a storm of one XID repeats the same line, the first ones tell the story."""
MAX_FR_LINES = 40
"""Flight-recorder lines in a verdict's evidence; per-rank lines grow with the world size."""
RAS_RECHECK_S = 1.0
"""Gap between the two RAS queries of an incident: counts that did not move across it are stuck."""

# Critical XIDs worth naming in a verdict (NVIDIA "XID Errors" catalogue); others print by number only.
XID_MEANING = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    63: "ECC page retirement / row remap recorded",
    64: "ECC page retirement / row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


# ------------------------------------------------------------------------------------------------
# GPU


@dataclass(frozen=True)
class XidEvent:
    device: int
    xid: int
    age_s: float  # seconds after the watch started (monotonic)


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
            for g in ev.values():
                for d in g.devices:
                    self._device_ranks.setdefault(d, set()).add(g.rank)
            return [
                dataclasses.replace(v, gpu_util=ev[v.rank].util, gpu_missing=ev[v.rank].missing and someone_fresh)
                if v.rank in ev
                else v
                for v in views
            ]
        except Exception:
            log.exception("gpu_watch.apply_failed")
            return out

    def _note_devices(self, devices: Sequence[DeviceSample]) -> None:
        age = time.monotonic() - self._t0
        for d in devices:
            self._devices[d.index] = d
            for xid in d.xids:
                self._xid_total += 1
                self._xids.append(XidEvent(d.index, xid, age))
                log.warning("gpu_xid", device=d.index, xid=xid, meaning=XID_MEANING.get(xid))

    def device_notes(self) -> list[str]:
        """XIDs since start and current ECC / row-remap trouble, as evidence lines (empty when healthy)."""
        lines: list[str] = []
        try:
            for e in self._xids:
                meaning = XID_MEANING.get(e.xid)
                lines.append(
                    f"GPU {e.device}{self._users(e.device)}: XID {e.xid}"
                    + (f" ({meaning})" if meaning else "")
                    + f" {e.age_s:.1f}s after the watchdog started"
                )
            if self._xid_total > len(self._xids):
                lines.append(f"{self._xid_total - len(self._xids)} older XID event(s) not listed")
            for i, d in sorted(self._devices.items()):
                where = f"GPU {i}{self._users(i)}"
                if d.ecc_uncorrected_volatile:
                    lines.append(f"{where}: {d.ecc_uncorrected_volatile} uncorrected ECC error(s) since driver load")
                if d.remap_failed:
                    lines.append(f"{where}: row remapping failed (the GPU needs service)")
                elif d.remap_pending:
                    lines.append(f"{where}: row remap pending (takes effect after a GPU reset)")
        except Exception:
            log.exception("gpu_watch.notes_failed")
        return lines

    def _users(self, device: int) -> str:
        ranks = sorted(self._device_ranks.get(device, ()))
        return f" (rank {', '.join(str(r) for r in ranks)})" if ranks else ""

    def close(self) -> None:
        if self.probe is not None:
            try:
                self.probe.close()
            except Exception:
                log.exception("gpu_watch.close_failed")


# ------------------------------------------------------------------------------------------------
# flight recorder


@dataclass(frozen=True)
class FrFindings:
    """The flight recorder's contribution to one incident."""

    lines: tuple[str, ...]  # evidence lines, most telling first (bounded)
    hints: FrHints | None  # None when no dump could be analysed
    notes: tuple[str, ...] = ()  # dumps skipped and why
    analysis: FrAnalysis | None = field(default=None, compare=False)


def fr_hints(analysis: FrAnalysis) -> FrHints:
    """The structured part of an analysis that the verdict uses."""
    behind: list[FrBehind] = []
    for g in analysis.groups:
        if not g.behind:
            continue
        top = max(p.entered for p in g.progress.values())
        top_op = next((p.entered_op for p in g.progress.values() if p.entered == top and p.entered_op), None)
        behind.extend(FrBehind(g.name, r, g.progress[r].entered, top, top_op) for r in g.behind)
    return FrHints(
        ranks=tuple(r for r in analysis.ranks if r not in analysis.empty_ranks),
        behind=tuple(behind),
        missing=analysis.missing,
        mismatches=analysis.mismatches,
    )


def fr_evidence(captures: Mapping[int, RankCapture]) -> FrFindings:
    """Parse every capture's flight-recorder dump and compare them across ranks. Never raises.

    A rank without a dump or with a malformed one is left out with a note; conclusions then cover only
    the ranks that dumped (``FrHints.ranks``), which the verdict takes into account.
    """
    notes: list[str] = []
    traces: dict[int, RankTrace] = {}
    for rank, cap in sorted(captures.items()):
        if not cap.fr_json:
            why = next((n for n in cap.notes if n.startswith("flight recorder")), None) or cap.responder_error
            notes.append(f"rank {rank}: no flight-recorder dump" + (f" ({why})" if why else ""))
            continue
        try:
            traces[rank] = load_dump(cap.fr_json, rank=rank)
        except (FlightRecorderFormatError, OSError, ValueError) as exc:
            notes.append(f"rank {rank}: flight-recorder dump skipped: {exc}"[:300])
    if not traces:
        return FrFindings(lines=tuple(f"flight recorder: {n}" for n in notes), hints=None, notes=tuple(notes))
    try:
        analysis = analyze_fr(traces)
    except Exception as exc:  # analyze is pure, but a dump can hold shapes nobody anticipated
        log.exception("fr_analyze_failed")
        notes.append(f"flight-recorder analysis failed: {type(exc).__name__}: {exc}"[:300])
        return FrFindings(lines=tuple(f"flight recorder: {n}" for n in notes), hints=None, notes=tuple(notes))
    hints = fr_hints(analysis)
    if not hints.ranks:
        notes.append("every flight-recorder dump is empty (TORCH_FR_BUFFER_SIZE unset, or no collective yet)")
    summary = analysis.summary_lines()
    if len(summary) > MAX_FR_LINES:
        summary = [*summary[:MAX_FR_LINES], f"{len(summary) - MAX_FR_LINES} more flight-recorder line(s) in fr/"]
    lines = tuple(f"flight recorder: {s}" for s in [*summary, *notes])
    return FrFindings(lines=lines, hints=hints if hints.ranks else None, notes=tuple(notes), analysis=analysis)


# ------------------------------------------------------------------------------------------------
# NCCL RAS


class RasWatch:
    """The job's local NCCL RAS endpoint, queried at an incident (twice, ``RAS_RECHECK_S`` apart).

    RAS lives only in NCCL ≥ 2.24 jobs; elsewhere the connection is refused and ``query`` returns None
    after one log line. Loopback only (``parse_ras_addr``): RAS answers anyone, unauthenticated.
    """

    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        *,
        disabled: bool = False,
        ras_timeout_s: int = DEFAULT_RAS_TIMEOUT_S,
        timeout_s: float | None = None,
    ) -> None:
        self.addr = addr
        self.disabled = disabled
        self.ras_timeout_s = ras_timeout_s
        self.timeout_s = timeout_s

    def query(self) -> RasStatus | None:
        """One status query; None when disabled, unreachable, silent or not RAS. Never raises."""
        if self.disabled:
            return None
        try:
            return query_ras(self.addr, ras_timeout_s=self.ras_timeout_s, timeout_s=self.timeout_s)
        except Exception:
            log.exception("ras_query_failed", addr=self.addr)
            return None

    def findings(self, prev: RasStatus | None, cur: RasStatus | None) -> list[RasFinding]:
        """Findings of the latest query, sharpened by the previous one ("stuck": counts did not move)."""
        if cur is None:
            return []
        try:
            return ras_findings(prev, cur)
        except Exception:
            log.exception("ras_findings_failed", addr=self.addr)
            return []

    def evidence(self, prev: RasStatus | None, cur: RasStatus | None) -> list[str]:
        """``findings`` as evidence lines for a verdict."""
        return [f"NCCL RAS: {f.text}" for f in self.findings(prev, cur)]

    def query_twice(self, gap_s: float = RAS_RECHECK_S) -> tuple[RasStatus | None, RasStatus | None]:
        """(first, second) queries ``gap_s`` apart; the second is skipped when the first found no RAS."""
        first = self.query()
        if first is None:
            return None, None
        time.sleep(gap_s)
        return first, self.query()
