"""Prometheus metrics for the daemon: a collector that reads the daemon's state at scrape time.

Every scrape builds fresh metric families from ``daemon.jobs``, so the values are never older than the
last poll; the only thing the poll path keeps for metrics is the step and phase histograms
(``JobWatch.step_stats``, a few bucket increments per step read), since a histogram must count every
step and a scrape only sees the recent ones. The poll loop runs in another thread; everything read here
is either replaced wholesale by it (views, the incident, the straggler diagnosis, live stragglers) or copied
in one C-level call (dicts, step deques, bucket counts), so a scrape never sees a half-updated structure.
Scrape cost is bounded: at most ``WINDOW_STEPS`` steps per rank are read, and nothing is diagnosed here: the
straggler diagnosis is the job's one (``JobEntry.straggler``, computed by the poll loop, the one the live
stragglers, their alerts and ``status`` read).

``prometheus_client`` is imported where a registry is built or a scrape rendered, not at this module's top:
the CLI imports this module with the rest of its command, and a watchdog that serves no metrics (the default)
stays without it (~3 MB of RSS, ~25 ms of start-up; ``benchmarks/bench_footprint.py``).

Names follow Prometheus conventions: base units (seconds), ``_total`` on counters, and labels
``job_id``/``rank``/``phase``. Label values are bounded: ranks and declared phases (at most 16 per
rank record), states from a fixed set.

Series budget: at most ``SERIES_PER_RANK_BUDGET`` series per rank by default (a 1,024-node job is then
~0.5 M series, what dcgm-exporter costs for the same GPUs), counted by ``benchmarks/bench_series.py``: the
step histogram is always there, the per-phase histograms (21 series per phase) only with
``--metrics-histograms``. ``rankwatch_rank_info`` carries the labels that join dcgm-exporter's series
(``Hostname``, ``gpu``, ``UUID``, ``pod``, ``namespace``, ``local_rank``), once per rank, so no other series
pays for them.

Who sees what (``Exposure``): per-job series name jobs, ranks, pids and phases of every user on the node.
``detail="aggregate"`` (the daemon's default) serves only node totals; ``detail="jobs"`` (``rankwatch
run``: one user's own job) everything; with a token file, a scrape that presents the token as
``Authorization: Bearer`` gets everything whatever the detail level.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import structlog

from ..core.snapshot import CRASHED, DEAD, EXITED, RUNNING, STOPPED, UNKNOWN, ZOMBIE
from ..core.steps import StepTiming
from ..core.straggler import StragglerPolicy
from ..core.straggler_live import LiveStragglerPolicy, reported
from ..errors import UserError
from .daemon import Daemon, JobEntry
from .http_endpoint import BoundedHttpServer, EndpointPolicy, Request, Response, error_response

if TYPE_CHECKING:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry

log = structlog.get_logger("rankwatch.metrics")

# Steps per rank that per-rank medians look at: the straggler policy's own window, as the end-of-run
# summary's per-rank figures.
WINDOW_STEPS = StragglerPolicy().window_steps
# Steps the exported straggler diagnosis covers: the daemon's live diagnosis (``JobEntry.straggler``).
DIAGNOSIS_STEPS = LiveStragglerPolicy().window_steps
RANK_STATES = (RUNNING, STOPPED, DEAD, CRASHED, ZOMBIE, EXITED, UNKNOWN)
# default series per rank must stay at or below this (tests/unit/serve/test_metrics.py, benchmarks/bench_series.py)
SERIES_PER_RANK_BUDGET = 60
DETAIL_LEVELS = ("aggregate", "jobs")


def _recent(steps: Iterable[StepTiming], n: int) -> list[StepTiming]:
    """The last ``n`` steps, copied in one call (a deque being appended to by the poll thread would
    make a Python-level loop fail with 'mutated during iteration')."""
    for _ in range(3):
        try:
            return list(steps)[-n:]
        except RuntimeError:
            continue
    return []


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _window(steps: list[StepTiming]) -> list[StepTiming]:
    """Step 0 carries start-up costs (imports, warm-up); leave it out once later steps exist."""
    later = [t for t in steps if t.step > 0]
    return (later or steps)[-WINDOW_STEPS:]


_Families: TypeAlias = "dict[str, GaugeMetricFamily | CounterMetricFamily]"
_Histograms: TypeAlias = "dict[str, HistogramMetricFamily]"


# key, kind, metric name (counters without "_total": the client adds it), labels, help
_J, _R = ("job_id",), ("job_id", "rank")
_SPEC: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("jobs", "gauge", "rankwatch_jobs", (),
     "Jobs this daemon watches (not yet retired)"),
    ("polls", "counter", "rankwatch_daemon_polls", (),
     "Poll cycles the daemon has completed"),
    ("errors", "counter", "rankwatch_metrics_collect_errors", (),
     "Jobs skipped in a scrape: reading them failed"),
    ("stalled", "gauge", "rankwatch_stalled", _J,
     "1 while the job has an open incident"),
    ("incidents", "counter", "rankwatch_incidents", _J,
     "Incidents opened for the job"),
    ("initiator", "gauge", "rankwatch_incident_initiator", (*_R, "kind", "phase"),
     "1 for each rank the open incident's verdict names"),
    ("longest", "gauge", "rankwatch_longest_step_seconds", _J,
     "Longest completed step (sets the auto stall timeout)"),
    ("timeout", "gauge", "rankwatch_stall_timeout_seconds", _J,
     "No progress for this long is a stall (the job's current stall timeout)"),
    # node totals: what every local user may see (served at every detail level)
    ("open", "gauge", "rankwatch_open_incidents", (),
     "Jobs on this node with an open incident"),
    ("node_incidents", "counter", "rankwatch_node_incidents", (),
     "Incidents opened on this node, over the jobs it watches now"),
    ("ranks", "gauge", "rankwatch_ranks", ("state",),
     "Ranks on this node in each process state"),
    ("node_stragglers", "gauge", "rankwatch_live_stragglers", (),
     "Live stragglers on this node"),
    ("poll_age", "gauge", "rankwatch_last_poll_age_seconds", (),
     "Time since the poll loop last completed a poll (a wedged loop still answers scrapes)"),
    ("owner_age", "gauge", "rankwatch_owner_last_look_age_seconds", ("uid",),
     "Per job owner (uid): time since that owner's jobs were last completely polled, in that owner's own lane "
     "(about one poll interval while it keeps up; the laggiest owners only, FairnessPolicy.owner_series)"),
    ("owner_lagging", "gauge", "rankwatch_owner_lagging", ("uid",),
     "1 while that owner's round has run past the loop's wait (a stopped reader, a flood of their own): "
     "their jobs keep their last state, nobody else waits for them"),
    ("owners_lagging", "gauge", "rankwatch_owners_lagging", (),
     "Job owners whose round runs past the loop's wait, all of them (beyond the per-owner series too)"),
    ("diagnosis", "gauge", "rankwatch_diagnosis", (*_J, "label", "phase"),
     f"1 for the job's straggler diagnosis over its last {DIAGNOSIS_STEPS} common steps (the live one)"),
    ("straggler", "gauge", "rankwatch_straggler", (*_R, "phase", "label", "cause"),
     "1 for each rank the current straggler diagnosis names; cause: why (cpu_contention, cpu_throttled, "
     "memory_pressure, io_pressure, own_work; empty when not measured)"),
    ("cause", "gauge", "rankwatch_straggler_cause", (*_R, "cause", "node"),
     "1 for the rank the current diagnosis's cause names (a straggler's, or on a communication-bound job the rank "
     "whose network path is slow); node: the other node it runs on when the leader's diagnosis compared the "
     "ranks other nodes share (empty: this node's rank)"),
    # a follower's copy of the leader's job-wide live diagnosis (``cluster.live_share``), beside its own node's above:
    # families of their own, so the ones above keep one meaning per node and a dashboard over every node counts
    # the leader's straggler once; served only by a follower while the leader shares one
    ("leader_diagnosis", "gauge", "rankwatch_leader_diagnosis", (*_J, "label", "phase", "leader", "authenticated"),
     "On a follower node, 1 for the leader's job-wide live straggler diagnosis over every node's ranks (leader: the "
     "leader node's name; authenticated: false when the store has no secret and anyone who reaches it could have "
     "written it)"),
    ("leader_straggler", "gauge", "rankwatch_leader_straggler", (*_R, "phase", "label", "cause", "node"),
     "On a follower node, 1 for each rank the leader's job-wide diagnosis names; node: the node it runs on"),
    ("leader_cause", "gauge", "rankwatch_leader_straggler_cause", (*_R, "cause", "node"),
     "On a follower node, 1 for the rank the leader's job-wide diagnosis's cause names; node: the node it runs on"),
    ("live", "gauge", "rankwatch_live_straggler", (*_R, "phase", "label"),
     "1 for each rank the live diagnosis has named on consecutive looks at the recent steps"),
    ("live_since", "gauge", "rankwatch_live_straggler_since_timestamp_seconds", (*_R, "phase", "label"),
     "Unix time a live straggler was first seen"),
    ("info", "gauge", "rankwatch_rank_info",
     (*_R, "node", "local_rank", "Hostname", "gpu", "UUID", "pod", "namespace"),
     "Identity of a rank, with the labels that join dcgm-exporter (gpu/UUID: NVML's, empty when unknown; "
     "no pid label: a restarted rank keeps its series)"),
    ("pid", "gauge", "rankwatch_rank_pid", _R,
     "Process id of the rank's process"),
    ("up", "gauge", "rankwatch_rank_up", _R,
     "1 while the rank's process exists (running or stopped)"),
    ("state", "gauge", "rankwatch_rank_state", (*_R, "state"),
     "1 for the rank's process state, 0 for the others"),
    ("phase_now", "gauge", "rankwatch_rank_phase", (*_R, "phase"),
     "1 for the phase the rank is in now, 0 for its other phases"),
    ("in_phase", "gauge", "rankwatch_rank_in_phase_seconds", _R,
     "Time in the current phase"),
    ("since", "gauge", "rankwatch_rank_seconds_since_progress", _R,
     "Time since the rank's last phase transition"),
    ("steps", "counter", "rankwatch_rank_steps", _R,
     "Steps the rank has completed"),
    ("coll_entered", "counter", "rankwatch_rank_collectives_entered", _R,
     "Collectives the rank has entered"),
    ("coll_done", "counter", "rankwatch_rank_collectives_completed", _R,
     "Collectives the rank has completed"),
    ("last", "gauge", "rankwatch_last_step_duration_seconds", _R,
     "Duration of the rank's last completed step"),
    ("med", "gauge", "rankwatch_step_duration_median_seconds", _R,
     f"Median step duration over the rank's last {WINDOW_STEPS} steps"),
    ("phase_med", "gauge", "rankwatch_phase_duration_median_seconds", (*_R, "phase"),
     f"Median time per step in each phase over the rank's last {WINDOW_STEPS} steps"),
)
# histograms, cumulative over every step the daemon read (core.histogram)
_HIST_SPEC: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("step_hist", "rankwatch_step_duration_seconds", _R,
     "Duration of every step the daemon read"),
    ("phase_hist", "rankwatch_phase_duration_seconds", (*_R, "phase"),
     "Time per step in each phase, over every step that spent time in it"),
)
# the families every scraper sees (no job, rank or pid in them)
NODE_TOTALS = frozenset({"jobs", "polls", "errors", "open", "node_incidents", "ranks", "node_stragglers", "poll_age",
                         "owner_age", "owner_lagging", "owners_lagging"})
METRIC_NAMES = tuple(name + ("_total" if kind == "counter" else "") for _, kind, name, _, _ in _SPEC) + tuple(
    name + "_count" for _, name, _, _ in _HIST_SPEC
)


def _families() -> _Families:
    """Fresh, empty metric families for one scrape."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: _Families = {}
    for key, kind, name, labels, doc in _SPEC:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        out[key] = cls(name, doc, labels=list(labels))
    return out


class DaemonCollector:
    """Builds every rankwatch metric family from the daemon's current state, on each scrape (a collector as
    ``prometheus_client``'s registry takes one: ``describe`` and ``collect``)."""

    def __init__(self, daemon: Daemon, *, jobs: bool = True, histograms: bool = False) -> None:
        self.daemon = daemon
        self.jobs = jobs  # per-job series (False: node totals only)
        self.histograms = histograms  # per-phase histograms (opt-in: 21 series per rank and phase)
        self._lock = threading.Lock()  # concurrent scrapes share the error count
        self._errors = 0

    def describe(self) -> Iterable[Metric]:
        # no fixed description: registering must not scrape a daemon that has not polled yet
        return []

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return list(self._collect())

    def _collect(self) -> Iterator[Metric]:
        from prometheus_client.core import HistogramMetricFamily

        m = _families()
        hists: _Histograms = {key: HistogramMetricFamily(name, doc, labels=list(labels))
                              for key, name, labels, doc in _HIST_SPEC}
        m["polls"].add_metric([], float(self.daemon.polls))
        last = self.daemon.last_poll_ns
        if last is not None:
            m["poll_age"].add_metric([], (time.monotonic_ns() - last) / 1e9)
        lags = self.daemon.owner_lags()
        m["owners_lagging"].add_metric([], sum(1 for lag in lags.values() if lag["lagging"]))
        worst = sorted(lags.items(), key=lambda kv: -float(kv[1]["age_s"]))[: self.daemon.config.fairness.owner_series]
        for uid, lag in worst:
            m["owner_age"].add_metric([str(uid)], float(lag["age_s"]))
            m["owner_lagging"].add_metric([str(uid)], 1.0 if lag["lagging"] else 0.0)
        n_jobs = n_open = n_incidents = n_live = 0
        states = dict.fromkeys(RANK_STATES, 0)
        for job_id, entry in list(self.daemon.jobs.items()):
            if entry.watch.retired:
                continue
            n_jobs += 1
            n_open += entry.incident is not None
            n_incidents += len(entry.incidents)
            n_live += len(reported(entry.live_stragglers))
            for view in entry.last_views:
                states[view.state if view.state in states else UNKNOWN] += 1
            if not self.jobs:
                continue
            try:
                self._job(job_id, entry, m, hists)
            except Exception:  # one unreadable job never fails the scrape
                self._errors += 1
                log.exception("metrics_job_failed", job=job_id)
        m["jobs"].add_metric([], n_jobs)
        m["open"].add_metric([], n_open)
        m["node_incidents"].add_metric([], float(n_incidents))
        m["node_stragglers"].add_metric([], n_live)
        for state, n in states.items():
            m["ranks"].add_metric([state], n)
        m["errors"].add_metric([], float(self._errors))
        if not self.jobs:  # node totals only: not even the names of per-job families
            yield from (fam for key, fam in m.items() if key in NODE_TOTALS)
            return
        yield from m.values()
        yield from hists.values()

    def _job(self, job_id: str, entry: JobEntry, m: _Families, hists: _Histograms) -> None:
        watch = entry.watch
        open_incident = entry.incident
        m["stalled"].add_metric([job_id], 1.0 if open_incident is not None else 0.0)
        m["incidents"].add_metric([job_id], float(len(entry.incidents)))
        m["longest"].add_metric([job_id], watch.longest_step_s)
        m["timeout"].add_metric([job_id], self.daemon.config.stall.timeout_for(watch.longest_step_s))
        if open_incident is not None:
            v = open_incident.verdict
            for r in v.get("initiating_ranks") or []:
                kind, phase = str(v.get("kind")), str(v.get("phase") or "")
                m["initiator"].add_metric([job_id, str(r), kind, phase], 1.0)

        rank_states = dict(list(watch.ranks.items()))
        devices = _rank_devices(self.daemon)
        place = _placement()
        for view in entry.last_views:
            labels = [job_id, str(view.rank)]
            rs = rank_states.get(view.rank)
            local = getattr(rs.last, "local_rank", None) if rs is not None else None
            gpu, uuid = devices.get(view.pid, ("", ""))
            m["info"].add_metric([*labels, view.node, "" if local is None else str(local), place.hostname, gpu,
                                  uuid, view.node if place.pods else "", place.namespace], 1.0)
            m["pid"].add_metric(labels, float(view.pid))
            m["up"].add_metric(labels, 1.0 if view.alive else 0.0)
            for s in RANK_STATES:
                m["state"].add_metric([*labels, s], 1.0 if view.state == s else 0.0)
            names = list(rs.last.phase_names) if rs is not None else []
            if view.phase and view.phase not in names:
                names.append(view.phase)
            for p in names:
                m["phase_now"].add_metric([*labels, p], 1.0 if view.phase == p else 0.0)
            m["in_phase"].add_metric(labels, view.in_phase_s)
            m["since"].add_metric(labels, view.since_progress_s)
            m["steps"].add_metric(labels, float(view.step))
            m["coll_entered"].add_metric(labels, float(view.coll_seq))
            m["coll_done"].add_metric(labels, float(view.coll_done))

        for rank, rank_hists in list(watch.step_stats.items()):
            labels = [job_id, str(rank)]
            buckets, total = rank_hists.step.cumulative()
            hists["step_hist"].add_metric(labels, buckets, total)
            for p, h in sorted(list(rank_hists.phases.items())) if self.histograms else []:
                buckets, total = h.cumulative()
                hists["phase_hist"].add_metric([*labels, p], buckets, total)
        for live in reported(entry.live_stragglers):
            labels = [job_id, str(live.rank), live.phase, live.label]
            m["live"].add_metric(labels, 1.0)
            m["live_since"].add_metric(labels, live.since_unix)

        for rank, ring in list(watch.history.items()):
            recent = _recent(ring, WINDOW_STEPS + 1)  # step 0 left out, still a whole window
            if not recent:
                continue
            labels = [job_id, str(rank)]
            window = _window(recent)
            m["last"].add_metric(labels, recent[-1].duration_ms / 1e3)
            m["med"].add_metric(labels, _median([t.duration_ms for t in window]) / 1e3)
            for p in sorted({p for t in window for p in t.phases_ms}):
                per_step = [t.phases_ms.get(p, 0.0) for t in window]
                m["phase_med"].add_metric([*labels, p], _median(per_step) / 1e3)
        diag, remote = entry.straggler, entry.straggler_remote  # the poll loop's: it replaces both wholesale
        if diag is not None:
            m["diagnosis"].add_metric([job_id, diag.label, diag.phase or ""], 1.0)
            for r in diag.straggler_ranks:
                cause = str((diag.cause or {}).get("cause") or "")
                m["straggler"].add_metric([job_id, str(r), diag.phase or "", diag.label, cause], 1.0)
            named, cause_rank = (diag.cause or {}).get("cause"), (diag.cause or {}).get("rank")
            if isinstance(named, str) and isinstance(cause_rank, int):
                m["cause"].add_metric([job_id, str(cause_rank), named, remote.get(cause_rank, "")], 1.0)
        job = self.daemon.job_diagnosis(job_id)  # the share thread replaces it wholesale
        if job is not None:
            m["leader_diagnosis"].add_metric([job_id, job.label, job.phase or "", job.leader,
                                              "true" if job.authenticated else "false"], 1.0)
            for r in job.straggler_ranks:
                m["leader_straggler"].add_metric([job_id, str(r), job.phase or "", job.label, job.cause or "",
                                                  job.nodes.get(r, "")], 1.0)
            if job.cause is not None and job.cause_rank is not None:
                m["leader_cause"].add_metric([job_id, str(job.cause_rank), job.cause,
                                              job.nodes.get(job.cause_rank, "")], 1.0)


@dataclass(frozen=True)
class Placement:
    """Where this daemon runs, for the labels dcgm-exporter's series carry: its ``Hostname`` label is the
    node name (``NODE_NAME`` from the downward API in Kubernetes, as dcgm-exporter reads it), and in
    Kubernetes a rank's hostname is its pod's name."""

    hostname: str
    pods: bool  # rank hostnames are pod names (the daemon runs in Kubernetes)
    namespace: str  # RANKWATCH_POD_NAMESPACE: the training pods' namespace, where one is set


def _placement(env: Mapping[str, str] | None = None) -> Placement:
    env = os.environ if env is None else env
    return Placement(
        hostname=env.get("NODE_NAME") or socket.gethostname(),
        pods=bool(env.get("KUBERNETES_SERVICE_HOST")),
        namespace=env.get("RANKWATCH_POD_NAMESPACE", ""),
    )


def _rank_devices(daemon: Daemon) -> dict[int, tuple[str, str]]:
    """pid -> (NVML GPU index, UUID) of the one device it uses, where NVML said so; nothing without it."""
    try:
        return daemon.gpu.pid_devices()
    except Exception:  # an older or failing probe: the labels stay empty
        return {}


@dataclass(frozen=True)
class Exposure:
    """What a scrape may see: ``detail`` for everyone, everything for a bearer of the token (if any)."""

    detail: str = "jobs"
    token: bytes | None = None

    def per_job(self, authorization: str | None) -> bool:
        if self.detail == "jobs":
            return True
        if self.token is None or not authorization or not authorization.startswith("Bearer "):
            return False
        return hmac.compare_digest(authorization[len("Bearer "):].strip().encode(), self.token)


def read_token(path: str) -> bytes:
    """The metrics token: a file only its owner can read (mode 0600/0400), one line, not empty."""
    try:
        # no O_NOFOLLOW: the operator names this path, and a Kubernetes secret volume's files are symlinks
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(4097)
    except OSError as exc:
        raise UserError(f"--metrics-token-file {path}: {exc.strerror or exc}") from None
    if st.st_mode & 0o077:
        raise UserError(f"--metrics-token-file {path} is readable by others (chmod 600 it)")
    token = raw.strip()
    if not token or len(raw) > 4096 or b"\n" in token:
        raise UserError(f"--metrics-token-file {path} must hold one line (the token), at most 4 KiB")
    return token


def health(daemon: Daemon, now_ns: int | None = None) -> tuple[bool, dict[str, Any]]:
    """Whether the poll loop made progress recently (``/healthz``, a Kubernetes liveness probe): a daemon
    whose loop is wedged still answers HTTP from this thread, so "the port answers" proves nothing."""
    policy = daemon.config.serve
    limit_s = max(policy.health_max_poll_age_s, policy.health_max_poll_intervals * daemon.config.poll_interval_s)
    last = daemon.last_poll_ns
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    age_s = None if last is None else round((now_ns - last) / 1e9, 3)
    ok = age_s is not None and age_s <= limit_s
    status = "ok" if ok else "starting" if last is None else "stale"
    lags = daemon.owner_lags()
    # the loop decides; owners that lag are said, never counted against it (one user's stopped reader
    # must not have systemd restart the daemon everyone relies on)
    return ok, {"status": status, "polls": daemon.polls, "last_poll_age_s": age_s,
                "limit_s": limit_s, "owners": len(lags),
                "owners_lagging": sorted(uid for uid, lag in lags.items() if lag["lagging"])}


@dataclass(frozen=True)
class _Routes:
    """What the metrics port answers: ``/healthz`` at once (on the server's loop, so a wedged render never
    hides the daemon's health), ``/metrics`` (and ``/``) rendered off the loop, anything else 404."""

    registry: CollectorRegistry  # every series
    aggregate: CollectorRegistry  # node totals only
    exposure: Exposure
    daemon: Daemon

    def __call__(self, request: Request) -> Response | Callable[[], Response]:
        path = request.target.split("?", 1)[0]
        if path == "/healthz":
            ok, doc = health(self.daemon)
            return Response(200 if ok else 503, (("Content-Type", "application/json"),),
                            (json.dumps(doc) + "\n").encode())
        if path not in ("/", "/metrics"):
            return error_response(404, "try /metrics or /healthz")
        accept = request.headers.get("Accept", "")
        full = self.exposure.per_job(request.headers.get("Authorization"))
        return lambda: self._scrape(accept, full)

    def _scrape(self, accept: str, full: bool) -> Response:
        from prometheus_client.exposition import choose_encoder

        try:
            encoder, content_type = choose_encoder(accept)
            body = encoder(self.registry if full else self.aggregate)
        except Exception:
            log.exception("metrics_scrape_failed")
            return error_response(500, "scrape failed; see the daemon log")
        return Response(200, (("Content-Type", content_type),), body)


@dataclass
class MetricsServer:
    """A running metrics endpoint; ``close()`` stops it and frees the port."""

    server: BoundedHttpServer
    registry: CollectorRegistry
    addr: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.close()


class MetricsUnavailable(Exception):
    """No port of those tried could be bound (taken, refused, or the address does not resolve here): the
    caller runs on without metrics and says so in one warning line, never failing the job for it."""


def serve_metrics(
    daemon: Daemon,
    addr: str,
    port: int,
    *,
    histograms: bool = False,
    exposure: Exposure | None = None,
    tries: int = 1,
    policy: EndpointPolicy | None = None,
) -> MetricsServer:
    """Serve ``daemon``'s metrics on http://addr:port/metrics, and ``/healthz`` (200 while the poll loop
    makes progress, else 503), from a background thread. ``histograms``: per-phase histograms too;
    ``exposure``: who gets per-job series (default: everyone, as ``rankwatch run`` serves one user's job).
    A taken ``port`` moves the server to the next of ``tries`` ports upward (``.port`` says which; the
    bound is ``MetricsPolicy``'s); when none can be bound, ``MetricsUnavailable``. ``policy``: the
    connection cap and deadlines (``http_endpoint.EndpointPolicy``).

    The registry is private (not prometheus_client's global one) so that two daemons in one process, or
    a library that registers its own metrics, never collide. Port 0 binds a free port (see ``.port``).
    """
    from prometheus_client.process_collector import ProcessCollector
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    # a collector by its methods: a subclass of ``Collector`` would load prometheus_client with this module
    registry.register(cast("Collector", DaemonCollector(daemon, histograms=histograms)))
    ProcessCollector(registry=registry)  # the daemon's own CPU and memory: its overhead, observable
    aggregate = CollectorRegistry(auto_describe=False)
    aggregate.register(cast("Collector", DaemonCollector(daemon, jobs=False)))
    ProcessCollector(registry=aggregate)
    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except (socket.gaierror, UnicodeError) as exc:
        raise MetricsUnavailable(f"cannot serve metrics on {addr}:{port}: {exc}") from exc
    policy = policy or EndpointPolicy()
    # port 0 is the kernel's choice already; never past the last port
    candidates = [port] if port == 0 else list(range(port, min(port + max(1, tries), 65536)))
    sock = None
    for candidate in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted daemon rebinds at once
            sock.bind((addr, candidate))
            sock.listen(policy.accept_backlog)
            break
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or candidate == candidates[-1]:
                # taken to the end of the range, or a reason the next port would share (EACCES below 1024,
                # an address not on this host): stop here
                where = f"{addr}:{port}" if candidate == port else f"{addr} ports {port}-{candidate}"
                raise MetricsUnavailable(f"cannot serve metrics on {where}: {exc.strerror or exc}") from exc
    assert sock is not None
    bound_port = int(sock.getsockname()[1])
    routes = _Routes(registry, aggregate, exposure or Exposure(), daemon)
    server = BoundedHttpServer(sock, routes, policy, name="rankwatch-metrics")
    server.start()
    log.info("metrics_serving", addr=addr, port=bound_port, asked_port=port)
    return MetricsServer(server, registry, addr, bound_port)


def file_sd_target(addr: str, port: int, labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """Prometheus' file-based service discovery document (``file_sd_configs``) for one endpoint: a scrape
    config that globs these files follows a `rankwatch run` wherever its port landed. A wildcard address
    is named by the host's name, the way another host scrapes it."""
    try:
        wildcard = not addr or ipaddress.ip_address(addr).is_unspecified
    except ValueError:  # a host name
        wildcard = False
    host = socket.gethostname() if wildcard else addr
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return [{"targets": [target], "labels": dict(labels)}]
