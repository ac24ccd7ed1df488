"""A follower shows the job-wide live diagnosis: the leader publishes its merged diagnosis (``live/diagnosis``) after
each merge on its ``LiveShare`` thread, and every follower's thread reads it back, checked as the nodes' live values
are (seal, size, schema and bounds, the leader's node, fresh, no replay) with every string cleaned, and shows it
beside its own node's diagnosis in its state file, ``rankwatch status`` and ``/metrics``.

On a real loopback TCPStore between two Correlators (node 0 the leader, node 1), with the figures of
``test_live_share.py`` (node 1's way out capped: its rank's path is the job's cause). Every value under the key may be
hostile; the last test runs a real daemon as the follower and shows that a forged diagnosis changes what status and
metrics show — marked unauthenticated — and nothing else: no incident, no live straggler.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import structlog
from conftest import free_port, wait_for
from rankwatch.watchdog.cluster.correlate import Correlator
from rankwatch.watchdog.cluster.live_share import (
    DIAGNOSIS_KEY,
    LiveShare,
    Offer,
    RemoteRanks,
    diagnosis_share,
    merge_live,
)
from rankwatch.watchdog.core.policy import CorrelationPolicy
from rankwatch.watchdog.core.schema import LIVE_DIAGNOSIS_SCHEMA
from rankwatch.watchdog.core.straggler import diagnose_stragglers
from rankwatch.watchdog.core.straggler_cause import explain
from rankwatch.watchdog.observe.process import ProcessTable
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig
from rankwatch.watchdog.serve.metrics import serve_metrics
from test_history_signals import NODE1_CLOCK, node
from test_live_share import FAST, FAST_PATH, SLOW_PATH

SECRET = b"s3cret-s3cret-s3cret-s3cret-32b!"
# FAST's shares, a staleness a loaded machine's few looks stay well within (a value written once here never changes)
POLICY = CorrelationPolicy(live_share_every_s=FAST.live_share_every_s, live_stale_s=3.0)


def leader_merge(offer: Offer, remote: RemoteRanks):
    """What the daemon's merge returns (``Daemon._merge_live``): the merged diagnosis's share."""
    per_rank, samples = merge_live(offer.steps, offer.samples, remote, FAST.live_steps_shared,
                                   FAST.live_samples_per_rank)
    if not remote.steps:
        return None
    diag = explain(diagnose_stragglers(per_rank), samples)
    return diagnosis_share(diag, remote.nodes, offer.node, FAST.live_diagnosis_ranks)


@pytest.fixture
def two(request):
    secret = getattr(request, "param", None)
    port = free_port()
    leader = Correlator("ld", 0, "127.0.0.1", port, nnodes=2, policy=POLICY, secret=secret)
    assert wait_for(lambda: leader.store is not None, timeout=30), leader.error
    follower = Correlator("ld", 1, "127.0.0.1", port, nnodes=2, policy=POLICY, secret=secret)
    assert wait_for(lambda: follower.store is not None, timeout=30), follower.error
    shares = [LiveShare(leader, leader_merge), LiveShare(follower)]
    yield leader, follower, shares
    for s in shares:
        s.close()
    follower.close()
    leader.close()


def share_both(shares) -> None:
    steps0, samples0 = node(0, 10**9, **FAST_PATH)
    steps1, samples1 = node(1, NODE1_CLOCK, **SLOW_PATH)
    shares[0].offer(Offer({0: steps0}, samples0, "host-a", 2))
    shares[1].offer(Offer({1: steps1}, samples1, "host-b", 2))


def rounds(share: LiveShare, n: int = 3) -> None:
    """``n`` more looks of ``share``'s thread: what it read is in by then."""
    looks = share.looks
    assert wait_for(lambda: share.looks >= looks + n, timeout=30)


def test_a_follower_gets_the_leaders_job_wide_diagnosis_while_it_changes(two):
    _leader, _follower, shares = two
    share_both(shares)
    got = wait_for(lambda: shares[1].job_diagnosis(), timeout=30)
    assert got, "the follower never read the leader's diagnosis"
    assert (got.label, got.cause, got.cause_rank) == ("COMMUNICATION-BOUND", "network_path", 1), got
    assert got.cause_text.startswith("cause: network_path — rank 1:") and "; next: " in got.cause_text
    assert got.nodes == {1: "host-b"} and got.leader == "host-a" and not got.authenticated
    assert 0 < shares[0].diagnosis_bytes < POLICY.live_diagnosis_bytes
    # nothing new on either side: the leader publishes it again every share (the follower shows it while it lives)
    seq = shares[1]._diagnosis.order[1]
    assert wait_for(lambda: shares[1]._diagnosis.order[1] >= seq + 2, timeout=30)
    # the leader reads none of its own: it is the job's diagnosis there already
    assert shares[0].job_diagnosis() is None
    # the leader's watchdog stops: after live_stale_s unchanged, the follower shows its own node's alone again
    shares[0].close()
    assert wait_for(lambda: shares[1].job_diagnosis() is None, timeout=30)


def forged(**over) -> dict:
    diag = {"label": "INPUT STRAGGLER", "straggler_ranks": [0], "phase": "dataloader", "why": "rank 0 is slow",
            "steps": 120, "excess_ms": 30.0, "time_lost_ms": 3600.0,
            "cause": {"cause": "own_work", "rank": 0, "text": "its own work", "next": "profile rank 0"},
            "nodes": {"0": "host-a"}}
    doc = {"schema": LIVE_DIAGNOSIS_SCHEMA, "node_rank": 0, "node": "host-a", "boot": 5.0, "seq": 9,
           "issued": round(time.time(), 3), "diagnosis": diag}
    for k, v in over.items():
        (diag if k in diag else doc)[k] = v
    return doc


def test_a_diagnosis_over_the_followers_limit_is_not_published_and_the_share_goes_on():
    # a leader whose diagnosis is larger than what followers accept: refused before it is sent (they would refuse
    # it unread), said once, and the store connection kept (the nodes' own values still go and come)
    tight = CorrelationPolicy(live_share_every_s=FAST.live_share_every_s, live_stale_s=3.0, live_diagnosis_bytes=200)
    port = free_port()
    leader = Correlator("lt", 0, "127.0.0.1", port, nnodes=2, policy=tight)
    assert wait_for(lambda: leader.store is not None, timeout=30), leader.error
    follower = Correlator("lt", 1, "127.0.0.1", port, nnodes=2, policy=tight)
    assert wait_for(lambda: follower.store is not None, timeout=30), follower.error
    shares = [LiveShare(leader, leader_merge), LiveShare(follower)]
    try:
        with structlog.testing.capture_logs() as logs:
            share_both(shares)
            assert wait_for(lambda: shares[0]._error == "diagnosis too large", timeout=30), shares[0]._error
            rounds(shares[0])
            rounds(shares[1])
        too_large = [e for e in logs if e["event"] == "live_diagnosis_too_large"]
        assert len(too_large) == 1 and too_large[0]["limit"] == 200 and too_large[0]["bytes"] > 200, too_large
        assert not any(e["event"] == "live_share_store_failed" for e in logs), logs
        assert shares[0].diagnosis_bytes == 0 and shares[1].job_diagnosis() is None
        assert shares[1].published_bytes > 0  # the follower's own value still reached the store
    finally:
        for sh in shares:
            sh.close()
        follower.close()
        leader.close()


def test_forged_replayed_stale_oversize_and_hostile_values(two):
    leader, _follower, (mine, theirs) = two
    mine.close()  # only the values written here are under the key
    # the follower publishes nothing (no offer) and reads every round

    def put(doc: dict) -> None:
        leader.store.set_json(DIAGNOSIS_KEY, doc)
        rounds(theirs)

    with structlog.testing.capture_logs() as logs:
        put(forged(node_rank=1))  # another node's, under the leader's key
        assert theirs.job_diagnosis() is None
        assert [e["key"] for e in logs if e.get("event") == "store_value_rejected"] == [DIAGNOSIS_KEY]
    for bad in (forged(issued=time.time() - 3600),  # an earlier run's, replayed
                forged(why="x" * (POLICY.live_diagnosis_bytes + 1)),  # oversize: refused unparsed
                forged(why="x" * 600),  # a line over the store's string bound
                forged(cause={"cause": "rm -rf", "rank": 0, "text": "", "next": ""}),  # no such cause
                forged(straggler_ranks=list(range(POLICY.live_diagnosis_ranks + 1))),
                forged(straggler_ranks=[True]), forged(label=7), forged(schema="rankwatch.history/1")):
        put(bad)
        assert theirs.job_diagnosis() is None, bad
        assert theirs._diagnosis_bad == leader.store._encode(DIAGNOSIS_KEY, bad).encode()  # read, and refused
    # hostile strings are taken, cleaned where they enter
    put(forged(label="\x1b[31mEVIL\u202e", phase="data\nloader", why="a\rb\x07", nodes={"0": "host\x1b]0;x\x07"},
               cause={"cause": "own_work", "rank": 0, "text": "\x1b[2J", "next": "\u2066rm\u2069"}))
    got = theirs.job_diagnosis()
    assert got is not None
    text = json.dumps(got.doc(), ensure_ascii=False)
    assert not any(c in text for c in "\x1b\x07\r\u202e\u2066\u2069"), text
    assert (got.label, got.phase, got.why, got.nodes[0]) == ("?[31mEVIL?", "data loader", "a b?", "host?]0;x?")
    # a value older than the one taken is a replay: the newer one stands
    put(forged(seq=8, label="BALANCED", straggler_ranks=[], cause=None, nodes={}))
    assert theirs.job_diagnosis() is got
    put(forged(seq=10, label="BALANCED", straggler_ranks=[], cause=None, nodes={}))
    newer = theirs.job_diagnosis()
    assert newer is not None and (newer.label, newer.straggler_ranks, newer.cause) == ("BALANCED", (), None)
    # one that stops changing ages out (live_stale_s)
    assert wait_for(lambda: theirs.job_diagnosis() is None, timeout=30)


@pytest.mark.parametrize("two", [SECRET], indirect=True)
def test_with_a_secret_only_the_leaders_sealed_diagnosis_is_taken(two):
    leader, _follower, shares = two
    text = json.dumps(forged()).encode()
    with structlog.testing.capture_logs() as logs:
        # written past the secret: the raw client under the job's key
        leader.store._io.call(lambda: leader.store._store.set(leader.store._k(DIAGNOSIS_KEY), text), "forge")
        assert wait_for(lambda: any(e.get("key") == DIAGNOSIS_KEY for e in logs), timeout=30), logs
    assert shares[1].job_diagnosis() is None
    share_both(shares)
    got = wait_for(lambda: shares[1].job_diagnosis(), timeout=30)
    assert got and got.authenticated and got.cause_rank == 1, got


# -- a real daemon as the follower: a forged diagnosis is shown, marked, and acted on by nothing -----------------
@pytest.fixture
def follower_daemon(tmp_path, monkeypatch):
    from test_metrics import written_ranks

    shm, out = str(tmp_path / "shm"), str(tmp_path / "out")
    writers = written_ranks(shm, monkeypatch, before_now_ms=0)
    port = free_port()
    slow_to_age = CorrelationPolicy(live_share_every_s=0.1, live_stale_s=120.0)  # the forgery is written once
    leader = Correlator("jobM", 0, "127.0.0.1", port, nnodes=2, policy=slow_to_age)
    assert wait_for(lambda: leader.store is not None, timeout=30), leader.error
    follower = Correlator("jobM", 1, "127.0.0.1", port, nnodes=2, policy=slow_to_age)
    assert wait_for(lambda: follower.store is not None, timeout=30), follower.error
    daemon = Daemon(DaemonConfig(shm_dir=shm, out_dir=out), procs=ProcessTable(protected={1}),
                    correlators={"jobM": follower})
    server = serve_metrics(daemon, "127.0.0.1", 0)
    yield daemon, leader, server
    server.close()
    daemon.close()
    leader.close()
    for w in writers:
        w.close()


def test_a_forged_diagnosis_changes_what_a_follower_shows_and_nothing_else(follower_daemon, tmp_path):
    from rankwatch.watchdog.cli.status import job_status, read_state
    from test_metrics import scrape, value

    daemon, leader, server = follower_daemon
    daemon.poll_once()
    entry = daemon.jobs["jobM"]
    own = entry.straggler
    assert own is not None and own.straggler_ranks == [2]  # this node's: its slow loader
    # no store secret: anyone who reaches the store can write the leader's key. This one names rank 0 — a rank of
    # this node, running fine — as the job's straggler
    leader.store.set_json(DIAGNOSIS_KEY, forged())
    assert wait_for(lambda: daemon.job_diagnosis("jobM"), timeout=30)
    daemon.poll_once()
    state = read_state(daemon.config.shm_dir, str(tmp_path / "none"), "jobM", time.time())
    assert state is not None
    job = job_status(entry.watch, entry.last_views, state, stale_after_s=60.0)
    d = job["job_diagnosis"]
    assert (d["label"], d["straggler_ranks"], d["from"], d["leader"], d["authenticated"]) == (
        "INPUT STRAGGLER", [0], "leader", "host-a", False), d
    assert (d["cause"], d["cause_rank"], d["nodes"], d["excess_ms"]) == ("own_work", 0, {"0": "host-a"}, 30.0)
    # this node's own diagnosis stands beside it
    assert (job["diagnosis"], job["straggler_ranks"], job["diagnosis_from"]) == ("INPUT STRAGGLER", [2], "watchdog")
    m = scrape(server)
    assert value(m, "rankwatch_leader_diagnosis", job_id="jobM", label="INPUT STRAGGLER", phase="dataloader",
                 leader="host-a", authenticated="false") == 1
    assert value(m, "rankwatch_leader_straggler", job_id="jobM", rank="0", phase="dataloader",
                 label="INPUT STRAGGLER", cause="own_work", node="host-a") == 1
    assert value(m, "rankwatch_leader_straggler_cause", job_id="jobM", rank="0", cause="own_work",
                 node="host-a") == 1
    assert [dict(k)["rank"] for k in m["rankwatch_straggler"]] == ["2"]  # this node's, unchanged
    # and nothing else: no incident, no live straggler of the forged rank, this node's diagnosis its own
    for _ in range(3):
        daemon.poll_once()
    assert entry.incident is None and entry.incidents == [] and not os.path.exists(daemon.incidents_dir("jobM"))
    assert all(r != 0 for r, _ in entry.live_stragglers) and entry.straggler is own
