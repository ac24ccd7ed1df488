"""Host signals across nodes (issue 41): each node shares its ranks' host-signal samples with its step history
(``rankwatch.history/1``, ``signals``), so the leader's end-of-run cause sets a rank's TCP path against its peers'
on other nodes — a node's watchdog alone sees only its own ranks, and all ranks of a slow node look alike to it.

On a real loopback TCPStore, two Correlators (the leader, node 0, and node 1). The figures are the ones measured in
``tests/e2e/test_network_cause.py``'s capped run: node 1's way out capped at 20 Mbit/s delivered its rank's data at
~19.5 Mbit/s with a ~20 ms round trip, its peer's veth ~100 Gbit/s at ~0.2 ms. Node 1's clock is far from node 0's
(another host's CLOCK_MONOTONIC): each rank is only compared over its own window, on its own node's clock.
Every store value may be hostile: a malformed ``signals`` entry rejects that node's history, with a log line.
"""

from __future__ import annotations

import itertools
import json

import pytest
import structlog
from conftest import free_port, wait_for
from rankwatch.watchdog.cluster.correlate import Correlator, parse_history_full, with_other_nodes
from rankwatch.watchdog.cluster.store import ValueRejected
from rankwatch.watchdog.core.host_signals import GpuState, NetCounters, RankCounters
from rankwatch.watchdog.core.policy import CorrelationPolicy
from rankwatch.watchdog.core.steps import StepTiming
from rankwatch.watchdog.core.straggler import StragglerDiagnosis
from rankwatch.watchdog.core.straggler_cause import explain, thin_samples

POLL_NS, STEP_NS, STEPS = 250_000_000, 70_000_000, 250
NODE1_CLOCK = 7_000 * 10**9  # node 1's CLOCK_MONOTONIC runs 7000 s ahead of node 0's


def counters(t_ns: int, since_ns: int, *, rate_bps: int, rtt_us: int, net: bool) -> RankCounters:
    s = (t_ns - since_ns) / 1e9
    return RankCounters(
        start_ticks=7, run_ns=int(0.4e9 * s), wait_ns=int(5e6 * s), cpu_ticks=0, majflt=0, nvcsw=0,
        throttled_us=0, nr_throttled=0, cpu_some_us=0, mem_some_us=0, io_some_us=0, cgroup="/job",
        net=NetCounters(sockets=3, bytes_sent=int(2e6 * s), bytes_acked=int(2e6 * s), retrans=0, busy_us=0,
                        rtt_us=rtt_us, delivery_bps=rate_bps) if net else None,
        gpu=GpuState(device=0, sm_clock_mhz=1980, sm_clock_max_mhz=1980, reasons=0, xids=0),
    )


def node(rank: int, clock: int, **net_kw: int) -> tuple[list[StepTiming], list[tuple[int, dict[int, RankCounters]]]]:
    """One rank's steps and its node's samples (a poll every 250 ms, a TCP dump every 2 s, as the reader does)."""
    steps = [StepTiming(step=i, start_ns=clock + i * STEP_NS, end_ns=clock + (i + 1) * STEP_NS,
                        phases_ms={"forward": 5.0, "collective": 60.0}) for i in range(STEPS)]
    samples = [(clock + i * POLL_NS, {rank: counters(clock + i * POLL_NS, clock, net=i % 8 == 0, **net_kw)})
               for i in range(STEPS * STEP_NS // POLL_NS + 2)]
    return steps, samples


@pytest.fixture
def nodes():
    port = free_port()
    leader = Correlator("hs", 0, "127.0.0.1", port, nnodes=2)
    assert wait_for(lambda: leader.store is not None, timeout=30), leader.error
    follower = Correlator("hs", 1, "127.0.0.1", port, nnodes=2)
    assert wait_for(lambda: follower.store is not None, timeout=30), follower.error
    yield leader, follower
    follower.close()
    leader.close()


def diagnosis(history: dict[int, list[StepTiming]]) -> StragglerDiagnosis:
    wins = {r: (s[-200].start_ns, s[-1].end_ns, 200) for r, s in history.items()}
    return StragglerDiagnosis("COMMUNICATION-BOUND", [], None, "", 200, {}, {}, {}, windows=wins)


def test_the_leader_names_the_path_of_a_rank_on_another_node(nodes):
    leader, follower = nodes
    steps0, samples0 = node(0, 10**9, rate_bps=12_500_000_000, rtt_us=200)
    steps1, samples1 = node(1, NODE1_CLOCK, rate_bps=2_437_500, rtt_us=20_530)  # 19.5 Mbit/s, 20.53 ms
    # alone, each node's watchdog has one rank and no peer to set it against: no cause
    assert explain(diagnosis({0: steps0}), samples0).cause is None
    follower.publish_history({1: steps1}, samples1)
    remote: dict[int, list[tuple[int, RankCounters]]] = {}
    got = leader.gather_histories(10.0, remote)
    assert [s.step for s in got[1]] == list(range(STEPS - 200, STEPS))
    rows = remote[1]
    # bounded, in time order, on node 1's clock, every TCP dump of the window kept
    assert len(rows) <= CorrelationPolicy().history_samples_per_rank
    assert all(a[0] < b[0] for a, b in itertools.pairwise(rows)) and rows[0][0] >= NODE1_CLOCK
    dumps = [t for t, c in rows if c.net is not None]
    assert len(dumps) == len([t for t, by in samples1 if by[1].net is not None
                              and steps1[-200].start_ns - POLL_NS < t < steps1[-1].end_ns + POLL_NS])
    assert rows[-1][1].gpu == samples1[-1][1][1].gpu and rows[-1][1].cgroup == "/job"
    history = {0: steps0, **got}
    samples = with_other_nodes(samples0, history, [0], remote, CorrelationPolicy())
    d = explain(diagnosis(history), samples)
    assert d.cause is not None and d.cause["cause"] == "network_path" and d.cause["rank"] == 1, d.cause
    tcp = d.cause["signals"]["tcp"]
    assert (tcp["delivery_mbps"], tcp["peers_delivery_mbps"]) == (19.5, 100_000.0), tcp
    assert set(d.signals) == {"0", "1"} and d.signals["1"]["tcp_rtt_ms"] == 20.53


def test_paths_alike_on_both_nodes_name_nobody(nodes):
    leader, follower = nodes
    steps0, samples0 = node(0, 10**9, rate_bps=12_500_000_000, rtt_us=200)
    steps1, samples1 = node(1, NODE1_CLOCK, rate_bps=9_000_000_000, rtt_us=240)
    follower.publish_history({1: steps1}, samples1)
    remote: dict[int, list[tuple[int, RankCounters]]] = {}
    history = {0: steps0, **leader.gather_histories(10.0, remote)}
    d = explain(diagnosis(history), with_other_nodes(samples0, history, [0], remote, CorrelationPolicy()))
    assert d.cause is None and set(d.signals) == {"0", "1"}


def doc(signals) -> bytes:
    step = [7, 0, 5_000_000, {"forward": 2.5}, [0.0, 0, 0]]
    return json.dumps({"schema": "rankwatch.history/1", "node_rank": 1, "ranks": {"4": [step]},
                       "signals": signals}).encode()


def row(t: int = 10, cg: int = 0, **kw) -> list:
    r = [t, cg, 7, 100, 5, 0, 0, 0, 0, 0, 0, 0, 0, None, None]
    for i, v in kw.items():
        r[int(i[1:])] = v
    return r


def test_the_shared_signals_read_back_and_hostile_ones_are_rejected():
    _, sig = parse_history_full(doc({"4": {"cgroups": ["/a", "/b"], "rows": [row(10), row(20, 1)]}}))
    assert [(t, c.cgroup, c.run_ns) for t, c in sig[4]] == [(10, "/a", 100), (20, "/b", 100)]
    assert parse_history_full(doc(None))[1] == {}  # a node that shares none (sampling off, an older version)
    net = [3, 10, 10, 0, 0, 200, 1000]
    assert parse_history_full(doc({"4": {"cgroups": [], "rows": [row(_13=net)]}}))[1][4][0][1].net.rtt_us == 200
    bad = [
        [],  # not an object
        {"5": {"cgroups": [], "rows": []}},  # a rank the node shared no steps of
        {"x": {"cgroups": [], "rows": []}},
        {"4": {"cgroups": ["/a"] * 9, "rows": []}},  # too many cgroups
        {"4": {"cgroups": [], "rows": [row()] * 257}},  # more rows than a rank may share
        {"4": {"cgroups": [], "rows": [row(20), row(10)]}},  # out of time order
        {"4": {"cgroups": ["/a"], "rows": [row(cg=1)]}},  # a cgroup index past the list
        {"4": {"cgroups": [], "rows": [row(_3=True)]}},  # a bool is no counter
        {"4": {"cgroups": [], "rows": [row(_3=-2)]}},  # below MISSING
        {"4": {"cgroups": [], "rows": [row(_3=1.5)]}},
        {"4": {"cgroups": [], "rows": [row(_3=1 << 64)]}},
        {"4": {"cgroups": [], "rows": [row()[:-1]]}},  # a field short
        {"4": {"cgroups": [], "rows": [row(_13=[1, 2])]}},  # net cut short
        {"4": {"cgroups": [], "rows": [row(_14=[0] * 3)]}},  # gpu cut short
        {"4": {"cgroups": [], "rows": [row(_14=[None] * 15)]}},  # a gpu without its device
        {"4": {"cgroups": [7], "rows": [row()]}},  # a cgroup that is no string
    ]
    for b in bad:
        with pytest.raises(ValueRejected):
            parse_history_full(doc(b))


def test_a_hostile_signals_entry_rejects_that_nodes_history_with_a_log_line(nodes):
    leader, _follower = nodes
    leader.store.set_json("history/1", json.loads(doc({"4": {"cgroups": [], "rows": [row(20), row(10)]}})))
    remote: dict[int, list[tuple[int, RankCounters]]] = {}
    with structlog.testing.capture_logs() as logs:
        assert leader.gather_histories(5.0, remote) == {} and remote == {}
    assert any(e.get("event") == "store_value_rejected" and "history/1" in str(e) for e in logs), logs


def test_thinning_keeps_the_ends_and_the_tcp_dumps():
    _, samples = node(0, 10**9, rate_bps=1, rtt_us=1)
    thin = thin_samples(samples, 40)
    assert len(thin) <= 40 and thin[0] == samples[0] and thin[-1] == samples[-1]
    dumps = [s for s in samples if s[1][0].net is not None]
    assert len(dumps) <= 20 or sum(1 for s in thin if s[1][0].net is not None) == 20
    assert thin_samples(samples[:10], 40) == samples[:10]
