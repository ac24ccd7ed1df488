"""The words of every evidence item (``core.evidence_items`` → ``report.evidence_words``): the lines the verdict
document's ``evidence`` carried before the items were data (tests elsewhere assert the items)."""

from __future__ import annotations

import calendar
import time

import pytest
from rankwatch.watchdog.core import evidence_items as ei
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.report.evidence_words import evidence_words, ras_text, straggler_line
from rankwatch.watchdog.verdict import decide

T0 = calendar.timegm(time.strptime("2026-12-04 10:11:12", "%Y-%m-%d %H:%M:%S"))

CASES = [
    (ei.Line("flight recorder: pg 0: rank 2 behind"), "flight recorder: pg 0: rank 2 behind"),
    (ei.FrNote("rank 3: no dump"), "flight recorder: rank 3: no dump"),
    (ei.DecidedLocally(ei.STORE_UNREACHABLE, error="connection refused"),
     "local only: store unreachable (connection refused)"),
    (ei.DecidedLocally(ei.EVIDENCE_UNPUBLISHED, error="timed out"),
     "local only: could not publish evidence (timed out)"),
    (ei.DecidedLocally(ei.LEADER_REJECTED),
     "local: no valid verdict from the leader in time (the value under verdict/ was rejected)"),
    (ei.DecidedLocally(ei.LEADER_SILENT),
     "local: the leader gave no verdict in time (leader node down or its daemon restarted)"),
    (ei.DecidedLocally(ei.HELD_AS, held="tampered"),
     "local: the leader decided without this node's evidence (it holds this node's evidence as tampered); this "
     "node holds its own ranks"),
    (ei.DecidedLocally(ei.HELD_MISSING, ranks=(2, 3)),
     "local: the leader decided without this node's evidence (it holds ranks 2, 3 as never answered); this node "
     "holds its own ranks"),
    (ei.DecidedLocally(ei.REFUSED_UNAUTHENTICATED, ranks=(2,)),
     "local: refused the leader's unauthenticated verdict, it names rank 2 as initiating but this node sees it "
     "making progress"),
    (ei.NodeEvidence(1, "tampered", ei.REJECTED, error="bad MAC", judged=()),
     "node 1: evidence tampered (bad MAC); its ranks are not judged here (tampering is no evidence about them)"),
    (ei.NodeEvidence(1, "unavailable", ei.DELETED_AFTER_SEEN, judged=(2, 3)),
     "node 1: evidence unavailable (its evidence was deleted after it was seen); its ranks 2, 3 judged on its last "
     "authenticated snapshot"),
    (ei.NodeEvidence(1, "unavailable", ei.KEY_EMPTY_NODE_ALIVE, judged=(2,), authenticated=False),
     "node 1: evidence unavailable (its daemon publishes on but its evidence is not in the store (deleted)); its "
     "rank 2 judged on its last snapshot"),
    (ei.NodeEvidence(2, "unavailable", ei.OVER_READ_BUDGET),
     "node 2: evidence unavailable (the store held more than one look may read before its snapshot); its ranks are "
     "not judged here (tampering is no evidence about them)"),
    (ei.UnauthenticatedExchange(),
     "the nodes' exchange was unauthenticated (no --store-secret-file): any process that reaches the store could "
     "have written or removed what other nodes said"),
    (ei.NoEvidenceFrom((2, 3), ("host-b",)), "no evidence from ranks 2, 3 (node(s) host-b did not answer)"),
    (ei.NoEvidenceFrom((5,)), "no evidence from rank 5 (never seen)"),
    (ei.NotJudged((4, 5)), "ranks 4, 5 not judged: the store was tampered with, so silence is no evidence about them"),
    (ei.PipelineFailed("RuntimeError", "py-spy exploded"), "incident pipeline failed: RuntimeError: py-spy exploded"),
    (ei.GpuXid(1, 79, 12.345, (1,)), "GPU 1 (rank 1): XID 79 (GPU has fallen off the bus) 12.3s after the watchdog "
     "started"),
    (ei.GpuXid(0, 999, 1.0), "GPU 0: XID 999 1.0s after the watchdog started"),
    (ei.GpuXidsOlder(3), "3 older XID event(s) not listed"),
    (ei.GpuEcc(2, 4, (2, 3)), "GPU 2 (rank 2, 3): 4 uncorrected ECC error(s) since driver load"),
    (ei.GpuRemap(1, failed=False, ranks=(1,)), "GPU 1 (rank 1): row remap pending (takes effect after a GPU reset)"),
    (ei.GpuRemap(1, failed=True), "GPU 1: row remapping failed (the GPU needs service)"),
    (ei.RasFinding("dead", None, (), (3487984,), pid=3487984, host="10.0.0.2"),
     "NCCL RAS: process 3487984 on 10.0.0.2 considered dead by RAS"),
    (ei.RasFinding("incomplete", None, (), (7,), pid=7, host="h", gpus="0,1"),
     "NCCL RAS: no communicator data from process 7 on h (GPU 0,1)"),
    (ei.RasFinding("timeout", None, (), (), count=2), "NCCL RAS: RAS hit 2 timeout(s) collecting data"),
    (ei.RasFinding("dead", "ae94", (21,), (5,), name="#0-0", pid=5, host="h"),
     "NCCL RAS: comm #0-0: rank 21 (pid 5 on h) considered dead"),
    (ei.RasFinding("incomplete", "ae94", (21,), (), name="#0-0"),
     "NCCL RAS: comm #0-0: rank 21 reachable but not reporting this communicator"),
    (ei.RasFinding("unresponsive", "ae94", (1,), (), name="ae94"), "NCCL RAS: comm ae94: rank 1 did not respond"),
    (ei.RasFinding("error", "ae94", (9,), (), name="#0-0", error="Remote process error"),
     "NCCL RAS: comm #0-0: rank 9 reported Remote process error"),
    (ei.RasFinding("lagging", "ae94", (5,), (), name="#0-0", op="AllReduce", count=6649, top=6650, frozen=True),
     "NCCL RAS: comm #0-0: rank(s) [5] at AllReduce #6649, others at #6650 — unchanged since the previous query"),
    (ei.RasFinding("lagging", "ae94", (), (), name="#0-0", op="AllReduce", count=1, top=2, n_ranks=3),
     "NCCL RAS: comm #0-0: 3 rank(s) at AllReduce #1, others at #2"),
    (ei.RasFinding("stuck", "ae94", (5,), (), name="#0-0"),
     "NCCL RAS: comm #0-0: collective counts did not move between two RAS queries"),
    (ei.StragglerBefore(1, "INPUT STRAGGLER", "dataloader", 40, T0, 12.4, "rank 1 loses 80 ms per step",
                        "cause: cpu_contention"),
     "before the stall, rank 1: INPUT STRAGGLER in dataloader — since step 40, first seen 10:11:12Z (12 s ago): "
     "rank 1 loses 80 ms per step; cause: cpu_contention"),
    (ei.StragglerBefore(2, "RANK-WIDE STRAGGLER", "all", -1, T0, 0.0, "slower everywhere"),
     "before the stall, rank 2: RANK-WIDE STRAGGLER — first seen 10:11:12Z (0 s ago): slower everywhere"),
]


@pytest.mark.parametrize(("item", "line"), CASES, ids=[f"{i.KIND}-{n}" for n, (i, _) in enumerate(CASES)])
def test_each_item_has_its_line(item: ei.EvidenceItem, line: str) -> None:
    assert evidence_words(item) == line


def test_every_kind_is_in_the_table_above() -> None:
    assert {type(i) for i, _ in CASES} == set(ei.item_kinds())


def test_status_and_ras_use_the_same_phrases() -> None:
    s = CASES[-2][0]
    assert isinstance(s, ei.StragglerBefore)
    assert evidence_words(s) == f"before the stall, {straggler_line(s)}"
    r = CASES[-3][0]
    assert isinstance(r, ei.RasFinding) and evidence_words(r) == f"NCCL RAS: {ras_text(r)}"


def test_the_verdict_renders_its_items_after_its_own_lines_and_keeps_them_as_data() -> None:
    views = [RankView(rank=r, node="n0", pid=100 + r, state="running", step=5, phase="dataloader" if r == 1 else "idle",
                      in_phase_s=30.0, since_progress_s=30.0, waiting=r != 1) for r in range(3)]
    items = [ei.DecidedLocally(ei.STORE_UNREACHABLE, error="refused"), ei.GpuXidsOlder(2)]
    doc = decide(views, job_id="j", incident_id="i", detected_after_s=31.0, extra_evidence=items).to_json()
    assert doc["evidence"][-2:] == ["local only: store unreachable (refused)", "2 older XID event(s) not listed"]
    assert doc["evidence_items"] == [i.to_json() for i in items]
    assert doc["evidence_items"][1] == {"kind": "gpu_xids_older", "count": 2}
