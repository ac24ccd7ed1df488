"""Works with (README "Works with"): HF Trainer, Lightning, Accelerate and FSDP2 scripts that know nothing of
rankwatch, each a real 2-rank torchrun job on CPU/gloo under `rankwatch run` (the zero-code hook), with one
rank made to hang; rankwatch must name that rank and the phase it hangs in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import REPO, bundle_dirs, rankwatch_cmd, torchrun_args

EXAMPLES = REPO / "examples" / "works_with"

CASES = [
    # script, framework module it needs, fault, faulty rank, the phase it hangs in
    ("train_hf_trainer.py", "transformers", "input-hang", 1, "dataloader"),
    ("train_lightning.py", "lightning", "compute-hang", 0, "forward"),
    ("train_accelerate.py", "accelerate", "compute-hang", 1, "forward"),
    ("train_fsdp2.py", "torch.distributed.fsdp", "input-hang", 1, "dataloader"),
]


@pytest.mark.parametrize(("script", "module", "fault", "rank", "phase"), CASES, ids=[c[0][6:-3] for c in CASES])
def test_framework_job_names_the_hung_rank_and_phase(procs, tmp_path, script, module, fault, rank, phase):
    pytest.importorskip(module)
    out, shm, fault_log = tmp_path / "out", tmp_path / "shm", tmp_path / "faults.jsonl"
    env = {**os.environ, "RW_FAULT": fault, "RW_FAULT_RANK": str(rank), "RW_FAULT_STEP": "3", "RW_STEPS": "100000",
           "RW_FAULT_LOG": str(fault_log), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = rankwatch_cmd("run", "--out", str(out), "--shm-dir", str(shm), "--stall-timeout", "3", "--on-stall", "kill",
                        "--quiet", "--", *torchrun_args(2, f"ww-{script[6:-3]}", str(EXAMPLES / script)))
    result = procs.run(cmd, timeout=240, text=True, env=env)
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()] if fault_log.exists() else []
    assert [(f["fault"], f["rank"]) for f in fired] == [(fault, rank)], result.stderr[-3000:]
    found = bundle_dirs(out / "incidents")
    assert len(found) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    v = json.loads((found[0] / "verdict.json").read_text())
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [rank], phase), "\n".join(
        [v["reason"], *v["evidence"]])
    assert result.returncode != 0  # --on-stall kill ended the job
    assert f"initiating rank {rank} in phase '{phase}'" in result.stdout
    assert (Path(out) / "summary.json").exists()
