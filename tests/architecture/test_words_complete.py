"""Every finding a rule can make has words, and a verdict's words never contradict its own ranks (issue 44:
a missing entry silently printed "no rule singled out a rank"; a verdict naming the one rank still running
said "every rank is stuck … a shared cause")."""

from __future__ import annotations

import ast
from pathlib import Path

from rankwatch.watchdog.core.rules.ladder import LADDER
from rankwatch.watchdog.core.rules.waits import NAMING_SOURCES
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.report import findings, live_words
from rankwatch.watchdog.verdict import decide

CORE = Path(__file__).resolve().parents[2] / "watchdog" / "core"


def shapes_made() -> set[str]:
    """Every ``"shape": "<name>"`` a core rule puts in a finding's data (read from the source)."""
    out: set[str] = set()
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == "shape" and isinstance(v, ast.Constant):
                        out.add(str(v.value))
    return out


def test_every_shape_a_rule_makes_has_words() -> None:
    made = shapes_made()
    assert len(made) > 20  # the scan sees the rules
    worded = set(live_words._LIVE) | findings.OFFLINE_SHAPES
    assert made <= worded, made - worded


def test_every_offline_rung_and_naming_source_has_words() -> None:
    offline = {r.offline_name for r in LADDER if r.offline is not None}
    assert offline <= set(findings._WORDS), offline - set(findings._WORDS)
    assert set(NAMING_SOURCES) <= set(findings._WAIT_SOURCE)


def rv(rank: int, **kw: object) -> RankView:
    base: dict[str, object] = dict(rank=rank, node="n0", pid=1000 + rank, state="running", step=10, phase="idle",
                                   in_phase_s=30.0, since_progress_s=30.0, coll_seq=10, coll_done=10,
                                   coll_op="all_reduce")
    base.update(kw)
    return RankView(**base)  # type: ignore[arg-type]


def test_the_one_rank_still_running_is_not_called_a_shared_cause() -> None:
    # between steps (not inside one: that is "finished_but_one"), e.g. an eval or upload after the loop
    views = [rv(0, phase="idle"), *(rv(r, state="exited", phase="idle") for r in (1, 2, 3))]
    doc = decide(views, job_id="j", incident_id="i", detected_after_s=31.0).to_json()
    assert doc["initiating_ranks"] == [0]
    assert doc["finding"]["data"]["shape"] == "last_running" and doc["finding"]["data"]["exited"] == [1, 2, 3]
    assert "every rank" not in doc["reason"] and "shared cause" not in doc["reason"], doc["reason"]
    assert "only rank still running" in doc["reason"]


def test_a_shared_cause_names_several_ranks_and_says_so() -> None:
    views = [rv(r, phase="dataloader") for r in range(3)]
    doc = decide(views, job_id="j", incident_id="i", detected_after_s=31.0).to_json()
    assert doc["finding"]["data"]["shape"] == "shared_cause" and doc["initiating_ranks"] == [0, 1, 2]
    assert "every rank" in doc["reason"]
