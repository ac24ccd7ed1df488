"""A wait cycle of sends and recvs with one new edge names its waiter (issue 44 item 5, pp-wrong-peer;
``core.rules.peers``), over constructed views as the hook's record gives them (the send/recv a rank is in, its
peer, and the peers it exchanged with before); anything less certain keeps today's answer (a cycle names nobody)."""

from __future__ import annotations

from typing import Any

from rankwatch.hooks.record import RecordSnapshot
from rankwatch.watchdog.core.facts import P2P_PEER, FactSet, KnownPeers, Rung, Waits
from rankwatch.watchdog.core.live_facts import live_facts
from rankwatch.watchdog.core.rules.peers import rule_wrong_peer
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.observe.wire import snapshot_from_doc, snapshot_to_doc
from rankwatch.watchdog.verdict import decide

# 4 GPipe stages, each exchanging with the stages beside it every step (what the record learned by step 5)
PIPE_PEERS = {0: {1}, 1: {0, 2}, 2: {1, 3}, 3: {2}}


def stage(rank: int, op: str, peer: int | None, *, known: set[int] | None = None, seq: int = 87, **kw: Any) -> RankView:
    base: dict[str, Any] = dict(
        rank=rank, node="n0", pid=1000 + rank, state="running", step=5, phase="collective", in_phase_s=30.0,
        since_progress_s=30.0, coll_seq=seq, coll_done=seq - 1, coll_op=op, p2p_dir=op, p2p_peer=peer,
        p2p_known=frozenset(PIPE_PEERS[rank] if known is None else known))
    return RankView(**{**base, **kw})


def wrong_peer_at_2(*over: RankView) -> list[RankView]:
    """Stage 2 posts its first recv of step 5 from stage 0: 0 waits to send to 1 (or for its gradient), 1 to send
    to 2, 3 for 2's activation; 2 for 0, which never sends to it."""
    views = {0: stage(0, "send", 1, seq=45), 1: stage(1, "send", 2), 2: stage(2, "recv", 0),
             3: stage(3, "recv", 2, seq=45)}
    views.update({v.rank: v for v in over})
    return [views[r] for r in sorted(views)]


def verdict(views: list[RankView]) -> dict[str, Any]:
    return decide(views, job_id="j", incident_id="i", detected_after_s=30.0).to_json()


def test_the_one_new_edge_of_a_send_recv_cycle_names_its_waiter():
    v = verdict(wrong_peer_at_2())
    f = v["finding"]
    assert (v["initiating_ranks"], v["kind"], v["confidence"]) == ([2], "collective_mismatch", "high"), v["reason"]
    assert (f["rule"], f["data"]["shape"]) == ("wrong_peer", "wrong_peer")
    assert (f["data"]["peer"], f["data"]["known"]) == (0, [1, 3])
    assert [e["rank"] for e in f["data"]["cycle"]] == [0, 1, 2]  # 3 waits for the cycle, not in it
    assert v["decided_by"] == "counters"
    # the words name it and its wrong peer (how they read: test_verdict_words.py style, here only that they exist)
    assert "rank 2" in v["reason"] and "never exchanged" in v["reason"]


def test_the_same_cycle_at_the_last_stage():
    # the fault one stage later (the suite's hogs-2 position): 3 posts its recv from 1; 1 sends to 2, 2 to 3
    v = verdict(wrong_peer_at_2(stage(2, "send", 3), stage(3, "recv", 1, seq=45)))
    assert (v["initiating_ranks"], v["kind"]) == ([3], "collective_mismatch"), v["reason"]


def test_the_waits_go_to_the_named_peers_not_to_anyone():
    facts = live_facts(wrong_peer_at_2(), None, exit_tolerance_s=0.5)
    assert {w.rank: (w.on, w.source, w.strength) for w in facts.waits} == {
        r: (frozenset({p}), P2P_PEER, Rung.COUNTERS) for r, p in {0: 1, 1: 2, 2: 0, 3: 2}.items()}
    assert {k.rank: k.peers for k in facts.peers} == {r: frozenset(p) for r, p in PIPE_PEERS.items()}


def test_a_cycle_of_known_edges_or_of_several_new_ones_names_nobody():
    # a genuine deadlock of the schedule itself (every edge an old one): nothing tells which side is wrong
    known = verdict(wrong_peer_at_2(stage(2, "recv", 0, known={0, 1, 3})))
    assert known["initiating_ranks"] == [], known["reason"]
    # two new edges in the cycle
    two = verdict(wrong_peer_at_2(stage(1, "send", 2, known={0})))
    assert two["initiating_ranks"] == [], two["reason"]


def test_peers_not_known_or_a_first_exchange_name_nobody():
    # one waiter's peers past the record's slots: any of its edges could be new
    full = verdict(wrong_peer_at_2(stage(1, "send", 2, known=set(), p2p_known=None)))
    assert full["initiating_ranks"] == [], full["reason"]
    # the new edge's waiter never exchanged with anyone yet (its first step): not a wrong schedule, a first one
    first = verdict(wrong_peer_at_2(stage(2, "recv", 0, known=set())))
    assert first["initiating_ranks"] == [], first["reason"]


def test_a_peer_not_named_keeps_the_old_wait_for_anyone():
    # a recv from any source (no peer in the record): it waits for anyone, no cycle is drawn
    v = verdict(wrong_peer_at_2(stage(2, "recv", None)))
    assert v["initiating_ranks"] == [] and v["finding"]["rule"] != "wrong_peer", v["reason"]


def test_a_busy_stage_is_the_sink_the_pipeline_waits_for():
    # pp (stage-spin): stage 1 spins in forward; 0 waits to send to it, 2 to receive from it, 3 from 2
    views = [stage(0, "send", 1, seq=45), stage(1, "recv", 0, phase="forward", coll_done=87),
             stage(2, "recv", 1), stage(3, "recv", 2, seq=45)]
    v = verdict(views)
    assert (v["initiating_ranks"], v["kind"], v["phase"]) == ([1], "hang", "forward"), v["reason"]
    assert v["finding"]["rule"] == "wait_for"


def test_a_busy_rank_beside_the_cycle_lowers_the_rule_to_medium():
    facts = FactSet(ranks=(0, 1, 2, 3), waits=[
        Waits(r, frozenset({p}), "", 9, op, Rung.COUNTERS, P2P_PEER)
        for r, p, op in ((0, 1, "send"), (1, 2, "send"), (2, 0, "recv"))],
        peers=[KnownPeers(r, frozenset(PIPE_PEERS[r])) for r in (0, 1, 2)])
    f = rule_wrong_peer(facts)
    assert f is not None and (f.ranks, f.confidence) == ([2], "medium")  # rank 3 not waiting: maybe what holds it


def test_the_readers_wire_carries_the_peers():
    snap = RecordSnapshot(
        path="p", pid=1, global_rank=2, local_rank=2, world_size=4, local_world_size=4, node_rank=0, device=-1,
        hostname="h", job_id="j", start_ns=1, flags=0, phase_names=("collective",), phase_budget_s=(0.0,), step=5,
        step_start_ns=1, phase="collective", phase_start_ns=1, last_progress_ns=1, transitions=3,
        coll_seq_entered=87, coll_seq_completed=86, coll_op="recv", budget_s=0.0, budget_start_ns=0, exit_ns=0,
        steps_done=5, p2p_dir="recv", p2p_peer=0, p2p_known=(1, 3), p2p_known_full=False)
    back = snapshot_from_doc(snapshot_to_doc(snap), "p")
    assert (back.p2p_dir, back.p2p_peer, back.p2p_known, back.p2p_known_full) == ("recv", 0, (1, 3), False)
    doc = snapshot_to_doc(snap)
    for bad in ({"p2p_dir": "sideways"}, {"p2p_known": list(range(100))}, {"p2p_peer": -3}):
        try:
            snapshot_from_doc({**doc, **bad}, "p")
        except Exception as exc:  # WireError
            assert type(exc).__name__ == "WireError"
        else:
            raise AssertionError(bad)
    old = {k: v for k, v in doc.items() if not k.startswith("p2p")}  # an older reader's answer: nothing known
    assert snapshot_from_doc(old, "p").p2p_dir is None


def test_a_remote_ranks_peers_cross_the_store_as_json():
    # the node snapshot every daemon publishes (``cluster.store``): a set is no JSON (every node's publish failed)
    import json

    from rankwatch.watchdog.cluster.store import view_from_doc, view_to_doc

    v = stage(2, "recv", 0)
    back = view_from_doc(json.loads(json.dumps(view_to_doc(v))))
    assert (back.p2p_dir, back.p2p_peer, back.p2p_known) == ("recv", 0, frozenset({1, 3}))
    full = view_from_doc(json.loads(json.dumps(view_to_doc(stage(1, "send", 2, p2p_known=None)))))
    assert full.p2p_known is None
