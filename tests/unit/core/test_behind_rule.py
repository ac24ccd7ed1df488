""""Behind" is one rule over one fact type (``core.rules.behind`` over ``Count``: rank, process group,
counter, value), fed by the hook's counters (live), the flight recorder's per-group progress (live) and a
log's SeqNums (offline). Pure."""

from __future__ import annotations

from typing import Any

from rankwatch.watchdog.core.facts import Count
from rankwatch.watchdog.core.fr_analysis import analyze_fr
from rankwatch.watchdog.core.fr_trace import parse_dump
from rankwatch.watchdog.core.live_facts import COLLECTIVE_SEQ, STEP, count_facts, progress_facts
from rankwatch.watchdog.core.rules.behind import behind_in, behind_of
from rankwatch.watchdog.core.rules.counters import rule_behind as counters_behind
from rankwatch.watchdog.core.rules.progress import rule_behind as seqnums_behind
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.diagnose.facts import collect
from rankwatch.watchdog.diagnose.log_facts import DEFAULT_POLICY, facts_of
from rankwatch.watchdog.diagnose.parser import SourceParser

WATCHDOG = (
    "[rank{r}]:[E1130 10:21:0{r}.500 ProcessGroupNCCL.cpp:632] {pg}Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600001 "
    "milliseconds before timing out."
)


def test_behind_is_the_lowest_count_of_one_counter_in_one_group():
    counts = [Count(0, "tp0", "entered", 9), Count(1, "tp0", "entered", 7), Count(2, "tp0", "entered", 8),
              Count(0, "dp", "entered", 3), Count(2, "dp", "entered", 3), Count(1, "dp", "step", 1)]
    # rank 2 in between waits (not behind); the dp group is level; a step is another counter, never mixed in
    assert behind_in(counts, "entered") == {"tp0": (1,), "dp": ()}
    assert behind_of(counts, "entered", "nope") == () and behind_of(counts, "step", "dp") == ()


def rv(rank: int, **kw: Any) -> RankView:
    base: dict[str, Any] = dict(rank=rank, node="n0", pid=1000 + rank, state="running", step=10, phase="collective",
                                in_phase_s=30.0, since_progress_s=30.0, coll_seq=10, coll_done=10, coll_op="all_reduce")
    return RankView(**{**base, **kw})


def test_the_hooks_counters_feed_the_one_rule_live():
    views = progress_facts([rv(0), rv(1, step=9, phase="forward"), rv(2)])
    assert [c.value for c in count_facts(views, STEP)] == [10, 9, 10]
    f = counters_behind(views)
    assert f is not None and f.ranks == list(behind_of(count_facts(views, STEP), STEP)) == [1]
    level = progress_facts([rv(0, coll_seq=12, coll_done=11), rv(1, coll_seq=11, coll_done=11, phase="forward"),
                            rv(2, coll_seq=12, coll_done=11)])
    f = counters_behind(level)
    assert f is not None and f.ranks == list(behind_of(count_facts(level, COLLECTIVE_SEQ), COLLECTIVE_SEQ)) == [1]


def test_the_flight_recorders_groups_feed_the_one_rule_live():
    def entry(rid: int, seq: int, done: bool) -> dict[str, Any]:
        return {"record_id": rid, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": seq,
                "p2p_seq_id": 0, "op_id": rid, "profiling_name": "gloo:all_reduce", "time_created_ns": rid,
                "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
                "state": "scheduled", "retired": done, "is_p2p": False}

    def dump(n: int) -> dict[str, Any]:
        es = [entry(i, i, True) for i in range(1, n)] + [entry(n, n, False)]
        return {"version": "2.10", "entries": es,
                "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}}

    fr = analyze_fr({r: parse_dump(dump(n), r) for r, n in {0: 6, 1: 4, 2: 5}.items()})
    (g,) = fr.groups
    assert g.behind == behind_of([Count(r, "0", "entered", p.entered) for r, p in g.progress.items()], "entered",
                                 "0") == (1,)


def test_a_logs_seqnums_feed_the_one_rule_offline():
    pg = "[PG ID 0 PG GUID 0(default_pg) Rank {r}] "
    lines = [WATCHDOG.format(r=r, pg=pg.format(r=r), seq=seq) for r, seq in ((0, 41), (1, 40), (2, 41))]
    p = SourceParser("t.log")
    facts = facts_of(collect([e for i, line in enumerate(lines, 1) for e in p.feed(i, line)]))
    assert {(c.rank, c.group, c.value) for c in facts.counts if c.counter == "timeout"} == {
        (0, "0", 41), (1, "0", 40), (2, "0", 41)}
    f = seqnums_behind(facts, DEFAULT_POLICY)
    assert f is not None and f.ranks == list(behind_of(facts.counts, "timeout", "0")) == [1]
