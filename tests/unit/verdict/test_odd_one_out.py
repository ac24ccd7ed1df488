"""One rule for "the odd ones out", three paths: the live verdict, the flight-recorder analysis (alone and
through the verdict) and the offline log diagnosis give the same ranks, in the same words, for the same
split of ranks at one collective (core.ranks.outside_majority / fmt_ranks)."""

from __future__ import annotations

import pytest
from rankwatch.watchdog.core.fr_analysis import analyze_fr
from rankwatch.watchdog.core.fr_facts import fr_facts
from rankwatch.watchdog.core.fr_trace import parse_dump
from rankwatch.watchdog.core.ranks import fmt_ranks, outside_majority
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.diagnose.facts import collect
from rankwatch.watchdog.diagnose.parser import SourceParser
from rankwatch.watchdog.diagnose.reasoning import diagnose_evidence
from rankwatch.watchdog.diagnose.render import render_text
from rankwatch.watchdog.report.text import headline
from rankwatch.watchdog.verdict import decide

SEQ = 7
# ops as the hook / the flight recorder name them, and as the NCCL watchdog prints them
OPS = {"all_reduce": "ALLREDUCE", "broadcast": "BROADCAST", "barrier": "BARRIER", "all_gather": "ALLGATHER"}


def split(*sizes: int) -> list[str]:
    """Rank r's op: the first group calls all_reduce, the next broadcast, then barrier, then all_gather."""
    names = list(OPS)
    return [names[g] for g, n in enumerate(sizes) for _ in range(n)]


# split → expected odd ranks ([] = no majority: nobody named)
CASES = {
    "5/2/1": (split(5, 2, 1), [5, 6, 7]),
    "5/1/1": (split(5, 1, 1), [5, 6]),
    "4/4": (split(4, 4), []),
    "7/1": (split(7, 1), [7]),
    "1/1/1/1": (split(1, 1, 1, 1), []),
}


def view(rank: int, op: str) -> RankView:
    return RankView(
        rank=rank,
        node="n0",
        pid=1000 + rank,
        state="running",
        step=10,
        phase="collective",
        in_phase_s=30.0,
        since_progress_s=30.0,
        coll_seq=SEQ,
        coll_done=SEQ - 1,  # inside collective #7
        coll_op=op,
    )


def live(ops: list[str]) -> dict:
    views = [view(r, op) for r, op in enumerate(ops)]
    return decide(views, job_id="j", incident_id="i", detected_after_s=31.0).to_json()


def fr_doc(op: str) -> dict:
    """A gloo dump whose last entry is collective #7, still in flight, entered as ``op``."""
    entries = [
        {
            "record_id": seq - 1,
            "pg_id": 0,
            "process_group": ["0", "default_pg"],
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "op_id": seq,
            "profiling_name": f"gloo:{'all_reduce' if seq < SEQ else op}",
            "input_sizes": [[4]],
            "input_dtypes": ["Float"],
            "output_sizes": [[4]],
            "output_dtypes": ["Float"],
            "state": "scheduled",
            "retired": seq < SEQ,
            "is_p2p": False,
            "time_created_ns": 1_000_000 * seq,
            "time_discovered_started_ns": 0,
            "time_discovered_completed_ns": 0,
            "timeout_ms": 1_800_000,
        }
        for seq in range(1, SEQ + 1)
    ]
    return {
        "version": "2.10",
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
        "pg_status": {"0": {"last_enqueued_collective": str(SEQ), "last_started_collective": "-1",
                            "last_completed_collective": str(SEQ - 1)}},
        "entries": entries,
    }


def nccl_line(rank: int, op: str) -> str:
    return (
        f"[rank{rank}]:[E1201 10:00:{rank:02d}.000000000 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID 0(default_pg) "
        f"Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={SEQ}, OpType={OPS[op]}, "
        "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600018 milliseconds before timing out."
    )


@pytest.mark.parametrize("name", list(CASES))
def test_every_path_names_the_same_odd_ranks_in_the_same_words(name: str) -> None:
    ops, expected = CASES[name]
    groups: dict[str, list[int]] = {}
    for r, op in enumerate(ops):
        groups.setdefault(op, []).append(r)
    assert list(outside_majority(groups) or ()) == expected

    # (a) live verdict over rank views, all inside Python-level collective #7 with different ops
    v = live(ops)
    assert v["kind"] == "collective_mismatch"
    assert v["initiating_ranks"] == expected
    assert v["confidence"] == ("high" if expected else "low")

    # (b) flight recorder: the analysis alone, then through the verdict (Python-level ops all agree, as
    # when a mismatch is only visible below the hook)
    traces = {r: parse_dump(fr_doc(op), rank=r) for r, op in enumerate(ops)}
    analysis = analyze_fr(traces)
    (mm,) = analysis.mismatches
    assert (mm.seq, mm.kind) == (SEQ, "op")
    assert list(mm.odd_ranks) == expected
    fr_line = next(line for line in analysis.summary_lines() if "mismatch" in line)
    views = [view(r, "all_reduce") for r in range(len(ops))]
    vf = decide(views, job_id="j", incident_id="i", detected_after_s=31.0, fr_facts=fr_facts(analysis)).to_json()
    assert vf["kind"] == "collective_mismatch"
    assert vf["initiating_ranks"] == expected
    assert vf["confidence"] == ("high" if expected else "low")
    assert vf["flight_recorder"]["role"] == "decided"

    # (c) offline: NCCL watchdog timeouts at the same SeqNum, different OpType, through the real parser
    parser = SourceParser("job.log", None)
    events = [e for i, (r, op) in enumerate(enumerate(ops), 1) for e in parser.feed(i, nccl_line(r, op))]
    evidence = collect(events)
    assert sorted(evidence.ranks) == list(range(len(ops)))
    d = diagnose_evidence(evidence)
    assert d.kind == "collective_mismatch"
    assert d.initiating_ranks == expected
    assert d.decided is bool(expected)
    if not expected:
        assert d.confidence == "low"

    # the same words for the same set everywhere
    if expected:
        who = fmt_ranks(expected)
        assert v["reason"].startswith(f"collective mismatch at collective #{SEQ}: {who} called ")
        assert f"odd {who} (" in fr_line
        assert f"recorder: {who} entered it as " in vf["reason"]
        assert d.reason.startswith(f"{who} called ")
        assert f"initiating {who} in phase" in headline(v)
        assert f"initiating {who} in phase" in headline(vf)
        assert render_text(d, evidence).startswith(f"COLLECTIVE MISMATCH — initiating {who}")
    else:
        assert "no majority" in v["reason"] and "no majority" in vf["reason"] and "no majority" in fr_line
        assert "no group is a minority" in d.reason
        assert "initiating no single rank" in headline(v)
        assert render_text(d, evidence).startswith("COLLECTIVE MISMATCH — initiating no single rank")
