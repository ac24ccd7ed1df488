"""The per-node watchdog loop: discover jobs, poll ranks, detect, hand incidents to the pipeline.

Detection is delegated to pure functions (``core.detect``); an incident runs in ``serve.incident`` off
this loop, so every job stays watched and the systemd heartbeat keeps beating while evidence is captured.
The loop survives any single failing probe or job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from rankwatch.hooks.files import atomic_write_in

from ..cluster.correlate import Correlator, SharedIncident
from ..cluster.live_share import JobDiagnosis, LiveShare, Offer, RemoteRanks, diagnosis_share, merge_live
from ..core.detect import (
    Trigger,
    allowance_s,
    find_trigger,
    first_step_s,
    local_stall_signs,
    recovered,
    stalled_ranks,
)
from ..core.engine import prior_verdict
from ..core.host_signals import RankCounters
from ..core.policy import (
    CapturePolicy,
    CorrelationPolicy,
    FairnessPolicy,
    KillPolicy,
    ObservePolicy,
    ServePolicy,
    StallPolicy,
)
from ..core.snapshot import RankView
from ..core.steps import StepTiming
from ..core.straggler import StragglerDiagnosis, StragglerPolicy, diagnose_stragglers
from ..core.straggler_cause import explain
from ..core.straggler_live import LiveStraggler, LiveStragglerPolicy, can_name, incident_notes, update_live
from ..evidence.capture import capture_all
from ..evidence.gpu import GpuWatch
from ..evidence.ras_watch import RasWatch
from ..observe import jobdir
from ..observe.jobwatch import JobWatch
from ..observe.process import ProcessTable
from ..observe.reader import open_job
from ..privsep.readers import ReaderError, Readers, default_readers
from ..report import bundle
from .act import Killer
from .alerts import Alerter
from .incident import CaptureFn, IncidentCallback, IncidentPipeline, IncidentRequest, IncidentResult
from .lanes import OwnerLane
from .state import Resumable, StatePublisher, diagnosis_doc, incident_ref, read_resumable, state_doc

log = structlog.get_logger("rankwatch.daemon")

OWNER_FILE = ".owner"  # <out>/<job>/.owner: the uid of the job's owner, for per-owner bundle budgets


@dataclass(frozen=True)
class DaemonConfig:
    shm_dir: str
    out_dir: str
    poll_interval_s: float = 0.5
    stall: StallPolicy = field(default_factory=StallPolicy)
    capture: CapturePolicy = field(default_factory=CapturePolicy)
    kill: KillPolicy = field(default_factory=KillPolicy)
    serve: ServePolicy = field(default_factory=ServePolicy)
    observe: ObservePolicy = field(default_factory=ObservePolicy)
    fairness: FairnessPolicy = field(default_factory=FairnessPolicy)
    live: LiveStragglerPolicy = field(default_factory=LiveStragglerPolicy)
    on_stall: str = "report"  # "report" | "kill"
    job_filter: str | None = None  # watch only this job (rankwatch run)
    incidents_dir: str | None = None  # override <out>/<job>/incidents (rankwatch run: <out>/incidents)


@dataclass
class OpenIncident:
    incident_id: str
    trigger: Trigger
    bundle_path: str | None
    verdict: dict[str, Any]
    pending: bool = False  # handed to the pipeline, verdict not yet decided
    notified: bool = False  # the webhooks heard of it (a restarted daemon owes them its resolved notice)
    opened_unix: float = 0.0


@dataclass(frozen=True)
class MergedLive:
    """The leader's live diagnosis over its own ranks and the other nodes' (``Daemon._merge_live``)."""

    version: int
    diag: StragglerDiagnosis
    remote: dict[int, str]  # the other nodes' ranks it compared: rank -> node name
    at: float  # monotonic time it was made
    # older than this it no longer stands (the share thread stopped merging: a wedged store), and the poll loop
    # diagnoses this node's ranks again: a share's staleness bound and one share
    stale_s: float


@dataclass
class JobEntry:
    watch: JobWatch
    incident: OpenIncident | None = None
    incidents: list[str] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    gone_since: float | None = None
    retired_at: float | None = None
    files_removed: bool = False
    bundles: dict[str, str] = field(default_factory=dict)  # incident id -> bundle path, once written
    last_views: list[RankView] = field(default_factory=list)  # replaced, never mutated: read by other threads
    # the job's straggler diagnosis of its recent steps, computed once per poll that saw new steps (every
    # ``live.every_s`` at most) and only here: metrics, the state file (status) and the live stragglers read it.
    # Replaced wholesale, never mutated once set: read by other threads
    straggler: StragglerDiagnosis | None = None
    # live stragglers by (rank, phase): replaced wholesale each diagnosis (read by metrics and status)
    live_stragglers: dict[tuple[int, str], LiveStraggler] = field(default_factory=dict)
    # the other nodes' ranks the diagnosis in ``straggler`` compared (rank -> node name): set with it, empty
    # when it covers this node's ranks only
    straggler_remote: dict[int, str] = field(default_factory=dict)
    # the leader's diagnosis over every node's shared ranks (``cluster.live_share``), made on the share thread and
    # replaced wholesale there; the poll loop takes each one once as the job's diagnosis
    merged: MergedLive | None = None
    merged_seen: int = 0  # the version of the merged diagnosis taken last
    live_at: float = 0.0  # monotonic time of the last live diagnosis
    live_key: tuple[tuple[int, int], ...] = ()  # (rank, last step) it saw: no new step, no new diagnosis
    # the incident a previous daemon left open for this job (its state file under --out), until this daemon
    # has seen whether the hang still holds (resumed: same id, no second bundle or alert) or is over
    resume: Resumable | None = None
    resume_polls: int = 0
    gen_start: float | None = None  # wall-clock start of the run watched (once known; reset on a new run)


def remote_trigger(
    remote: SharedIncident, longest_step_s: float, stall: StallPolicy, *, unauthenticated_seen: str | None = None
) -> Trigger:
    """The trigger of an incident another node detected, as this node records it (an unauthenticated claim
    with what this node's own ranks showed that made it worth capturing)."""
    ranks = remote.trigger.get("ranks")
    after = remote.trigger.get("detected_after_s")
    seen = f" [unauthenticated claim; here: {unauthenticated_seen}]" if unauthenticated_seen else ""
    return Trigger(
        kind=str(remote.trigger.get("kind", "remote"))[:32],
        ranks=tuple(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else (),
        reason=f"signalled by node {remote.by_node}: {str(remote.trigger.get('reason', ''))[:200]}{seen}",
        timeout_s=stall.timeout_for(longest_step_s),
        detected_after_s=after if isinstance(after, (int, float)) and 0 <= after < 1e7 else 0.0,
    )


def new_incident_id(kind: str, seq: int) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{seq:03d}-{kind}"


class Daemon:
    """Collaborators are passed in (tests and commands build their own); defaults are the real probes."""

    def __init__(
        self,
        config: DaemonConfig,
        on_incident: IncidentCallback | None = None,
        *,
        procs: ProcessTable | None = None,
        gpu: GpuWatch | None = None,
        ras: RasWatch | None = None,
        capture: CaptureFn = capture_all,
        correlators: Mapping[str, Correlator] | None = None,
        correlator_factory: Callable[[JobWatch], Correlator | None] | None = None,
        alerts: Alerter | None = None,
        readers: Readers | None = None,
    ) -> None:
        self.config = config
        self.jobs: dict[str, JobEntry] = {}
        # the job owners' readers: started first, so the zygote is forked before this daemon has threads
        self.readers = readers or default_readers()
        self.procs = procs or ProcessTable()
        self._incident_seq = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # entry.incident / incidents / verdicts: loop vs pipeline workers
        self.polls = 0
        self.last_poll_ns: int | None = None  # monotonic end of the last completed poll (/healthz)
        # how long the latest polls took, in seconds (``poll_stats``: what the loop costs, e.g. per node of a job)
        self.poll_s: deque[float] = deque(maxlen=4096)
        # outside evidence: NVML opened once (a no-op without a driver); NCCL RAS asked only at incidents
        self.gpu = gpu or GpuWatch()
        self.ras = ras or RasWatch()
        # job id -> cross-node correlator (multi-node jobs); known up front (rankwatch run) or built by the
        # factory when a multi-node job is first seen (daemon mode reads the topology from job.json)
        self.correlators: dict[str, Correlator] = dict(correlators or {})
        self.correlator_factory = correlator_factory
        self._factory_tried: set[str] = set()
        # job id -> its live exchange with the other nodes (``cluster.live_share``), beside its correlator
        self.shares: dict[str, LiveShare] = {}
        self._merge_seq = itertools.count(1)
        # discovery: every name of the shared dir is looked at (one lstat) once, and again only when it changed
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (inode, ctime ns) when examined
        self._rejected: set[str] = set()  # examined and refused (not a dir, no reader took it): re-checked in turn
        self._recheck_at = 0
        self._present: frozenset[str] = frozenset()  # the shared dir's names at the last listing
        self._jobs_lock = threading.Lock()  # self.jobs, the lanes and the discovery state: loop vs lanes
        self._shared_lock = threading.Lock()  # what the owners' lanes share: NVML, correlators, incident ids
        self.lanes: dict[int, OwnerLane] = {}  # job owner uid -> the thread that polls that owner's jobs
        self._clean_dumps = False  # remove dump dirs a killed daemon left, at each job's first look
        self._in_flight: dict[int, int] = {}  # job owner uid -> incidents in the pipeline (under self._lock)
        self._deferred_logged: set[str] = set()
        killer = Killer(self.procs, config.kill) if config.on_stall == "kill" else None
        # descendants are pinned only when they may have to be killed
        self._observe = dataclasses.replace(config.observe, track_descendants=killer is not None)
        self.procs.descendants_per_owner = config.fairness.descendant_pidfds_per_owner
        self._quiet = False  # no new incidents (``rankwatch run`` shutting the job down on purpose)
        self.pipeline = IncidentPipeline(
            capture_policy=config.capture,
            serve_policy=config.serve,
            gpu=self.gpu,
            ras=self.ras,
            killer=killer,
            capture=capture,
            on_incident=on_incident,
            alerts=alerts,
        )
        self.alerts = alerts
        self.pipeline.on_late_bundle = self._late_bundle
        # what `rankwatch status` reads: beside the records, and (daemon) under --out
        self.state = StatePublisher(config.serve.state_refresh_s, None if config.job_filter else config.out_dir)

    # -- discovery ----------------------------------------------------------------------------------
    def discover(self, wait_s: float | None = None) -> None:
        """Route the shared dir's new names to their owners' lanes and let each lane take its first look
        (waiting ``wait_s``, default ``FairnessPolicy.discover_wait_s``): what start-up and tests call; the
        loop routes and polls in one go (``poll_once``)."""
        self._route()
        self._run_lanes(self._adopt, self.config.fairness.discover_wait_s if wait_s is None else wait_s)

    def _route(self) -> None:
        """List the shared dir and hand each new name that is a dir to its owner's lane (one lstat per name,
        never an open here: the lane opens it, in that owner's round). A name already examined is not looked
        at again until it changes; a flood of names costs its lstats once."""
        fair = self.config.fairness
        try:
            names = [self.config.job_filter] if self.config.job_filter else os.listdir(self.config.shm_dir)
        except OSError as exc:
            if self.polls <= 1:
                log.warning("shm_dir_unreadable", shm_dir=self.config.shm_dir, error=str(exc))
            return
        present = frozenset(names)
        self._present = present
        with self._jobs_lock:
            for gone in [n for n in self._seen if n not in present]:
                del self._seen[gone]
                self._rejected.discard(gone)
            fresh = [n for n in names if n not in self._seen and n not in self.jobs][: fair.examine_per_poll]
            rejected = sorted(self._rejected)
        recheck: list[str] = []
        if rejected:
            at = self._recheck_at % len(rejected)
            recheck = (rejected[at:] + rejected[:at])[: fair.recheck_per_poll]
            self._recheck_at = at + len(recheck)
        if not fresh and not recheck:
            return
        try:
            base = jobdir.open_dir(self.config.shm_dir)
        except OSError:
            return
        try:
            for name in recheck:
                if self._key(base, name) != self._seen.get(name):
                    with self._jobs_lock:
                        self._seen.pop(name, None)
                        self._rejected.discard(name)
                    self._examine(base, name)
            for name in fresh:
                self._examine(base, name)
        finally:
            os.close(base)

    @staticmethod
    def _key(base: int, name: str) -> tuple[int, int] | None:
        try:
            st = os.stat(name, dir_fd=base, follow_symlinks=False)
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def _examine(self, base: int, name: str) -> None:
        if name.startswith(".") or not jobdir.SAFE_NAME.match(name):
            with self._jobs_lock:
                self._seen[name] = (0, 0)  # a name is never anything else: not looked at again
            return
        try:
            st = os.stat(name, dir_fd=base, follow_symlinks=False)
        except OSError:
            return  # gone already (or not yet there: `rankwatch run` before its ranks start)
        with self._jobs_lock:
            self._seen[name] = (st.st_ino, st.st_ctime_ns)
            if not stat.S_ISDIR(st.st_mode):
                self._rejected.add(name)
        if not stat.S_ISDIR(st.st_mode):
            log.info("job_dir_skipped", job=name, error="not a directory")
            return
        self._lane(st.st_uid).pending.append(name)

    def _lane(self, uid: int) -> OwnerLane:
        with self._jobs_lock:
            lane = self.lanes.get(uid)
            if lane is None:
                lane = self.lanes[uid] = OwnerLane(uid)
            return lane

    def _run_lanes(self, work: Callable[[OwnerLane], None], wait_s: float) -> None:
        """One round of ``work`` in every lane that is not still busy with its last one, all at once; wait
        for them until ``wait_s`` has passed. A lane still busy then is lagging: nobody waits for it (its
        jobs keep their last state). With one owner there is nobody to be fair to: its round is waited for,
        until a second owner's job dir appears."""
        with self._jobs_lock:
            lanes = list(self.lanes.values())
        kicked = [lane for lane in lanes if lane.kick(work)]
        if len(lanes) == 1 and kicked:
            # one owner so far: its round is the poll, waited for — while the shared dir is looked at for a
            # new owner, whose first look must not wait behind this one's round
            while not kicked[0].wait(time.monotonic() + self.config.fairness.new_owner_look_s):
                self._route()
                if len(self.lanes) > 1:
                    return
            return
        deadline = time.monotonic() + wait_s
        for lane in kicked:
            if not lane.wait(deadline):
                log.debug("owner_lagging", owner_uid=lane.uid, round_s=round(lane.lag_s(), 3))

    def _adopt(self, lane: OwnerLane) -> None:
        """The lane's first look at a few of its owner's new job dirs (``new_jobs_per_round``), while the
        owner holds fewer than ``jobs_per_owner``: opened once, never through a symlink, and held."""
        fair = self.config.fairness
        base: int | None = None
        taken = 0
        try:
            while lane.pending and taken < fair.new_jobs_per_round:
                if len(lane.jobs) >= fair.jobs_per_owner:
                    self._evict_retired(lane)
                if len(lane.jobs) >= fair.jobs_per_owner:
                    if not lane.over_budget_logged:
                        lane.over_budget_logged = True
                        log.warning("job_dirs_over_budget", owner_uid=lane.uid, budget=fair.jobs_per_owner,
                                    waiting=len(lane.pending),
                                    detail="this user's new job dirs wait until one of their jobs is retired")
                    return
                lane.over_budget_logged = False
                name = lane.pending.popleft()
                if name in self.jobs or name not in self._present:
                    continue
                taken += 1
                if base is None:
                    try:
                        base = jobdir.open_dir(self.config.shm_dir)
                    except OSError:
                        lane.pending.appendleft(name)
                        return
                try:
                    job = open_job(self.readers, base, name)
                except (OSError, ReaderError) as exc:
                    with self._jobs_lock:
                        self._rejected.add(name)
                    log.info("job_dir_skipped", job=name, error=str(exc)[:200])
                    continue
                if job.uid != lane.uid:  # swapped since its lstat: examined afresh next poll
                    job.close()
                    with self._jobs_lock:
                        self._seen.pop(name, None)
                    continue
                entry = JobEntry(JobWatch(self.config.shm_dir, name, self.procs, self._observe, job=job))
                if not self.config.job_filter and not self.config.incidents_dir:
                    entry.resume = read_resumable(self.config.out_dir, name, self.incidents_dir(name))
                if self._clean_dumps:
                    n = entry.watch.remove_stale_dumps(self.config.serve.stale_dump_age_s)
                    if n:
                        log.info("stale_dumps_removed", job=name, files=n)
                with self._jobs_lock:
                    self.jobs[name] = entry
                    lane.jobs = [*lane.jobs, name]
                log.info("job_discovered", job=name, owner_uid=job.uid,
                         **({"open_incident": entry.resume.incident_id} if entry.resume else {}))
        finally:
            if base is not None:
                os.close(base)

    def _evict_retired(self, lane: OwnerLane) -> None:
        """Make room in a full lane: the owner's longest-retired job is let go (its dir and the reader's
        handles closed). Its name is looked at again once the dir changes (a new run's records)."""
        retired = [(e.retired_at, j) for j in lane.jobs if (e := self.jobs.get(j)) and e.retired_at is not None]
        if retired:
            _, job_id = min(retired)
            self._forget(lane, job_id, watch_again=True)
            log.info("job_let_go", job=job_id, owner_uid=lane.uid, why="the owner's share of job dirs is full")

    def _forget(self, lane: OwnerLane, job_id: str, *, watch_again: bool = False) -> None:
        """A finished job whose directory was removed: forgotten, so a long-lived daemon stays small
        (``watch_again``: its dir is still there, re-examined when it changes)."""
        with self._jobs_lock:
            entry = self.jobs.pop(job_id, None)
            lane.jobs = [j for j in lane.jobs if j != job_id]
            if watch_again and job_id in self._seen:
                self._rejected.add(job_id)
                with contextlib.suppress(OSError):  # as it is now: looked at again only once it changes
                    st = os.stat(os.path.join(self.config.shm_dir, job_id), follow_symlinks=False)
                    self._seen[job_id] = (st.st_ino, st.st_ctime_ns)
            else:
                self._seen.pop(job_id, None)
        if entry is not None:
            entry.watch.close()
        with self._shared_lock:
            corr = self.correlators.pop(job_id, None)
            share = self.shares.pop(job_id, None)
            self._factory_tried.discard(job_id)
        if share is not None:
            share.close()
        if corr is not None:
            corr.close()

    # -- one poll ---------------------------------------------------------------------------------
    def poll_once(self) -> None:
        """One poll: route new names, then every owner's round in that owner's lane, in parallel, waited
        for at most ``FairnessPolicy.round_wait_s`` (``/healthz`` counts these: the loop, not one owner)."""
        started = time.perf_counter()
        self.polls += 1
        self._route()
        self.pipeline.retry_unwritten()
        self._run_lanes(self._owner_round, self.config.fairness.round_wait_s)
        self.last_poll_ns = time.monotonic_ns()
        self.poll_s.append(time.perf_counter() - started)

    def _owner_round(self, lane: OwnerLane) -> None:
        """Everything of one owner's jobs this poll: the first look at new dirs, then each job polled,
        detected and (off this thread) handed to the incident pipeline."""
        self._adopt(lane)
        for job_id in lane.jobs:
            entry = self.jobs.get(job_id)
            if entry is None:
                continue
            if entry.watch.retired:
                if job_id not in self._present:
                    self._forget(lane, job_id)
                    continue
                self._maybe_revive(job_id, entry)
                self._maybe_remove_files(job_id, entry)
                continue
            try:
                self._poll_job(job_id, entry)
            except Exception:  # one bad job never stops the daemon
                log.exception("job_poll_failed", job=job_id)

    def _owner_lag(self, uid: int) -> float:
        """How late this owner's previous look came beyond one poll and the loop's wait (0: on time)."""
        lane = self.lanes.get(uid)
        if lane is None or lane.done_ns is None:
            return 0.0
        late = lane.age_s() - self.config.poll_interval_s - self.config.fairness.round_wait_s
        return late if late > 0.5 else 0.0

    def owner_lags(self) -> dict[int, dict[str, float | int | bool]]:
        """Per job owner: how old their newest complete look is, how long the round in progress has run,
        whether they lag (for ``/metrics``, ``/healthz`` and the state files)."""
        now = time.monotonic_ns()
        wait = self.config.fairness.round_wait_s
        with self._jobs_lock:
            lanes = list(self.lanes.values())
            jobs = {lane.uid: len(lane.jobs) for lane in lanes}
        return {lane.uid: {"age_s": round(lane.age_s(now), 3), "round_s": round(lane.lag_s(now), 3),
                           "lagging": lane.lag_s(now) > wait, "jobs": jobs[lane.uid],
                           "waiting_dirs": len(lane.pending)}
                for lane in lanes}

    def _maybe_revive(self, job_id: str, entry: JobEntry) -> None:
        """A retired job id that gets fresh records is a new run (torchrun restart, reused run name)."""
        if self.polls % self.config.serve.revive_check_every:
            return
        watch = entry.watch
        watch.drop_gone_ranks()
        if watch.refresh():
            watch.retired = False
            entry.retired_at = None
            entry.files_removed = False
            entry.last_views = []
            entry.incident = None
            entry.gone_since = None
            entry.straggler, entry.live_stragglers, entry.live_key = None, {}, ()
            entry.merged, entry.straggler_remote = None, {}
            entry.resume, entry.gen_start = None, None
            watch.longest_step_s = 0.0
            log.info("job_restarted", job=job_id, ranks=len(watch.ranks))

    def _correlator(self, job_id: str, watch: JobWatch) -> Correlator | None:
        correlator = self.correlators.get(job_id)
        factory = self.correlator_factory
        if correlator is None and factory is not None and watch.job_info and job_id not in self._factory_tried:
            # every correlated job holds three store connections and three threads: bounded in all and per owner,
            # however many job dirs claiming several nodes a user makes (the owners' lanes count together)
            policy = self.config.serve
            with self._shared_lock:
                self._factory_tried.add(job_id)
                mine = sum(1 for j in self.correlators
                           if (e := self.jobs.get(j)) and e.watch.owner_uid == watch.owner_uid)
                total = len(self.correlators)
            if total >= policy.correlated_jobs or mine >= policy.correlated_jobs_per_owner:
                log.warning("correlation_refused", job=job_id, owner_uid=watch.owner_uid,
                            correlated=total, of_owner=mine, why="this daemon correlates at most "
                            f"{policy.correlated_jobs} jobs, {policy.correlated_jobs_per_owner} per user")
                return None
            correlator = factory(watch)
            if correlator is not None:
                with self._shared_lock:
                    self.correlators[job_id] = correlator
        return correlator

    def _poll_job(self, job_id: str, entry: JobEntry) -> None:
        watch = entry.watch
        watch.refresh()
        first_look = not entry.last_views
        if first_look and watch.drop_gone_ranks(proven_too=False) and not watch.ranks:
            # only records of processes that are gone and were never seen alive: an earlier run (they are not
            # this run's dead ranks)
            watch.retired = True
            entry.retired_at = time.monotonic()
            log.info("job_stale", job=job_id)
            return
        polled = watch.poll()
        with self._shared_lock:  # one NVML sample at a time (its device maps are the node's)
            views = self.gpu.apply(polled)
        entry.last_views = views
        try:
            watch.sample_signals(self.gpu.gpu_state)
        except Exception:  # a cause is a nicety: it never costs a poll
            log.exception("signals_sample_failed", job=job_id)
        if not views:
            return
        if entry.gen_start is None:
            entry.gen_start = watch.generation_start_unix()
        if watch.all_gone(views):
            entry.gone_since = entry.gone_since or time.monotonic()
        else:
            entry.gone_since = None
        correlator = self._correlator(job_id, watch)
        self._live_stragglers(job_id, entry, correlator)
        if correlator is not None:
            correlator.fresh_after_unix = watch.generation_start_unix()
            correlator.publish_snapshot(watch.node, views)
        incident = entry.incident
        if incident is None and entry.resume is not None and self._resume(job_id, entry, views):
            pass  # an incident a previous daemon reported: resumed, closed, or still being looked at
        elif incident is None and self._quiet:
            pass  # the job is being shut down on purpose: deaths now are not incidents
        elif incident is None:
            trigger = find_trigger(views, self.config.stall, watch.longest_step_s, watch.stopped_for_s())
            if trigger is not None and not (trigger.kind == "dead" and entry.incidents and watch.all_gone(views)):
                self._open_incident(job_id, entry, trigger, views, correlator)
            elif correlator is not None:
                remote = correlator.poll_incident()
                seen = None
                if remote is not None and not correlator.authenticated:
                    # no secret: anyone could have written the claim; capture only if the ranks here agree
                    stall, longest = self.config.stall, watch.longest_step_s
                    seen = local_stall_signs(
                        views, stall, longest, correlator.policy.unauthenticated_claim_stall_fraction
                    )
                    first = first_step_s(views, stall, longest)
                    give_up = max((allowance_s(v, stall, longest, first) for v in views),
                                  default=stall.timeout_for(longest))
                    remote = correlator.screen_unauthenticated(remote, seen, give_up)
                if remote is not None:
                    trigger = remote_trigger(
                        remote, watch.longest_step_s, self.config.stall, unauthenticated_seen=seen
                    )
                    self._open_incident(job_id, entry, trigger, views, correlator, remote)
        elif not incident.pending and recovered(views, self.config.stall, watch.longest_step_s):
            log.info("incident_closed", job=job_id, incident=incident.incident_id)
            entry.incident = None
            self._resolved(job_id, "job recovered", incident.incident_id)
        retire = entry.gone_since is not None and time.monotonic() - entry.gone_since > self.config.serve.retire_after_s
        self.publish_state(job_id, entry, force=retire)
        if retire:
            watch.retired = True
            entry.retired_at = time.monotonic()
            log.info("job_retired", job=job_id, incidents=len(entry.incidents))
            self._resolved(job_id, "job killed by --on-stall kill" if self.killed(job_id) else "job ended")

    def _resume(self, job_id: str, entry: JobEntry, views: list[RankView]) -> bool:
        """Whether the incident a previous daemon left open (``entry.resume``) decides this poll: still hung
        (the trigger holds) — resumed under its id, bundle and alert, nothing written or sent again; the job
        recovered meanwhile — closed, with the resolved notice its alert is owed; another run of the job id,
        or neither within ``ServePolicy.resume_polls`` — dropped, and detection goes on as for any job."""
        r, watch, stall = entry.resume, entry.watch, self.config.stall
        assert r is not None
        tolerance = self.config.serve.resume_generation_tolerance_s
        if r.generation_start_unix is None or entry.gen_start is None or (
            abs(entry.gen_start - r.generation_start_unix) > tolerance
        ):
            entry.resume = None
            log.info("incident_not_resumed", job=job_id, incident=r.incident_id, why="another run of the job")
            return False
        trigger = find_trigger(views, stall, watch.longest_step_s, watch.stopped_for_s())
        over = trigger is None and recovered(views, stall, watch.longest_step_s)
        entry.resume_polls += 1
        if trigger is None and not over:
            if entry.resume_polls < self.config.serve.resume_polls:
                return True
            entry.resume = None
            log.info("incident_not_resumed", job=job_id, incident=r.incident_id, why="no stall and no recovery seen")
            return False
        entry.resume = None
        with self._lock:
            entry.incidents.append(r.incident_id)
            entry.verdicts.append(r.verdict)
            entry.bundles[r.incident_id] = r.bundle
        if r.notified and self.alerts is not None:
            self.alerts.adopt(r.verdict, r.bundle, r.opened_unix, owner=watch.owner_uid)
        if trigger is not None:
            entry.incident = OpenIncident(r.incident_id, trigger, r.bundle, r.verdict, notified=r.notified,
                                          opened_unix=r.opened_unix)
            log.warning("incident_resumed", job=job_id, incident=r.incident_id, bundle=r.bundle,
                        kind=r.verdict.get("kind"), initiating_ranks=r.verdict.get("initiating_ranks"))
        else:
            log.info("incident_closed", job=job_id, incident=r.incident_id, why="recovered while no daemon watched")
            self._resolved(job_id, "job recovered", r.incident_id)
        return True

    def publish_state(self, job_id: str, entry: JobEntry, *, force: bool = False) -> None:
        """The job's state file for ``rankwatch status`` (never fatal: status falls back to the records)."""
        watch, stall = entry.watch, self.config.stall
        with self._lock:
            incident, verdicts, bundles = entry.incident, list(entry.verdicts), dict(entry.bundles)
        open_doc = None
        if incident is not None and incident.verdict:
            open_doc = incident_ref(incident.verdict, bundle=incident.bundle_path)
            open_doc.update(notified=incident.notified, opened_unix=round(incident.opened_unix, 3))
        elif incident is not None:  # handed to the pipeline, not decided yet: what the trigger said
            trigger = incident.trigger
            open_doc = incident_ref(
                {"incident_id": incident.incident_id, "kind": trigger.kind,
                 "initiating_ranks": list(trigger.ranks), "reason": trigger.reason},
                decided=False,
            )
        keep = self.config.serve.state_incidents
        doc = state_doc(
            job_id=job_id,
            generation_start_unix=entry.gen_start,
            mode="run" if self.config.job_filter else "daemon",
            on_stall=self.config.on_stall,
            stall_timeout_s=stall.timeout_for(watch.longest_step_s),
            stalled=stalled_ranks(entry.last_views, stall, watch.longest_step_s),
            open_incident=open_doc,
            incidents=[
                incident_ref(v, bundle=bundles.get(str(v.get("incident_id")))) for v in verdicts[-keep:]
            ],
            stragglers=[s.doc() for s in entry.live_stragglers.values() if s.reported],
            owner_lag_s=self._owner_lag(watch.owner_uid),
            diagnosis=diagnosis_doc(entry.straggler, entry.straggler_remote),
            job_diagnosis=job.doc() if (job := self.job_diagnosis(job_id)) is not None else None,
        )
        try:
            self.state.publish(job_id, watch.dir_path, doc, force=force)
        except Exception:  # a state file is a convenience: it never costs a poll
            log.exception("state_publish_failed", job=job_id)

    def _live_stragglers(self, job_id: str, entry: JobEntry, correlator: Correlator | None = None) -> None:
        """Diagnose the job's recent steps every ``live.every_s`` — the job's one diagnosis, kept as
        ``entry.straggler`` for metrics and status —; log stragglers that start or end. On a multi-node job the
        lists built for it are offered to the job's live share (``cluster.live_share``: published off this thread);
        on the leader, while other nodes share theirs, the job's diagnosis is the one merged over every node's
        ranks on the share thread (``_merge_live``), taken here once per new merge, and this node's own is not
        made (it would not name another node's ranks)."""
        policy = self.config.live
        now = time.monotonic()
        if now - entry.live_at < policy.every_s:
            return
        entry.live_at = now
        merged = entry.merged
        if merged is not None and now - merged.at > merged.stale_s:
            merged = None  # the share thread stopped merging (a wedged store): this node's own diagnosis again
        if merged is not None and merged.version != entry.merged_seen:
            entry.merged_seen = merged.version
            self._apply_live(job_id, entry, merged.diag, merged.remote)
        history = {r: h for r, h in entry.watch.history.items() if h}
        key = tuple(sorted((r, h[-1].step) for r, h in history.items()))
        if not history or key == entry.live_key:
            return  # no step since the last look says nothing new
        entry.live_key = key
        keep = 2 * policy.window_steps  # ranks a few steps apart still share a full window
        per_rank = {r: list(itertools.islice(h, max(0, len(h) - keep), None)) for r, h in history.items()}
        samples = list(entry.watch.signals)
        if correlator is not None:
            # the leader also hands its whole rings over (a reference per step, ~0.1 ms for 8 ranks): the other
            # nodes' steps reach it a share or two late and are compared with its own steps of the same numbers
            rings = {r: list(h) for r, h in history.items()} if correlator.leader else None
            self._share(job_id, entry, correlator).offer(
                Offer(per_rank, samples, entry.watch.node, self._world(entry), rings))
        if merged is not None:
            return  # the merged diagnosis is the job's while other nodes share their ranks
        self._apply_live(job_id, entry, self._diagnose(entry, per_rank, samples, {}), {})

    def _diagnose(self, entry: JobEntry, per_rank: Mapping[int, Sequence[StepTiming]],
                  samples: Sequence[tuple[int, Mapping[int, RankCounters]]], remote: Mapping[int, object]
                  ) -> StragglerDiagnosis:
        """The job's live diagnosis of these steps, with its cause from these samples; the host's own pressure is
        quoted only for a straggler of this node (``remote``: the ranks other nodes shared)."""
        diag = diagnose_stragglers(per_rank, StragglerPolicy(window_steps=self.config.live.window_steps))
        mine = not diag.straggler_ranks or diag.straggler_ranks[0] not in remote
        return explain(diag, samples, entry.watch.host if mine else None)

    def _apply_live(self, job_id: str, entry: JobEntry, diag: StragglerDiagnosis, remote: dict[int, str]) -> None:
        """``diag`` as the job's diagnosis (over ``remote``'s ranks of other nodes beside this node's): the live
        stragglers it confirms or ends, logged and alerted."""
        entry.straggler, entry.straggler_remote = diag, remote  # whole before they are shared
        if not can_name(diag, self.config.live):
            return  # one rank has no peers; too few steps to call a rank a straggler live
        state, events = update_live(entry.live_stragglers, diag, self.config.live, time.time())
        entry.live_stragglers = state
        for kind, s in events:
            where = {"node": remote[s.rank]} if s.rank in remote else {}
            fields: dict[str, Any] = dict(job=job_id, rank=s.rank, label=s.label, phase=s.phase,
                                          since_step=s.since_step, why=s.why, cause=s.cause,
                                          cause_text=s.cause_text, **where)
            if kind == "started":
                log.warning("straggler_detected", **fields)
            else:
                log.info("straggler_ended", **fields)
            if self.alerts is not None:  # sent only with --notify-stragglers
                self.alerts.straggler(job_id, remote.get(s.rank, entry.watch.node), s.doc(), kind == "started")

    @staticmethod
    def _world(entry: JobEntry) -> int:
        return max((st.last.world_size for st in list(entry.watch.ranks.values())), default=0)

    def _share(self, job_id: str, entry: JobEntry, correlator: Correlator) -> LiveShare:
        share = self.shares.get(job_id)
        if share is None or share.corr is not correlator:
            if share is not None:
                share.close()
            policy = correlator.policy
            share = LiveShare(correlator, lambda offer, remote: self._merge_live(entry, policy, offer, remote))
            with self._shared_lock:
                self.shares[job_id] = share
        return share

    def _merge_live(self, entry: JobEntry, share: CorrelationPolicy, offer: Offer, remote: RemoteRanks
                    ) -> dict[str, Any] | None:
        """On the leader's share thread, never the poll loop's: the live diagnosis over this node's offered ranks
        and the other nodes' (each rank on its own node's clock, ``merge_live``), for the poll loop to take; none
        while no other node shares a rank. Returned as the share the followers show beside their own node's
        (``live_share.diagnosis_share``): the job's diagnosis, published only once it covers another node's ranks
        and as many steps as this node's status needs to show it."""
        if not remote.steps:
            entry.merged = None
            return None
        per_rank, samples = merge_live(offer.history or offer.steps, offer.samples, remote,
                                       share.live_steps_shared, share.live_samples_per_rank)
        diag = self._diagnose(entry, per_rank, samples, remote.steps)
        entry.merged = MergedLive(next(self._merge_seq), diag, dict(remote.nodes), time.monotonic(),
                                  share.live_stale_s + share.live_share_every_s)
        if not can_name(diag, self.config.live):
            return None  # as ``_apply_live``: too few steps to name a straggler live
        return diagnosis_share(diag, remote.nodes, offer.node, share.live_diagnosis_ranks)

    def job_diagnosis(self, job_id: str) -> JobDiagnosis | None:
        """On a follower, the leader's job-wide live diagnosis of ``job_id`` (``LiveShare.job_diagnosis``), shown
        beside this node's own in the state file and metrics, and never read by detection, alerts or kills."""
        share = self.shares.get(job_id)
        return share.job_diagnosis() if share is not None else None

    def _maybe_remove_files(self, job_id: str, entry: JobEntry) -> None:
        keep = self.config.serve.retain_finished_s
        if keep is None or entry.files_removed or entry.retired_at is None:
            return
        if time.monotonic() - entry.retired_at < keep:
            return
        entry.files_removed = True
        entry.watch.drop_gone_ranks()
        removed = entry.watch.remove_finished_files()
        log.info("job_files_removed", job=job_id, entries=removed)

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
        correlator: Correlator | None,
        shared: SharedIncident | None = None,
    ) -> None:
        """Hand the incident to the pipeline; the loop goes on polling. An owner with
        ``incidents_in_flight_per_owner`` incidents in the pipeline waits (the trigger is found again next poll)."""
        owner = entry.watch.owner_uid
        with self._lock:
            busy = self._in_flight.get(owner, 0) >= self.config.serve.incidents_in_flight_per_owner
            if not busy:
                self._in_flight[owner] = self._in_flight.get(owner, 0) + 1
        if busy:
            if job_id not in self._deferred_logged:
                self._deferred_logged.add(job_id)
                log.warning("incident_deferred", job=job_id, owner_uid=owner,
                            why="this user already has the most incidents in flight one user may have")
            return
        self._deferred_logged.discard(job_id)
        with self._shared_lock:
            self._incident_seq += 1
            incident_id = new_incident_id(trigger.kind, self._incident_seq)
        watch = entry.watch
        world = max((st.last.world_size for st in watch.ranks.values()), default=len(views))
        req = IncidentRequest(
            job_id=job_id,
            incident_id=incident_id,
            trigger=trigger,
            views=tuple(views),
            job_dir=watch.dir_path,
            node=watch.node,
            world_size=world,
            incidents_dir=self.incidents_dir(job_id),
            latest_views=lambda: entry.last_views,
            correlator=correlator,
            shared=shared,
            identities=tuple(watch.identities()),
            # this node's own detection, or a claim authenticated by the store secret: may be acted upon
            trusted=shared is None or (correlator is not None and correlator.authenticated),
            notes=tuple(incident_notes(entry.live_stragglers, time.time())),
            prior=prior_verdict(entry.verdicts[-1:], killed=self.config.on_stall == "kill"),
            owner_uid=watch.owner_uid,
        )
        opened = time.time()
        entry.incident = OpenIncident(incident_id, trigger, None, {}, pending=True, opened_unix=opened)
        self._mark_owner(job_id, watch.owner_uid)

        def done(result: IncidentResult) -> None:
            with self._lock:
                self._in_flight[owner] = max(0, self._in_flight.get(owner, 0) - 1)
                entry.incident = OpenIncident(result.incident_id, trigger, result.bundle_path, result.verdict,
                                              notified=result.notified, opened_unix=opened)
                entry.incidents.append(result.incident_id)
                entry.verdicts.append(result.verdict)
                if result.bundle_path is not None:
                    entry.bundles[result.incident_id] = result.bundle_path
            if result.bundle_path is not None:
                self._prune_bundles()

        self.pipeline.submit(req, done)

    def _late_bundle(self, job_id: str, incident_id: str, path: str) -> None:
        log.info("bundle_written_late", job=job_id, incident=incident_id, path=path)
        entry = self.jobs.get(job_id)
        if entry is not None:
            with self._lock:
                entry.bundles[incident_id] = path
                if entry.incident is not None and entry.incident.incident_id == incident_id:
                    entry.incident = dataclasses.replace(entry.incident, bundle_path=path)
        self._prune_bundles()

    def _incident_dirs(self) -> list[str]:
        if self.config.incidents_dir:
            return [self.config.incidents_dir]
        try:
            jobs = os.listdir(self.config.out_dir)
        except OSError:
            return []
        return [os.path.join(self.config.out_dir, j, "incidents") for j in jobs if not j.startswith(".")]

    def _owner_of(self, job_id: str) -> int:
        """The uid whose job ``job_id`` was: from the watch, else from the marker this daemon wrote in the
        job's out dir (root's own dir: never a job-controlled file); -1 when unknown."""
        entry = self.jobs.get(job_id)
        if entry is not None:
            return entry.watch.owner_uid
        try:
            with open(os.path.join(self.config.out_dir, job_id, OWNER_FILE), "rb") as f:
                return int(f.read(16))
        except (OSError, ValueError):
            return -1

    def _mark_owner(self, job_id: str, uid: int) -> None:
        if self.config.incidents_dir:
            return
        job_out = os.path.join(self.config.out_dir, job_id)
        try:
            os.makedirs(job_out, mode=0o700, exist_ok=True)
            atomic_write_in(job_out, OWNER_FILE, str(uid).encode())
        except OSError as exc:
            log.warning("owner_mark_failed", job=job_id, error=str(exc))

    def _prune_bundles(self) -> None:
        """Bundles are kept per job owner (``--keep-incidents`` and a byte budget each): one user's incident
        storm prunes only that user's bundles."""
        serve = self.config.serve
        if serve.keep_incidents is None and serve.keep_incident_bytes is None:
            return
        by_owner: dict[int, list[str]] = {}
        for d in self._incident_dirs():
            job = os.path.basename(os.path.dirname(d))
            by_owner.setdefault(-2 if self.config.incidents_dir else self._owner_of(job), []).append(d)
        for uid, dirs in by_owner.items():
            for path in bundle.prune_bundles(dirs, serve.keep_incidents, serve.keep_incident_bytes):
                log.info("bundle_pruned", path=path, keep=serve.keep_incidents, owner_uid=uid)

    def clean_leftovers(self) -> None:
        """What a daemon killed mid-incident left: half-written bundles and unanswered dump dirs."""
        for d in self._incident_dirs():
            n = bundle.remove_partial_bundles(d)
            if n:
                log.info("partial_bundles_removed", dir=d, count=n)
        # every job dir's stale dumps go at its first look, by the owner's reader in that owner's lane, through
        # dir fds (a symlinked dumps dir is never followed)
        self._clean_dumps = True
        self.discover()

    def killed(self, job_id: str) -> bool:
        """Whether ``--on-stall kill`` signalled this job's ranks."""
        killer = self.pipeline.killer
        return killer is not None and job_id in killer.killed_jobs

    def quiesce(self) -> None:
        """Open no new incident from now on (incidents in flight finish): the job is stopped on purpose."""
        self._quiet = True

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for incidents in flight (``rankwatch run`` before its summary); True when none is left."""
        return self.pipeline.drain(timeout_s)

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

    def poll_stats(self) -> dict[str, float | int]:
        """The latest polls' durations (ms): median, p90, p99 and max — the loop's own cost."""
        times = sorted(list(self.poll_s))
        if not times:
            return {"polls": 0}

        def at(q: float) -> float:
            return round(1e3 * times[min(len(times) - 1, int(q * (len(times) - 1)))], 2)

        return {"polls": len(times), "median_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
                "max_ms": round(1e3 * times[-1], 2)}

    def _resolved(self, job_id: str, why: str, incident_id: str | None = None) -> None:
        """The alerts' resolved notice for this incident (None: every incident of the job that fired)."""
        if self.alerts is None:
            return
        if incident_id is None:
            self.alerts.resolve_job(job_id, why)
        else:
            self.alerts.resolve(job_id, incident_id, why)

    def close(self) -> None:
        for lane in list(self.lanes.values()):
            lane.close()
        self.pipeline.close()
        job = self.config.job_filter
        if job:  # rankwatch run: the job has ended with the run
            self._resolved(job, "job killed by --on-stall kill" if self.killed(job) else "job ended")
        if self.alerts is not None:
            self.alerts.close(self.config.serve.drain_timeout_s)  # what the incidents queued is sent
        for share in list(self.shares.values()):
            share.close()
        for correlator in self.correlators.values():
            correlator.close()
        for entry in self.jobs.values():
            entry.watch.close()
        self.procs.close()
        self.gpu.close()
