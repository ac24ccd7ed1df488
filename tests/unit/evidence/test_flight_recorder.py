"""Flight-recorder loading and cross-rank analysis, on real gloo dumps and hand-built NCCL ones."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from rankwatch.watchdog.core.fr_analysis import analyze_fr
from rankwatch.watchdog.core.fr_trace import FlightRecorderFormatError, RankTrace
from rankwatch.watchdog.evidence.fr_dump import load_dump

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "fr"


def _doc(entry: dict) -> bytes:
    return json.dumps({"version": "2.10", "entries": [entry]}).encode()


def traces(scenario: str) -> dict[int, RankTrace]:
    out = {}
    for p in sorted((FIX / scenario).glob("rank-*.fr.json")):
        t = load_dump(p)
        assert t.rank is not None
        out[t.rank] = t
    assert out, scenario
    return out


# -- what real gloo dumps contain ------------------------------------------------------------------


def test_gloo_dump_fields_as_recorded():
    t = load_dump(FIX / "healthy" / "rank-0.fr.json")
    assert t.rank == 0
    assert t.version == "2.10"
    assert [e.profiling_name for e in t.entries] == ["gloo:all_reduce"] * 3 + ["gloo:broadcast"]
    assert [e.collective_seq_id for e in t.entries] == [1, 2, 3, 4]
    # gloo has no events: state never leaves "scheduled", completion shows only as retired
    assert {e.state for e in t.entries} == {"scheduled"}
    assert all(e.retired and e.finished for e in t.entries)
    assert all(e.time_started_ns is None and e.time_completed_ns is None for e in t.entries)
    assert t.entries[0].input_sizes == ((4,),) and t.entries[0].input_dtypes == ("Float",)
    assert t.entries[0].pg_name == "0" and t.entries[0].pg_desc == "default_pg"
    assert t.entries[0].frames == ()  # JSON dumps carry no stack frames
    st = t.pg_status[0]
    assert (st.last_enqueued, st.last_started, st.last_completed) == (4, -1, 4)


def test_healthy_run_has_no_findings():
    a = analyze_fr(traces("healthy"))
    assert a.ranks == (0, 1)
    assert a.behind_ranks == () and a.missing_ranks == () and a.mismatches == ()
    assert a.per_rank[1].last_entered is not None and a.per_rank[1].last_entered.op == "broadcast"
    assert a.per_rank[1].last_completed == a.per_rank[1].last_entered
    assert a.per_rank[0].in_flight == ()


def test_skipped_collective_names_the_rank_that_never_joined():
    a = analyze_fr(traces("skip"))
    assert a.missing_ranks == (2,)
    assert a.behind_ranks == (2,)
    (m,) = a.missing
    assert (m.pg, m.seq, m.op, m.joined, m.missing) == ("0", 4, "all_reduce", (0, 1), (2,))
    g = a.groups[0]
    assert g.members == (0, 1, 2)
    assert g.progress[2].entered == 3 and g.progress[0].entered == 4
    assert [c.seq for c in a.per_rank[0].in_flight] == [4]
    assert a.per_rank[2].in_flight == ()
    text = "\n".join(a.summary_lines())
    assert "entered by ranks 0, 1; never joined by rank 2" in text


def test_op_mismatch_names_minority_rank():
    a = analyze_fr(traces("mismatch_op"))
    (mm,) = a.mismatches
    assert (mm.seq, mm.kind, mm.odd_ranks) == (3, "op", (1,))
    assert mm.variants == {"all_reduce": (0, 2), "broadcast": (1,)}
    assert a.behind_ranks == () and a.missing_ranks == ()


def test_size_mismatch_names_minority_rank_and_async_retirement_is_weak():
    a = analyze_fr(traces("mismatch_size"))
    (mm,) = a.mismatches
    assert (mm.seq, mm.kind, mm.odd_ranks) == (3, "size", (1,))
    # rank 0 entered seq 3 but its seq 2 was not yet retired when it dumped: reported as lag, not "behind"
    assert a.behind_ranks == ()
    assert a.groups[0].completion_lag == (0,)


# -- NCCL format (hand-built from FlightRecorderDetail.hpp) ----------------------------------------


def test_nccl_hang_fixture():
    tr = traces("nccl_hang")
    assert tr[0].comm_lib_version == "2.27.3"
    assert tr[0].pg_config["0"].ranks == (0, 1, 2, 3)
    assert tr[0].entries[-1].state == "started" and not tr[0].entries[-1].finished
    a = analyze_fr(tr)
    assert a.missing_ranks == (3,) and a.behind_ranks == (3,)
    sub = next(g for g in a.groups if g.name == "1")
    assert sub.members == (0, 1) and sub.behind == () and sub.mismatches == ()
    # the p2p send is excluded from matching but kept in the per-rank trace
    assert any(e.is_p2p for e in tr[1].entries)
    assert a.per_rank[3].last_completed is not None and a.per_rank[3].last_completed.seq == 9


def test_nccl_dtype_mismatch_and_timeout():
    a = analyze_fr(traces("nccl_mismatch_dtype"))
    (mm,) = a.mismatches
    assert (mm.seq, mm.kind, mm.odd_ranks) == (5, "dtype", (2,))
    assert [c.seq for c in a.per_rank[0].timed_out] == [4]
    assert any("timed out" in line for line in a.summary_lines())


def test_two_way_tie_has_no_majority():
    tr = traces("mismatch_op")
    a = analyze_fr({0: tr[0], 1: tr[1]})
    (mm,) = a.mismatches
    assert mm.odd_ranks == ()
    assert "no majority" in "\n".join(a.summary_lines())


def test_rank_without_entries_in_default_pg_is_behind(tmp_path):
    doc = json.loads((FIX / "healthy" / "rank-0.fr.json").read_text())
    doc.pop("entries")  # torch omits the key when the buffer is empty
    doc["pg_status"] = {}
    empty = load_dump(json.dumps(doc).encode(), rank=5)
    assert empty.entries == ()
    tr = traces("healthy")
    tr[5] = empty
    a = analyze_fr(tr)
    assert a.empty_ranks == (5,)
    assert a.behind_ranks == (5,)


def test_ring_wrap_uses_pg_status():
    doc = json.loads((FIX / "healthy" / "rank-1.fr.json").read_text())
    doc["entries"] = doc["entries"][-1:]  # only seq 4 left in the ring
    t = load_dump(json.dumps(doc).encode(), rank=1)
    a = analyze_fr({0: load_dump(FIX / "healthy" / "rank-0.fr.json"), 1: t})
    assert a.behind_ranks == () and a.missing_ranks == ()


# -- malformed input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[]",
        b'{"entries": []}',
        b'{"version": "2.10", "entries": {}}',
        b'{"version": "2.10", "entries": [{"record_id": 0}]}',
        _doc({"record_id": "x", "process_group": ["0", "d"], "profiling_name": "a"}),
        _doc({"record_id": 0, "process_group": ["0", "d"], "profiling_name": "a", "state": "weird"}),
        _doc({"record_id": 0, "process_group": ["0", "d"], "profiling_name": "a", "input_sizes": [["x"]]}),
        _doc({"record_id": 0, "process_group": "0", "profiling_name": "a"}),
        b"\xff\xfe",
    ],
)
def test_malformed_dumps_raise_format_error(data):
    with pytest.raises(FlightRecorderFormatError):
        load_dump(data)


def test_pickled_dump_is_refused():
    with pytest.raises(FlightRecorderFormatError, match="pickle"):
        load_dump(pickle.dumps({"version": "2.10"}))


def test_size_bound(tmp_path):
    p = tmp_path / "rank-3.fr.json"
    p.write_bytes(b" " * 100 + b'{"version": "1"}')
    with pytest.raises(FlightRecorderFormatError, match="limit"):
        load_dump(p, max_bytes=50)
    assert load_dump(p).rank == 3
    with pytest.raises(FlightRecorderFormatError, match="limit"):
        load_dump(b"x" * 100, max_bytes=10)


def test_missing_file_is_oserror(tmp_path):
    with pytest.raises(OSError):
        load_dump(tmp_path / "rank-0.fr.json")
