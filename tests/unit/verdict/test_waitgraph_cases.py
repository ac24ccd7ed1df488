"""The misclassifications of issue #19, as pure verdicts over constructed views and flight-recorder dumps.

Each case named the wrong rank with the weighed ladder; the wait-for graph names the sink: the rank every
waiting rank waits for, directly or through others, that itself waits for nobody.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from rankwatch.watchdog.core.facts import PriorVerdict
from rankwatch.watchdog.core.fr_analysis import analyze_fr
from rankwatch.watchdog.core.fr_facts import fr_facts
from rankwatch.watchdog.core.fr_trace import parse_dump
from rankwatch.watchdog.core.rules.recorder import fr_behind
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.core.verdict import decide


def rv(rank: int, **kw: Any) -> RankView:
    base: dict[str, Any] = dict(
        rank=rank, node="n0", pid=1000 + rank, state="running", step=10, phase="collective", in_phase_s=30.0,
        since_progress_s=30.0, coll_seq=10, coll_done=10, coll_op="all_reduce",
    )
    base.update(kw)
    return RankView(**base)


def verdict(views: list[RankView], **kw: Any) -> dict[str, Any]:
    return decide(views, job_id="j", incident_id="i", detected_after_s=31.0, **kw).to_json()


def entry(rid: int, pg: str, seq: int, op: str, *, done: bool, p2p: bool = False, p2p_seq: int = 0) -> dict[str, Any]:
    return {
        "record_id": rid, "pg_id": 0, "process_group": [pg, "default_pg" if pg == "0" else "undefined"],
        "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": rid, "profiling_name": f"gloo:{op}",
        "time_created_ns": rid, "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]],
        "output_dtypes": ["Float"], "state": "scheduled", "retired": done, "is_p2p": p2p,
    }


def dump(entries: list[dict[str, Any]], groups: dict[str, list[int]], status: dict[str, int] | None = None) -> Any:
    doc: dict[str, Any] = {
        "version": "2.10",
        "pg_config": {name: {"name": name, "desc": "default_pg" if name == "0" else "undefined",
                             "ranks": str(ranks)} for name, ranks in groups.items()},
        "pg_status": {"0": {"last_enqueued_collective": str(v), "last_started_collective": "-1",
                            "last_completed_collective": str(v - 1)} for v in ([status["0"]] if status else [])},
        "entries": entries,
    }
    return doc


def hints_of(dumps: dict[int, Any]):  # type: ignore[no-untyped-def]
    return fr_facts(analyze_fr({r: parse_dump(d, r) for r, d in dumps.items()}))


# -- pipeline parallel: p2p ops are not "behind" -------------------------------------------------------


def _pipeline_dumps() -> dict[int, Any]:
    """4 stages on the default group (gloo: one counter for collectives and p2p). Stage 2 spins in its
    forward; stages 0, 1, 3 wait in send/recv. The middle stages issue the most ops by design."""
    world = {"0": [0, 1, 2, 3]}
    out: dict[int, Any] = {}
    counts = {0: 7, 1: 12, 2: 12, 3: 6}
    for r, n in counts.items():
        es = [entry(i, "0", i, "send" if r < 2 else "recv", done=True, p2p=True, p2p_seq=i) for i in range(1, n)]
        es.insert(0, entry(0, "0", 0, "all_reduce", done=True))
        if r != 2:  # the spinning stage has nothing in flight
            es.append(entry(n, "0", n, "recv" if r else "send", done=False, p2p=True, p2p_seq=n))
        out[r] = dump(es, world, {"0": n})
    return out


def _pipeline_views() -> list[RankView]:
    return [
        rv(0, coll_seq=7, coll_done=6, coll_op="send"),
        rv(1, coll_seq=12, coll_done=11, coll_op="recv"),
        rv(2, phase="forward", coll_seq=12, coll_done=12, coll_op="recv", waiting=False),
        rv(3, coll_seq=6, coll_done=5, coll_op="recv"),
    ]


def test_pipeline_stage_that_never_sends_is_named_not_the_stages_with_fewer_ops():
    hints = hints_of(_pipeline_dumps())
    assert fr_behind(hints) == []  # one counter for collectives and p2p: seqs are not compared
    v = verdict(_pipeline_views(), fr_facts=hints)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [2], "forward"), v["reason"]
    assert v["finding"]["rule"] == "wait_for" and v["finding"]["data"]["waiters"] == [0, 1, 3]


def test_pipeline_without_a_flight_recorder_ignores_p2p_counts():
    v = verdict(_pipeline_views())
    assert v["initiating_ranks"] == [2], v["reason"]
    assert v["finding"]["rule"] == "wait_for"


# -- tensor x data parallel: waiting in the TP group is not "behind" in the DP group -------------------


def _tp_dp_dumps() -> dict[int, Any]:
    """8 ranks on 2 nodes: TP groups {0-3} {4-7}, DP groups {r, r+4}. Rank 1 blocks before its TP
    all_reduce #20; ranks 0, 2, 3 wait in it; ranks 4-7 finished their forward and wait in DDP's
    all_reduce #31 of their DP group, which ranks 0-3 never reach."""
    groups = {"tp0": [0, 1, 2, 3], "tp1": [4, 5, 6, 7], **{f"dp{r}": [r, r + 4] for r in range(4)}}
    out: dict[int, Any] = {}
    for r in range(8):
        es = []
        tp = "tp0" if r < 4 else "tp1"
        last_tp = 19 if r == 1 else 20
        rid = 0
        for s in range(1, last_tp + 1):
            rid += 1
            es.append(entry(rid, tp, s, "all_reduce", done=not (r in (0, 2, 3) and s == 20)))
        last_dp = 31 if r >= 4 else 30
        for s in range(1, last_dp + 1):
            rid += 1
            es.append(entry(rid, f"dp{r % 4}", s, "all_reduce", done=not (r >= 4 and s == 31)))
        out[r] = dump(es, groups)
    return out


def _tp_dp_views() -> list[RankView]:
    views = []
    for r in range(8):
        node = "n0" if r < 4 else "n1"
        if r == 1:
            views.append(rv(r, node=node, phase="forward", coll_seq=19, coll_done=19, waiting=False))
        elif r < 4:
            views.append(rv(r, node=node, coll_seq=20, coll_done=19, waiting=True))
        else:
            views.append(rv(r, node=node, phase="backward", coll_seq=20, coll_done=20, waiting=True))
    return views


def test_tp_x_dp_names_the_one_rank_waiting_for_nobody():
    hints = hints_of(_tp_dp_dumps())
    assert {b.rank for b in fr_behind(hints)} == {0, 1, 2, 3}  # per group "behind" blames the whole TP group
    v = verdict(_tp_dp_views(), fr_facts=hints)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [1], "forward"), v["reason"]
    assert v["decided_by"] == "flight_recorder"
    assert v["finding"]["data"]["edge_strength"] == "flight_recorder"


# -- a process-group timeout shorter than the stall timeout ----------------------------------------------


def test_ranks_that_exited_on_a_pg_timeout_point_at_the_alive_rank_waiting_for_nobody():
    timeout = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 8000ms"
    views = [
        rv(0, state="crashed", exit_age_s=1.0, exit_cause=timeout),
        rv(1, phase="forward", coll_seq=9, coll_done=9, waiting=False),
        rv(2, state="crashed", exit_age_s=0.9, exit_cause=timeout),
        rv(3, state="crashed", exit_age_s=0.95, exit_cause=timeout),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [1], "forward"), v["reason"]
    assert v["finding"]["rule"] == "wait_for" and v["finding"]["data"]["via_anyone"] == [0, 2, 3]
    # the one live rank busy is no "shared cause" backing it: the rule says so of every rank, not of one
    assert "waiting" not in v["finding"]["data"].get("backed_by", []), v["evidence"]


# -- a lost node: its ranks are the sinks ------------------------------------------------------------------


def test_a_silent_nodes_ranks_are_named_when_every_answering_rank_waits_for_them():
    lost = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 8000ms"
    views = [
        rv(0, state="crashed", exit_age_s=0.5, exit_cause=lost, coll_seq=50, coll_done=49),
        *(rv(r, coll_seq=50, coll_done=49) for r in (1, 2, 3)),
        rv(4, node="n1", state="missing", coll_seq=50, coll_done=49),
        rv(5, node="n1", state="missing", coll_seq=50, coll_done=49),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("comm_hang", [4, 5]), v["reason"]
    assert v["finding"]["data"]["silent_nodes"] == ["n1"]


def test_a_silent_node_whose_peers_saw_their_connections_closed_is_dead_not_hanging():
    """node-loss: node n1 is SIGKILLed whole (ranks, agent, watchdog). Rank 1's gloo pair reads "Connection
    reset by peer" — the peer's kernel closed it, so the peer's process is gone (a frozen or unreachable
    node gives a timeout instead); rank 0 still waits in DDP's backward. The silent ranks are dead."""
    reset = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
             "[127.0.0.1]:10420: Connection reset by peer. This is typically caused by a remote worker hanging")
    views = [
        rv(0, phase="backward", coll_seq=6, coll_done=6, waiting=None),
        rv(1, state="crashed", exit_age_s=0.2, exit_cause=reset, phase="backward", coll_seq=6, coll_done=6),
        rv(2, node="n1", state="missing", step=0, phase=None, coll_seq=0, coll_done=0),
        rv(3, node="n1", state="missing", step=0, phase=None, coll_seq=0, coll_done=0),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [2, 3]), v["reason"]
    data = v["finding"]["data"]
    assert (data["silent_nodes"], data["peer_ended"], v["decided_by"]) == (["n1"], [1], "missing_node")
    assert v["confidence"] == "medium"  # silence: which of the node's ranks went first cannot be told


# -- after rankwatch's own kill: no second incident blames a rank that lost its peer -------------------


def test_after_a_kill_a_rank_that_lost_its_peer_is_not_blamed():
    lost = "DistNetworkError: Connection closed by peer"
    # node n0 decides alone (node n1's ranks were killed for incident stopped-1, its watchdog is done)
    views = [
        rv(0, state="crashed", exit_age_s=0.2, exit_cause=lost),
        rv(1, state="dead", exit_age_s=0.1),  # torn down by torchrun after rank 0 ended
    ]
    plain = verdict(views)
    assert plain["initiating_ranks"] == [0]  # without the prior verdict, the survivor that lost its peer
    prior = PriorVerdict("stopped-1", (2, 3), killed=True)
    v = verdict(views, prior=prior, killed=(2, 3))
    assert (v["kind"], v["initiating_ranks"], v["follows_incident"]) == ("dead_rank", [2, 3], "stopped-1")
    assert v["finding"]["rule"] == "after_kill" and v["finding"]["data"]["ended"] == [0, 1]


def test_after_a_kill_a_rank_failing_by_its_own_cause_is_still_news():
    views = [rv(0, state="crashed", exit_age_s=0.2, exit_cause="torch.OutOfMemoryError: CUDA out of memory"),
             rv(1)]
    v = verdict(views, prior=PriorVerdict("stopped-1", (1,), killed=True), killed=(1,))
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [0])
    assert "follows_incident" not in v


def test_the_graph_over_8192_ranks_names_one_rank_behind_a_tp_group():
    # one shared target set per collective: the graph stays linear in ranks
    views = [rv(r, node=f"n{r // 8}", coll_seq=20, coll_done=19) for r in range(8192)]
    views[4321] = dataclasses.replace(views[4321], phase="dataloader", coll_seq=19, coll_done=19, waiting=False)
    v = verdict(views)
    assert (v["initiating_ranks"], v["decided_by"]) == ([4321], "counters")


def test_a_recv_waits_for_its_named_sender_not_for_any_busy_rank():
    """NCCL names a p2p op's peer ("nccl:recv 0<-1"): rank 0 waits for 1, 1 for 2; rank 2 spins in forward.
    Rank 3 is busy in its input pipeline too, but nobody waits for it: it is not the sink."""
    world = {"0": [0, 1, 2, 3]}
    dumps: dict[int, Any] = {}
    for r in range(4):
        es = [entry(1, "0", 1, "all_reduce", done=True)]
        es[0]["profiling_name"] = "nccl:all_reduce"
        es[0]["state"] = "completed"
        if r in (0, 1):
            e = entry(2, "0", 0, "recv", done=False, p2p=True, p2p_seq=1)
            e["profiling_name"] = f"nccl:recv {r}<-{r + 1}"
            es.append(e)
        dumps[r] = dump(es, world)
    views = [
        rv(0, coll_seq=2, coll_done=1, coll_op="recv"),
        rv(1, coll_seq=2, coll_done=1, coll_op="recv"),
        rv(2, phase="forward", coll_seq=1, coll_done=1, waiting=False),
        rv(3, phase="dataloader", coll_seq=1, coll_done=1, waiting=False),
    ]
    assert verdict(views)["initiating_ranks"] == [3]  # without peers: the earliest phase of the busy ranks
    v = verdict(views, fr_facts=hints_of(dumps))
    assert (v["initiating_ranks"], v["phase"]) == ([2], "forward"), v["reason"]
    assert v["finding"]["data"]["via_anyone"] == []


def test_prior_verdict_only_with_a_kill_and_a_well_formed_verdict():
    from rankwatch.watchdog.core.engine import prior_verdict

    last = {"incident_id": "stopped-1", "initiating_ranks": [2, 3]}
    assert prior_verdict([last], killed=False) is None  # --on-stall report: every incident stands alone
    assert prior_verdict([], killed=True) is None
    assert prior_verdict([{**last, "initiating_ranks": ["2", True]}], killed=True) is None
    assert prior_verdict([last], killed=True) == PriorVerdict("stopped-1", (2, 3), killed=True)
    with_pids = {**last, "ranks": {"0": {"pid": 1000}, "1": {"pid": "x"}}}
    assert prior_verdict([with_pids], killed=True).pids == {0: 1000}  # type: ignore[union-attr]


def test_after_a_kill_exits_of_a_restarted_generation_are_news():
    views = [rv(0, state="dead", exit_age_s=0.2, pid=4242), rv(1)]  # torchrun restarted: a new pid
    prior = PriorVerdict("stopped-1", (1,), killed=True, pids={0: 1000, 1: 1001})
    v = verdict(views, prior=prior, killed=(1,))
    assert (v["initiating_ranks"], v.get("follows_incident")) == ([0], None)
    same = [rv(0, state="dead", exit_age_s=0.2), rv(1)]  # the process that was decided (pid 1000)
    assert verdict(same, prior=prior, killed=(1,))["follows_incident"] == "stopped-1"


def test_a_weaker_rung_naming_a_proven_waiter_too_does_not_question_the_sink():
    """TP groups of 2 (tpdp-tp2): rank 1 blocks before its TP all_reduce; its TP peer 0 waits in it with a
    stack of its own, the others wait in DDP's backward. "A stack no other rank shares" names {0, 1}, but the
    flight recorder shows rank 0 waiting for rank 1: no disagreement, the sink keeps its confidence."""
    hints = hints_of(_tp_dp_dumps())
    views = [
        dataclasses.replace(v, stack_signature="spin" if v.rank == 1 else "tp_all_reduce" if v.rank == 0
                            else "ddp_backward")
        for v in _tp_dp_views()
    ]
    views[2] = dataclasses.replace(views[2], stack_signature="ddp_backward")
    views[3] = dataclasses.replace(views[3], stack_signature="ddp_backward")
    v = verdict(views, fr_facts=hints)
    assert (v["initiating_ranks"], v["confidence"]) == ([1], "high"), v["evidence"]
    assert "stacks" not in v["finding"]["data"].get("questioned_by", [])


@pytest.mark.parametrize("gone", ["dead", "zombie"])
def test_a_rank_a_monitored_barrier_names_is_the_sink_after_the_launcher_killed_it(gone):
    # rank 0 reports rank 2 missing the barrier and exits, ranks 1, 3 lose rank 0; torchrun then tears rank 2
    # down before the verdict: its end is one more consequence, yet it is the rank the others waited for.
    # Was: dead_rank [0] (low), the reporter named for its own report
    barrier = "RuntimeError: Ranks 2 failed to pass monitoredBarrier in 8000 ms"
    lost = "DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    views = [rv(0, state="crashed", exit_order=0, exit_age_s=2.0, exit_cause=barrier),
             rv(1, state="crashed", exit_order=1, exit_age_s=1.9, exit_cause=lost),
             rv(2, state=gone, exit_order=3, exit_age_s=0.5, phase="forward"),
             rv(3, state="crashed", exit_order=2, exit_age_s=1.9, exit_cause=lost)]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [2], "forward"), v["reason"]


def _node_loss_mid_step(rank1_in_phase_s: float) -> list[RankView]:
    """node-loss caught mid-step: node n1 died in step 7's allreduce, rank 0 entered it and waits, rank 1 is
    still in its own backward (its stack runs its code) ``rank1_in_phase_s`` after its last progress."""
    return [
        rv(0, phase="backward", step=7, coll_seq=7, coll_done=6, waiting=True, in_phase_s=0.4, since_progress_s=0.4),
        rv(1, phase="backward", step=7, coll_seq=6, coll_done=6, waiting=False,
           in_phase_s=rank1_in_phase_s, since_progress_s=rank1_in_phase_s),
        rv(2, node="n1", state="missing", step=7, phase="backward", coll_seq=7, coll_done=6),
        rv(3, node="n1", state="missing", step=7, phase="backward", coll_seq=7, coll_done=6),
    ]


def test_a_live_rank_caught_mid_step_yields_to_the_silent_node():
    """The incident fires at once on the lost node, 0.1 s into rank 1's backward: rank 1 is the one live rank
    rank 0 waits for, but it is working, not holding anyone — the silent node is (was: rank 1, a hang)."""
    v = verdict(_node_loss_mid_step(0.1))
    assert (v["initiating_ranks"], v["decided_by"]) == ([2, 3], "missing_node"), v["reason"]
    assert v["finding"]["data"]["silent_nodes"] == ["n1"]


def test_a_live_rank_stuck_in_its_own_code_is_named_even_beside_a_silent_node():
    """The same layout with rank 1 in its backward for 30 s: a rank that long in its own code is stuck there,
    whatever else is silent (silence is the weaker evidence)."""
    v = verdict(_node_loss_mid_step(30.0))
    assert v["initiating_ranks"] == [1], v["reason"]


def test_a_rank_caught_mid_step_is_still_the_sink_when_nothing_is_silent():
    """Without a silent node a rank just now in its phase is all the graph has: it stays the sink (the rule
    that passes over it needs silent ranks to name instead)."""
    views = [v for v in _node_loss_mid_step(0.1) if v.rank < 2]
    views += [dataclasses.replace(views[0], rank=r, pid=1000 + r) for r in (2, 3)]
    v = verdict(views)
    assert v["initiating_ranks"] == [1], v["reason"]


def test_of_the_ranks_a_monitored_barrier_names_the_one_still_in_its_step_is_the_sink():
    """Under load a healthy rank reaches the barrier after its timeout too: rank 0's report names ranks 1 and 2,
    then torchrun tears both down. Rank 1's record was between phases (it had reached the barrier, which is no
    step stage), rank 2's in forward (it never did): rank 2 (was: ranks 1, 2 — the CI run at load 20)."""
    barrier = "RuntimeError: Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms"
    lost = "DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    views = [rv(0, state="crashed", exit_order=0, exit_age_s=2.0, exit_cause=barrier),
             rv(1, state="dead", exit_order=2, exit_age_s=0.5, phase="idle", step=0),
             rv(2, state="dead", exit_order=3, exit_age_s=0.5, phase="forward", step=0),
             rv(3, state="crashed", exit_order=1, exit_age_s=1.9, exit_cause=lost)]
    v = verdict(views)
    assert (v["initiating_ranks"], v["phase"]) == ([2], "forward"), v["reason"]
    # both still in their step: the report stands as it is
    both = [views[0], dataclasses.replace(views[1], phase="backward"), views[2], views[3]]
    assert verdict(both)["initiating_ranks"] == [1, 2]
