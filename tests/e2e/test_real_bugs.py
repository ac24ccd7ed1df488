"""Bug classes real jobs have, not the demo's injected faults: each a real DDP job under `rankwatch run`.

The barrier runs on 3 ranks: the odd rank in a collective the others never call, beside two that agree on
theirs. A rank that leaves early runs on 2: its exit is the evidence, whoever waits for it. Every rank is a
torch start-up (~1.6 s of CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bundle_dirs, rankwatch_cmd, torchrun_args

BUGS = str(Path(__file__).resolve().parents[1] / "procs" / "ddp_bugs.py")


@pytest.mark.parametrize(
    ("bug", "rank", "kind", "nproc"),
    [
        ("rank-barrier", 2, "collective_mismatch", 3),  # `if rank == 2: dist.barrier()` inside the loop
        ("rank-barrier", 0, "collective_mismatch", 3),
        ("uneven-data", 1, "dead_rank", 2),  # rank 1's shard runs out: it leaves while its peer needs it
        ("uneven-data", 0, "dead_rank", 2),
    ],
)
def test_real_bug_classes_name_the_rank_that_caused_them(procs, tmp_path, bug, rank, kind, nproc):
    out, shm = tmp_path / "out", tmp_path / "shm"
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--stall-timeout", "3", "--on-stall",
                        "kill", "--quiet", "--",
                        *torchrun_args(nproc, f"{bug}-{rank}", BUGS, "--bug", bug, "--rank", str(rank)))
    result = procs.run(cmd, timeout=300, text=True)
    found = bundle_dirs(out / "incidents")
    assert len(found) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    v = json.loads((found[0] / "verdict.json").read_text())
    assert (v["kind"], v["initiating_ranks"]) == (kind, [rank]), "\n".join([v["reason"], *v["evidence"]])
    if bug == "uneven-data":  # its exit is the evidence: a normal one, first (words: test_verdict_words.py)
        assert (v["finding"]["data"]["shape"], v["finding"]["data"]["how"]) == ("first_exit", "exited"), v["finding"]
    else:
        assert v["decided_by"] in ("flight_recorder", "counters")
