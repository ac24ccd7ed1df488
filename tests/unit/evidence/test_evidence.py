"""GPU, flight-recorder and NCCL RAS evidence feeding the verdict (evidence.py and verdict.py's use of it).

The NVML stand-in and the RAS replay server are the ones of tests/unit/evidence/test_nvml_probe.py and
tests/unit/evidence/test_nccl_ras.py (there is no GPU and no NCCL here); flight-recorder dumps are the real
gloo fixtures in tests/fixtures/fr/.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path

import pytest
from rankwatch.watchdog.cluster.store import fr_share, node_doc, parse_evidence_doc
from rankwatch.watchdog.core.evidence_items import GpuRemap, GpuXid
from rankwatch.watchdog.core.facts import FactSet
from rankwatch.watchdog.core.fr_analysis import analyze_fr
from rankwatch.watchdog.core.fr_facts import fr_facts
from rankwatch.watchdog.core.fr_trace import compact_dump, parse_dump
from rankwatch.watchdog.core.rules.recorder import fr_behind, fr_doc
from rankwatch.watchdog.evidence import flight_recorder as evidence_mod
from rankwatch.watchdog.evidence.capture import RankCapture
from rankwatch.watchdog.evidence.flight_recorder import fr_evidence, with_remote
from rankwatch.watchdog.evidence.gpu import GpuWatch
from rankwatch.watchdog.evidence.ras_watch import RasWatch
from rankwatch.watchdog.verdict import decide
from test_nccl_ras import RasServer
from test_nccl_ras import fixture as ras_fixture
from test_nvml_probe import FakeNvml
from test_nvml_probe import script as nvml_script
from test_verdict_rules import fr_entered, rv

FR = Path(__file__).resolve().parents[2] / "fixtures" / "fr"


def verdict(views, **kw):
    return decide(views, job_id="j", incident_id="i", detected_after_s=31.0, **kw).to_json()


def captures(scenario: str) -> dict[int, RankCapture]:
    out = {}
    for p in sorted((FR / scenario).glob("rank-*.fr.json")):
        r = int(p.name.split("-")[1].split(".")[0])
        out[r] = RankCapture(rank=r, pid=1000 + r, fr_json=p.read_bytes())
    return out


def hints(scenario: str) -> FactSet:
    f = fr_evidence(captures(scenario))
    assert f.facts is not None
    return f.facts


# -- GPU evidence in the verdict -------------------------------------------------------------------


def test_cpu_stuck_culprit_at_zero_percent_while_peers_spin_is_high_confidence():
    # two ranks: rule "minority not waiting" alone cannot tell 1 from 1 → medium; the GPU breaks the tie
    views = [
        rv(0, waiting=True, gpu_util=100.0),
        rv(1, phase="dataloader", waiting=False, gpu_util=0.0),
    ]
    plain = verdict([dataclasses.replace(v, gpu_util=None) for v in views])
    assert (plain["initiating_ranks"], plain["confidence"]) == ([1], "medium")
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["phase"], v["confidence"]) == ("hang", [1], "dataloader", "high")
    assert v["finding"]["data"]["gpu"] == "agrees"
    assert v["ranks"]["1"]["gpu_util"] == 0.0 and v["ranks"]["0"]["gpu_util"] == 100.0
    # absent from NVML's samples counts as idle too
    views[1] = dataclasses.replace(views[1], gpu_util=None, gpu_missing=True)
    v = verdict(views)
    assert v["confidence"] == "high" and v["finding"]["data"]["gpu"] == "agrees"  # words: test_verdict_words.py


def test_culprit_inside_a_kernel_at_100_percent_is_named_by_the_other_signals_not_the_gpu():
    views = [rv(r, waiting=True, gpu_util=100.0) for r in range(4)]
    views[3] = rv(3, phase="forward", waiting=False, gpu_util=100.0)
    v = verdict(views)
    assert (v["kind"], v["initiating_ranks"], v["phase"], v["confidence"]) == ("hang", [3], "forward", "high")
    assert v["finding"]["data"]["gpu"] == "singles_nobody_out"
    # two ranks: the GPU does not raise a 1-vs-1 call
    v = verdict([views[0], dataclasses.replace(views[3], rank=1)])
    assert (v["initiating_ranks"], v["confidence"]) == ([1], "medium")
    # everyone in the same collective at 100 %: still nobody singled out
    same = dict(phase="collective", coll_seq=7, coll_done=6, gpu_util=100.0)
    v = verdict([rv(r, **same) for r in range(4)])
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("comm_hang", [], "low")


def test_busy_culprit_with_idle_peers_is_noted_but_not_weakened():
    views = [rv(0, waiting=True, gpu_util=0.0), rv(1, waiting=True, gpu_util=0.0), rv(2, phase="forward")]
    views[2] = dataclasses.replace(views[2], waiting=False, gpu_util=100.0)
    v = verdict(views)
    assert (v["initiating_ranks"], v["confidence"]) == ([2], "high")
    assert v["finding"]["data"]["gpu"] == "disagrees"


# -- flight-recorder evidence in the verdict --------------------------------------------------------


def test_size_mismatch_visible_only_in_the_flight_recorder():
    # every rank called all_reduce #3 from Python: the hook sees identical collectives
    same = dict(phase="collective", coll_seq=3, coll_done=2, coll_op="all_reduce")
    views = [rv(r, **same) for r in range(3)]
    assert verdict(views)["kind"] == "comm_hang"
    v = verdict(views, fr_facts=hints("mismatch_size"))
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("collective_mismatch", [1], "high")
    assert v["decided_by"] == "flight_recorder" and v["finding"]["data"]["shape"] == "fr_mismatch"
    assert (v["finding"]["data"]["mismatch"], v["finding"]["data"]["seq"]) == ("size", 3), v["finding"]
    fr = v["flight_recorder"]
    assert fr["role"] == "decided" and fr["ranks"] == [0, 1, 2]
    assert fr["mismatches"][0]["kind"] == "size" and fr["mismatches"][0]["odd_ranks"] == [1]
    # the schema keys are untouched; the FR is an extra key
    assert v["schema"] == "rankwatch.verdict/1" and set(v["ranks"]["0"]) >= {"gpu_util", "collective"}


def test_op_mismatch_seen_by_both_layers_is_backed():
    same = dict(phase="collective", coll_seq=3, coll_done=2)
    views = [rv(0, **same), rv(1, **same, coll_op="broadcast"), rv(2, **same)]
    v = verdict(views, fr_facts=hints("mismatch_op"))
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("collective_mismatch", [1], "high")
    # the flight recorder is the stronger rung: it decides, and the Python-level counters back it
    assert v["flight_recorder"]["role"] == "decided" and v["decided_by"] == "flight_recorder"
    assert "counters" in v["finding"]["data"]["backed_by"]


def test_ddp_internal_all_reduce_skipped_is_decided_by_the_flight_recorder():
    # all three ranks in backward, no Python-level collective and no stack verdict: the hook cannot tell
    views = [rv(r, phase="backward", coll_seq=0, coll_done=0, coll_op=None) for r in range(3)]
    assert verdict(views)["kind"] == "unknown"
    v = verdict(views, fr_facts=hints("skip"))
    assert (v["kind"], v["initiating_ranks"], v["phase"], v["confidence"]) == ("hang", [2], "backward", "high")
    assert v["decided_by"] == "flight_recorder" and v["finding"]["data"]["shape"] == "fr_behind", v["finding"]
    assert v["finding"]["data"]["detail"] == [{"rank": 2, "pg": "0", "seq": 3, "top_seq": 4, "top_op": "all_reduce"}]
    assert v["flight_recorder"]["role"] == "decided"


def test_flight_recorder_backs_the_python_level_rules():
    # the rank behind by Python counters gets FR backing
    views = [
        rv(0, coll_seq=4, coll_done=3, phase="collective"),
        rv(1, coll_seq=4, coll_done=3, phase="collective"),
        rv(2, coll_seq=3, coll_done=3, phase="forward"),
    ]
    v = verdict(views, fr_facts=hints("skip"))
    assert (v["initiating_ranks"], v["confidence"]) == ([2], "high")
    assert v["flight_recorder"]["role"] == "decided"
    assert "counters" in v["finding"]["data"]["backed_by"]
    # a 1-vs-1 minority: the FR decides, the phase rule agrees
    two = [rv(0, waiting=True), rv(1, phase="dataloader", waiting=False)]
    v = verdict(two, fr_facts=fr_entered((0, 1), "0", {0: 6, 1: 5}))
    assert (v["initiating_ranks"], v["confidence"]) == ([1], "high")
    assert "fr_behind" in v["finding"]["data"]["backed_by"], v["finding"]
    assert [(b["rank"], b["seq"], b["top_seq"]) for b in v["flight_recorder"]["behind"]] == [(1, 5, 6)]


def test_a_rank_behind_in_the_recorder_that_itself_waits_is_not_the_sink():
    # rank 0 entered fewer collectives, but its stack waits on peers: it waits too, so the sink of the
    # wait-for graph is the one rank that waits for nobody (rank 2, in its input pipeline)
    views = [rv(0, waiting=True), rv(1, waiting=True), rv(2, phase="dataloader", waiting=False)]
    v = verdict(views, fr_facts=fr_entered((0, 1, 2), "0", {0: 5, 1: 6, 2: 6}))
    assert (v["initiating_ranks"], v["phase"]) == ([2], "dataloader")
    assert v["finding"]["rule"] == "wait_for" and v["finding"]["data"]["waiters"] == [0, 1]


def test_dead_rank_is_never_overridden_by_the_survivors_flight_recorder():
    views = [rv(0), rv(1, state="dead", exit_age_s=1.0), rv(2)]
    v = verdict(views, fr_facts=hints("mismatch_size"))
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [1])
    # the dead rank's own dump (captured before it died, or written as it ended) says it issued the odd size:
    # the recorder backs its end, it does not turn it into the abort of a receiver
    assert v["flight_recorder"]["role"] == "backed"


def test_partial_flight_recorder_coverage_is_medium():
    same = dict(phase="collective", coll_seq=3, coll_done=2)
    views = [rv(r, **same) for r in range(4)]  # rank 3 has no dump
    v = verdict(views, fr_facts=hints("mismatch_size"))
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("collective_mismatch", [1], "medium")


def test_healthy_flight_recorder_changes_nothing():
    views = [rv(0), rv(1, phase="dataloader"), rv(2)]
    assert verdict(views, fr_facts=hints("healthy")) | {"flight_recorder": None} == verdict(views) | {
        "flight_recorder": None
    }


# -- fr_evidence on real captures ------------------------------------------------------------------


def test_fr_evidence_on_real_gloo_dumps():
    f = fr_evidence(captures("mismatch_op"))
    assert f.facts is not None and f.facts.ranks == (0, 1, 2)
    (mm,) = fr_doc(f.facts)["mismatches"]
    assert (mm["seq"], mm["kind"], mm["odd_ranks"]) == (3, "op", [1])
    assert f.lines[0].startswith("flight recorder: pg 0 (default_pg) seq 3: op mismatch, odd rank 1")
    f = fr_evidence(captures("skip"))
    assert f.facts is not None
    (b,) = fr_behind(f.facts)
    assert (b.rank, b.seq, b.top_seq, b.top_op) == (2, 3, 4, "all_reduce")
    assert [m.missing for m in f.facts.unjoined] == [(2,)]
    f = fr_evidence(captures("healthy"))
    assert f.facts is not None
    doc = fr_doc(f.facts)
    assert not doc["behind"] and not doc["mismatches"] and not doc["missing"]


def test_fr_evidence_skips_bad_and_absent_dumps_with_a_note():
    caps = captures("mismatch_op")
    caps[1] = RankCapture(rank=1, pid=1, fr_json=b"\x80\x04pickle")
    caps[2] = RankCapture(rank=2, pid=2, notes=["flight recorder: _dump_fr_trace_json: empty trace"])
    caps[3] = RankCapture(rank=3, pid=3, responder_error="dump responder not listening")
    f = fr_evidence(caps)
    assert f.facts is not None and f.facts.ranks == (0,)
    assert any("rank 1: flight-recorder dump skipped: pickled dump refused" in n for n in f.notes)
    assert any("rank 2: no flight-recorder dump (flight recorder: _dump_fr_trace_json" in n for n in f.notes)
    assert any("rank 3: no flight-recorder dump (dump responder not listening)" in n for n in f.notes)
    assert all(line.startswith("flight recorder: ") for line in f.lines)
    # nothing usable at all
    f = fr_evidence({0: RankCapture(rank=0, pid=1, fr_json=b"{}")})
    assert f.facts is None and f.lines and "skipped" in f.lines[0]
    assert fr_evidence({}).facts is None


def test_fr_evidence_lines_are_bounded(monkeypatch):
    monkeypatch.setattr(evidence_mod, "MAX_FR_LINES", 2)
    f = fr_evidence(captures("skip"))
    assert len(f.lines) == 3 and "more flight-recorder line(s)" in f.lines[-1]


# -- GpuWatch --------------------------------------------------------------------------------------


def test_gpu_watch_without_nvml_is_a_no_op():
    w = GpuWatch()  # real pynvml, no driver on this machine
    assert not w.available
    views = [rv(0), rv(1)]
    assert w.apply(views) == views
    assert w.device_notes() == []
    w.close()
    assert not GpuWatch(nvml=FakeNvml(nvml_script(), absent=True)).available
    assert not GpuWatch(nvml=FakeNvml(nvml_script()), enabled=False).available


def test_gpu_watch_fills_views_from_the_scripted_nvml_and_keeps_xids():
    sc = nvml_script()
    w = GpuWatch(nvml=FakeNvml(sc), wall_clock=lambda: sc["now_s"])
    assert w.available
    views = [rv(0, pid=1001), rv(1, pid=1002), rv(2, pid=7777), rv(3, pid=0, state="missing")]
    out = w.apply(views)
    assert [(v.gpu_util, v.gpu_missing) for v in out] == [(98.0, False), (None, True), (None, False), (None, False)]
    assert out[3] is views[3]
    notes = w.device_notes()
    assert any(isinstance(n, GpuXid) and (n.device, n.xid, n.ranks) == (1, 79, (1,)) for n in notes)
    assert GpuRemap(1, failed=False, ranks=(1,)) in notes
    # XIDs are drained by the probe but remembered by the watch
    w.apply(views)
    assert sum(isinstance(n, GpuXid) and n.xid == 79 for n in w.device_notes()) == 1
    w.close()


def test_gpu_watch_does_not_flag_everyone_missing():
    sc = nvml_script()
    sc["devices"][0]["samples"] = []  # pid 1001 has a context but no fresh sample either
    w = GpuWatch(nvml=FakeNvml(sc), wall_clock=lambda: sc["now_s"])
    out = w.apply([rv(0, pid=1001), rv(1, pid=1002)])
    assert [(v.gpu_util, v.gpu_missing) for v in out] == [(None, False), (None, False)]


def test_gpu_watch_views_feed_the_verdict():
    sc = nvml_script()
    w = GpuWatch(nvml=FakeNvml(sc), wall_clock=lambda: sc["now_s"])
    views = w.apply([rv(0, pid=1001, waiting=True), rv(1, pid=1002, phase="dataloader", waiting=False)])
    v = verdict(views, extra_evidence=w.device_notes())
    assert (v["initiating_ranks"], v["confidence"]) == ([1], "high")
    assert v["ranks"]["0"]["gpu_util"] == 98.0
    assert any(i["kind"] == GpuXid.KIND and i["xid"] == 79 for i in v["evidence_items"])


def test_gpu_watch_never_raises(monkeypatch):
    sc = nvml_script()
    w = GpuWatch(nvml=FakeNvml(sc), wall_clock=lambda: sc["now_s"])
    assert w.probe is not None

    def boom(*a, **k):
        raise RuntimeError("driver gone")

    monkeypatch.setattr(w.probe, "sample", boom)
    views = [rv(0, pid=1001)]
    assert w.apply(views) == views


# -- RasWatch --------------------------------------------------------------------------------------


def test_ras_watch_two_queries_against_the_replay_server():
    with RasServer(ras_fixture("json_stuck_q1.json")) as srv:
        a = RasWatch(srv.addr, timeout_s=5).query()
    with RasServer(ras_fixture("json_stuck_q2.json")) as srv:
        w = RasWatch(srv.addr, timeout_s=5)
        b = w.query()
    assert a is not None and b is not None
    kinds = {(f.what, f.ranks) for f in w.findings(a, b)}
    assert ("stuck", (2,)) in kinds
    assert w.evidence(a, b) == w.findings(a, b)  # the verdict's items (report.evidence_words phrases them)
    assert w.findings(None, None) == []


def test_ras_watch_disabled_or_unreachable():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    w = RasWatch(f"127.0.0.1:{port}", timeout_s=1)
    assert w.query() is None and w.evidence(None, w.query()) == []
    assert RasWatch("localhost:1", disabled=True).query() is None
    assert RasWatch("10.0.0.1:28028", timeout_s=0.2).query() is None  # not loopback: refused


@pytest.mark.parametrize("addr", ["localhost:28028", "127.0.0.1:5"])
def test_ras_watch_address_is_configurable(addr):
    assert RasWatch(addr).addr == addr and RasWatch().addr == "localhost:28028"


def test_of_the_ranks_behind_in_the_flight_recorder_the_one_with_nothing_in_flight_started_it():
    # DDP broadcasts buffers at every forward: rank 3 stopped before its forward; rank 1 is still inside
    # the broadcast (#18, relayed through rank 3) while ranks 0 and 2 went on to #19
    views = [rv(r, waiting=True) for r in (0, 1, 2)] + [rv(3, phase="dataloader", waiting=False)]
    # (rank 1 is behind in the broadcast's group, rank 3 in the all-reduce's: the lowest count of each)
    relayed = fr_entered((0, 1, 2, 3), "1", {0: 19, 1: 18, 2: 19, 3: 19}, op="broadcast", waiting=(1,))
    lagging = fr_entered((0, 1, 2, 3), "0", {0: 19, 1: 19, 2: 19, 3: 17})
    fr = FactSet(ranks=(0, 1, 2, 3), counts=[*relayed.counts, *lagging.counts], in_op=[*relayed.in_op, *lagging.in_op],
                 waits=relayed.waits)
    assert [(b.rank, b.waiting) for b in fr_behind(fr)] == [(1, True), (3, False)]
    v = verdict(views, fr_facts=fr)
    assert (v["initiating_ranks"], v["decided_by"]) == ([3], "flight_recorder")


# -- the recorder across nodes: a broadcast root behind yet waiting (real gloo dumps) ---------------


def _broadcast_views():
    """The live views of the accuracy suite's miss: DDP broadcasts a model's buffers at the start of each
    forward, so with rank 2 stuck in its input pipeline on node 1, the broadcast's root (rank 0) waits
    inside forward while ranks 1 and 3 got the data and wait in backward's all-reduce."""
    return [
        rv(0, node="n0", phase="forward", waiting=True),
        rv(1, node="n0", waiting=True),
        rv(2, node="n1", phase="dataloader", waiting=False),
        rv(3, node="n1", waiting=True),
    ]


def test_a_waiting_broadcast_root_is_not_named_when_the_recorder_covers_only_its_own_node():
    caps = captures("broadcast_root")
    leader_only = fr_evidence({r: caps[r] for r in (0, 1)})
    assert leader_only.facts is not None and [b.rank for b in fr_behind(leader_only.facts)] == [0]
    v = verdict(_broadcast_views(), fr_facts=leader_only.facts)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [2], "dataloader"), v["reason"]
    # the root waits in the broadcast for the members the recorder does not cover (ranks 2, 3); rank 3
    # waits in its stack: the sink is rank 2
    assert v["finding"]["rule"] == "wait_for" and v["finding"]["data"]["sinks"] == {"2": "waiting"}


def test_the_leader_reads_the_other_nodes_recorder_from_its_evidence_and_decides_on_every_rank():
    caps = captures("broadcast_root")
    views = _broadcast_views()
    leader = fr_evidence({r: caps[r] for r in (0, 1)})
    follower = fr_evidence({r: caps[r] for r in (2, 3)})
    share = fr_share(follower.traces, per_pg=64, budget_bytes=2 << 20)
    raw = json.dumps(node_doc(1, "n1", 0, views[2:], "evidence", flight_recorder=share)).encode()
    answer = parse_evidence_doc(raw)
    assert sorted(answer.fr) == [2, 3] and not answer.notes
    merged = with_remote(leader, answer.fr)
    # the same facts as if every dump had been local
    assert merged.facts == fr_evidence(caps).facts
    assert merged.traces.keys() == {0, 1}  # the merged findings still hold only this node's own traces
    v = verdict(views, fr_facts=merged.facts)
    assert (v["kind"], v["initiating_ranks"], v["confidence"]) == ("hang", [2], "high"), v["reason"]
    assert v["decided_by"] == "flight_recorder" and v["flight_recorder"]["ranks"] == [0, 1, 2, 3]
    assert v["finding"]["rule"] == "wait_for" and v["finding"]["data"]["edge_strength"] == "flight_recorder"


def test_compacted_traces_keep_the_newest_entries_and_the_counters():
    trace = fr_evidence(captures("broadcast_root")).traces[1]
    back = parse_dump(compact_dump(trace, per_pg=2), rank=1)
    assert [e.collective_seq_id for e in back.entries] == [3, 4]
    assert back.pg_status == trace.pg_status and back.pg_config == trace.pg_config
    assert back.entries == tuple(dataclasses.replace(e, output_sizes=()) for e in trace.entries[-2:])
    # the analysis over cut traces still says who is behind and who never joined
    caps = fr_evidence(captures("skip"))
    cut = {r: parse_dump(compact_dump(t, per_pg=1), rank=r) for r, t in caps.traces.items()}
    facts = fr_facts(analyze_fr(cut))
    assert [b.rank for b in fr_behind(facts)] == [2] and [m.missing for m in facts.unjoined] == [(2,)]


def test_a_nodes_share_shrinks_to_fit_and_is_dropped_when_nothing_fits():
    real = fr_evidence(captures("broadcast_root")).traces[1]
    # a long-running rank: 200 collectives in its ring buffer
    e = real.entries[0]
    long = dataclasses.replace(real, entries=tuple(
        dataclasses.replace(e, record_id=i, collective_seq_id=i + 1) for i in range(200)
    ))
    traces = {0: long, 1: long}

    def kept(share):
        return [len(share[k]["entries"]) for k in sorted(share)]

    assert kept(fr_share(traces, per_pg=64, budget_bytes=2 << 20)) == [64, 64]
    size_of_16 = len(json.dumps(fr_share(traces, per_pg=16, budget_bytes=2 << 20), separators=(",", ":")))
    assert kept(fr_share(traces, per_pg=64, budget_bytes=size_of_16)) == [16, 16]  # halved twice to fit
    assert kept(fr_share(traces, per_pg=64, budget_bytes=size_of_16 - 1)) == [8, 8]
    assert fr_share(traces, per_pg=64, budget_bytes=100) == {}


def test_hostile_recorder_entries_in_a_nodes_evidence_are_refused_one_by_one():
    caps = captures("broadcast_root")
    traces = fr_evidence(caps).traces
    share = fr_share({2: traces[2]}, per_pg=64, budget_bytes=2 << 20)
    share["0"] = share["2"]  # node 1 speaking for the leader's rank 0
    share["3"] = {"version": "2.10", "entries": {"not": "a list"}}
    share["x; rm -rf /"] = share["2"]
    share["1e9"] = "\x80\x04pickle"
    doc = node_doc(1, "n1", 0, _broadcast_views()[2:], "evidence", flight_recorder=share)
    answer = parse_evidence_doc(json.dumps(doc).encode())
    assert sorted(answer.fr) == [2]
    assert [v.rank for v in answer.views] == [2, 3]
    text = "\n".join(answer.notes)
    assert "rank 0, not one of its ranks" in text and "rank 3's flight recorder rejected" in text
    assert "is not a rank" in text
    doc["flight_recorder"] = ["not", "an", "object"]
    answer = parse_evidence_doc(json.dumps(doc).encode())
    assert answer.fr == {} and [v.rank for v in answer.views] == [2, 3] and answer.notes


def test_nccl_dumps_survive_the_trip_between_nodes():
    """NCCL entries carry states and discovered times gloo's do not (started/completed, timeouts): the
    compacted share must keep what the analysis reads, so the leader's facts equal the all-local ones."""
    for scenario in ("nccl_hang", "nccl_mismatch_dtype"):
        caps = captures(scenario)
        ranks = sorted(caps)
        whole = fr_evidence(caps)
        local = fr_evidence({r: caps[r] for r in ranks[:1]})
        share = fr_share({r: whole.traces[r] for r in ranks[1:]}, per_pg=16, budget_bytes=512 << 10)
        views = [rv(r, node=f"n{int(r != ranks[0])}") for r in ranks[1:]]
        answer = parse_evidence_doc(json.dumps(node_doc(1, "n1", 0, views, "evidence", flight_recorder=share)).encode())
        assert sorted(answer.fr) == ranks[1:] and not answer.notes
        assert with_remote(local, answer.fr).facts == whole.facts, scenario
