"""Shapes of real multi-rank failure logs (as pasted in GitHub issues) that `diagnose` used to get wrong.

One block per fix; the fixtures are in tests/fixtures/logs/realistic/ (README.md there says what each
models, make_realistic.py writes them).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankwatch.watchdog.core.failures import CONSEQUENCE, INITIATING, abort_role
from rankwatch.watchdog.diagnose import diagnose_jobs, diagnose_logs
from rankwatch.watchdog.diagnose import events as ev
from rankwatch.watchdog.diagnose.facts import collect
from rankwatch.watchdog.diagnose.jobs import SourceInfo, conflict, group
from rankwatch.watchdog.diagnose.parser import SourceParser
from rankwatch.watchdog.diagnose.patterns import split_prefix
from rankwatch.watchdog.diagnose.reasoning import Diagnosis, diagnose_evidence

LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "logs"
REAL = LOGS / "realistic"
PG = "[PG ID 0 PG GUID 0(default_pg) Rank {r}]"


def feed(lines: list[str], name: str = "t.log") -> list[ev.Event]:
    p = SourceParser(name)
    return [e for i, line in enumerate(lines, 1) for e in p.feed(i, line)]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rankwatch", "diagnose", *args], capture_output=True, text=True, timeout=60)


def finding(d: Diagnosis) -> dict[str, Any]:
    """The structured finding of the verdict document (what decided, on which data)."""
    found = d.to_json()["finding"]
    assert isinstance(found, dict)
    return found


def E(family: str, rank: int, **kw: object) -> ev.Event:
    return ev.Event(family, "x.log", kw.pop("line", 1), "t", rank=rank, **kw)  # type: ignore[arg-type]


# -- 1: a lone NCCL timeout while everyone else finished ------------------------------------------------
def test_lone_timeout_after_the_others_finished_names_the_extra_collective() -> None:
    d, _ = diagnose_logs([str(REAL / "extra_collective_r3.log")])
    assert (d.initiating_ranks, d.kind, d.confidence, d.decided) == ([3], "collective_mismatch", "medium", True)
    f = finding(d)
    assert (f["rule"], f["data"]["shape"], f["data"]["seq"], f["data"]["finished"]) == (
        "lone_collective", "lone", 1201, [0, 1, 2])
    assert d.phase == "collective"
    assert all("finished" in d.others[r] for r in (0, 1, 2))


def test_a_minority_that_finished_left_early() -> None:
    d, _ = diagnose_logs([str(REAL / "left_early_r0.log")])
    assert (d.initiating_ranks, d.kind, d.confidence) == ([0], "dead_rank", "medium")
    f = finding(d)
    assert (f["rule"], f["data"]["shape"], f["data"]["seq"]) == ("lone_collective", "left_early", 845)
    assert finding(d)["data"]["root_cause_victims"] == [2]


def test_lone_timeout_below_what_the_finished_ranks_reached_is_behind_with_low_confidence() -> None:
    """Ranks 0-2 are known (PG status) to have reached #1300 and then finished; rank 3 timed out in #1201,
    a collective they had issued and left without waiting for: rank 3 arrived late."""
    events = [E(ev.FINISHED, r) for r in (0, 1, 2)]
    events += [E(ev.NCCL_STATUS, r, enqueued=1300, completed=1300, seq=1300) for r in (0, 1, 2)]
    events += [E(ev.NCCL_TIMEOUT, 3, seq=1201, op="ALLREDUCE")]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind, d.confidence, d.decided) == ([3], "hang", "low", True)
    f = finding(d)
    assert (f["rule"], f["data"]["shape"], f["data"]["seq"], f["data"]["reached"]) == (
        "lone_collective", "late", 1201, 1300)


def test_finished_ranks_and_timeouts_tied_decide_nothing() -> None:
    events = [E(ev.FINISHED, r) for r in (0, 1)] + [E(ev.NCCL_TIMEOUT, r, seq=9, op="ALLREDUCE") for r in (2, 3)]
    d = diagnose_evidence(collect(events))
    assert not d.decided and d.initiating_ranks == []


def test_normal_exit_in_a_failure_report_counts_as_finished() -> None:
    events = [E(ev.EXIT, r, exitcode=0, line=r + 1) for r in (0, 1, 2)]
    events += [E(ev.NCCL_TIMEOUT, 3, seq=40, op="ALLREDUCE"), E(ev.EXIT, 3, exitcode=-6, signal="SIGABRT")]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind) == ([3], "collective_mismatch")


def test_finished_lines_are_recognised() -> None:
    lines = [
        "[rank0]:Training finished: 1200 steps",
        "[rank1]:[W1130 12:40:02.1 ProcessGroupNCCL.cpp:1496] Warning: WARNING: destroy_process_group() was not "
        "called before program exit, which can leak resources.",
        "[rank2]:[W1130 12:40:02.1 ProcessGroupNCCL.cpp:1168] Warning: WARNING: process group has NOT been "
        "destroyed before we destruct ProcessGroupNCCL.",
        "[rank3]:Finished training in 3h",
        "[rank4]:epoch 3 finished",  # an epoch is not the run
    ]
    assert [(e.family, e.rank) for e in feed(lines)] == [(ev.FINISHED, r) for r in range(4)]


# -- 2: "Observed flight recorder dump signal" is the printing rank being told ----------------------------
def test_observed_dump_signal_is_not_a_timeout_of_the_printing_rank() -> None:
    (e,) = feed([f"[rank2]:[E1130 14:22:40.9 ProcessGroupNCCL.cpp:1746] {PG.format(r=2)} Observed flight "
                 "recorder dump signal from another rank via TCPStore."])
    assert (e.family, e.rank, e.detail) == (ev.DUMP_SIGNAL, 2, "another rank")
    f = collect([e]).ranks[2]
    assert f.told is not None and not f.own_dump and f.nccl_timeout is None


def test_rank_that_only_observed_the_dump_signal_never_entered_the_collective() -> None:
    d, _ = diagnose_logs([str(REAL / "observed_dump_signal_r2.log")])
    assert (d.initiating_ranks, d.kind, d.decided) == ([2], "hang", True)
    f = finding(d)
    assert (f["rule"], f["ranks"], f["data"]["told"]) == ("outside", [2], [2])
    assert "not its own timeout" in d.others.get(0, "") or "NCCL watchdog timeout" in d.others[0]


# -- 3: the watchdog's SIGABRT is a consequence -----------------------------------------------------------
def test_abort_role() -> None:
    assert abort_role(own_watchdog=True, aborted_with_timed_out_peers=False) == CONSEQUENCE
    assert abort_role(own_watchdog=False, aborted_with_timed_out_peers=True) == CONSEQUENCE
    assert abort_role(own_watchdog=False, aborted_with_timed_out_peers=False) == INITIATING


def test_sigabrt_of_every_rank_after_a_timeout_is_not_the_initiator() -> None:
    d, _ = diagnose_logs([str(REAL / "sigabrt_after_timeout_r6.log")])
    assert (d.initiating_ranks, d.kind, d.confidence) == ([6], "hang", "high")
    assert 7 not in d.initiating_ranks  # torchrun's Root Cause, silent, SIGABRT in the same second
    assert finding(d)["data"]["root_cause_victims"] == [7]


def test_a_lone_sigabrt_without_any_watchdog_is_still_a_crash() -> None:
    events = [E(ev.EXIT, 1, exitcode=-6, signal="SIGABRT", pid=11, ts=100.0)]
    events += [E(ev.EXIT, r, exitcode=-15, signal="SIGTERM", pid=10 + r, ts=101.0) for r in (0, 2, 3)]
    events += [ev.Event(ev.AGENT_TERM, "x.log", 1, "t", pid=10 + r, signal="SIGTERM") for r in (0, 2, 3)]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind) == ([1], "dead_rank")


def test_sigabrt_clearly_before_the_others_watchdog_aborts_is_a_crash() -> None:
    events = [E(ev.EXIT, 1, exitcode=-6, signal="SIGABRT", ts=100.0)]
    for r in (0, 2, 3):
        events += [E(ev.NCCL_TIMEOUT, r, seq=5, op="ALLREDUCE"), E(ev.EXIT, r, exitcode=-6, signal="SIGABRT", ts=700.0)]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind) == ([1], "dead_rank")


# -- 4: "… from rank N" is evidence about rank N -------------------------------------------------------
def test_dump_signal_from_rank_n_is_evidence_about_rank_n() -> None:
    line = (f"[rank0]:[E1130 18:05:10.0002 ProcessGroupNCCL.cpp:1787] {PG.format(r=0)} Received a dump signal due "
            "to a collective timeout from  rank 2 and we will try our best to dump the debug info. Last enqueued "
            "NCCL work: 12, last completed NCCL work: 12.This is most likely caused by …")
    told, reported = feed([line])
    assert (told.family, told.rank, told.enqueued, told.completed) == (ev.DUMP_SIGNAL, 0, 12, 12)
    assert (reported.family, reported.rank, reported.local_rank) == (ev.TIMEOUT_REPORTED, 2, None)
    assert "per rank 0" in reported.detail
    facts = collect([told, reported]).ranks
    assert facts[0].told is not None and not facts[0].own_dump
    assert facts[2].counts[ev.TIMEOUT_REPORTED] == 1


def test_older_torch_dump_signal_wordings() -> None:
    own, other = feed([
        "[rank1]:[E ProcessGroupNCCL.cpp:1] [PG 0 Rank 1] Received a dump signal from this local rank and will "
        "start to dump the debug info. Last enqueued NCCL work: 7, last completed NCCL work: 6.",
        "[rank2]:[E ProcessGroupNCCL.cpp:1] [PG 0 Rank 2] Received a global timeout from another rank and will "
        "start to dump the debug info. Last enqueued NCCL work: 6, last completed NCCL work: 6.",
    ])
    assert (own.rank, own.detail, other.rank, other.detail) == (1, "this rank", 2, "another rank")


def test_timeout_known_only_from_the_others_reports() -> None:
    d, evidence = diagnose_logs([str(REAL / "dump_signal_from_rank_r2.log")])
    assert (d.initiating_ranks, d.kind, d.confidence, d.decided) == ([2], "collective_mismatch", "medium", True)
    f = finding(d)
    assert (f["rule"], f["data"]["shape"], f["data"]["idle"], f["data"]["idle_completed"]) == (
        "lone_collective", "lone", [0, 1, 3], 12)
    assert evidence.ranks[2].counts[ev.TIMEOUT_REPORTED] == 3
    assert not any(evidence.ranks[r].counts[ev.TIMEOUT_REPORTED] for r in (0, 1, 3))


# -- 5: prefixes that hid the rank ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "rank", "local", "pid", "host", "body"),
    [
        ("[1,3]<stderr>:Traceback (most recent call last):", 3, None, None, None, "Traceback (most recent call last):"),
        ("[2]<stdout>:step 1", 2, None, None, None, "step 1"),
        ("[80749] RuntimeError: x", None, None, 80749, None, "RuntimeError: x"),
        ("[80749] [rank0]: RuntimeError: x", 0, None, 80749, None, "RuntimeError: x"),
        ("[gpu-node-5:41233:0] KeyError: 'a'", None, None, 41233, "gpu-node-5", "KeyError: 'a'"),
        ("2024-01-01 12:00:00,123 - INFO - [rank3]: boom", 3, None, None, None, "boom"),
        ("2024-01-01 12:00:00,123 - trainer - ERROR - [default1]:boom", None, 1, None, None, "boom"),
        ("[2024-01-01 12:00:00,123] [INFO] [rank2]: boom", 2, None, None, None, "boom"),
        ("2026-11-30T21:01:30.250Z [gpu-node-5:41233:0] boom", None, None, 41233, "gpu-node-5", "boom"),
        ("2024-01-01 12:00:00 5: [rank5]: boom", 5, None, None, None, "boom"),
        ("ERROR:root:boom", None, None, None, None, "boom"),
        ("[1]:", None, None, None, None, "[1]:"),  # a failure-report entry number is not a pid
        ("[rank0]:[E1118 20:32:23.955 ProcessGroupNCCL.cpp:629] x", 0, None, None, None,
         "[E1118 20:32:23.955 ProcessGroupNCCL.cpp:629] x"),
    ],
)
def test_known_prefixes_are_stripped(line: str, rank: int | None, local: int | None, pid: int | None,
                                     host: str | None, body: str) -> None:
    pre, rest = split_prefix(line)
    assert (pre.rank, pre.local_rank, pre.pid, pre.host, rest) == (rank, local, pid, host, body)


def test_wall_clock_prefix_gives_the_event_a_time() -> None:
    (e,) = feed(["2024-03-05 09:04:22,118 - INFO - [default1]:RuntimeError: CUDA error: an illegal memory access"])
    assert e.family == ev.CUDA_ERROR and e.local_rank == 1 and e.ts is not None


@pytest.mark.parametrize(
    ("fixture", "rank", "cause", "exception"),
    [
        ("mpirun_tag_output_r2.log", 2, "python_error", "ValueError"),
        ("pylogging_prefix_r1.log", 1, "cuda_error", ""),
        ("pid_prefix_r3.log", 3, "cuda_oom", ""),
        ("host_pid_prefix_r1.log", 1, "python_error", "KeyError"),
    ],
)
def test_prefixed_logs_name_the_failing_rank(fixture: str, rank: int, cause: str, exception: str) -> None:
    d, _ = diagnose_logs([str(REAL / fixture)])
    assert (d.initiating_ranks, d.kind, d.confidence, d.decided) == ([rank], "dead_rank", "high", True), d.reason
    f = finding(d)
    assert (f["rule"], f["strength"], f["data"]["cause"]) == ("exit_cause", "exit_cause", cause)
    assert f["data"]["detail"].startswith(exception)


def test_pid_tagged_tracebacks_of_interleaved_ranks_stay_apart() -> None:
    es = feed([
        "[101] Traceback (most recent call last):",
        "[102] Traceback (most recent call last):",
        '[101]   File "/w/a.py", line 3, in main',
        '[102]   File "/w/b.py", line 9, in main',
        "[101] ValueError: one",
        "[102] KeyError: 'two'",
    ])
    errors = {e.pid: e.detail for e in es if e.family == ev.PY_ERROR}
    assert errors == {101: "ValueError: one", 102: "KeyError: 'two'"}


# -- 6: exit codes ------------------------------------------------------------------------------------
def test_a_guess_from_the_report_alone_exits_1(tmp_path: Path) -> None:
    """torchrun's report alone names a rank but does not decide: exit 1, not 0 (it was 0 before)."""
    report = "\n".join([
        "Failures:", "[1]:", "  time      : 2026-11-30_10:00:01", "  host      : n1", "  rank      : 1 (local_rank: 1)",
        "  exitcode  : 1 (pid: 11)", "  error_file: <N/A>", "  traceback : To enable traceback see: …",
        "Root Cause (first observed failure):", "[0]:", "  time      : 2026-11-30_10:00:01", "  host      : n1",
        "  rank      : 0 (local_rank: 0)", "  exitcode  : 1 (pid: 10)", "  error_file: <N/A>",
        "  traceback : To enable traceback see: …", "=" * 60, "",
    ])
    log = tmp_path / "report_only.log"
    log.write_text(report)
    p = run("--json", str(log))
    doc = json.loads(p.stdout)
    assert doc["initiating_ranks"] == [0] and doc["decided"] is False
    assert p.returncode == 1


def test_decided_exits_0() -> None:
    assert run(str(REAL / "extra_collective_r3.log")).returncode == 0


# -- 7: several jobs in one directory -----------------------------------------------------------------
SEVERAL = {  # job_id → (initiating ranks, kind, sources)
    None: ([0], "dead_rank", ["old_attempt.log"]),
    "slurm:48811": ([1], "dead_rank", ["slurm-48811.out"]),
    "slurm:48907": ([3], "dead_rank", ["slurm-48907.out"]),
    "run:pretrain-7b": ([2], "dead_rank", ["pretrain/console.log", "pretrain/dmesg.txt"]),
}


def test_a_directory_of_several_jobs_is_diagnosed_job_by_job() -> None:
    result = diagnose_jobs([str(REAL / "several_jobs")])
    got = {j.job_id: (j.diagnosis.initiating_ranks, j.diagnosis.kind,
                      [str(Path(f).relative_to(REAL / "several_jobs")) for f in j.files]) for j in result.jobs}
    assert got == SEVERAL
    assert [Path(f).name for f in result.ungrouped] == ["notes.txt"]  # no rank, no time, no key: not guessed
    assert result.decided
    # before, every rank of the four jobs was folded into one 4-rank job
    merged, _ = diagnose_logs([str(REAL / "several_jobs")])
    assert not merged.decided


def test_several_jobs_cli_text_and_json() -> None:
    p = run(str(REAL / "several_jobs"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("4 jobs in these logs")
    assert p.stdout.count("=== job ") == 4 and p.stdout.count(" — initiating ") == 4
    assert "Slurm job 48811" in p.stdout and "torchrun run pretrain-7b" in p.stdout
    assert "not assigned to any job:" in p.stdout and "notes.txt" in p.stdout
    p = run("--json", str(REAL / "several_jobs"))
    docs = json.loads(p.stdout)
    assert isinstance(docs, list) and len(docs) == 4
    assert all(d["schema"] == "rankwatch.verdict/1" and d["decided"] for d in docs)
    assert {d["job_id"]: d["initiating_ranks"] for d in docs} == {k: v[0] for k, v in SEVERAL.items()}
    assert all(any("notes.txt" in n for n in d["notes"]) for d in docs)


def test_one_undecided_job_makes_the_exit_code_1(tmp_path: Path) -> None:
    shutil.copy(REAL / "several_jobs" / "slurm-48811.out", tmp_path)
    shutil.copy(LOGS / "torchrun_tee" / "size_mismatch_large.log", tmp_path)
    p = run("--json", str(tmp_path))
    docs = json.loads(p.stdout)
    assert [d["decided"] for d in docs] == [False, True]
    assert p.returncode == 1


def test_unrelated_captures_in_one_directory_are_not_merged() -> None:
    """The six real captures share ranks 0-3 at different times: six jobs, each with its own verdict."""
    result = diagnose_jobs([str(LOGS / "torchrun_tee")])
    assert len(result.jobs) == 6 and not result.ungrouped
    expected = {"collective_mismatch_r3.log": [3], "dead_rank_r2.log": [2], "debug_detail_all_segv.log": [],
                "input_hang_r1.log": [1], "size_mismatch_large.log": [], "size_mismatch_small.log": [1]}
    assert {Path(j.files[0]).name: j.diagnosis.initiating_ranks for j in result.jobs} == expected


def test_single_job_json_keeps_its_shape() -> None:
    p = run("--json", str(LOGS / "logdir_input_hang_r3"))
    doc = json.loads(p.stdout)
    assert isinstance(doc, dict) and doc["job_id"] is None and "sources" not in doc


def test_conflict_rules() -> None:
    a = SourceInfo("a", ranks={0, 1}, t_min=100.0, t_max=200.0)
    assert not conflict(a, SourceInfo("b", ranks={2, 3}, t_min=5000.0, t_max=6000.0))  # other ranks: other node
    assert conflict(a, SourceInfo("b", ranks={1}, t_min=5000.0, t_max=6000.0))  # rank 1 twice, other time
    assert conflict(a, SourceInfo("b", ranks={1}, hosts={"h2"}) ) is False  # a has no host: nothing to compare
    assert conflict(SourceInfo("a", ranks={1}, hosts={"h1"}), SourceInfo("b", ranks={1}, hosts={"h2"}))
    assert conflict(SourceInfo("a", keys={"slurm": {"1"}}), SourceInfo("b", keys={"slurm": {"2"}}))
    assert conflict(SourceInfo("a", keys={"port": {"29500"}}), SourceInfo("b", keys={"port": {"29501"}}))
    assert not conflict(SourceInfo("a", keys={"port": {"29500", "41123"}}), SourceInfo("b", keys={"port": {"29500"}}))


def test_a_script_naming_several_runs_links_none_of_them() -> None:
    infos = [SourceInfo("capture.sh", keys={"run": {"fx1", "fx2"}}),
             SourceInfo("a/x.log", folder="a", keys={"run": {"fx1"}}, ranks={0}),
             SourceInfo("b/y.log", folder="b", keys={"run": {"fx2"}}, ranks={0})]
    g = group(infos)
    assert g.jobs == [[1], [2]] and g.ungrouped == [0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.builds(
    SourceInfo,
    name=st.just("f"),
    folder=st.sampled_from(["", "a", "a/b", "c"]),
    keys=st.dictionaries(st.sampled_from(["run", "slurm", "rdzv", "port"]),
                         st.sets(st.sampled_from(["1", "2", "3"]), min_size=1, max_size=2), max_size=3),
    ranks=st.sets(st.integers(0, 3), max_size=3),
    local_ranks=st.sets(st.integers(0, 3), max_size=2),
    launchers=st.sets(st.integers(1, 3), max_size=2),
    hosts=st.sets(st.sampled_from(["h1", "h2"]), max_size=2),
    t_min=st.none() | st.floats(0, 10_000),
), max_size=8))
def test_grouping_is_a_partition(infos: list[SourceInfo]) -> None:
    for s in infos:  # a span needs both ends
        s.t_max = None if s.t_min is None else s.t_min + 60.0
    g = group(infos)
    placed = [i for job in g.jobs for i in job] + g.ungrouped
    assert sorted(placed) == list(range(len(infos)))
    assert all(job for job in g.jobs) and (g.jobs or not infos)


# -- accuracy suite: a worker missing from torchrun's failure report had exited 0 ---------------------------
def report(rank: int, code: int, sig: str | None, line: int) -> ev.Event:
    """One failure-report entry (host, rank = local rank on one node)."""
    return ev.Event(ev.EXIT, "c.log", line, "t", rank=rank, local_rank=rank, host="n1", pid=100 + rank,
                    exitcode=code, signal=sig, detail="Signal 15" if sig else "To enable traceback")


def test_a_rank_missing_from_the_report_between_victims_left_early() -> None:
    # ranks 0 and 2 lost their peer and exited 1; rank 1 printed nothing and torchrun does not list it
    events = [E(ev.PEER_LOST, r, detail="peer") for r in (0, 2)] + [report(0, 1, None, 40), report(2, 1, None, 50)]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind) == ([1], "dead_rank")
    assert (finding(d)["rule"], finding(d)["data"]["shape"]) == ("lone_collective", "left_early")
    assert any("rank 1 is not in this failure report" in q for q in d.evidence)


def test_a_missing_rank_is_exited_when_the_report_lists_the_ranks_torchrun_terminated() -> None:
    # torch elastic listed every rank it SIGTERMed: the one it does not list was gone already; one peer
    # lost it, the other waited silently (a tie between waiting and silent is not the evidence)
    events = [E(ev.PEER_LOST, 0, detail="peer")]
    events += [report(0, 1, None, 40), report(2, -15, "SIGTERM", 50), report(3, -15, "SIGTERM", 60)]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind) == ([1], "dead_rank")


def test_a_missing_rank_proves_nothing_when_it_may_still_have_been_running() -> None:
    # ranks 0 and 2 timed out (not a lost peer) and no SIGTERM entry shows torchrun lists the workers it
    # stops: rank 1 may have been hung and then stopped (older torch lists neither) — not "left early"
    events = [E(ev.GLOO_TIMEOUT, r, detail="x") for r in (0, 2)] + [report(0, 1, None, 40), report(2, 1, None, 50)]
    d = diagnose_evidence(collect(events))
    assert finding(d)["data"].get("shape") != "left_early" and 1 not in collect(events).ranks
    # nor is a rank above the highest listed one seen (the report does not give nproc)
    events = [E(ev.PEER_LOST, r, detail="peer") for r in (0, 1)] + [report(0, 1, None, 40), report(1, 1, None, 50)]
    assert 2 not in collect(events).ranks


def test_a_sigabrt_next_to_an_unclaimed_gloo_enforce_is_the_mismatch_not_a_crash() -> None:
    # gloo's size enforcement: std::terminate prints it with no rank prefix; the receiver dies by SIGABRT
    enforce = ev.Event(ev.SIZE_MISMATCH, "c.log", 5, "t", detail="received 131716 bytes, expected 4")
    events = [enforce, E(ev.EXIT, 3, exitcode=-6, signal="SIGABRT", ts=100.0)]
    events += [E(ev.PEER_LOST, r, detail="peer") for r in (1, 2)] + [E(ev.EXIT, 0, exitcode=-15, signal="SIGTERM")]
    d = diagnose_evidence(collect(events))
    assert (d.initiating_ranks, d.kind, d.decided) == ([], "collective_mismatch", False)
    f = finding(d)
    assert (f["rule"], f["data"]["source"], f["data"]["noticed"]) == ("mismatch", "size", [3])
    # without the enforce line the same SIGABRT is still that rank's own crash
    d = diagnose_evidence(collect(events[1:]))
    assert (d.initiating_ranks, d.kind) == ([3], "dead_rank")


# -- a bare SIGABRT long after the others timed out (issue 44: named high) ----------------------------------
def test_a_bare_abort_long_after_the_others_timed_out_is_not_named_with_confidence(tmp_path: Path) -> None:
    """Two ranks' NCCL watchdogs time out in collective #808 at 10:40; torchrun reports rank 2 dead by SIGABRT
    (no message of its own) at 10:59. Its end came after they had given up: it is not what they waited for,
    and a hung rank's own watchdog abort ends the same way. Undecidable: never named with confidence."""
    timeout = ("[rank{r}]:[E726 10:40:12.45174 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught collective "
               "operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, "
               "Timeout(ms)=600000) ran for 600020 milliseconds before timing out.")
    report = ["Root Cause (first observed failure):", "[0]:", "  time      : 2024-07-26_10:59:45",
              "  host      : node1", "  rank      : 2 (local_rank: 2)", "  exitcode  : -6 (pid: 214033)",
              "  error_file: <N/A>", "  traceback : Signal 6 (SIGABRT) received by PID 214033", "=" * 40]
    log = tmp_path / "late_abort.log"
    log.write_text("\n".join([timeout.format(r=0), timeout.format(r=1), *report]) + "\n")
    d, _ = diagnose_logs([str(log)])
    assert d.confidence == "low" and not d.decided, d.reason
    assert finding(d)["data"]["after_waits"] > 1000  # seconds after the first timeout
    # the same abort at the time of the timeouts is still read as before (the watchdog's, with its peers')
    log.write_text("\n".join([timeout.format(r=0), timeout.format(r=1),
                              *(x.replace("10:59:45", "10:40:12") for x in report)]) + "\n")
    d, _ = diagnose_logs([str(log)])
    assert finding(d)["data"].get("after_waits") is None


# -- a local rank on another node read as a global one (issue 44) --------------------------------------------
def test_a_local_rank_of_another_node_is_only_a_guess(tmp_path: Path) -> None:
    """nodeA's lines map local to global ranks one to one ([default1] … [Rank 1]); nodeB's failing rank is named
    only by its local rank ([default3]): on two nodes that is rank 3 of nodeB's block, not global rank 3 — a
    guess at low confidence, never a decision. The same failure on the mapping node stays decided."""
    timeout = ("nodeA: [default{r}]:[E726 10:40:12.4517 ProcessGroupNCCL.cpp:616] [Rank {r}] Watchdog caught "
               "collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, "
               "NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.")
    failure = ["{h}: [default3]:Traceback (most recent call last):",
               '{h}: [default3]:  File "/work/train.py", line 88, in <module>',
               "{h}: [default3]:    loss = model(batch)", "{h}: [default3]:ValueError: bad batch shape (3, 224)"]
    log = tmp_path / "two_nodes.log"
    log.write_text("\n".join([*(x.format(h="nodeB") for x in failure), timeout.format(r=1), timeout.format(r=0)]))
    d, _ = diagnose_logs([str(log)])
    assert (d.initiating_ranks, d.confidence, d.decided) == ([3], "low", False), d.reason
    assert finding(d)["data"]["local_ranks_only"] is True
    log.write_text("\n".join([*(x.format(h="nodeA") for x in failure), timeout.format(r=1), timeout.format(r=0)]))
    d, _ = diagnose_logs([str(log)])
    assert (d.initiating_ranks, d.confidence, d.decided) == ([3], "high", True), d.reason
