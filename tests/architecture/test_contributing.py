"""docs/CONTRIBUTING.md's "a new bug class" checklist points at real places: every registry, table and
function it names exists where it says (a rename that leaves the checklist behind fails here)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (checklist text, module, attribute): what the checklist tells a contributor to extend
POINTS = (
    ("NAMED_WAITS", "rankwatch.watchdog.core.failures", "NAMED_WAITS"),
    ("PATTERNS", "rankwatch.watchdog.diagnose.parser", "PATTERNS"),
    ("facts_of", "rankwatch.watchdog.diagnose.log_facts", "facts_of"),
    ("NAMING_SOURCES", "rankwatch.watchdog.core.rules.waits", "NAMING_SOURCES"),
    ("LADDER", "rankwatch.watchdog.core.rules.ladder", "LADDER"),
    ("REFINEMENTS", "rankwatch.watchdog.core.rules.ladder", "REFINEMENTS"),
    ("_LIVE", "rankwatch.watchdog.report.live_words", "_LIVE"),
    ("_WORDS", "rankwatch.watchdog.report.findings", "_WORDS"),
    ("OFFLINE_SHAPES", "rankwatch.watchdog.report.findings", "OFFLINE_SHAPES"),
    ("_WAIT_SOURCE", "rankwatch.watchdog.report.findings", "_WAIT_SOURCE"),
)


def checklist() -> str:
    text = (ROOT / "docs" / "CONTRIBUTING.md").read_text()
    start = text.index("### A new bug class (checklist)")
    return text[start : text.index("\n### ", start + 1)]


def test_every_name_the_checklist_points_at_exists() -> None:
    text = checklist()
    for name, module, attr in POINTS:
        assert f"`{name}`" in text, name
        assert hasattr(importlib.import_module(module), attr), (module, attr)


def test_every_file_the_checklist_names_exists() -> None:
    paths = set(re.findall(r"`((?:core|diagnose|report|benchmarks|tests)/[\w/.]+\.(?:py|json))`", checklist()))
    assert len(paths) >= 10
    for rel in paths:
        candidates = [ROOT / rel, ROOT / "watchdog" / rel]
        assert any(c.exists() for c in candidates), rel


def test_every_flag_the_checklist_names_is_a_rung_field() -> None:
    from rankwatch.watchdog.core.rules.ladder import LadderRung

    text = checklist()
    flags = re.findall(r"`(\w+)`", text[text.index("its role as flags") : text.index("`core/verdict.py` reads")])
    assert len(flags) >= 7 and set(flags) <= set(LadderRung.__dataclass_fields__), flags


def test_the_live_classes_it_names_are_in_the_accuracy_table() -> None:
    from test_v3_classes import CLASSES, FIXED_IN_V4, OUTSIDE_V4, STAY_RIGHT

    assert set(FIXED_IN_V4) | set(STAY_RIGHT) | set(OUTSIDE_V4) <= set(CLASSES)


def test_the_ladder_table_in_the_docs_is_the_registry() -> None:
    from rankwatch.watchdog.core.rules.ladder import flags_table

    text = (ROOT / "docs" / "verdict-engine.md").read_text()
    block = text[text.index("<!-- ladder-flags:start -->\n") + 28 : text.index("\n<!-- ladder-flags:end -->")]
    regenerate = "python -c 'from rankwatch.watchdog.core.rules.ladder import flags_table; print(flags_table())'"
    assert block == flags_table(), regenerate
