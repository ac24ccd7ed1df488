"""Offline formats of issue #19 read by ``rankwatch diagnose`` (each line shape from the source that prints
it, cited in diagnose/patterns.py): every case below was ignored or misread before the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.diagnose import diagnose_logs
from rankwatch.watchdog.report.text import verdict_text
from rankwatch.watchdog.verdict import decide


def rv(rank: int, **kw: Any) -> RankView:
    base: dict[str, Any] = dict(rank=rank, node="n0", pid=1000 + rank, state="running", step=10, phase="backward",
                                in_phase_s=30.0, since_progress_s=30.0, coll_seq=10, coll_done=10, coll_op="all_reduce")
    return RankView(**{**base, **kw})

WATCHDOG = (
    "[rank{r}]:[E1130 10:21:0{r}.500 ProcessGroupNCCL.cpp:632] {pg}Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600001 "
    "milliseconds before timing out."
)


def diagnose(tmp_path: Path, text: str, name: str = "console.log"):  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text(text)
    d, _ = diagnose_logs([str(path)])
    return d


def test_desync_report_names_the_rank_that_did_not_join(tmp_path: Path) -> None:
    # as pasted in NVIDIA/nccl#2213: rank 0's log only; rank 1 says nothing
    log = "\n".join([
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1155874, OpType=ALLREDUCE, "
        "NumelIn=9445376, NumelOut=9445376, Timeout(ms)=1800000) ran for 1800002 milliseconds before timing out.",
        "[1] finished collective #1155873, but didn't join collective #1155874",
    ])
    d = diagnose(tmp_path, log)
    assert (d.initiating_ranks, d.kind, d.confidence) == ([1], "hang", "high")
    f = d.to_json()["finding"]
    assert (f["rule"], f["ranks"], f["strength"], f["data"]["source"], f["data"]["decided"]) == (
        "wait_for", [1], "flight_recorder", "desync_report", True)


def test_desync_report_over_four_ranks_with_everyone_timing_out(tmp_path: Path) -> None:
    lines = [WATCHDOG.format(r=r, pg="", seq=183) for r in (0, 1, 2)]
    lines.append("[rank0]:\t - To our best knowledge, the lagging/dead/mismatched ranks that caused the desync are:")
    lines.append("[rank0]:\t     [3] finished collective #182, but didn't join collective #183 (count from 1)")
    lines.append(WATCHDOG.format(r=3, pg="", seq=182))
    d = diagnose(tmp_path, "\n".join(lines))
    assert d.initiating_ranks == [3] and d.kind == "hang"


def test_fingerprints_three_against_one_name_the_one(tmp_path: Path) -> None:
    fp = "CollectiveFingerPrint(SequenceNumber=12, OpType={op}, TensorShape=[4], TensorDtypes=Float)"
    lines = [
        f"[rank{r}]: RuntimeError: Detected mismatch between collectives on ranks. Rank {r} is running collective: "
        f"{fp.format(op='ALLREDUCE')}, but Rank 3 is running collective: {fp.format(op='BROADCAST')}"
        for r in (0, 1, 2)
    ]
    lines.append(
        "[rank3]: RuntimeError: Detected mismatch between collectives on ranks. Rank 3 is running collective: "
        f"{fp.format(op='BROADCAST')}, but Rank 0 is running collective: {fp.format(op='ALLREDUCE')}"
    )
    d = diagnose(tmp_path, "\n".join(lines))
    assert (d.initiating_ranks, d.kind) == ([3], "collective_mismatch")


def test_nccl_op_counts_name_the_rank_behind_when_every_rank_raised_alike(tmp_path: Path) -> None:
    lines = []
    for r in range(4):
        last = 0x2F if r == 2 else 0x30
        for op in range(0x2E, last + 1):
            lines.append(
                f"[rank{r}]:node{r // 2}:{100 + r}:{200 + r} [{r % 2}] NCCL INFO AllReduce: opCount {op:x} sendbuff "
                f"0x7f00 recvbuff 0x7f00 count 1024 datatype 7 op 0 root 0 comm 0x55{r} [nranks=4] stream 0x1"
            )
    lines += [f"[rank{r}]: torch.distributed.DistBackendError: NCCL communicator was aborted" for r in range(4)]
    d = diagnose(tmp_path, "\n".join(lines))
    assert (d.initiating_ranks, d.kind, d.rule) == ([2], "hang", "wait_for"), d.reason


def test_mpirun_exit_notice_is_the_first_failure(tmp_path: Path) -> None:
    lines = [f"[1,{r}]<stderr>:RuntimeError: Connection reset by peer" for r in (0, 2, 3)]
    lines.append("mpirun noticed that process rank 1 with PID 4242 on node n2 exited on signal 9 (Killed).")
    d = diagnose(tmp_path, "\n".join(lines))
    assert (d.initiating_ranks, d.kind, d.rule) == ([1], "dead_rank", "exit_cause"), d.reason


def test_seqnums_of_different_process_groups_are_never_compared(tmp_path: Path) -> None:
    lines = [
        WATCHDOG.format(r=0, pg="[PG ID 0 PG GUID 0(default_pg) Rank 0] ", seq=40000),
        WATCHDOG.format(r=1, pg="[PG ID 3 PG GUID 3 Rank 1] ", seq=8000),
    ]
    d = diagnose(tmp_path, "\n".join(lines))
    assert d.initiating_ranks == [] and not d.decided, d.reason


def test_seqnums_of_no_stated_group_far_apart_are_not_compared(tmp_path: Path) -> None:
    lines = [WATCHDOG.format(r=0, pg="[Rank 0] ", seq=40000), WATCHDOG.format(r=1, pg="[Rank 1] ", seq=8000)]
    d = diagnose(tmp_path, "\n".join(lines))
    assert d.initiating_ranks == [] and not d.decided, d.reason
    # close together they are one group's: the rank behind is named
    lines = [WATCHDOG.format(r=0, pg="[Rank 0] ", seq=40), WATCHDOG.format(r=1, pg="[Rank 1] ", seq=39)]
    assert diagnose(tmp_path, "\n".join(lines)).initiating_ranks == [1]


def test_every_rank_raising_the_same_exception_names_nobody(tmp_path: Path) -> None:
    lines = [f"[rank{r}]: ValueError: expected a config key 'lr'" for r in range(4)]
    d = diagnose(tmp_path, "\n".join(lines))
    assert d.initiating_ranks == [] and not d.decided


def test_determined_rank_prefix_attributes_the_line(tmp_path: Path) -> None:
    lines = ["[rank=3] RuntimeError: CUDA error: an illegal memory access was encountered"]
    lines += [f"[rank={r}] RuntimeError: Connection closed by peer" for r in (0, 1, 2)]
    d = diagnose(tmp_path, "\n".join(lines))
    assert (d.initiating_ranks, d.kind) == ([3], "dead_rank")


def test_diagnose_returns_the_verdict_rankwatch_printed_in_its_console(tmp_path: Path) -> None:
    views = [rv(0), rv(1), rv(2, phase="dataloader"), rv(3)]
    doc = decide(views, job_id="j", incident_id="hang-1", detected_after_s=31.0).to_json()
    console = "\n".join([
        "[rank0]:step 10 loss 0.5",
        verdict_text(doc),
        "[rank1]: RuntimeError: Connection closed by peer",  # after the kill: a consequence
        "bundle: out/incidents/hang-1",
    ])
    d = diagnose(tmp_path, console)
    assert d.rule == "rankwatch_verdict"
    assert (d.kind, d.initiating_ranks, d.confidence, d.phase) == (
        doc["kind"], doc["initiating_ranks"], doc["confidence"], doc["phase"]
    )
    # a verdict that named nobody is returned as undecided
    same = dict(phase="collective", coll_seq=7, coll_done=6)
    doc = decide([rv(r, **same) for r in range(4)], job_id="j", incident_id="c-1", detected_after_s=1.0).to_json()
    d = diagnose(tmp_path, verdict_text(doc), name="c.log")
    assert (d.kind, d.initiating_ranks, d.decided) == ("comm_hang", [], False)
