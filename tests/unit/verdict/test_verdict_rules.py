"""Verdict and detection rules on constructed snapshots (pure functions)."""

from __future__ import annotations

import dataclasses

from rankwatch.watchdog.core.detect import find_trigger, recovered
from rankwatch.watchdog.core.facts import FR_ENTERED, FR_ENTRY, Count, FactSet, InOp, Rung, Waits
from rankwatch.watchdog.core.fr_facts import ENTERED
from rankwatch.watchdog.core.policy import StallPolicy
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.core.verdict import decide


def rv(rank, **kw) -> RankView:
    base = dict(
        rank=rank,
        node="n0",
        pid=1000 + rank,
        state="running",
        step=10,
        phase="backward",
        in_phase_s=30.0,
        since_progress_s=30.0,
        coll_seq=10,
        coll_done=10,
        coll_op="all_reduce",
    )
    base.update(kw)
    return RankView(**base)


def verdict(views):
    return decide(views, job_id="j", incident_id="i", detected_after_s=31.0).to_json()


def fr_mismatch(ranks, pg, seq, kind, variants) -> FactSet:
    """The flight recorder's facts (``core.fr_facts``) of one mismatch: each rank's entry at (pg, seq)."""
    return FactSet(ranks=tuple(ranks), in_op=[InOp(r, desc, FR_ENTRY, seq=seq, group=pg, aspect=kind)
                                              for desc, rs in variants.items() for r in rs])


def fr_entered(ranks, pg, entered, op="all_reduce", waiting=()) -> FactSet:
    """The flight recorder's facts of one group's progress: each member's highest ``entered`` seq (the op of
    the furthest), and the members in ``waiting`` with their newest collective still in flight."""
    top = max(entered.values())
    return FactSet(
        ranks=tuple(ranks),
        counts=[Count(r, pg, ENTERED, n) for r, n in entered.items()],
        in_op=[InOp(r, op, FR_ENTERED, seq=n, group=pg) for r, n in entered.items() if n == top],
        waits=[Waits(r, frozenset(m for m, k in entered.items() if k < entered[r]), pg, entered[r], None,
                     Rung.FLIGHT_RECORDER, FR_ENTRY) for r in waiting],
    )


def test_minority_outside_the_sync_point_is_named_with_its_phase():
    views = [rv(0), rv(1), rv(2, phase="dataloader"), rv(3)]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["phase"], v["confidence"]) == ("hang", [2], "dataloader", "high")
    assert v["finding"]["rule"] == "wait_for" and v["finding"]["data"]["phases"] == {"2": "dataloader"}


def test_rank_behind_in_steps_wins_even_if_others_look_busy():
    views = [
        rv(0, step=11, phase="collective", coll_seq=11, coll_done=10),
        rv(1, step=10, phase="optimizer"),
        rv(2, step=11, phase="collective", coll_seq=11, coll_done=10),
    ]
    v = verdict(views)
    assert v["initiating_ranks"] == [1] and v["phase"] == "optimizer"


def test_rank_behind_in_collective_count():
    views = [
        rv(0, coll_seq=12, coll_done=11, phase="collective"),
        rv(1, coll_seq=11, phase="checkpoint"),
        rv(2, coll_seq=12, coll_done=11, phase="collective"),
    ]
    v = verdict(views)
    assert v["initiating_ranks"] == [1] and v["phase"] == "checkpoint"
    want = {"shape": "behind", "by": "collective_seq", "low": 11, "high": 12, "op": "all_reduce", "phase": "checkpoint",
            "behind": [1], "ahead": [0, 2], "phases": ["checkpoint"]}
    assert v["finding"]["data"] == want


def test_collective_mismatch_names_the_odd_op_and_a_tie_is_low_confidence():
    same = dict(phase="collective", coll_seq=7, coll_done=6)
    v = verdict([rv(0, **same), rv(1, **same, coll_op="all_gather"), rv(2, **same), rv(3, **same)])
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("collective_mismatch", [1], "high")
    v = verdict([rv(0, **same), rv(1, **same, coll_op="broadcast")])
    assert v["kind"] == "collective_mismatch" and v["confidence"] == "low"


def test_same_collective_everywhere_is_a_comm_hang_without_initiator_unless_gpu_singles_one_out():
    same = dict(phase="collective", coll_seq=7, coll_done=6)
    v = verdict([rv(r, **same) for r in range(4)])
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("comm_hang", [], "low")
    views = [rv(r, **same, gpu_util=100.0) for r in range(4)]
    views[3] = dataclasses.replace(views[3], gpu_util=0.0)
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("comm_hang", [3])


def test_first_death_wins_over_later_ones_and_over_waiting_ranks():
    views = [
        rv(0),
        rv(1, state="crashed", exit_age_s=0.2, phase="idle"),
        rv(2, state="dead", exit_age_s=0.9, phase="forward"),
        rv(3, state="dead", exit_age_s=0.1),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("dead_rank", [2], "forward")
    assert v["finding"]["data"]["exit_order"] == [2, 1, 3]


PEER_LOST = "RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:41231"


def test_a_killed_rank_beats_a_peer_whose_connection_error_was_seen_first():
    # under load the peer's crash reaches the watchdog 10 ms before the killed rank's exit
    views = [
        rv(0),
        rv(1, state="dead", exit_age_s=0.20, exit_order=1),
        rv(2, state="crashed", exit_age_s=0.21, exit_order=0, exit_cause=PEER_LOST),
        rv(3),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("dead_rank", [1], "high")
    assert v["finding"]["data"]["roles"] == {"2": "consequence", "1": "initiating"}


def test_live_and_offline_ends_are_ordered_by_one_rule():
    """The same two own ends 30 ms apart on one node: live (the node's exact exit order) names the first,
    offline (log times only) cannot order them and names both — one rule over the facts each path makes."""
    from rankwatch.watchdog.core.facts import Ended, FactSet
    from rankwatch.watchdog.core.policy import OfflinePolicy
    from rankwatch.watchdog.core.rules.ended import rule_exit_cause

    views = [
        rv(0),
        rv(1, state="dead", exit_age_s=0.23, exit_order=0),
        rv(2, state="dead", exit_age_s=0.20, exit_order=1),
        rv(3),
    ]
    live = verdict(views)
    assert (live["initiating_ranks"], live["finding"]["data"]["exit_order"]) == ([1], [1, 2])
    ends = [Ended(1, own=True, cause="cuda_error", ts=100.00, node="h0"),
            Ended(2, own=True, cause="cuda_error", ts=100.03, node="h0")]
    facts = FactSet(ranks=(0, 1, 2, 3), ended=ends)
    offline = rule_exit_cause(facts, OfflinePolicy(tie_s=0.05))
    assert offline is not None and (offline.ranks, offline.data["exit_order"]) == ([1, 2], [1, 2])
    assert offline.data["lead"] == 1


def test_across_nodes_cause_decides_where_clocks_cannot():
    # node n1's evidence was captured two seconds after n0's: ages across nodes are not comparable
    views = [
        rv(0, state="dead", exit_age_s=2.1, exit_order=1),  # torchrun tore node n0 down after rank 1 crashed
        rv(1, state="crashed", exit_age_s=2.2, exit_order=0, exit_cause=PEER_LOST),
        rv(2, node="n1", state="crashed", exit_age_s=0.05, exit_order=1, exit_cause=PEER_LOST),
        rv(3, node="n1", state="dead", exit_age_s=0.08, exit_order=0),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [3])


def test_an_own_exception_is_the_initiator_and_its_peers_connection_errors_are_not():
    views = [
        rv(0, state="crashed", exit_age_s=0.5, exit_order=0, exit_cause="ConnectionResetError: reset by peer"),
        rv(1, state="crashed", exit_age_s=0.5, exit_order=1, exit_cause=PEER_LOST),
        rv(2, state="crashed", exit_age_s=0.4, exit_order=2, exit_cause="ValueError: batch 17 has no labels"),
        rv(3, state="crashed", exit_age_s=0.3, exit_order=3,
           exit_cause="RuntimeError: CUDA error: an illegal memory access was encountered (NCCL)"),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [2])
    assert v["finding"]["data"]["cause"].startswith("ValueError: batch 17 has no labels")


def test_stopped_rank():
    v = verdict([rv(0), rv(1, state="stopped", phase="idle"), rv(2)])
    assert (v["kind"], v["initiating_ranks"]) == ("stopped_rank", [1])


def test_stack_grouping_backs_or_weakens_the_phase_rule():
    views = [
        rv(0, stack_signature="A"),
        rv(1, stack_signature="A"),
        rv(2, phase="dataloader", stack_signature="B"),
        rv(3, stack_signature="A"),
    ]
    v = verdict(views)
    assert "stacks" in v["finding"]["data"]["backed_by"] and v["confidence"] == "high"
    views[2] = dataclasses.replace(views[2], stack_signature="A")
    views[0] = dataclasses.replace(views[0], stack_signature="C")
    v = verdict(views)
    assert v["initiating_ranks"] == [2] and v["confidence"] == "medium"


def test_missing_node_is_named_when_nothing_else_explains_the_stall():
    views = [rv(0, phase="collective", coll_seq=7, coll_done=6), rv(1, state="missing", node="n1", phase=None)]
    v = verdict(views)
    assert v["missing_ranks"] == [1]


def test_verdict_matches_schema():
    v = verdict([rv(0), rv(1, phase="forward")])
    assert set(v) >= {
        "schema",
        "job_id",
        "incident_id",
        "kind",
        "initiating_ranks",
        "phase",
        "confidence",
        "reason",
        "detected_after_s",
        "ranks",
        "evidence",
    }
    r = v["ranks"]["1"]
    assert set(r) == {"node", "pid", "state", "step", "phase", "in_phase_s", "collective", "gpu_util", "stack_top"}
    assert r["collective"] == {"seq": 10, "op": "all_reduce"}


POLICY = StallPolicy(timeout_s=10, startup_s=120)


def test_stall_needs_timeout_startup_budget_and_declared_budget_excuses():
    assert find_trigger([rv(0, since_progress_s=5), rv(1, since_progress_s=5)], POLICY, 1.0, {}) is None
    t = find_trigger([rv(0, since_progress_s=11), rv(1, since_progress_s=5)], POLICY, 1.0, {})
    assert t is not None and t.kind == "stall" and t.ranks == (0,)
    # before the first step the start-up budget applies (nobody waits for anyone yet: imports, compile)
    assert find_trigger([rv(0, step=0, phase="forward", since_progress_s=100)], POLICY, 0.0, {}) is None
    assert find_trigger([rv(0, step=0, phase="forward", since_progress_s=130)], POLICY, 0.0, {}) is not None
    # ... until a rank of the job waits in a collective: start-up is over for it, and a rank blocked before its
    # first step gets three times what the waiter needed to get there (at least the stall timeout), not the
    # 120 s start-up budget (issue 44: it waited for the 300 s default)
    blocked = rv(1, step=0, phase="idle", since_progress_s=13)
    waiting = rv(0, step=0, phase="collective", coll_seq=1, coll_done=0, since_progress_s=1, age_s=5)
    t = find_trigger([waiting, blocked], POLICY, 0.0, {})
    assert t is not None and t.ranks == (1,)
    assert find_trigger([rv(0, step=0, phase="forward", since_progress_s=5), blocked], POLICY, 0.0, {}) is None
    # start-up skew is not a hang: the waiter needed 12 s to get there, the late rank gets 36 s
    slow_start = dataclasses.replace(waiting, age_s=13)
    assert find_trigger([slow_start, blocked], POLICY, 0.0, {}) is None
    assert find_trigger([slow_start, dataclasses.replace(blocked, since_progress_s=37)], POLICY, 0.0, {}) is not None
    # a waiter whose start is not known (another node's view): the start-up budget, as before
    assert find_trigger([dataclasses.replace(waiting, age_s=None), blocked], POLICY, 0.0, {}) is None
    # a rank inside a declared phase within budget excuses the others waiting for it
    ckpt = rv(0, phase="checkpoint", budget_s=900, budget_elapsed_s=300, since_progress_s=300)
    assert find_trigger([ckpt, rv(1, since_progress_s=300)], POLICY, 1.0, {}) is None
    over = dataclasses.replace(ckpt, budget_elapsed_s=901, since_progress_s=901)
    assert find_trigger([over, rv(1, since_progress_s=901)], POLICY, 1.0, {}) is not None


def test_auto_timeout_learns_from_steps_with_a_floor():
    auto = StallPolicy(timeout_s=None, auto_factor=4, auto_floor_s=30)
    assert auto.timeout_for(1.0) == 30
    assert auto.timeout_for(20.0) == 80
    assert find_trigger([rv(0, since_progress_s=60)], auto, 20.0, {}) is None
    assert find_trigger([rv(0, since_progress_s=81)], auto, 20.0, {}) is not None


def test_dead_and_stopped_trigger_without_waiting_for_the_timeout():
    t = find_trigger([rv(0, since_progress_s=0.1), rv(1, state="dead", exit_age_s=0.05)], POLICY, 1.0, {})
    assert t.kind == "dead" and t.ranks == (1,)
    views = [rv(0, since_progress_s=0.5), rv(1, state="stopped", since_progress_s=0.5)]
    assert find_trigger(views, POLICY, 1.0, {1: 0.2}) is None
    assert find_trigger(views, POLICY, 1.0, {1: 1.5}).kind == "stopped"


def test_recovery_closes_an_incident():
    assert recovered([rv(0, since_progress_s=1), rv(1, since_progress_s=2)], POLICY, 1.0)
    assert not recovered([rv(0, since_progress_s=1), rv(1, since_progress_s=20)], POLICY, 1.0)
    assert not recovered([rv(0, since_progress_s=1), rv(1, state="dead")], POLICY, 1.0)


def test_a_barrier_only_one_rank_calls_is_named_from_the_flight_recorder():
    # rank 2 runs `if rank == 2: dist.barrier()`; the others wait in DDP's gradient all-reduce, which the
    # Python-level counters do not see, so by the counters three of four ranks look "behind"
    views = [rv(r, phase="backward", coll_seq=13, coll_done=13, waiting=True) for r in (0, 1, 3)]
    views.insert(2, rv(2, phase="collective", coll_seq=14, coll_done=13, coll_op="barrier", waiting=True))
    fr = fr_mismatch((0, 1, 2, 3), "0", 14, "op", {"all_reduce": (0, 1, 3), "barrier": (2,)})
    v = decide(views, job_id="j", incident_id="i", detected_after_s=1.0, fr_facts=fr).to_json()
    assert (v["kind"], v["initiating_ranks"], v["decided_by"]) == ("collective_mismatch", [2], "flight_recorder")
    assert "counters" in v["finding"]["data"]["backed_by"]
    # without a flight recorder the counters still point at the rank that entered the extra collective
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("collective_mismatch", [2], "medium")


def test_a_rank_that_left_early_is_the_initiator_of_the_crashes_it_caused():
    # uneven data: rank 1's shard ran out, it left the loop and exited normally; ranks 0 and 2 then crash
    # with connection errors, rank 3 waits in backward
    views = [
        rv(0, state="crashed", exit_age_s=1.0, exit_order=1, exit_cause=PEER_LOST),
        rv(1, state="exited", phase=None, exit_age_s=1.2, exit_order=0),
        rv(2, state="crashed", exit_age_s=1.0, exit_order=2, exit_cause=PEER_LOST),
        rv(3, phase="backward"),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("dead_rank", [1], "high")
    assert (v["finding"]["data"]["how"], v["finding"]["data"]["roles"]["1"]) == ("exited", "initiating")


def test_ranks_that_all_finished_are_not_early_leavers():
    # every rank done; one crashed while tearing down afterwards: the exits are not to blame
    views = [
        rv(0, state="exited", phase=None, exit_age_s=2.0),
        rv(1, state="exited", phase=None, exit_age_s=2.0),
        rv(2, state="crashed", phase=None, exit_age_s=1.0, exit_cause="RuntimeError: gloo teardown"),
    ]
    v = verdict(views)
    assert v["initiating_ranks"] == [2]


def test_a_missing_node_singles_out_its_ranks_in_a_communication_hang():
    views = [rv(r, coll_seq=9, coll_done=8, phase="collective") for r in (0, 1)]
    views += [rv(r, node="n1", state="missing", step=0, phase=None, coll_seq=0, coll_done=0) for r in (2, 3)]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["decided_by"]) == ("comm_hang", [2, 3], "missing_node")
    assert v["finding"]["data"]["silent_nodes"] == ["n1"]


def test_a_majority_is_never_blamed_on_weak_evidence():
    # three of four ranks behind by the Python counters, nobody waiting: the counters alone cannot blame them
    views = [rv(r, step=5, phase="forward") for r in (0, 1, 2)] + [rv(3, step=6, phase="forward")]
    v = verdict(views)
    assert v["initiating_ranks"] == [0, 1, 2] and v["confidence"] == "low"
    assert v["finding"]["data"]["majority_on_weak_evidence"] is True


def test_a_rank_still_in_a_collective_after_the_others_finished_is_the_odd_one():
    # ranks 0-2 finished their loop and exited; rank 3 issued one more all_reduce that nobody joins
    views = [rv(r, state="exited", phase=None, step=40, exit_age_s=5.0) for r in (0, 1, 2)]
    views.append(rv(3, step=40, phase="collective", coll_seq=121, coll_done=120, coll_op="all_reduce"))
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("collective_mismatch", [3])
    assert v["finding"]["data"]["shape"] == "finished_but_one" and v["finding"]["data"]["stuck"] == [3]
    # the same when its collective then failed because the others had left
    views[3] = rv(3, state="crashed", step=40, phase="collective", coll_seq=121, coll_done=120, coll_op="all_reduce",
                  exit_age_s=0.5, exit_cause=PEER_LOST)
    assert verdict(views)["initiating_ranks"] == [3]


def test_a_rank_aborted_inside_a_mismatched_collective_is_not_its_cause():
    # rank 0 skipped an all_reduce the others call: its next collective meets theirs with another size and
    # gloo aborts the receiver (rank 3, SIGABRT, no exit mark); the survivors' flight recorders show it
    views = [rv(r, phase="collective", coll_seq=7, coll_done=6) for r in (0, 1, 2)]
    views.append(rv(3, state="dead", phase="collective", exit_age_s=0.3, exit_order=0))
    fr = fr_mismatch((0, 1, 2), "0", 12, "size", {"in [[10]]": (1, 2), "in [[1290]]": (0,)})
    v = decide(views, job_id="j", incident_id="i", detected_after_s=1.0, fr_facts=fr).to_json()
    assert (v["kind"], v["initiating_ranks"], v["decided_by"]) == ("collective_mismatch", [0], "flight_recorder")
    assert v["finding"]["data"]["aborted_receivers"] == [3]


def test_without_a_flight_recorder_odd_collective_counts_explain_an_abort_inside_a_collective():
    # every rank died before capture (gloo's abort chain); rank 0 had skipped the metrics all_reduce
    views = [
        rv(3, state="dead", phase="collective", coll_seq=6, coll_done=5, exit_age_s=0.40),
        rv(1, state="dead", phase="collective", coll_seq=6, coll_done=5, exit_age_s=0.33),
        rv(0, state="dead", phase="backward", coll_seq=5, coll_done=5, exit_age_s=0.32),
        rv(2, state="crashed", phase="idle", coll_seq=6, coll_done=6, exit_age_s=0.31, exit_cause=PEER_LOST),
    ]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("collective_mismatch", [0]), v["reason"]
    # an ordinary kill inside a collective, counts agreeing, stays a dead rank
    same = [dataclasses.replace(x, coll_seq=6) for x in views]
    assert verdict(same)["kind"] == "dead_rank"
    # a rank that is merely behind, still computing, is not blamed for a peer's death inside a collective
    lagging = [*views[:2], dataclasses.replace(views[2], phase="forward"), views[3]]
    assert verdict(lagging)["kind"] == "dead_rank"


def test_odd_collective_counts_explain_an_abort_when_the_flight_recorder_names_nobody():
    # rank 1 skipped the metrics all_reduce; gloo aborted the receiver (rank 0, no mark) and rank 3 crashed
    # on the lost peer: only ranks 1 and 2 dumped, and their sizes at seq 17 differ 1 against 1 — a tie
    views = [
        rv(0, state="dead", phase="collective", coll_seq=6, coll_done=5, exit_age_s=0.09, exit_order=0),
        rv(1, phase="backward", coll_seq=5, coll_done=5),
        rv(2, phase="collective", coll_seq=6, coll_done=5),
        rv(3, state="crashed", phase="idle", coll_seq=6, coll_done=6, exit_age_s=0.09, exit_cause=PEER_LOST),
    ]
    tie = fr_mismatch((1, 2), "0", 17, "size", {"in [[263425]]": (1,), "in [[1]]": (2,)})
    v = decide(views, job_id="j", incident_id="i", detected_after_s=1.0, fr_facts=tie).to_json()
    assert (v["kind"], v["initiating_ranks"]) == ("collective_mismatch", [1]), v["reason"]
    data = v["finding"]["data"]
    assert (data["shape"], data["aborted_receivers"], data["fr_mismatch_tie"]) == ("abort_with_odd_counts", [0], True)


def test_a_rank_one_collective_short_that_waits_on_its_peers_skipped_one():
    # rank 2 skipped the loop's metrics all_reduce (#6) the others wait in, went on to the next forward and
    # blocks in DDP's buffer broadcast there (a torch.distributed frame on top of its stack): not computing,
    # so not a hang in forward but a collective only some ranks call — with no flight recorder to say so
    others = dict(phase="collective", coll_seq=6, coll_done=5, waiting=True)
    views = [rv(0, **others), rv(1, **others), rv(2, phase="forward", coll_seq=5, coll_done=5, waiting=True),
             rv(3, **others)]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"]) == ("collective_mismatch", [2]), v["reason"]
    assert v["finding"]["data"] == {"shape": "skipped_collective", "by": "collective_seq", "seq": 6, "op": "all_reduce",
                                    "at": 5, "behind": [2], "ahead": [0, 1, 3], "phases": ["forward"]}
    # the same counts while rank 2 computes (its stack is its own code, or unknown): it is just late
    for waiting in (False, None):
        late = [*views[:2], dataclasses.replace(views[2], waiting=waiting), views[3]]
        v = verdict(late)
        assert (v["kind"], v["initiating_ranks"]) == ("hang", [2]), v["reason"]


def test_behind_is_the_lowest_count_of_a_group_and_ranks_in_between_are_waiters():
    """Real dumps (tests/fixtures/fr/broadcast_root): in pg 0 rank 2, stuck in its input, entered #2; rank 0,
    the root of DDP's buffer broadcast, entered #3 and waits in it; ranks 1, 3 entered #4. Only rank 2 is
    behind (``core.ranks.behind``), in the flight recorder's own rung as in the counters'."""
    from pathlib import Path

    from rankwatch.watchdog.core.ranks import behind
    from rankwatch.watchdog.core.rules.recorder import fr_behind
    from rankwatch.watchdog.evidence.capture import RankCapture
    from rankwatch.watchdog.evidence.flight_recorder import fr_evidence

    assert behind({0: 3, 1: 4, 2: 2, 3: 4}) == (2,) and behind({0: 4, 1: 4}) == ()
    dumps = sorted((Path(__file__).resolve().parents[2] / "fixtures" / "fr" / "broadcast_root").glob("rank-*.fr.json"))
    caps = {int(p.name.split("-")[1].split(".")[0]): p.read_bytes() for p in dumps}
    facts = fr_evidence({r: RankCapture(rank=r, pid=1000 + r, fr_json=b) for r, b in caps.items()}).facts
    assert facts is not None and [b.rank for b in fr_behind(facts)] == [2]
    views = [rv(0, node="n0", phase="forward", waiting=True), rv(1, node="n0", waiting=True),
             rv(2, node="n1", phase="dataloader", waiting=False), rv(3, node="n1", waiting=True)]
    v = decide(views, job_id="j", incident_id="i", detected_after_s=31.0, fr_facts=facts)
    fr = v.found["fr_behind"]
    assert v.initiating_ranks == [2] and fr is not None and fr.ranks == [2]
    assert "fr_behind" in v.finding.data["backed_by"]


def test_a_rank_whose_helper_thread_died_is_named_by_its_rung_over_facts():
    # rank 2's prefetch thread raised; its main thread waits on the queue (idle, not in a collective): no
    # stronger rung singles it out, the thread's death (a ``ThreadDied`` fact of the hook's record) does
    views = [rv(0, waiting=True), rv(1, waiting=True),
             rv(2, phase="idle", waiting=True, thread_died="thread prefetch: ValueError: boom"), rv(3, waiting=True)]
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["decided_by"]) == ("hang", [2], "thread_died")
    assert v["finding"]["data"]["threads"] == {"2": "thread prefetch: ValueError: boom"}
    # where the graph names the rank already, the dead thread backs it
    views[2] = dataclasses.replace(views[2], phase="dataloader", waiting=False)
    v = verdict(views)
    assert (v["initiating_ranks"], v["confidence"]) == ([2], "high")
    assert "thread_died" in v["finding"]["data"]["backed_by"]
