"""The live verdict's words for findings that the rule and end-to-end tests assert as data (issue 44: tests
assert finding data, phrases only in renderer tests): the same inputs as tests/unit/evidence/test_evidence.py and
tests/unit/serve/test_daemon_gpu.py, read here for what ``reason`` and ``evidence`` say."""

from __future__ import annotations

import dataclasses

from test_evidence import hints, rv, verdict
from test_verdict_rules import fr_entered


def gpu_views(**culprit: object) -> list:
    return [rv(0, waiting=True, gpu_util=100.0), rv(1, phase="dataloader", waiting=False, **culprit)]


def test_gpu_agreeing_says_each_named_ranks_reading() -> None:
    v = verdict(gpu_views(gpu_util=0.0))
    assert v["finding"]["data"]["gpu"] == "agrees"
    assert any(e.startswith("GPU agrees: rank 1 0 %") for e in v["evidence"]), v["evidence"]
    # absent from NVML's samples: said so, not as a percentage
    v = verdict(gpu_views(gpu_util=None, gpu_missing=True))
    assert any(e.startswith("GPU agrees: rank 1 missing from NVML samples") for e in v["evidence"]), v["evidence"]
    # no GPU read: no GPU line
    v = verdict([dataclasses.replace(x, gpu_util=None) for x in gpu_views(gpu_util=0.0)])
    assert "gpu" not in v["finding"]["data"] and not any(e.startswith("GPU ") for e in v["evidence"])


def test_a_flight_recorder_size_mismatch_says_size_and_where_it_was_seen() -> None:
    same = dict(phase="collective", coll_seq=3, coll_done=2, coll_op="all_reduce")
    v = verdict([rv(r, **same) for r in range(3)], fr_facts=hints("mismatch_size"))
    assert v["finding"]["data"]["shape"] == "fr_mismatch"
    assert v["reason"].startswith("collective mismatch (size) at collective #3"), v["reason"]
    assert "flight recorder" in v["reason"], v["reason"]


def test_a_mismatch_with_an_untraced_member_says_whose_entry_is_missing() -> None:
    # tests/unit/verdict/test_outside_classes.py's gather-shape: dumps of ranks 0, 1, 3 written as they ended
    from rankwatch.watchdog.evidence.flight_recorder import analyse_traces
    from rankwatch.watchdog.evidence.fr_dump import load_dump
    from test_outside_classes import FR, _gather_shape_views

    fr = analyse_traces({r: load_dump(FR / "gather-shape" / f"rank-{r}.fr.json") for r in (0, 1, 3)}, []).facts
    v = verdict(_gather_shape_views(), fr_facts=fr)
    assert v["reason"].startswith("collective mismatch (size) at collective #23 of process group 0"), v["reason"]
    assert "flight recorder: nothing of rank 2 at collective #23 (no dump): the majority is the likeliest, not a " \
        "certainty" in v["evidence"], v["evidence"]
    assert any(e.startswith("rank 2 died without an exit mark inside a collective: gloo aborts") for e in v["evidence"])
    assert "wait for (weaker evidence) names rank 2: an end the stronger evidence above explains as its " \
        "consequence" in v["evidence"], v["evidence"]


def test_a_rank_behind_in_the_flight_recorder_says_which_collective() -> None:
    views = [rv(r, phase="backward", coll_seq=0, coll_done=0, coll_op=None) for r in range(3)]
    v = verdict(views, fr_facts=hints("skip"))
    assert v["finding"]["data"]["shape"] == "fr_behind"
    assert "behind in the flight recorder" in v["reason"] and "while others entered #4" in v["reason"], v["reason"]


def test_the_flight_recorder_backing_a_finding_says_so_with_its_numbers() -> None:
    two = [rv(0, waiting=True), rv(1, phase="dataloader", waiting=False)]
    v = verdict(two, fr_facts=fr_entered((0, 1), "0", {0: 6, 1: 5}))
    assert "fr_behind" in v["finding"]["data"]["backed_by"]
    assert any("rank 1 entered collective #5 of pg 0 while others entered #6" in e for e in v["evidence"])


def test_a_rank_that_left_early_is_said_to_have_left_early() -> None:
    # tests/e2e/test_real_bugs.py's uneven data: one rank exited normally while its peer waits in a collective
    v = verdict([rv(0, waiting=True, phase="collective", coll_seq=11, coll_done=10), rv(1, state="exited")])
    assert (v["finding"]["data"]["shape"], v["finding"]["data"]["how"]) == ("first_exit", "exited")
    assert v["reason"].startswith("rank 1 left early"), v["reason"]


def test_a_dead_helper_threads_exception_is_quoted_in_the_reason() -> None:
    # tests/e2e/test_v3_classes.py's helper-thread-dies: the exception is the cause the verdict carries
    views = [rv(r, waiting=True) for r in range(4)]
    views[1] = rv(1, phase="idle", waiting=False, thread_died="thread prefetch: RuntimeError: corrupt record in shard")
    v = verdict(views)
    assert "thread_died" in v["finding"]["data"]["backed_by"], v["finding"]
    assert "its helper thread died: thread prefetch: RuntimeError: corrupt record in shard" in v["reason"]
