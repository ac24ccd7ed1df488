"""Live stragglers across nodes (issue 41): each node shares its ranks' recent steps and signal samples while the job
runs (``cluster.live_share``), and the leader's live diagnosis compares them with its own ranks'.

The merge is pure (``merge_live``): each rank read over its own window on its own node's clock. The exchange runs on
a real loopback TCPStore between two Correlators (node 0 the leader, node 1), each with its ``LiveShare`` thread;
node 1's ranks are the figures measured in ``tests/e2e/test_network_cause.py``'s capped run (its way out capped at
20 Mbit/s: ~19.5 Mbit/s delivered, ~20 ms round trip; node 0's veth ~100 Gbit/s at ~0.2 ms), its clock 7000 s
ahead of node 0's. Every store value may be hostile: forged, replayed, about another node's or the leader's own
ranks — each is refused with a log line, and a node whose value stops changing drops out of the live diagnosis.
"""

from __future__ import annotations

import json
import time

import pytest
import structlog
from conftest import free_port, wait_for
from rankwatch.watchdog.cluster.correlate import Correlator, history_doc
from rankwatch.watchdog.cluster.live_share import LiveShare, Offer, RemoteRanks, merge_live
from rankwatch.watchdog.core.policy import CorrelationPolicy
from rankwatch.watchdog.core.straggler import diagnose_stragglers
from rankwatch.watchdog.core.straggler_cause import explain
from test_history_signals import NODE1_CLOCK, diagnosis, node

FAST = CorrelationPolicy(live_share_every_s=0.1, live_stale_s=1.0)
SLOW_PATH = {"rate_bps": 2_437_500, "rtt_us": 20_530}  # 19.5 Mbit/s, 20.53 ms
FAST_PATH = {"rate_bps": 12_500_000_000, "rtt_us": 200}


def remote_of(rank: int, k: int, steps, samples) -> RemoteRanks:
    return RemoteRanks({rank: steps}, {rank: [(t, by[rank]) for t, by in samples]}, {rank: f"host{k}"}, {rank: k})


def test_the_merge_compares_each_rank_on_its_own_nodes_clock():
    steps0, samples0 = node(0, 10**9, **FAST_PATH)
    steps1, samples1 = node(1, NODE1_CLOCK, **SLOW_PATH)
    # alone, the leader's rank has no peer: no cause
    assert explain(diagnosis({0: steps0}), samples0).cause is None
    per_rank, samples = merge_live({0: steps0}, samples0, remote_of(1, 1, steps1, samples1), 200, 64)
    assert sorted(per_rank) == [0, 1] and per_rank[1] is steps1
    # one entry per node and sample time, each node's in time order, every rank's on its own clock
    node0 = [t for t, by in samples if 0 in by]
    node1 = [t for t, by in samples if 1 in by]
    assert node0 == sorted(node0) and node1 == sorted(node1) and all(0 not in by or 1 not in by for _, by in samples)
    assert min(node1) >= NODE1_CLOCK > max(node0)
    assert len(node0) <= 64  # the leader's own thinned over the same steps as the other node's were
    d = explain(diagnosis(per_rank), samples)
    assert d.cause is not None and (d.cause["cause"], d.cause["rank"]) == ("network_path", 1), d.cause
    # the live diagnosis itself (the daemon's, over the merged ranks) names the same cause
    live = explain(diagnose_stragglers(per_rank), samples)
    assert live.label == "COMMUNICATION-BOUND" and (live.cause or {}).get("rank") == 1, (live.label, live.cause)


def test_a_rank_the_leader_watches_is_never_taken_from_another_node():
    steps0, samples0 = node(0, 10**9, **FAST_PATH)
    steps1, samples1 = node(0, NODE1_CLOCK, **SLOW_PATH)  # node 1 claims rank 0
    per_rank, samples = merge_live({0: steps0}, samples0, remote_of(0, 1, steps1, samples1), 200, 64)
    assert per_rank == {0: steps0} and samples == samples0
    # no other node shared samples: the leader's own unchanged, the other node's ranks compared on steps alone
    per_rank, samples = merge_live({0: steps0}, samples0, RemoteRanks({1: steps1}, {}, {1: "b"}, {1: 1}), 200, 64)
    assert sorted(per_rank) == [0, 1] and samples == samples0


@pytest.fixture
def pair(request):
    secret = getattr(request, "param", None)
    port = free_port()
    leader = Correlator("ls", 0, "127.0.0.1", port, nnodes=3, policy=FAST, secret=secret)
    assert wait_for(lambda: leader.store is not None, timeout=30), leader.error
    follower = Correlator("ls", 1, "127.0.0.1", port, nnodes=3, policy=FAST, secret=secret)
    assert wait_for(lambda: follower.store is not None, timeout=30), follower.error
    merges: list[tuple[Offer, RemoteRanks]] = []
    shares = [LiveShare(leader, lambda o, r: merges.append((o, r))), LiveShare(follower)]
    yield leader, follower, shares, merges
    for s in shares:
        s.close()
    follower.close()
    leader.close()


def test_the_leader_gets_another_nodes_ranks_while_the_job_runs(pair):
    _leader, _follower, (mine, theirs), merges = pair
    steps0, samples0 = node(0, 10**9, **FAST_PATH)
    steps1, samples1 = node(1, NODE1_CLOCK, **SLOW_PATH)
    theirs.offer(Offer({1: steps1}, samples1, "host-b", 2))
    offer = Offer({0: steps0}, samples0, "host-a", 2)
    mine.offer(offer)
    assert wait_for(lambda: any(r.steps for _, r in merges), timeout=30), merges
    got_offer, remote = [m for m in merges if m[1].steps][-1]
    assert got_offer is offer  # the poll loop's lists as offered, nothing copied on its thread
    assert list(remote.steps) == [1] and [s.step for s in remote.steps[1]] == [s.step for s in steps1[-200:]]
    assert remote.nodes == {1: "host-b"} and remote.node_ranks == {1: 1}
    rows = remote.signals[1]
    assert len(rows) <= FAST.live_samples_per_rank and rows[0][0] >= NODE1_CLOCK
    # bounded: what node 1 published stays within the live bounds
    assert 0 < theirs.published_bytes < 400_000
    per_rank, samples = merge_live(offer.steps, offer.samples, remote, FAST.live_steps_shared,
                                   FAST.live_samples_per_rank)
    d = explain(diagnose_stragglers(per_rank), samples)
    assert (d.cause or {}).get("cause") == "network_path" and d.cause["rank"] == 1, (d.label, d.cause)
    # nothing new on either side: no new merge
    looks, n = mine.looks, len(merges)
    assert wait_for(lambda: mine.looks >= looks + 3, timeout=30)
    assert len(merges) == n
    # node 1's watchdog stops publishing: after live_stale_s its ranks leave the leader's live diagnosis
    theirs.close()
    assert wait_for(lambda: not merges[-1][1].steps, timeout=30), merges[-1]


def hostile(leader: Correlator, key: str, doc: dict) -> None:
    leader.store.set_json(key, doc)


def live_doc(k: int, rank: int, **extra) -> dict:
    steps, samples = node(rank, NODE1_CLOCK, **SLOW_PATH)
    base = {"node": "evil", "boot": 1.0, "seq": 1, "issued": round(time.time(), 3)}
    return history_doc(k, {rank: steps}, samples, 200, 64, 1024, {**base, **extra})


def test_forged_replayed_and_misplaced_values_are_refused(pair):
    leader, _follower, (mine, _theirs), merges = pair
    steps0, samples0 = node(0, 10**9, **FAST_PATH)
    mine.offer(Offer({0: steps0}, samples0, "host-a", 4))
    with structlog.testing.capture_logs() as logs:
        hostile(leader, "live/1", live_doc(2, 1))  # node 2's value under node 1's key
        hostile(leader, "live/2", live_doc(2, 2, issued=time.time() - 3600))  # an earlier run's, replayed
        assert wait_for(lambda: sum(e.get("event") == "store_value_rejected" for e in logs) >= 2, timeout=30), logs
    assert not any(r.steps for _, r in merges)
    # the leader's own rank, another node's rank already taken, and a rank beyond the job are not taken
    hostile(leader, "live/1", live_doc(1, 0))
    hostile(leader, "live/2", live_doc(2, 7))
    looks = mine.looks
    assert wait_for(lambda: mine.looks >= looks + 3, timeout=30)
    assert not any(r.steps for _, r in merges), merges[-1]
    # a value older than one already seen of the node is a replay
    hostile(leader, "live/1", live_doc(1, 1, boot=5.0, seq=9))
    assert wait_for(lambda: any(1 in r.steps for _, r in merges), timeout=30)
    hostile(leader, "live/1", live_doc(1, 3, boot=5.0, seq=8))
    looks = mine.looks
    assert wait_for(lambda: mine.looks >= looks + 3, timeout=30)
    assert not any(3 in r.steps for _, r in merges), merges[-1]
    assert mine._bad.get(1) is not None  # refused (logged once per key: the first refusal above)


@pytest.mark.parametrize("pair", [b"s3cret-s3cret-s3cret-s3cret-32b!"], indirect=True)
def test_with_a_secret_an_unsealed_value_is_refused(pair):
    leader, _follower, (mine, theirs), merges = pair
    steps0, samples0 = node(0, 10**9, **FAST_PATH)
    mine.offer(Offer({0: steps0}, samples0, "host-a", 2))
    text = json.dumps(live_doc(1, 1)).encode()
    with structlog.testing.capture_logs() as logs:
        # written past the secret: the raw client under the job's key
        leader.store._io.call(lambda: leader.store._store.set(leader.store._k("live/1"), text), "forge")
        assert wait_for(lambda: any(e.get("event") == "store_value_rejected" for e in logs), timeout=30), logs
    assert not any(r.steps for _, r in merges)
    # node 1's own sealed value is taken
    steps1, samples1 = node(1, NODE1_CLOCK, **SLOW_PATH)
    theirs.offer(Offer({1: steps1}, samples1, "host-b", 2))
    assert wait_for(lambda: any(1 in r.steps for _, r in merges), timeout=30)
