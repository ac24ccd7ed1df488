"""`rankwatch diagnose` on consoles of real faults run here (tests/fixtures/logs/captured, truth in TRUTH.json):
formats and bug classes verdict v4 reads (a monitored barrier's report, torch.multiprocessing.spawn's exit,
a torchrun console without rank prefixes, an exception pasted without its traceback) and classes outside the
suite (issue 44 item 5: a silent exit 0, the CPU allocator's and the cgroup OOM killer's ends, and a mismatched
all_gather whose log cannot tell the sender: truth [], nobody named)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

CAPTURED = Path(__file__).resolve().parents[2] / "fixtures" / "logs" / "captured"
TRUTH: dict[str, dict[str, Any]] = json.loads((CAPTURED / "TRUTH.json").read_text())["files"]
RANK = {"low": 0, "medium": 1, "high": 2}


def diagnose(name: str) -> dict[str, Any]:
    out = subprocess.run(["rankwatch", "diagnose", "--json", str(CAPTURED / name)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode in (0, 1), out.stderr
    doc = json.loads(out.stdout)
    assert isinstance(doc, dict)
    return doc


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_captured_log_names_its_fault(name: str) -> None:
    doc, t = diagnose(name), TRUTH[name]
    assert (sorted(doc["initiating_ranks"]), doc["kind"]) == (t["truth"], t["kind"]), doc["reason"]
    assert RANK[doc["confidence"]] >= RANK[t["min_confidence"]], doc["reason"]


def test_every_captured_log_has_a_truth_and_a_row() -> None:
    logs = {p.name for p in CAPTURED.glob("*.log")}
    assert logs == set(TRUTH)
    table = (CAPTURED / "README.md").read_text()
    assert all(f"| {name} |" in table for name in logs)
