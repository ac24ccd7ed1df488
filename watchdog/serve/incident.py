"""One incident as a pipeline of explicit stages, run off the poll loop by a bounded pool of workers.

    open → capture → evidence → decide → finalize → publish → act

Capture (py-spy, responder dumps) takes up to the py-spy timeout, NCCL RAS a second look, and a
cross-node verdict waits for the leader: together tens of seconds. Run inside the poll loop that would
leave every other job on the node unwatched and stop the systemd heartbeat for longer than
``WatchdogSec`` — systemd would kill the daemon in the middle of the incident it exists to report. Here
the loop only hands a request over and keeps polling; the request carries a callable that returns the
loop's newest views of the job, so the pipeline never touches the loop's ``JobWatch`` (not thread-safe).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import structlog

from ..cluster.correlate import Correlator, SharedIncident
from ..core.detect import Trigger
from ..core.document import VerdictDocument
from ..core.evidence_items import EvidenceItem, Line, PipelineFailed
from ..core.facts import PriorVerdict
from ..core.finalize import finalize_verdict, trigger_doc
from ..core.fr_trace import RankTrace
from ..core.policy import CapturePolicy, ServePolicy
from ..core.snapshot import GONE_STATES, RUNNING, STOPPED, RankView
from ..core.stacks import signature, stack_top, waiting_on_peers
from ..core.text import clean_doc
from ..core.verdict import rank_entry
from ..evidence.capture import RankCapture, capture_all, exit_dumps
from ..evidence.flight_recorder import FrFindings, fr_evidence, with_remote
from ..evidence.gpu import GpuWatch
from ..evidence.ras_watch import RasWatch
from ..observe.process import Identity
from ..report import bundle
from ..report.text import verdict_text
from ..verdict import decide
from .act import Killer
from .alerts import Alerter

log = structlog.get_logger("rankwatch.incident")

IncidentCallback = Callable[[dict[str, Any], "str | None"], None]


class CaptureFn(Protocol):
    def __call__(
        self, targets: Sequence[tuple[int, int, bool]], job_dir: str, token: str, policy: CapturePolicy
    ) -> dict[int, RankCapture]: ...


class ExitDumpFn(Protocol):
    def __call__(
        self, gone: Sequence[tuple[int, int]], job_dir: str, policy: CapturePolicy
    ) -> dict[int, RankCapture]: ...


@dataclass(frozen=True)
class IncidentRequest:
    """What the poll loop knows when it opens an incident; everything the pipeline may use of the job."""

    job_id: str
    incident_id: str
    trigger: Trigger
    views: tuple[RankView, ...]  # at detection (GPU readings are kept from here: py-spy pauses ranks)
    job_dir: str
    node: str
    world_size: int
    incidents_dir: str
    latest_views: Callable[[], Sequence[RankView]]  # the loop's newest poll of this job
    correlator: Correlator | None = None
    shared: SharedIncident | None = None  # set when another node opened it
    identities: tuple[Identity, ...] = ()  # the job's verified ranks: all that --on-stall kill may signal
    # False: opened on another node's claim that no store secret authenticates; never acted upon
    trusted: bool = True
    # what the loop saw before the stall (live stragglers), added to the evidence as it stands
    notes: tuple[EvidenceItem, ...] = ()
    prior: PriorVerdict | None = None  # the job's last verdict when rankwatch killed for it (engine.after_kill)
    owner_uid: int = -1  # the job dir's owner: whose share of the alert queues its alerts use


@dataclass
class IncidentResult:
    incident_id: str
    verdict: dict[str, Any]
    bundle_path: str | None
    views: list[RankView] = field(default_factory=list)
    notified: bool = False  # the webhooks were told (a resolved notice is owed when it ends)


@dataclass(frozen=True)
class IncidentEvidence:
    views: list[RankView]
    captures: dict[int, RankCapture]
    fr: FrFindings
    outside: list[EvidenceItem]  # evidence from outside the ranks' views beside the flight recorder's lines


def enrich(views: Sequence[RankView], captures: Mapping[int, RankCapture], policy: CapturePolicy) -> list[RankView]:
    """The views with the stack evidence of their captures."""
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


def _has_trace(cap: RankCapture | None) -> bool:
    return cap is not None and (cap.fr_trace is not None or bool(cap.fr_json))


def ranks_doc(job_id: str, verdict: Mapping[str, Any], views: Sequence[RankView]) -> dict[str, Any]:
    """The bundle's ``ranks.json``: every rank as this node saw it, its job-chosen strings cleaned as the
    verdict's are (``finalize_verdict``)."""
    doc: dict[str, Any] = clean_doc({
        "job_id": job_id,
        "job": verdict.get("job"),
        "ranks": [
            {
                **rank_entry(v).to_json(),
                "rank": v.rank,
                "since_progress_s": round(v.since_progress_s, 3),
                "collective_done": v.coll_done,
                "stack_signature": v.stack_signature,
                "waiting": v.waiting,
            }
            for v in views
        ],
    })
    return doc


T = TypeVar("T")


def admit(queue: list[T], item: T, owner_of: Callable[[T], int], per_owner: int, total: int) -> list[T]:
    """Append ``item`` to ``queue`` within the shares; returns what was pushed out, oldest first. Over its
    owner's share, that owner's own oldest goes (never another user's); over the whole queue (many users at
    once), the oldest of whoever holds the most."""
    queue.append(item)
    lost: list[T] = []
    owner = owner_of(item)
    while sum(1 for q in queue if owner_of(q) == owner) > per_owner:
        lost.append(queue.pop(next(i for i, q in enumerate(queue) if owner_of(q) == owner)))
    while len(queue) > total:
        counts: dict[int, int] = {}
        for q in queue:
            counts[owner_of(q)] = counts.get(owner_of(q), 0) + 1
        top = max(counts, key=lambda uid: counts[uid])
        lost.append(queue.pop(next(i for i, q in enumerate(queue) if owner_of(q) == top)))
    return lost


class IncidentPipeline:
    def __init__(
        self,
        *,
        capture_policy: CapturePolicy,
        serve_policy: ServePolicy,
        gpu: GpuWatch,
        ras: RasWatch,
        killer: Killer | None,
        capture: CaptureFn = capture_all,
        exit_dumps_fn: ExitDumpFn = exit_dumps,
        on_incident: IncidentCallback | None = None,
        alerts: Alerter | None = None,
    ) -> None:
        self.capture_policy = capture_policy
        self.serve_policy = serve_policy
        self.gpu = gpu
        self.ras = ras
        self.killer = killer
        self.capture_fn = capture
        self.exit_dumps_fn = exit_dumps_fn
        self.on_incident = on_incident
        self.alerts = alerts
        # incidents whose --on-incident command waits for the bundle (written on a later try)
        self._command_waits: dict[str, dict[str, Any]] = {}
        self._pool = ThreadPoolExecutor(max_workers=serve_policy.incident_workers, thread_name_prefix="rankwatch-inc")
        self._futures: set[Future[IncidentResult]] = set()
        # bundles that could not be written yet (disk full, read-only): retried until they are
        self._unwritten: list[tuple[IncidentRequest, dict[str, Any], IncidentEvidence]] = []
        self._unwritten_lock = threading.Lock()
        self._retry_at = 0.0
        self._retrying = False
        # (job id, incident id, path) of a bundle written on a later try
        self.on_late_bundle: Callable[[str, str, str], None] | None = None

    # -- scheduling -------------------------------------------------------------------------------
    def submit(self, req: IncidentRequest, done: Callable[[IncidentResult], None]) -> Future[IncidentResult]:
        """Run ``req`` on a worker; ``done`` gets the result (also when a stage failed)."""

        def work() -> IncidentResult:
            try:
                result = self.run(req)
            except Exception as exc:  # a failing stage never stops the daemon, and the incident is kept
                log.exception("incident_failed", job=req.job_id, incident=req.incident_id)
                result = self._fallback(req, exc)
            try:
                done(result)
            except Exception:
                log.exception("incident_done_failed", job=req.job_id, incident=req.incident_id)
            return result

        fut = self._pool.submit(work)
        self._futures.add(fut)
        fut.add_done_callback(self._futures.discard)
        return fut

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for in-flight incidents; True when none is left."""
        pending = set(self._futures)
        if not pending:
            return True
        _, left = wait(pending, timeout=timeout_s)
        return not left

    def close(self) -> None:
        self.drain(self.serve_policy.drain_timeout_s)
        if self.unwritten:
            self._retry()  # one last try; what still fails is in the log (each verdict was logged whole)
        for req, _, _ in self._unwritten:
            log.error("bundle_never_written", job=req.job_id, incident=req.incident_id)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the stages, in order ---------------------------------------------------------------------
    def run(self, req: IncidentRequest) -> IncidentResult:
        shared, incident_id = self.open(req)
        req = dataclasses.replace(req, incident_id=incident_id, shared=shared)
        ev = self.evidence(req, self.capture(req))
        decided, decided_here = self.decide(req, ev)
        # exits that follow rankwatch's own kill are that incident's consequences: no second alert
        notify = decided_here and not decided.follows_incident
        verdict = decided.to_json()  # what every sink gets: the document's JSON
        path = self.publish(req, verdict, ev, notify=notify)
        self.act(req)
        return IncidentResult(incident_id, verdict, path, ev.views, notified=notify and self.alerts is not None)

    def open(self, req: IncidentRequest) -> tuple[SharedIncident | None, str]:
        """Claim the incident for every node (multi-node jobs), so all nodes share one id."""
        shared = req.shared
        if req.correlator is not None and shared is None:
            shared = req.correlator.claim(req.incident_id, trigger_doc(req.trigger))
        incident_id = shared.incident_id if shared is not None else req.incident_id
        log.warning(
            "incident_detected",
            job=req.job_id,
            incident=incident_id,
            trigger=req.trigger.kind,
            ranks=list(req.trigger.ranks),
            reason=req.trigger.reason,
            signalled_by=shared.by_node if shared is not None and req.shared is not None else None,
        )
        return shared, incident_id

    def capture(self, req: IncidentRequest) -> tuple[dict[int, RankCapture], Any, float]:
        """Stacks and dumps of every live local rank, in parallel; NCCL RAS asked before and after."""
        ras_first = self.ras.query()
        t0 = time.monotonic()
        targets = [(v.rank, v.pid, v.state == STOPPED) for v in req.views if v.state in (RUNNING, STOPPED)]
        captures = self.capture_fn(targets, req.job_dir, req.incident_id, self.capture_policy)
        log.info(
            "capture_done",
            job=req.job_id,
            incident=req.incident_id,
            ranks=len(targets),
            stacks=sum(1 for c in captures.values() if c.main_frames()),
            seconds=round(time.monotonic() - t0, 3),
        )
        return captures, ras_first, t0

    def evidence(self, req: IncidentRequest, captured: tuple[dict[int, RankCapture], Any, float]) -> IncidentEvidence:
        """Fresh states with the stacks, the flight-recorder analysis, GPU notes and the RAS recheck."""
        captures, ras_first, t0 = captured
        # states may have moved on during capture (a rank died): take the loop's newest poll, keep the
        # GPU reading of detection time (py-spy pauses ranks during capture)
        fresh = {v.rank: v for v in req.latest_views()}
        vanished = {r for r, c in captures.items() if c.vanished}
        settle_by = time.monotonic() + self.capture_policy.vanished_settle_s
        while any(fresh[r].alive for r in vanished if r in fresh) and time.monotonic() < settle_by:
            time.sleep(0.05)  # the loop's next poll sees the death (the views are in memory: no I/O here)
            fresh = {v.rank: v for v in req.latest_views()}
        merged = [
            dataclasses.replace(fresh[v.rank], gpu_util=v.gpu_util, gpu_missing=v.gpu_missing) if v.rank in fresh else v
            for v in req.views
        ]
        captures = self._with_exit_dumps(req, merged, captures)
        views = enrich(merged, captures, self.capture_policy)
        fr = fr_evidence(captures)
        outside: list[EvidenceItem] = [*req.notes, *self.gpu.device_notes()]
        if ras_first is not None:
            time.sleep(max(0.0, self.capture_policy.ras_recheck_s - (time.monotonic() - t0)))
            outside += self.ras.evidence(ras_first, self.ras.query())
        return IncidentEvidence(views, captures, fr, outside)

    def _with_exit_dumps(
        self, req: IncidentRequest, views: Sequence[RankView], captures: dict[int, RankCapture]
    ) -> dict[int, RankCapture]:
        """The captures with the flight recorder each gone rank wrote as it ended (``hooks.exit_dump``), where
        none was captured: a mismatch often ends the whole job before the first capture, and what each rank
        issued is then told only by these. A rank's capture keeps its stacks; the dump adds the trace."""
        gone = [(v.rank, v.pid) for v in views if v.state in GONE_STATES and v.pid > 0
                and not _has_trace(captures.get(v.rank))]
        if not gone:
            return captures
        out = dict(captures)
        for rank, dumped in self.exit_dumps_fn(gone, req.job_dir, self.capture_policy).items():
            had = out.get(rank)
            out[rank] = dumped if had is None else dataclasses.replace(
                had, fr_trace=dumped.fr_trace, notes=[*had.notes, *dumped.notes])
        return out

    def decide(self, req: IncidentRequest, ev: IncidentEvidence) -> tuple[VerdictDocument, bool]:
        """The verdict over this node's evidence, or over every node's through the leader; and whether this
        node decided it (the webhooks hear of a multi-node incident once, from the node that decided)."""

        def decide_over(
            all_views: Sequence[RankView],
            notes: Sequence[EvidenceItem],
            correlation: str | None,
            remote_fr: Mapping[int, RankTrace],
        ) -> VerdictDocument:
            fr = with_remote(ev.fr, remote_fr)
            verdict = decide(
                all_views,
                job_id=req.job_id,
                incident_id=req.incident_id,
                detected_after_s=req.trigger.detected_after_s,
                extra_evidence=[*(Line(x) for x in fr.lines), *notes, *ev.outside],
                fr_facts=fr.facts,
                prior=req.prior,
                killed=req.prior.ranks if req.prior is not None else (),
            ).document()
            return finalize_verdict(verdict, trigger=req.trigger, correlation=correlation, local_views=ev.views)

        if req.correlator is None or req.shared is None:
            return decide_over(ev.views, [], None, {}), True
        leader, how, source = correlate_and_decide(
            req.correlator, req.shared, ev.views, req.node, req.world_size, decide_over,
            stall_timeout_s=req.trigger.timeout_s, local_fr=ev.fr.traces,
        )
        log.info("correlated", job=req.job_id, incident=req.incident_id, how=how, verdict=source)
        if source == DECIDED_HERE:
            return leader, True
        if source == CONFIRMED:
            log.info("remote_verdict_confirmed_locally", job=req.job_id, incident=req.incident_id,
                     initiating_ranks=list(leader.initiating_ranks[:16]))
        # the leader's verdict, completed with this node's trigger and ranks
        return finalize_verdict(
            leader, trigger=req.trigger, correlation=leader.correlation or how,
            local_views=ev.views,
        ), False

    def publish(
        self, req: IncidentRequest, verdict: dict[str, Any], ev: IncidentEvidence, *, notify: bool = True
    ) -> str | None:
        """Bundle (or a place in the retry queue), log line with the whole verdict's gist, callback, alerts
        (the webhooks now; the command once the bundle exists, on this node: it holds this node's stacks)."""
        path = self._write_bundle(req, verdict, ev)
        if path is None:
            self._keep_unwritten(req, verdict, ev)
        if self.alerts is not None:
            if path is None:
                with self._unwritten_lock:
                    self._command_waits[req.incident_id] = verdict
            self.alerts.submit(verdict, path, notify=notify, command=path is not None, owner=req.owner_uid)
        log.warning(
            "verdict",
            job=req.job_id,
            incident=req.incident_id,
            kind=verdict["kind"],
            initiating_ranks=verdict["initiating_ranks"],
            phase=verdict["phase"],
            confidence=verdict["confidence"],
            reason=verdict["reason"],
            bundle=path,
            # without a bundle the log is the only record until a retry succeeds: keep the evidence here too
            **({"evidence": verdict.get("evidence", [])[:40]} if path is None else {}),
        )
        if self.on_incident is not None:
            try:
                self.on_incident(verdict, path)
            except Exception:
                log.exception("incident_callback_failed", job=req.job_id)
        return path

    def act(self, req: IncidentRequest) -> None:
        """Only with ``--on-stall kill`` (a killer is configured), only on verified ranks, and never for an
        incident opened on another node's unauthenticated claim (anyone reaching the store could forge it)."""
        if self.killer is None or not req.identities:
            return
        if not req.trusted:
            log.warning(
                "kill_refused",
                job=req.job_id,
                incident=req.incident_id,
                reason="opened on another node's claim that no store secret authenticates "
                "(--store-secret-file); only this node's own detection may kill its ranks",
            )
            return
        self.killer.kill_job(req.job_id, req.identities)

    # -- bundles that could not be written ----------------------------------------------------------
    def _keep_unwritten(self, req: IncidentRequest, verdict: dict[str, Any], ev: IncidentEvidence) -> None:
        with self._unwritten_lock:
            policy = self.serve_policy
            for lost, _, _ in admit(self._unwritten, (req, verdict, ev), lambda item: item[0].owner_uid,
                                    policy.max_unwritten_bundles_per_owner, policy.max_unwritten_bundles):
                log.error("bundle_abandoned", job=lost.job_id, incident=lost.incident_id, owner_uid=lost.owner_uid,
                          why="retry queue full (this user's share, or the whole queue)")
            self._retry_at = time.monotonic() + self.serve_policy.bundle_retry_every_s

    @property
    def unwritten(self) -> int:
        with self._unwritten_lock:
            return len(self._unwritten)

    def retry_unwritten(self) -> None:
        """Called every poll: hands a retry of the waiting bundles to a worker when it is time."""
        with self._unwritten_lock:
            if not self._unwritten or self._retrying or time.monotonic() < self._retry_at:
                return
            self._retrying = True
        self._pool.submit(self._retry)

    def _retry(self) -> None:
        try:
            with self._unwritten_lock:
                waiting, self._unwritten = self._unwritten, []
            still = []
            for req, verdict, ev in waiting:
                path = self._write_bundle(req, verdict, ev, attempts=1)
                if path is None:
                    still.append((req, verdict, ev))
                    continue
                with self._unwritten_lock:
                    waiting_verdict = self._command_waits.pop(req.incident_id, None)
                if self.alerts is not None and waiting_verdict is not None:
                    self.alerts.submit(waiting_verdict, path, notify=False, command=True, owner=req.owner_uid)
                if self.on_late_bundle is not None:
                    try:
                        self.on_late_bundle(req.job_id, req.incident_id, path)
                    except Exception:
                        log.exception("late_bundle_callback_failed", job=req.job_id)
            with self._unwritten_lock:
                self._unwritten[:0] = still
                self._retry_at = time.monotonic() + self.serve_policy.bundle_retry_every_s
        finally:
            with self._unwritten_lock:
                self._retrying = False

    # -- helpers ----------------------------------------------------------------------------------
    def _write_bundle(
        self, req: IncidentRequest, verdict: dict[str, Any], ev: IncidentEvidence, attempts: int | None = None
    ) -> str | None:
        policy = self.serve_policy
        for attempt in range(attempts or policy.bundle_attempts):
            try:
                path = bundle.write_bundle(
                    req.incidents_dir,
                    req.incident_id,
                    verdict,
                    verdict_text(verdict),
                    ranks_doc(req.job_id, verdict, ev.views),
                    ev.views,
                    ev.captures,
                )
                log.info("bundle_written", job=req.job_id, incident=req.incident_id, path=path)
                return path
            except OSError as exc:
                log.error(
                    "bundle_write_failed", job=req.job_id, incident=req.incident_id, error=str(exc), attempt=attempt
                )
                if attempts is None:
                    time.sleep(policy.bundle_retry_s)
        return None

    def _fallback(self, req: IncidentRequest, exc: Exception) -> IncidentResult:
        """A stage raised: the incident is still decided over the detection-time views and published."""
        decided = decide(
            req.views,
            job_id=req.job_id,
            incident_id=req.incident_id,
            detected_after_s=req.trigger.detected_after_s,
            extra_evidence=[PipelineFailed(type(exc).__name__, str(exc)[:300])],
        ).document()
        verdict = finalize_verdict(decided, trigger=req.trigger, correlation=None, local_views=req.views).to_json()
        path = None
        try:
            path = self.publish(req, verdict, IncidentEvidence(list(req.views), {}, FrFindings((), None, ()), []))
        except Exception:
            log.exception("incident_publish_failed", job=req.job_id, incident=req.incident_id)
        return IncidentResult(req.incident_id, verdict, path, list(req.views), notified=self.alerts is not None)


DECIDED_HERE, LEADER, CONFIRMED = "here", "leader", "confirmed"
# (views, the exchange's evidence items, how the nodes agreed, the other nodes' flight-recorder traces)
DecideOver = Callable[[Sequence[RankView], Sequence[EvidenceItem], "str | None", Mapping[int, RankTrace]],
                      VerdictDocument]


def correlate_and_decide(
    correlator: Correlator, shared: SharedIncident, views: list[RankView], node: str, world: int,
    decide_over: DecideOver,
    **resolve_kw: Any,
) -> tuple[VerdictDocument, str, str]:
    """The pipeline's decide step over several nodes: exchange evidence, decide where this node must
    (``decide_over(views, notes, how, remote_fr)``), publish as the leader. (verdict, how, whose: this
    node's ``DECIDED_HERE``, the ``LEADER``'s, or a refused leader's verdict this node ``CONFIRMED``: a
    rank that ran on past its peers and then blocked looked healthy a moment ago, and this node's own
    evidence names the same ranks — the nodes agree, on the leader's verdict)."""
    res = correlator.resolve(shared, views, node, world, **resolve_kw)
    if res.verdict is not None:
        return res.verdict, res.how, LEADER
    verdict = decide_over(res.views, res.notes, res.how, res.remote_fr)
    if res.exchange is not None:  # what this node held of every node's evidence, authenticated or not
        verdict = dataclasses.replace(verdict, exchange=res.exchange)
    if res.refused is not None and confirms_refused(verdict, res.refused):
        return res.refused, res.how, CONFIRMED
    if res.publish:
        correlator.publish_verdict(shared, verdict)
    return verdict, res.how, DECIDED_HERE


def confirms_refused(local: VerdictDocument, refused: VerdictDocument) -> bool:
    """This node's own verdict names exactly the (non-empty) initiating ranks of the leader's verdict it
    refused: then adopting the leader's blames no rank this node would not, and the nodes write one verdict
    (a rank that ran on past its peers and then blocked looks "progressing" for a moment)."""
    mine = sorted(local.initiating_ranks)
    return bool(mine) and mine == sorted(refused.initiating_ranks)
