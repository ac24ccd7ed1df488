"""Two simulated nodes on one machine: two `rankwatch run` agents, separate shm dirs and daemons,
one TCPStore. Both nodes' bundles must carry the same verdict naming the initiating global rank.

Most jobs run one rank per node: what is checked is the exchange between the nodes, and every rank is a
torch start-up (~1.6 s of CPU) beside its node's torchrun agent. Two ranks per node where the node's second
rank is the point: a fault on a node's local rank 1 (global rank = node_rank * nproc + local_rank), and the
flight-recorder cases, where rank 0 waits one collective behind its node's peer."""

from __future__ import annotations

import json
import time

import pytest
from conftest import (
    DEMO,
    REPO,
    examples_module,
    free_port,
    rankwatch_cmd,
    resolve_and_decide,
    torchrun_args,
    wait_for,
)

TRANSFORMER = str(REPO / "examples" / "transformer_demo.py")
# the right kind and phase of each fault: the catalogue's (examples/fault_catalogue.py)
FAULTS = examples_module("fault_catalogue").FAULTS


def start_node(
    procs,
    tmp_path,
    node_rank: int,
    master_port: int,
    store_port: int,
    scenario_args: list[str],
    extra: tuple[str, ...] = (),
    script: str = DEMO,
    nproc: int = 2,
):
    out, shm = tmp_path / f"out{node_rank}", tmp_path / f"shm{node_rank}"
    cmd = rankwatch_cmd(
        "run",
        "--out",
        str(out),
        "--shm-dir",
        str(shm),
        "--run-name",
        "mn",
        "--store",
        f"127.0.0.1:{store_port}",
        "--stall-timeout",
        "3",
        "--json-logs",
        *extra,
        "--",
        *torchrun_args(nproc, "mn", script, *scenario_args, nnodes=2, node_rank=node_rank, master_port=master_port),
    )
    return procs.start(cmd, text=True), out


def verdicts(out):
    inc = out / "incidents"
    if not inc.exists():
        return []
    return [json.loads((p / "verdict.json").read_text()) for p in sorted(inc.iterdir()) if not p.name.startswith(".")]


def one_verdict_each(nodes, timeout: float) -> tuple[dict, dict]:
    """Wait for both agents (``--on-stall kill`` ends the job) and return each node's single verdict."""
    for proc, _ in nodes:
        try:
            proc.wait(timeout=timeout)
        except Exception:
            pass
    found = [verdicts(out) for _, out in nodes]
    assert all(len(v) == 1 for v in found), [p.stderr.read()[-3000:] for p, _ in nodes]
    return found[0][0], found[1][0]


@pytest.mark.parametrize(
    ("scenario", "rank", "nproc"),
    [
        # node 1's local rank 1: the other node's rank (a rank spinning in forward on the other node is the same
        # exchange: test_store_auth.py's signed daemons; one node's compute hang: test_watchdog_e2e.py)
        ("input-hang", 3, 2),
        ("dead-rank", 1, 1),
        ("input-hang", 0, 1),  # the leader's own rank
    ],
)
def test_both_nodes_agree_on_the_initiating_rank(procs, tmp_path, scenario, rank, nproc):
    expect = FAULTS[scenario]
    master, store = free_port(), free_port()
    args = ["--scenario", scenario, "--fault-rank", str(rank), "--fault-step", "4", "--steps", "400"]
    nodes = [start_node(procs, tmp_path, k, master, store, args, ("--on-stall", "kill"), nproc=nproc) for k in (0, 1)]
    v0, v1 = one_verdict_each(nodes, timeout=180)
    assert v0["initiating_ranks"] == expect.ranks(rank) and v0["kind"] in expect.kinds, "\n".join(
        [v0["reason"], *v0["evidence"]]
    )
    if expect.phase:
        assert v0["phase"] == expect.phase
    # one verdict, the same on both nodes
    for key in ("incident_id", "kind", "initiating_ranks", "phase", "reason", "confidence"):
        assert v0[key] == v1[key], key
    every_rank = {str(r) for r in range(2 * nproc)}
    assert set(v0["ranks"]) == every_rank
    assert v0["correlation"].startswith("leader node 0 over 2 node(s)")
    # the leader's end-of-run summary covers the ranks of both nodes
    summary0 = json.loads((nodes[0][1] / "summary.json").read_text())
    assert set(summary0["ranks"]) == every_rank


@pytest.mark.parametrize(
    "scenario", ["input-hang", "skipped-collective"],
)
def test_the_leader_weighs_the_other_nodes_flight_recorder(procs, tmp_path, scenario):
    """A transformer under DDP broadcasts its buffers at the start of every forward: with rank 2 (node 1)
    stuck, rank 0 — the broadcast's root — waits one collective behind its node's peer, and on its own
    node's recorder alone looks like the rank that is late. The leader must read node 1's recorder too."""
    master, store = free_port(), free_port()
    args = ["--scenario", scenario, "--fault-rank", "2", "--fault-step", "4", "--steps", "400", "--pg-timeout-s", "60"]
    nodes = [
        start_node(procs, tmp_path, k, master, store, args, ("--on-stall", "kill"), script=TRANSFORMER)
        for k in (0, 1)
    ]
    v0, v1 = one_verdict_each(nodes, timeout=240)
    expect = FAULTS[scenario]
    assert v0["kind"] in expect.kinds and v0["initiating_ranks"] == expect.ranks(2), "\n".join(
        [v0["reason"], *v0["evidence"]]
    )
    if expect.phase:
        assert v0["phase"] == expect.phase
    assert v0["flight_recorder"]["ranks"] == [0, 1, 2, 3] and v0["decided_by"] == "flight_recorder"
    for key in ("incident_id", "kind", "initiating_ranks", "reason"):
        assert v0[key] == v1[key], key


def test_leader_still_reports_when_the_other_nodes_watchdog_is_killed(procs, tmp_path):
    master, store = free_port(), free_port()
    scenario, fault_rank = "input-hang", 0  # the leader's own rank: its verdict needs no other node
    expect = FAULTS[scenario]
    args = ["--scenario", scenario, "--fault-rank", str(fault_rank), "--fault-step", "15", "--steps", "400"]
    node0, out0 = start_node(procs, tmp_path, 0, master, store, args, nproc=1)
    node1, _out1 = start_node(procs, tmp_path, 1, master, store, args, nproc=1)
    # node 1's rank keeps running; only its watchdog (the rankwatch run process) dies, mid-run
    assert wait_for(lambda: (tmp_path / "shm1" / "mn" / "rank-1.hb").exists(), timeout=120)
    time.sleep(1.0)
    node1.kill()
    assert wait_for(lambda: verdicts(out0), timeout=120), node0.stderr
    v = verdicts(out0)[0]
    assert v["initiating_ranks"] == expect.ranks(fault_rank) and v["kind"] in expect.kinds, v
    assert v["phase"] == expect.phase
    # node 1's rank is there in the verdict, marked as missing: its evidence never came
    assert v["missing_ranks"] == [1] and v["ranks"]["1"]["state"] == "missing", v


def test_garbage_in_the_store_is_rejected_with_a_log_line(procs, tmp_path):
    import datetime

    import torch.distributed as dist
    from rankwatch.watchdog.cluster.correlate import Correlator
    from rankwatch.watchdog.core.policy import CorrelationPolicy

    port = free_port()
    leader = Correlator("g", 0, "127.0.0.1", port)
    assert wait_for(lambda: leader.store is not None, timeout=30)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("rankwatch/g/incident/current", b"\x80\x04not json, maybe a pickle")
    follower = Correlator("g", 1, "127.0.0.1", port, policy=CorrelationPolicy(verdict_timeout_s=1.0))
    assert wait_for(lambda: follower.store is not None, timeout=30)
    assert follower.poll_incident() is None
    client.set(
        "rankwatch/g/incident/current",
        json.dumps({"schema": "rankwatch.incident/1", "gen": "1; rm -rf /", "id": "x", "by": 0, "trigger": {}}),
    )
    assert follower.poll_incident() is None
    client.set("rankwatch/g/verdict/1", b'{"schema": "rankwatch.verdict/1", "kind": "__import__(\'os\')"}')
    client.set("rankwatch/g/node/0", b"[" * 100000)
    from rankwatch.watchdog.core.snapshot import RankView
    from rankwatch.watchdog.verdict import decide

    view = RankView(
        rank=2, node="n1", pid=5, state="running", step=3, phase="forward", in_phase_s=9.0, since_progress_s=9.0
    )
    from rankwatch.watchdog.cluster.correlate import SharedIncident

    inc = SharedIncident(gen=1, incident_id="inc", by_node=1, trigger={})
    verdict, how, decided_here = resolve_and_decide(
        follower,
        inc,
        [view],
        "n1",
        4,
        lambda vs, notes, how, remote_fr: decide(
            vs, job_id="g", incident_id="inc", detected_after_s=1.0, extra_evidence=notes
        ).document(),
    )
    assert decided_here
    assert how.startswith("local")
    assert verdict["initiating_ranks"] == [2]
    leader.close()
    follower.close()


def test_published_verdict_is_slim_for_very_large_jobs():
    from rankwatch.watchdog.core.policy import CorrelationPolicy
    from rankwatch.watchdog.core.snapshot import RankView
    from rankwatch.watchdog.verdict import decide

    views = [
        RankView(
            rank=r,
            node=f"n{r // 8}",
            pid=r + 10,
            state="running",
            step=5,
            phase="backward",
            in_phase_s=9.0,
            since_progress_s=9.0,
        )
        for r in range(4096)
    ]
    views[1234] = RankView(
        rank=1234, node="n154", pid=9, state="running", step=5, phase="dataloader", in_phase_s=9.0, since_progress_s=9.0
    )
    doc = decide(views, job_id="big", incident_id="i", detected_after_s=9.0).document()
    full = doc.to_json()
    assert full["initiating_ranks"] == [1234]
    assert "ranks 0–1233, 1235–4095 wait" in full["reason"]
    slim = doc.slimmed(CorrelationPolicy().slim_verdict_above_ranks).to_json()
    assert list(slim["ranks"]) == ["1234"] and slim["ranks_slimmed"]
    assert len(json.dumps(slim)) < 100_000 < len(json.dumps(full))


def test_shared_histories_keep_the_input_pipeline_and_reject_malformed_entries():
    from rankwatch.watchdog.cluster.correlate import parse_history
    from rankwatch.watchdog.cluster.store import ValueRejected

    def doc(steps):
        return json.dumps({"schema": "rankwatch.history/1", "node_rank": 1, "ranks": {"4": steps}}).encode()

    (t,) = parse_history(doc([[7, 0, 5_000_000, {"dataloader": 2.5}, [61.0, 1, 2]]]))[4]
    assert (t.step, t.input_ms, t.input_batches, t.input_workers) == (7, 61.0, 1, 2)
    (old,) = parse_history(doc([[7, 0, 5_000_000, {"dataloader": 2.5}]]))[4]  # a node without input timing
    assert (old.input_ms, old.input_batches) == (0.0, 0)
    for bad in ([1.0, 1], "x", [1.0, -1, 2], [1.0, 1, 1 << 20], [float("inf"), 1, 1]):
        with pytest.raises(ValueRejected):
            parse_history(doc([[7, 0, 5, {}, bad]]))
