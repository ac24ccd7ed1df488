"""Every log fixture names its expected initiating rank(s) and kind (tests/fixtures/logs/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rankwatch.watchdog.diagnose import diagnose_jobs, diagnose_logs

LOGS = Path(__file__).resolve().parents[2] / "fixtures" / "logs"

# fixture (file or directory) -> (initiating ranks, kind)
EXPECTED: dict[str, tuple[list[int], str]] = {
    # real gloo captures
    "torchrun_tee/dead_rank_r2.log": ([2], "dead_rank"),
    "torchrun_tee/input_hang_r1.log": ([1], "hang"),
    "torchrun_tee/collective_mismatch_r3.log": ([3], "collective_mismatch"),
    "torchrun_tee/size_mismatch_small.log": ([1], "collective_mismatch"),
    "torchrun_tee/size_mismatch_large.log": ([], "collective_mismatch"),
    "torchrun_tee/debug_detail_all_segv.log": ([], "unknown"),
    "logdir_dead_rank_r1": ([1], "dead_rank"),
    "logdir_dead_rank_r1/fx4_e9xs5ipa/attempt_0": ([1], "dead_rank"),  # per-rank files alone
    "logdir_input_hang_r3": ([3], "hang"),
    "logdir_input_hang_r3/fx5_5pi475zf/attempt_0": ([3], "hang"),
    # real console logs without --tee (torchrun's stderr; README "Real consoles")
    "console/uneven_data_r1.log": ([1], "dead_rank"),  # absent from the failure report: it had exited 0
    "console/uneven_data_sigtermed.log": ([], "hang"),  # the early leaver was SIGTERMed like the rest
    "console/skipped_collective_gloo_abort.log": ([], "collective_mismatch"),  # gloo aborts the receiver
    "console/pre_init_store_wait_r3.log": ([3], "hang"),  # the others' start-up store waits name its key
    "console/node_lost_4n": ([], "hang"),  # ranks 4, 5 (one node) SIGKILLed at once: the log cannot decide
    # templated NCCL / CUDA / Slurm / kernel formats
    "templated/nccl_behind_r2.log": ([2], "hang"),
    "templated/nccl_optype_mismatch_r1.log": ([1], "collective_mismatch"),
    "templated/slurm_cuda_illegal_r5.log": ([5], "dead_rank"),
    "templated/cuda_oom_r3.log": ([3], "dead_rank"),
    "templated/host_oom_r6": ([6], "dead_rank"),
    "templated/ecc_r1": ([1], "dead_rank"),
    # realistic shapes of logs pasted in issues (realistic/make_realistic.py,
    # tests/unit/diagnose/test_diagnose_realistic.py)
    "realistic/extra_collective_r3.log": ([3], "collective_mismatch"),
    "realistic/left_early_r0.log": ([0], "dead_rank"),
    "realistic/observed_dump_signal_r2.log": ([2], "hang"),
    "realistic/sigabrt_after_timeout_r6.log": ([6], "hang"),
    "realistic/dump_signal_from_rank_r2.log": ([2], "collective_mismatch"),
    "realistic/mpirun_tag_output_r2.log": ([2], "dead_rank"),
    "realistic/pylogging_prefix_r1.log": ([1], "dead_rank"),
    "realistic/pid_prefix_r3.log": ([3], "dead_rank"),
    "realistic/host_pid_prefix_r1.log": ([1], "dead_rank"),
    # realistic/several_jobs/ holds four jobs (tests/unit/diagnose/test_diagnose_realistic.py); each alone:
    "realistic/several_jobs/slurm-48811.out": ([1], "dead_rank"),
    "realistic/several_jobs/slurm-48907.out": ([3], "dead_rank"),
    "realistic/several_jobs/pretrain": ([2], "dead_rank"),
    "realistic/several_jobs/old_attempt.log": ([0], "dead_rank"),
}


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_fixture_initiator_and_kind(fixture: str) -> None:
    ranks, kind = EXPECTED[fixture]
    d, _ = diagnose_logs([str(LOGS / fixture)])
    assert d.initiating_ranks == ranks, d.reason
    assert d.kind == kind, d.reason
    assert d.decided == bool(ranks)
    doc = d.to_json()
    assert doc["schema"] == "rankwatch.verdict/1" and doc["source"] == "logs"
    assert doc["kind"] in ("hang", "dead_rank", "stopped_rank", "collective_mismatch", "comm_hang", "unknown")
    assert all(":" in e for e in doc["evidence"])


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_each_fixture_is_one_job(fixture: str) -> None:
    """Grouping sources into jobs never splits a fixture (console + per-rank files, log + dmesg)."""
    result = diagnose_jobs([str(LOGS / fixture)])
    assert len(result.jobs) == 1 and not result.ungrouped, [j.files for j in result.jobs]
    ranks, kind = EXPECTED[fixture]
    d = result.jobs[0].diagnosis
    assert (d.initiating_ranks, d.kind) == (ranks, kind), d.reason
    assert result.decided == bool(ranks)


def test_every_fixture_is_covered() -> None:
    """A new capture must come with its expectation (the public and captured corpora's live in their TRUTH.json)."""
    covered = {LOGS / k for k in EXPECTED}
    for corpus in ("public", "captured"):  # truth tables of their own (test_public_logs, test_captured_logs)
        covered |= {LOGS / corpus / name for name in json.loads((LOGS / corpus / "TRUTH.json").read_text())["files"]}
    for path in LOGS.rglob("*.log"):
        assert any(c == path or c in path.parents for c in covered), path


def test_root_cause_that_was_a_victim_is_called_out() -> None:
    d, _ = diagnose_logs([str(LOGS / "torchrun_tee/input_hang_r1.log")])
    assert d.to_json()["finding"]["data"]["root_cause_victims"] == [0]
    d, _ = diagnose_logs([str(LOGS / "logdir_dead_rank_r1")])
    assert d.to_json()["finding"]["data"]["root_cause_victims"] == [0]


def test_evidence_points_at_the_initiators_lines() -> None:
    d, _ = diagnose_logs([str(LOGS / "torchrun_tee/collective_mismatch_r3.log")])
    assert "all_gather" in d.evidence[0] and "collective_mismatch_r3.log:14:" in d.evidence[0]
    f = d.to_json()["finding"]
    assert (f["rule"], f["data"]["majority_op"], f["data"]["majority"]) == ("mismatch", "all_reduce", [0, 1, 2])
    d, _ = diagnose_logs([str(LOGS / "templated/host_oom_r6")])
    assert any("dmesg.txt:" in e and "48213" in e for e in d.evidence)


def test_other_ranks_are_described() -> None:
    d, _ = diagnose_logs([str(LOGS / "templated/nccl_behind_r2.log")])
    assert set(d.others) == {0, 1, 3}
    assert all("ALLREDUCE #1043" in v for v in d.others.values())
    f = d.to_json()["finding"]
    assert (f["rule"], f["ranks"], f["data"]["low"], f["data"]["high"]) == ("behind", [2], 1042, 1043)


def test_undecided_says_what_would_decide() -> None:
    for fixture in ("torchrun_tee/size_mismatch_large.log", "torchrun_tee/debug_detail_all_segv.log"):
        d, _ = diagnose_logs([str(LOGS / fixture)])
        assert not d.decided and d.would_decide


def test_local_ranks_map_to_global_via_rank_prefixes() -> None:
    _, ev = diagnose_logs([str(LOGS / "logdir_input_hang_r3/fx5_5pi475zf/attempt_0")])
    assert sorted(ev.ranks) == [0, 1, 2, 3]
