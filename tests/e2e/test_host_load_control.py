"""The control of the straggler causes: a balanced 2-rank job beside two CPU hogs that load the whole host
(not pinned: the scheduler spreads them, and the ranks, over every CPU) must name no straggler. Every rank
waits for a CPU then, alike; the summary shows the wait per rank (its ``signals``) and names nobody.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import demo_job_cmd, skip_if_gloo_teardown_abort

pytestmark = pytest.mark.slow

STEPS = 260
HOG = [sys.executable, "-c", "while True: pass"]


def test_a_balanced_job_on_a_host_loaded_evenly_names_no_straggler(procs, tmp_path: Path):
    for _ in range(2):
        procs.start(HOG, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    demo = ("--scenario", "balanced", "--steps", str(STEPS), "--compute-extra-matmuls", "60",
            "--input-sleep-ms", "0")
    cmd, out, shm = demo_job_cmd(tmp_path, "host-load", 2, *demo)
    result = procs.run(cmd, timeout=600, text=True)
    skip_if_gloo_teardown_abort(result, shm / "host-load", STEPS)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    s = json.loads((out / "summary.json").read_text())
    assert s["straggler_ranks"] == [], (s["diagnosis"], s["why"], s["cause"], s["signals"])
    waits = [s["signals"][r]["run_queue_wait"] for r in ("0", "1")]
    assert min(waits) > 0, s["signals"]  # the load was there, on both ranks
