"""The per-node watchdog loop: discover jobs, poll ranks, detect, capture, decide, write bundles.

All decisions are delegated to pure functions (detect, verdict); this module does the I/O around them
and survives any single failing probe or job.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from ..cluster.correlate import Correlator, SharedIncident
from ..core.detect import Trigger, find_trigger, recovered
from ..core.policy import CapturePolicy, KillPolicy, StallPolicy
from ..core.snapshot import RUNNING, STOPPED, RankView
from ..core.verdict import Verdict, decide, rank_entry
from ..evidence.capture import RankCapture, capture_all, signature, stack_top, waiting_on_peers
from ..evidence.outside import RAS_RECHECK_S, GpuWatch, RasWatch, fr_evidence
from ..observe.jobwatch import JobWatch
from ..observe.process import ExitWatcher, ProcessProbe
from ..report import bundle
from ..report.text import verdict_text

log = structlog.get_logger("rankwatch.daemon")

# a job whose ranks are all gone is retired after this long (lets a late incident still be reported)
RETIRE_AFTER_S = 10.0
# retired jobs are checked for a new run's records every this many polls
REVIVE_CHECK_EVERY = 4


@dataclass(frozen=True)
class DaemonConfig:
    shm_dir: str
    out_dir: str
    poll_interval_s: float = 0.5
    stall: StallPolicy = field(default_factory=StallPolicy)
    capture: CapturePolicy = field(default_factory=CapturePolicy)
    kill: KillPolicy = field(default_factory=KillPolicy)
    on_stall: str = "report"  # "report" | "kill"
    job_filter: str | None = None  # watch only this job (rankwatch run)
    incidents_dir: str | None = None  # override <out>/<job>/incidents (rankwatch run: <out>/incidents)


@dataclass
class OpenIncident:
    incident_id: str
    trigger: Trigger
    bundle_path: str | None
    verdict: dict[str, Any]


@dataclass
class JobEntry:
    watch: JobWatch
    incident: OpenIncident | None = None
    incidents: list[str] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    gone_since: float | None = None
    last_views: list[RankView] = field(default_factory=list)


IncidentCallback = Callable[[dict[str, Any], str | None], None]


def enrich(views: Sequence[RankView], captures: dict[int, RankCapture], policy: CapturePolicy) -> list[RankView]:
    """Attach stack evidence to the views (pure apart from reading the captures)."""
    out = []
    for v in views:
        cap = captures.get(v.rank)
        if cap is None:
            out.append(v)
            continue
        frames = cap.main_frames()
        out.append(
            dataclasses.replace(
                v,
                stack_top=stack_top(frames, policy.stack_top_frames),
                stack_signature=signature(frames, policy.signature_frames),
                waiting=waiting_on_peers(frames) if frames else None,
            )
        )
    return out


def remote_trigger(remote: SharedIncident, longest_step_s: float, daemon: Daemon) -> Trigger:
    """The trigger of an incident another node detected, as this node records it."""
    ranks = remote.trigger.get("ranks")
    after = remote.trigger.get("detected_after_s")
    return Trigger(
        kind=str(remote.trigger.get("kind", "remote"))[:32],
        ranks=tuple(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else (),
        reason=f"signalled by node {remote.by_node}: {str(remote.trigger.get('reason', ''))[:200]}",
        timeout_s=daemon.config.stall.timeout_for(longest_step_s),
        detected_after_s=after if isinstance(after, (int, float)) and 0 <= after < 1e7 else 0.0,
    )


def new_incident_id(kind: str, seq: int) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{seq:03d}-{kind}"


class Daemon:
    def __init__(self, config: DaemonConfig, on_incident: IncidentCallback | None = None) -> None:
        self.config = config
        self.on_incident = on_incident
        self.jobs: dict[str, JobEntry] = {}
        self.exits = ExitWatcher()
        self.procs = ProcessProbe()
        self._incident_seq = 0
        self._stop = threading.Event()
        self.polls = 0
        # outside evidence: NVML opened once (a no-op without a driver); NCCL RAS asked only at incidents
        self.gpu = GpuWatch()
        self.ras = RasWatch()
        # job id -> cross-node correlator (multi-node jobs); set by the command that knows the topology
        self.correlators: dict[str, Correlator] = {}
        # daemon mode: builds a correlator for a newly seen multi-node job (None: single node)
        self.correlator_factory: Callable[[JobWatch], Correlator | None] | None = None
        self._factory_tried: set[str] = set()

    # -- discovery --------------------------------------------------------------------------------
    def discover(self) -> None:
        try:
            names = [self.config.job_filter] if self.config.job_filter else os.listdir(self.config.shm_dir)
        except OSError as exc:
            if self.polls == 0:
                log.warning("shm_dir_unreadable", shm_dir=self.config.shm_dir, error=str(exc))
            return
        present = set(names)
        for gone in [j for j, e in self.jobs.items() if e.watch.retired and j not in present]:
            # a finished job whose directory was removed: forget it, so a long-lived daemon stays small
            self.jobs.pop(gone).watch.close()
            corr = self.correlators.pop(gone, None)
            if corr is not None:
                corr.close()
            self._factory_tried.discard(gone)
        for name in names:
            if name in self.jobs or name.startswith("."):
                continue
            path = os.path.join(self.config.shm_dir, name)
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            self.jobs[name] = JobEntry(JobWatch(self.config.shm_dir, name, self.exits, self.procs))
            log.info("job_discovered", job=name)

    # -- one poll ---------------------------------------------------------------------------------
    def poll_once(self) -> None:
        self.polls += 1
        self.discover()
        for job_id, entry in list(self.jobs.items()):
            if entry.watch.retired:
                self._maybe_revive(job_id, entry)
                continue
            try:
                self._poll_job(job_id, entry)
            except Exception:  # one bad job never stops the daemon
                log.exception("job_poll_failed", job=job_id)

    def _maybe_revive(self, job_id: str, entry: JobEntry) -> None:
        """A retired job id that gets fresh records is a new run (torchrun restart, reused run name)."""
        if self.polls % REVIVE_CHECK_EVERY:
            return
        watch = entry.watch
        watch.drop_gone_ranks()
        if watch.refresh():
            watch.retired = False
            entry.last_views = []
            entry.incident = None
            entry.gone_since = None
            watch.longest_step_s = 0.0
            log.info("job_restarted", job=job_id, ranks=len(watch.ranks))

    def _poll_job(self, job_id: str, entry: JobEntry) -> None:
        watch = entry.watch
        watch.refresh()
        first_look = not entry.last_views
        if first_look and watch.drop_gone_ranks() and not watch.ranks:
            # only records of processes that are gone: an earlier run (they are not this run's dead ranks)
            watch.retired = True
            log.info("job_stale", job=job_id)
            return
        views = self.gpu.apply(watch.poll())
        entry.last_views = views
        if not views:
            return
        if watch.all_gone(views):
            entry.gone_since = entry.gone_since or time.monotonic()
        else:
            entry.gone_since = None
        correlator = self.correlators.get(job_id)
        factory = self.correlator_factory
        if correlator is None and factory is not None and watch.job_info and job_id not in self._factory_tried:
            self._factory_tried.add(job_id)
            correlator = factory(watch)
            if correlator is not None:
                self.correlators[job_id] = correlator
        if correlator is not None:
            correlator.publish_snapshot(watch.node, views)
        if entry.incident is None:
            trigger = find_trigger(views, self.config.stall, watch.longest_step_s, watch.stopped_for_s())
            if trigger is not None and not (trigger.kind == "dead" and entry.incidents and watch.all_gone(views)):
                self._open_incident(job_id, entry, trigger, views)
            elif correlator is not None:
                remote = correlator.poll_incident()
                if remote is not None:
                    self._open_incident(
                        job_id, entry, remote_trigger(remote, watch.longest_step_s, self), views, remote
                    )
        elif recovered(views, self.config.stall, watch.longest_step_s):
            log.info("incident_closed", job=job_id, incident=entry.incident.incident_id)
            entry.incident = None
        if entry.gone_since is not None and time.monotonic() - entry.gone_since > RETIRE_AFTER_S:
            watch.retired = True
            log.info("job_retired", job=job_id, incidents=len(entry.incidents))

    # -- incidents --------------------------------------------------------------------------------
    def incidents_dir(self, job_id: str) -> str:
        if self.config.incidents_dir:
            return self.config.incidents_dir
        return os.path.join(self.config.out_dir, job_id, "incidents")

    def _open_incident(
        self,
        job_id: str,
        entry: JobEntry,
        trigger: Trigger,
        views: list[RankView],
        shared: SharedIncident | None = None,
    ) -> None:
        self._incident_seq += 1
        incident_id = new_incident_id(trigger.kind, self._incident_seq)
        correlator = self.correlators.get(job_id)
        if correlator is not None and shared is None:
            trigger_doc = {
                "kind": trigger.kind,
                "ranks": list(trigger.ranks),
                "reason": trigger.reason,
                "detected_after_s": round(trigger.detected_after_s, 3),
            }
            shared = correlator.claim(incident_id, trigger_doc)
        if shared is not None:
            incident_id = shared.incident_id  # the same id on every node
        log.warning(
            "incident_detected",
            job=job_id,
            incident=incident_id,
            trigger=trigger.kind,
            ranks=list(trigger.ranks),
            reason=trigger.reason,
            signalled_by=shared.by_node if shared is not None else None,
        )
        ras_first = self.ras.query()  # before capture; the second query after it shows counts that do not move
        t0 = time.monotonic()
        targets = [(v.rank, v.pid, v.state == STOPPED) for v in views if v.state in (RUNNING, STOPPED)]
        captures = capture_all(targets, entry.watch.job_dir, incident_id, self.config.capture)
        log.info(
            "capture_done",
            job=job_id,
            incident=incident_id,
            ranks=len(targets),
            stacks=sum(1 for c in captures.values() if c.main_frames()),
            seconds=round(time.monotonic() - t0, 3),
        )
        # states may have moved on during capture (a rank died): re-read, keep the stacks
        # keep the GPU reading taken when the stall was detected (py-spy pauses ranks during capture)
        fresh = {v.rank: v for v in entry.watch.poll()}
        merged = [
            dataclasses.replace(fresh[v.rank], gpu_util=v.gpu_util, gpu_missing=v.gpu_missing) if v.rank in fresh else v
            for v in views
        ]
        enriched = enrich(merged, captures, self.config.capture)
        fr = fr_evidence(captures)
        outside = [*fr.lines, *self.gpu.device_notes()]
        if ras_first is not None:
            time.sleep(max(0.0, RAS_RECHECK_S - (time.monotonic() - t0)))
            outside += self.ras.evidence(ras_first, self.ras.query())

        def decide_over(all_views: Sequence[RankView], notes: Sequence[str]) -> Verdict:
            return decide(
                all_views,
                job_id=job_id,
                incident_id=incident_id,
                detected_after_s=trigger.detected_after_s,
                extra_evidence=[*notes, *outside],
                fr_hints=fr.hints,
            )

        if correlator is not None and shared is not None:
            world = max((st.last.world_size for st in entry.watch.ranks.values()), default=len(enriched))
            verdict, how = correlator.resolve(shared, enriched, entry.watch.node, world, decide_over)
            log.info("correlated", job=job_id, incident=incident_id, how=how)
        else:
            verdict = decide_over(enriched, []).to_json()
        verdict["trigger"] = {"kind": trigger.kind, "ranks": list(trigger.ranks), "reason": trigger.reason}
        verdict["stall_timeout_s"] = round(trigger.timeout_s, 3)
        path = self._write_bundle(job_id, incident_id, verdict, enriched, captures)
        entry.incident = OpenIncident(incident_id, trigger, path, verdict)
        entry.incidents.append(incident_id)
        entry.verdicts.append(verdict)
        log.warning(
            "verdict",
            job=job_id,
            incident=incident_id,
            kind=verdict["kind"],
            initiating_ranks=verdict["initiating_ranks"],
            phase=verdict["phase"],
            confidence=verdict["confidence"],
            reason=verdict["reason"],
            bundle=path,
        )
        if self.on_incident is not None:
            try:
                self.on_incident(verdict, path)
            except Exception:
                log.exception("incident_callback_failed", job=job_id)
        if self.config.on_stall == "kill":
            self.kill_job(entry.watch, enriched)

    def _write_bundle(
        self,
        job_id: str,
        incident_id: str,
        verdict: dict[str, Any],
        views: list[RankView],
        captures: dict[int, RankCapture],
    ) -> str | None:
        ranks_doc = {
            "job_id": job_id,
            "job": verdict.get("job"),
            "ranks": [
                {
                    **rank_entry(v),
                    "rank": v.rank,
                    "since_progress_s": round(v.since_progress_s, 3),
                    "collective_done": v.coll_done,
                    "stack_signature": v.stack_signature,
                    "waiting": v.waiting,
                }
                for v in views
            ],
        }
        for attempt in range(3):
            try:
                path = bundle.write_bundle(
                    self.incidents_dir(job_id), incident_id, verdict, verdict_text(verdict), ranks_doc, views, captures
                )
                log.info("bundle_written", job=job_id, incident=incident_id, path=path)
                return path
            except OSError as exc:
                log.error("bundle_write_failed", job=job_id, incident=incident_id, error=str(exc), attempt=attempt)
                time.sleep(0.2)
        return None

    # -- actions (opt-in only) --------------------------------------------------------------------
    def kill_job(self, watch: JobWatch, views: Sequence[RankView]) -> None:
        """--on-stall kill: SIGTERM (and SIGCONT for stopped ranks), SIGKILL after a grace period."""
        pids = [v.pid for v in views if v.state in (RUNNING, STOPPED) and v.pid > 0]
        log.warning("killing_job", job=watch.job_id, pids=pids)
        for pid in pids:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass

        def finish() -> None:
            deadline = time.monotonic() + self.config.kill.term_grace_s
            while time.monotonic() < deadline:
                if all(self.exits.exit_ns(p) is not None for p in pids):
                    return
                time.sleep(0.1)
            for pid in pids:
                if self.exits.exit_ns(pid) is None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass

        threading.Thread(target=finish, name="rankwatch-kill", daemon=True).start()

    # -- loop -------------------------------------------------------------------------------------
    def run(self, heartbeat: Callable[[], None] | None = None) -> None:
        interval = self.config.poll_interval_s
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll_once()
            if heartbeat is not None:
                heartbeat()
            self._stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        for correlator in self.correlators.values():
            correlator.close()
        for entry in self.jobs.values():
            entry.watch.close()
        self.exits.close()
        self.gpu.close()
