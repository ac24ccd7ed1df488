"""The facts behind the classes outside the suite (issue 44 item 5; jobs/outside.py, pipeline.py's wrong-peer):
what each miss of their first run was, held at the fact it came from. Pure: real gloo dumps and views, no
processes. The classes themselves run end to end in ``test_v3_classes.py`` (``OUTSIDE_SUITE``) and in the
accuracy suite (benchmarks/README.md, "Classes outside the suite")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rankwatch.watchdog.core.facts import Ended, FactSet, Progress
from rankwatch.watchdog.core.fr_analysis import analyze_fr
from rankwatch.watchdog.core.live_facts import COLLECTIVE_SEQ, STEP, count_facts, progress_facts
from rankwatch.watchdog.core.rules.counters import rule_behind
from rankwatch.watchdog.core.rules.ended import rule_exit_order
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.evidence.fr_dump import load_dump

FR = Path(__file__).resolve().parents[2] / "fixtures" / "fr"


def test_gloos_status_counter_of_every_op_is_not_a_pipelines_progress():
    # pp-wrong-peer's dumps (4 GPipe stages, gloo, taken at the hang): gloo's recorder keeps the collectives only
    # (seq 1-5, one logging all_reduce per step) while its pg_status counts every op id, sends and recvs
    # included: 45 on the first and last stage, 85 on the middle ones. Read as progress it named stages 0 and 3
    # "behind" (the first run: hang [0, 3])
    traces = {r: load_dump(FR / "pipeline-p2p" / f"rank-{r}.fr.json") for r in range(4)}
    assert {r: t.pg_status[0].last_enqueued for r, t in traces.items()} == {0: 45, 1: 85, 2: 85, 3: 45}
    a = analyze_fr(traces)
    (g,) = a.groups
    assert {r: p.entered for r, p in g.progress.items()} == {0: 5, 1: 5, 2: 5, 3: 5}
    assert a.behind_ranks == ()
    # a status on the collectives' own scale still counts (a ring that wrapped): test_flight_recorder's
    # test_ring_wrap_uses_pg_status


def rv(rank: int, **kw: Any) -> RankView:
    base: dict[str, Any] = dict(rank=rank, node="n0", pid=1000 + rank, state="running", step=5, phase="collective",
                                in_phase_s=30.0, since_progress_s=30.0, coll_seq=87, coll_done=86, coll_op="recv")
    return RankView(**{**base, **kw})


def test_python_level_counts_with_sends_and_recvs_name_nobody_behind():
    # the same hang, live: the hook counts every Python-level call, p2p included; the last stage issues fewer
    # by design and was named "stuck before collective #87 (send)" at high confidence once the recorder no
    # longer named anyone
    stages = progress_facts(
        [rv(0, coll_seq=45, coll_done=44), rv(1, coll_op="send"), rv(2), rv(3, coll_seq=45, coll_done=44)])
    assert count_facts(stages, COLLECTIVE_SEQ) == []
    assert len(count_facts(stages, STEP)) == 4  # steps still compare
    assert rule_behind(stages) is None
    # without p2p the count is the collectives' own: the rank behind is named as before
    flat = progress_facts([rv(0, coll_op="all_reduce"),
                           rv(1, coll_seq=86, coll_done=86, coll_op="all_reduce", phase="forward"),
                           rv(2, coll_op="all_reduce")])
    f = rule_behind(flat)
    assert f is not None and f.ranks == [1]


LOST = "Connection reset by peer"


def _ends(lead_phase: str) -> FactSet:
    # gather-shape live: rank 2 vanished without any mark (gloo aborted it: a message of the wrong size from
    # rank 1), ranks 1 and 3 then lost it, rank 0 still waits in the all_gather
    return FactSet(
        ranks=(0, 1, 2, 3),
        progress=[Progress(0, "running", "collective", 6, True, 23, "all_gather"),
                  Progress(2, "dead", lead_phase, 6)],
        ended=[Ended(2, own=True, ts=-0.02, order=0, how="dead", phase=lead_phase, step=6),
               *(Ended(r, own=False, cause=LOST, peer_ended=True, ts=-0.01, order=r, how="crashed") for r in (1, 3))],
    )


def test_a_death_without_a_word_inside_a_collective_is_named_as_a_guess():
    f = rule_exit_order(_ends("collective"), 0.5)
    assert f is not None and f.ranks == [2]
    assert (f.confidence, f.data["decided"], f.data["silent_in_collective"]) == ("low", False, True)
    # killed while computing (the OOM killer in forward, cgroup-oom; a SIGKILL at the step's start): its own
    f = rule_exit_order(_ends("forward"), 0.5)
    assert f is not None and f.ranks == [2]
    assert (f.confidence, f.data["decided"], f.data["silent_in_collective"]) == ("high", True, False)


RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
         "[127.0.0.1]:3483: Connection reset by peer.")


def _gather_shape_views() -> list[RankView]:
    # the live run's ranks as the daemon saw them (its bundle's verdict, the exit ages of its evidence): gloo
    # aborted rank 2 (SIGABRT, no mark) on rank 1's wrong-sized message, torchrun SIGTERMed rank 0 in the
    # all_gather 0.11 s later, ranks 3 and 1 raised on the reset connection — all gone before the first capture
    common: dict[str, Any] = dict(step=6, coll_seq=12, coll_op="all_gather")
    return [rv(0, state="dead", phase="collective", coll_done=11, exit_age_s=0.23, exit_order=1, **common),
            rv(1, state="crashed", phase="idle", coll_done=12, exit_age_s=0.20, exit_order=3, exit_cause=RESET,
               **common),
            rv(2, state="dead", phase="collective", coll_done=11, exit_age_s=0.34, exit_order=0, **common),
            rv(3, state="crashed", phase="idle", coll_done=12, exit_age_s=0.20, exit_order=2, exit_cause=RESET,
               **common)]


def test_dumps_written_at_the_ranks_ends_name_the_rank_whose_all_gather_differs():
    """gather-shape: rank 1's metrics tensor has 3 elements where the others' have 2 (all_gather #23 of the world
    group). Nobody is alive to capture; the dumps the hook wrote as each rank ended (``hooks.exit_dump``: ranks 1
    and 3 on their exception, rank 0 on torchrun's SIGTERM; rank 2 was aborted and wrote none) are the bundle's
    ``fr/`` of a real run. Was: rank 2, dead_rank (low) — the receiver gloo aborted."""
    from rankwatch.watchdog.evidence.flight_recorder import analyse_traces
    from rankwatch.watchdog.verdict import decide

    traces = {r: load_dump(FR / "gather-shape" / f"rank-{r}.fr.json") for r in (0, 1, 3)}
    fr = analyse_traces(traces, []).facts
    assert fr is not None
    v = decide(_gather_shape_views(), job_id="j", incident_id="i", detected_after_s=0.6, fr_facts=fr).to_json()
    assert (v["kind"], v["initiating_ranks"], v["decided_by"]) == ("collective_mismatch", [1], "flight_recorder")
    data = v["finding"]["data"]
    assert (data["shape"], data["seq"], data["majority"], data["aborted_receivers"]) == ("fr_mismatch", 23, [0, 3], [2])
    # two against one with rank 2's size unknown: rank 1 is the likeliest, not the certain one; the wait-for
    # graph's sink, rank 2, is the aborted receiver's end the mismatch explains: no evidence against it
    assert data["untraced"] == [2] and v["confidence"] == "medium"
    assert "questioned_by" not in data, data


def test_without_the_dump_of_the_rank_torchrun_stopped_the_mismatch_names_nobody():
    # ranks 1 and 3 alone differ one against one (a tie): the recorder names nobody, and the aborted receiver
    # stays a low-confidence guess — why the hook also dumps on SIGTERM
    from rankwatch.watchdog.evidence.flight_recorder import analyse_traces
    from rankwatch.watchdog.verdict import decide

    traces = {r: load_dump(FR / "gather-shape" / f"rank-{r}.fr.json") for r in (1, 3)}
    fr = analyse_traces(traces, []).facts
    v = decide(_gather_shape_views(), job_id="j", incident_id="i", detected_after_s=0.6, fr_facts=fr).to_json()
    assert v["confidence"] == "low" and v["initiating_ranks"] != [1], v["reason"]


@pytest.mark.parametrize("stacks_blocked", [True, None], ids=["stacks-wait", "stacks-say-nothing"])
def test_a_wait_cycle_across_groups_is_left_to_the_counters(stacks_blocked):
    """group-a2a-skip: expert pairs {0, 2} {1, 3} (pg 1, pg 2) and DDP's world group (pg 0); rank 3 skips its
    pair's all_to_all #6 and goes on to the world's all_reduce #21. The recorder shows rank 1 behind in pg 0
    (waiting in pg 2 for rank 3) and rank 3 behind in pg 2 (waiting in pg 0 for rank 1): a cycle it cannot
    break, so it names nobody, and the hook's count of Python-level collectives (rank 3 issued one fewer)
    decides. Was: ranks 1, 3 (low), half wrong."""
    from rankwatch.watchdog.core.facts import FactSet as Facts
    from rankwatch.watchdog.verdict import decide
    from test_verdict_rules import fr_entered

    world = fr_entered((0, 1, 2, 3), "0", {0: 21, 1: 20, 2: 21, 3: 21}, waiting=(0, 2, 3))
    pair_a = fr_entered((0, 1, 2, 3), "1", {0: 6, 2: 6}, op="all_to_all")
    pair_b = fr_entered((0, 1, 2, 3), "2", {1: 6, 3: 5}, op="all_to_all", waiting=(1,))
    fr = Facts(ranks=(0, 1, 2, 3), counts=[*world.counts, *pair_a.counts, *pair_b.counts],
               in_op=[*world.in_op, *pair_a.in_op, *pair_b.in_op], waits=[*world.waits, *pair_b.waits])
    # DDP's all_reduce runs under autograd's backward: a stack there may say nothing of a wait (the live run:
    # ranks 0, 2, 3 shared one such stack) — the recorder's in-flight all_reduce says they wait all the same
    views = [rv(r, step=5, coll_seq=12, coll_done=12, coll_op="all_to_all_single", phase="backward",
                waiting=stacks_blocked) for r in (0, 2)]
    views += [rv(1, step=5, coll_seq=12, coll_done=11, coll_op="all_to_all_single", phase="forward", waiting=True),
              rv(3, step=5, coll_seq=11, coll_done=11, coll_op="all_to_all_single", phase="backward",
                 waiting=stacks_blocked)]
    v = decide(sorted(views, key=lambda x: x.rank), job_id="j", incident_id="i", detected_after_s=30.0,
               fr_facts=fr).to_json()
    assert (v["initiating_ranks"], v["kind"]) == ([3], "collective_mismatch"), (v["decided_by"], v["reason"])
    assert v["flight_recorder"]["role"] != "decided"
