"""Prometheus endpoint: a real daemon over real shm records, scraped over HTTP and parsed."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import statistics
import threading
import time
import urllib.error
import urllib.request

import pytest
import rankwatch.hooks.tracker as tracker_mod
import structlog
from conftest import free_port, new_tracker
from prometheus_client.parser import text_string_to_metric_families
from rankwatch.hooks.record import RecordWriter
from rankwatch.watchdog.cli.status import job_status, read_state
from rankwatch.watchdog.core.detect import Trigger
from rankwatch.watchdog.core.policy import StallPolicy
from rankwatch.watchdog.core.straggler import diagnose_stragglers
from rankwatch.watchdog.core.straggler_live import LiveStragglerPolicy, update_live
from rankwatch.watchdog.errors import UserError
from rankwatch.watchdog.observe.process import ProcessTable
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig, OpenIncident
from rankwatch.watchdog.serve.metrics import (
    METRIC_NAMES,
    SERIES_PER_RANK_BUDGET,
    Exposure,
    MetricsUnavailable,
    file_sd_target,
    read_token,
    serve_metrics,
)

JOB = "jobM"
STEPS = 30
MS = 1_000_000
# own work per phase in ms; rank 2 loads its input 35 ms slower and the others wait in the all-reduce
OWN = {"dataloader": 5, "forward": 10, "backward": 20, "optimizer": 5}
SLOW_RANK, SLOW_LOADER = 2, 40


class FakeClock:
    def __init__(self, start: int) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now


def run_steps(t, rank: int, clock: FakeClock, n: int) -> None:
    loader = SLOW_LOADER if rank == SLOW_RANK else OWN["dataloader"]
    wait = SLOW_LOADER - loader
    for _ in range(n):
        for slot, ms in ((0, loader), (1, OWN["forward"]), (2, OWN["backward"]), (3, OWN["optimizer"])):
            t.enter(slot)
            clock.now += ms * MS
            t.exit(slot)
        t.collective_enter("all_reduce")
        clock.now += wait * MS
        t.collective_exit()
        t.step()


def write_rank(shm: str, rank: int, clock: FakeClock) -> RecordWriter:
    os.makedirs(os.path.join(shm, JOB), mode=0o700, exist_ok=True)
    t = new_tracker(os.path.join(shm, JOB, f"rank-{rank}.hb"), rank=rank, local_rank=rank, world_size=3,
                    local_world_size=3, job_id=JOB, start_ns=clock.now)
    writer = t._writer
    run_steps(t, rank, clock, STEPS)
    if rank == 0:
        t.enter(1)  # rank 0 is inside forward right now
    return writer


def written_ranks(shm: str, monkeypatch, before_now_ms: int = 100) -> list[RecordWriter]:
    """The three ranks' records, their steps ending ``before_now_ms`` ago (so no rank looks stalled)."""
    os.makedirs(shm, mode=0o700)
    step_ns = (sum(OWN.values()) - OWN["dataloader"] + SLOW_LOADER) * MS
    clock = FakeClock(time.monotonic_ns() - STEPS * step_ns - before_now_ms * MS)
    start = clock.now
    monkeypatch.setattr(tracker_mod, "_now", clock)
    writers = []
    for rank in range(3):
        clock.now = start
        writers.append(write_rank(shm, rank, clock))
    return writers


@pytest.fixture
def daemon_setup(tmp_path, monkeypatch):
    shm, out = str(tmp_path / "shm"), str(tmp_path / "out")
    writers = written_ranks(shm, monkeypatch)
    # the records are written by this test process: let the daemon verify it as their rank
    daemon = Daemon(DaemonConfig(shm_dir=shm, out_dir=out), procs=ProcessTable(protected={1}))
    daemon.poll_once()
    server = serve_metrics(daemon, "127.0.0.1", 0, histograms=True)
    yield daemon, server
    server.close()
    daemon.close()
    for w in writers:
        w.close()


def scrape(server, token: str | None = None) -> dict[str, dict[tuple, float]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def phase_s(samples, rank: str, phase: str) -> float:
    return value(samples, "rankwatch_phase_duration_median_seconds", job_id=JOB, rank=rank, phase=phase)


def test_metrics_reflect_daemon_state(daemon_setup):
    daemon, server = daemon_setup
    m = scrape(server)
    assert value(m, "rankwatch_jobs") == 1
    assert value(m, "rankwatch_daemon_polls_total") == 1
    assert value(m, "rankwatch_stalled", job_id=JOB) == 0
    assert value(m, "rankwatch_incidents_total", job_id=JOB) == 0
    for r in ("0", "1", "2"):
        assert value(m, "rankwatch_rank_steps_total", job_id=JOB, rank=r) == STEPS
        assert value(m, "rankwatch_rank_up", job_id=JOB, rank=r) == 1
        assert value(m, "rankwatch_rank_state", job_id=JOB, rank=r, state="running") == 1
        assert value(m, "rankwatch_rank_state", job_id=JOB, rank=r, state="dead") == 0
        # no pid: restarts keep it; the dcgm-exporter join labels (no NVML here: no gpu/UUID)
        assert value(m, "rankwatch_rank_info", job_id=JOB, rank=r, node="nodeA", local_rank=r,
                     Hostname=socket.gethostname(), gpu="", UUID="", pod="", namespace="") == 1
        assert value(m, "rankwatch_rank_pid", job_id=JOB, rank=r) == os.getpid()
        assert value(m, "rankwatch_rank_collectives_completed_total", job_id=JOB, rank=r) == STEPS
        # every step is 75 ms of wall time on every rank: the slow loader's peers wait in the all-reduce
        assert value(m, "rankwatch_last_step_duration_seconds", job_id=JOB, rank=r) == pytest.approx(0.075)
        # every step read, as a histogram: all STEPS steps are 75 ms, in the (0.05, 0.1] bucket
        assert value(m, "rankwatch_step_duration_seconds_count", job_id=JOB, rank=r) == STEPS
        assert value(m, "rankwatch_step_duration_seconds_bucket", job_id=JOB, rank=r, le="0.05") == 0
        assert value(m, "rankwatch_step_duration_seconds_bucket", job_id=JOB, rank=r, le="0.1") == STEPS
        assert value(m, "rankwatch_step_duration_seconds_sum", job_id=JOB, rank=r) == pytest.approx(0.075 * STEPS)
        assert value(m, "rankwatch_phase_duration_seconds_bucket", job_id=JOB, rank=r, phase="forward",
                     le="0.01") == STEPS
        assert value(m, "rankwatch_step_duration_median_seconds", job_id=JOB, rank=r) == pytest.approx(0.075)
        assert phase_s(m, r, "forward") == pytest.approx(0.010)
        assert phase_s(m, r, "backward") == pytest.approx(0.020)
        assert 0 <= value(m, "rankwatch_rank_seconds_since_progress", job_id=JOB, rank=r) < 30
    loader = {r: phase_s(m, r, "dataloader") for r in ("0", "1", "2")}
    assert loader == pytest.approx({"0": 0.005, "1": 0.005, "2": 0.040})
    assert phase_s(m, "0", "collective") == pytest.approx(0.035)
    # rank 2 never waits, so no collective sample exists for it
    assert (("job_id", JOB), ("phase", "collective"), ("rank", "2")) not in m["rankwatch_phase_duration_median_seconds"]
    assert value(m, "rankwatch_rank_phase", job_id=JOB, rank="0", phase="forward") == 1
    assert value(m, "rankwatch_rank_phase", job_id=JOB, rank="0", phase="dataloader") == 0
    assert value(m, "rankwatch_rank_phase", job_id=JOB, rank="1", phase="forward") == 0
    # the diagnosis names the slow loader, not the ranks that waited for it
    # with its cause: the fake writers' steps are not in the sampled wall time, so it is not measured ("")
    assert m["rankwatch_straggler"] == {
        (("cause", ""), ("job_id", JOB), ("label", "INPUT STRAGGLER"), ("phase", "dataloader"), ("rank", "2")): 1.0
    }
    assert value(m, "rankwatch_diagnosis", job_id=JOB, label="INPUT STRAGGLER", phase="dataloader") == 1
    assert value(m, "rankwatch_longest_step_seconds", job_id=JOB) == pytest.approx(0.075)
    assert "process_resident_memory_bytes" in m  # the daemon's own overhead
    assert "rankwatch_incident_initiator" not in m

    # an open incident shows up as stalled, counted, with its initiating rank
    entry = daemon.jobs[JOB]
    trigger = Trigger("stall", (2,), "no progress", 30.0, 31.0)
    entry.incident = OpenIncident("inc-1", trigger, None, {"initiating_ranks": [2], "kind": "hang",
                                                          "phase": "dataloader"})
    entry.incidents.append("inc-1")
    m = scrape(server)
    assert value(m, "rankwatch_stalled", job_id=JOB) == 1
    assert value(m, "rankwatch_incidents_total", job_id=JOB) == 1
    assert value(m, "rankwatch_incident_initiator", job_id=JOB, rank="2", kind="hang", phase="dataloader") == 1

    # retired jobs drop out
    entry.watch.retired = True
    m = scrape(server)
    assert value(m, "rankwatch_jobs") == 0
    assert "rankwatch_stalled" not in m



def test_one_straggler_diagnosis_per_poll_is_what_metrics_and_status_show(daemon_setup, tmp_path):
    daemon, server = daemon_setup
    daemon.config = dataclasses.replace(daemon.config, live=LiveStragglerPolicy(every_s=0.0))  # every poll looks
    entry = daemon.jobs[JOB]
    diag = entry.straggler  # the job's diagnosis, made by the poll loop
    assert diag is not None
    assert (diag.label, diag.straggler_ranks, diag.phase) == ("INPUT STRAGGLER", [SLOW_RANK], "dataloader")
    # scrapes diagnose nothing: they export the poll's diagnosis, which stays the same object
    for _ in range(2):
        m = scrape(server)
        assert value(m, "rankwatch_diagnosis", job_id=JOB, label=diag.label, phase="dataloader") == 1
        assert [dict(k)["rank"] for k in m["rankwatch_straggler"]] == [str(SLOW_RANK)]
    assert entry.straggler is diag
    # a poll that saw no new step keeps it too: nothing new to diagnose
    daemon.poll_once()
    assert entry.straggler is diag
    # status shows the watchdog's diagnosis, read back from the state file the poll wrote, not one of its own
    # (status runs in-process here: as a child of this test, which writes the records, it would refuse them)
    state = read_state(daemon.config.shm_dir, str(tmp_path / "none"), JOB, time.time())
    assert state is not None
    job = job_status(entry.watch, entry.last_views, state, stale_after_s=60.0)
    assert (job["diagnosis"], job["straggler_ranks"], job["phase"], job["why"], job["diagnosis_from"]) == (
        diag.label, [SLOW_RANK], "dataloader", diag.why, "watchdog")



def test_every_declared_metric_is_exposed(daemon_setup):
    daemon, server = daemon_setup
    entry = daemon.jobs[JOB]
    # a straggler named by two consecutive live diagnoses is a live straggler
    diag = diagnose_stragglers({r: list(h) for r, h in entry.watch.history.items()})
    policy = LiveStragglerPolicy()
    for _ in range(policy.confirm):
        entry.live_stragglers, _ = update_live(entry.live_stragglers, diag, policy, time.time())
    entry.incident = OpenIncident("inc-1", Trigger("stall", (2,), "x", 30.0, 31.0), None,
                                  {"initiating_ranks": [2], "kind": "hang", "phase": None})
    # a measured cause (the fake writers' steps are not in the sampled wall time), on a rank another node shared
    diag = dataclasses.replace(entry.straggler, cause={"cause": "network_path", "rank": 5})
    entry.straggler, entry.straggler_remote = diag, {5: "node-b"}
    m = scrape(server)
    # the leader's job-wide diagnosis is a follower's, read from a store: tests/unit/cluster/test_live_diagnosis.py
    follower_only = {"rankwatch_leader_diagnosis", "rankwatch_leader_straggler", "rankwatch_leader_straggler_cause"}
    missing = [n for n in METRIC_NAMES if n not in m and n != "rankwatch_metrics_collect_errors_total"
               and n not in follower_only]
    assert not missing
    assert value(m, "rankwatch_straggler_cause", job_id=JOB, rank="5", cause="network_path", node="node-b") == 1
    assert value(m, "rankwatch_metrics_collect_errors_total") == 0
    for name in METRIC_NAMES:
        assert name.startswith("rankwatch_")


def test_scrapes_during_polls_and_other_paths(daemon_setup):
    daemon, server = daemon_setup
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            daemon.poll_once()

    t = threading.Thread(target=poll)
    t.start()
    try:
        for _ in range(10):
            assert value(scrape(server), "rankwatch_jobs") == 1
    finally:
        stop.set()
        t.join()
    assert value(scrape(server), "rankwatch_metrics_collect_errors_total") == 0
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/nope", timeout=10)
    assert err.value.code == 404


def test_a_taken_port_moves_to_the_next_free_one_and_close_frees_the_port(tmp_path):
    """Metrics are optional (issue 42): a taken port is not an error while a port of the range is free; only
    when none is (or the address cannot be served here) does ``MetricsUnavailable`` say so, for the caller to
    warn and go on (it used to be a UserError: `rankwatch run` exited 2 before launching the job)."""
    daemon = Daemon(DaemonConfig(shm_dir=str(tmp_path), out_dir=str(tmp_path)))
    try:
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", free_port()))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(MetricsUnavailable, match=re.escape(f"cannot serve metrics on 127.0.0.1:{port}: ")):
                serve_metrics(daemon, "127.0.0.1", port)  # one try: the daemon's fixed port
            moved = serve_metrics(daemon, "127.0.0.1", port, tries=16)
            assert port < moved.port < port + 16 and moved.url == f"http://127.0.0.1:{moved.port}/metrics"
            assert value(scrape(moved), "rankwatch_jobs") == 0
            # the whole range taken: a bounded scan, then the reason with the range it covered
            with pytest.raises(MetricsUnavailable, match=re.escape(
                    f"cannot serve metrics on 127.0.0.1 ports {port}-{moved.port}: ")):
                serve_metrics(daemon, "127.0.0.1", port, tries=moved.port - port + 1)
            moved.close()
        server = serve_metrics(daemon, "127.0.0.1", port)
        assert server.url == f"http://127.0.0.1:{port}/metrics"
        server.close()
        again = serve_metrics(daemon, "127.0.0.1", port)
        again.close()
        with pytest.raises(MetricsUnavailable, match=re.escape("cannot serve metrics on no-such-host.invalid:")):
            serve_metrics(daemon, "no-such-host.invalid", 0)
    finally:
        daemon.close()


def test_the_file_sd_document_names_the_endpoint_as_prometheus_reaches_it():
    labels = {"rankwatch_run": "j1"}
    assert file_sd_target("127.0.0.1", 9432, labels) == [{"targets": ["127.0.0.1:9432"], "labels": labels}]
    assert file_sd_target("::1", 9432, labels)[0]["targets"] == ["[::1]:9432"]
    for wildcard in ("0.0.0.0", "::", ""):  # every interface: another host reaches it by this host's name
        assert file_sd_target(wildcard, 9431, labels)[0]["targets"] == [f"{socket.gethostname()}:9431"]


def test_a_straggler_that_persists_is_logged_exported_and_named_in_the_incident(tmp_path, monkeypatch):
    shm, out = str(tmp_path / "shm"), str(tmp_path / "out")
    os.makedirs(os.path.join(shm, JOB), mode=0o700)
    step_ns = (sum(OWN.values()) - OWN["dataloader"] + SLOW_LOADER) * MS
    clock = FakeClock(time.monotonic_ns() - 2 * STEPS * step_ns - 100 * MS)
    start = clock.now
    monkeypatch.setattr(tracker_mod, "_now", clock)
    trackers = [new_tracker(os.path.join(shm, JOB, f"rank-{r}.hb"), rank=r, local_rank=r, world_size=3,
                            local_world_size=3, job_id=JOB, start_ns=start) for r in range(3)]

    def advance(n: int) -> None:
        t0 = clock.now
        for r, t in enumerate(trackers):
            clock.now = t0
            run_steps(t, r, clock, n)

    live = LiveStragglerPolicy(every_s=0.0)
    daemon = Daemon(DaemonConfig(shm_dir=shm, out_dir=out, live=live), procs=ProcessTable(protected={1}))
    server = serve_metrics(daemon, "127.0.0.1", 0)
    try:
        with structlog.testing.capture_logs() as logs:
            advance(STEPS)
            daemon.poll_once()  # named once: not yet reported
            assert not [e for e in logs if e["event"] == "straggler_detected"]
            assert "rankwatch_live_straggler" not in scrape(server)
            advance(10)
            daemon.poll_once()  # named again on new steps: reported
        (event,) = [e for e in logs if e["event"] == "straggler_detected"]
        assert (event["rank"], event["label"], event["phase"]) == (SLOW_RANK, "INPUT STRAGGLER", "dataloader")
        assert event["log_level"] == "warning" and event["since_step"] >= 1
        m = scrape(server)
        labels = dict(job_id=JOB, rank=str(SLOW_RANK), phase="dataloader", label="INPUT STRAGGLER")
        assert value(m, "rankwatch_live_straggler", **labels) == 1
        assert time.time() - 60 < value(m, "rankwatch_live_straggler_since_timestamp_seconds", **labels) <= time.time()
        # then the job stops making progress: the incident's evidence names the rank that straggled before
        clock.now = time.monotonic_ns() - 10 * 1_000_000_000  # it entered its loader 10 s ago
        trackers[SLOW_RANK].enter(0)
        entry = daemon.jobs[JOB]
        daemon.config = dataclasses.replace(daemon.config, stall=StallPolicy(timeout_s=3.0))
        daemon.poll_once()
        assert entry.incident is not None
        assert daemon.drain(60)
        evidence = entry.verdicts[0]["evidence"]
        assert any(e.startswith("before the stall, rank 2: INPUT STRAGGLER in dataloader — since step")
                   for e in evidence), evidence
    finally:
        server.close()
        daemon.close()
        for t in trackers:
            t._writer.close()


def series_per_rank(m: dict[str, dict[tuple, float]], ranks: int) -> float:
    """Every series that names the job (per-rank and per-job ones), per rank."""
    n = sum(1 for samples in m.values() for labels in samples if ("job_id", JOB) in labels)
    return n / ranks


def test_default_series_stay_within_the_budget_and_phase_histograms_are_opt_in(daemon_setup):
    daemon, full = daemon_setup
    default = serve_metrics(daemon, "127.0.0.1", 0)
    try:
        m = scrape(default)
        assert series_per_rank(m, 3) <= SERIES_PER_RANK_BUDGET, series_per_rank(m, 3)
        assert "rankwatch_phase_duration_seconds_bucket" not in m
        assert value(m, "rankwatch_step_duration_seconds_count", job_id=JOB, rank="1") == STEPS
        # the phase medians stay (one gauge per phase), the histograms come with --metrics-histograms
        assert phase_s(m, "2", "dataloader") == pytest.approx(0.040)
        with_hists = scrape(full)
        assert value(with_hists, "rankwatch_phase_duration_seconds_count", job_id=JOB, rank="2",
                     phase="dataloader") == STEPS
        assert series_per_rank(with_hists, 3) > SERIES_PER_RANK_BUDGET
    finally:
        default.close()


def test_aggregate_exposure_shows_no_job_and_the_token_shows_all(daemon_setup, tmp_path):
    daemon, _ = daemon_setup
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    server = serve_metrics(daemon, "127.0.0.1", 0, exposure=Exposure("aggregate", read_token(str(token))))
    try:
        for presented in (None, "wrong"):
            m = scrape(server, presented)
            assert not [labels for samples in m.values() for labels in samples if ("job_id", JOB) in labels]
            assert not [n for n in m if n.startswith("rankwatch_rank_")]
            assert value(m, "rankwatch_jobs") == 1 and value(m, "rankwatch_ranks", state="running") == 3
            assert value(m, "rankwatch_open_incidents") == 0
            assert 0 <= value(m, "rankwatch_last_poll_age_seconds") < 600
        m = scrape(server, "s3cret-token")
        assert value(m, "rankwatch_rank_steps_total", job_id=JOB, rank="0") == STEPS
    finally:
        server.close()
    token.chmod(0o644)
    with pytest.raises(UserError, match="readable by others"):
        read_token(str(token))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the rank."""
    total = buckets[-1][1]
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-9)
        prev_bound, prev_count = bound, count
    return prev_bound


@pytest.mark.parametrize("true_ms", [8, 12, 23, 38, 61, 90, 140, 230, 380, 700, 1300])
def test_buckets_resolve_typical_step_and_dataloader_times(true_ms):
    """Times spread ±15% around a median: the quantile Prometheus computes from the buckets lands within
    20% of the true median (the old 50 -> 100 ms jump read a 61 ms median as 75 ms)."""
    from rankwatch.watchdog.core.histogram import Histogram

    h = Histogram()
    times = [true_ms * (0.85 + 0.3 * i / 99) / 1e3 for i in range(100)]
    for t in times:
        h.add(t)
    cumulative, _ = h.cumulative()
    buckets = [(float(le), n) for le, n in cumulative if le != "+Inf"]
    estimate = histogram_quantile(0.5, buckets)
    assert estimate == pytest.approx(statistics.median(times), rel=0.2), (estimate, buckets)


def test_rank_info_carries_nvmls_gpu_index_and_uuid_for_the_dcgm_join(tmp_path, monkeypatch):
    """NVML from a recorded-format stand-in (no GPU here): the rank's pid has a context on GPU 0, so its
    rank_info says gpu="0" and that device's UUID, the labels dcgm-exporter's series carry; Hostname is
    NODE_NAME where set (the downward API in Kubernetes)."""
    from rankwatch.watchdog.evidence.gpu import GpuWatch
    from test_daemon_gpu import LiveNvml

    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    shm = str(tmp_path / "shm")
    os.makedirs(shm, mode=0o700)
    clock = FakeClock(time.monotonic_ns() - STEPS * 80 * MS)
    monkeypatch.setattr(tracker_mod, "_now", clock)
    writer = write_rank(shm, 0, clock)
    gpu = GpuWatch(nvml=LiveNvml({os.getpid(): 40.0}))
    daemon = Daemon(DaemonConfig(shm_dir=shm, out_dir=str(tmp_path / "out")), procs=ProcessTable(protected={1}),
                    gpu=gpu)
    daemon.poll_once()
    server = serve_metrics(daemon, "127.0.0.1", 0)
    try:
        (labels,) = scrape(server)["rankwatch_rank_info"]
        got = dict(labels)
        assert (got["gpu"], got["UUID"], got["Hostname"]) == ("0", "GPU-00000000-0000-0000-0000-000000000000",
                                                              "gpu-node-7")
        assert (got["rank"], got["local_rank"], got["job_id"]) == ("0", "0", JOB)
    finally:
        server.close()
        daemon.close()
        writer.close()
