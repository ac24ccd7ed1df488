"""`rankwatch diagnose` on real logs from public issue threads (tests/fixtures/logs/public, truth in TRUTH.json).

What a user relies on, per log, through the installed CLI:
- never a wrong rank: where the thread establishes who started it, nothing else is named; where nobody knows,
  a naming is at most a low-confidence guess;
- an undecidable log (every rank timed out alike, one waiting rank's view, SeqNums of unnamed groups, …) is
  never named with confidence;
- a decidable log that today's code already reads names exactly the truth.

TRUTH.json ``today`` records what the code does now (``right`` or ``safe``); a log that regresses fails here.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

PUBLIC = Path(__file__).resolve().parents[2] / "fixtures" / "logs" / "public"
TRUTH: dict[str, dict[str, Any]] = json.loads((PUBLIC / "TRUTH.json").read_text())["files"]

HELD_NOW = sorted(n for n, t in TRUTH.items() if t["today"] in ("right", "safe", "abstains"))
RIGHT_NOW = sorted(n for n, t in TRUTH.items() if t["today"] == "right")


@cache
def diagnose(name: str) -> dict[str, Any]:
    p = subprocess.run(
        ["rankwatch", "diagnose", "--json", str(PUBLIC / name)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode in (0, 1), p.stderr  # 1: diagnosed, nobody named
    doc = json.loads(p.stdout)
    assert isinstance(doc, dict)
    return doc


def named(doc: dict[str, Any]) -> list[int]:
    return sorted(doc.get("initiating_ranks") or [])


def confident(doc: dict[str, Any]) -> bool:
    return bool(named(doc)) and doc.get("confidence") != "low"


def check_never_wrong(name: str) -> None:
    doc, t = diagnose(name), TRUTH[name]
    if t["truth"] is not None:
        assert set(named(doc)) <= set(t["truth"]), (name, doc.get("reason"))
    else:
        assert not confident(doc), (name, doc.get("confidence"), doc.get("reason"))


def check_undecidable_not_confident(name: str) -> None:
    doc = diagnose(name)
    if not TRUTH[name]["decidable"]:
        assert not confident(doc), (name, named(doc), doc.get("confidence"), doc.get("reason"))


@pytest.mark.parametrize("name", HELD_NOW)
def test_never_a_wrong_rank(name: str) -> None:
    check_never_wrong(name)


@pytest.mark.parametrize("name", HELD_NOW)
def test_undecidable_log_is_not_named_with_confidence(name: str) -> None:
    check_undecidable_not_confident(name)


@pytest.mark.parametrize("name", RIGHT_NOW)
def test_decidable_log_names_the_truth(name: str) -> None:
    doc = diagnose(name)
    assert named(doc) == TRUTH[name]["truth"], (name, doc.get("reason"))


def test_truth_table_is_complete() -> None:
    """Every log has a truth entry and a row in TRUTH.md (with its source), and nothing else is listed."""
    logs = {p.name for p in PUBLIC.glob("*.log")}
    assert logs == set(TRUTH)
    table = (PUBLIC / "TRUTH.md").read_text()
    for name, t in TRUTH.items():
        assert t["today"] in ("right", "safe", "abstains")  # "confident" (a known wrong answer) is no longer accepted
        assert (t["truth"] is not None) or not t["decidable"]
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}`")), "")
        assert t["source"] in row, name
