"""Every finding a rule can make has words, and a verdict's words never contradict its own ranks (issue 44:
a missing entry silently printed "no rule singled out a rank"; a verdict naming the one rank still running
said "every rank is stuck … a shared cause")."""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

from rankwatch.watchdog.core.evidence_items import item_kinds
from rankwatch.watchdog.core.ranks import fmt_ranks
from rankwatch.watchdog.core.rules.ladder import LADDER
from rankwatch.watchdog.core.rules.waits import NAMING_SOURCES
from rankwatch.watchdog.core.snapshot import RankView
from rankwatch.watchdog.diagnose import diagnose_jobs
from rankwatch.watchdog.report import evidence_words, findings, live_words
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
    assert "every live rank (ranks 0–2)" in doc["reason"], doc["reason"]


def _scenario(rng: random.Random) -> list[RankView]:
    """A job of 2–6 ranks in any mix of states, phases, collective counters, exits and stacks (states as the
    daemon reports them: an exit cause only on a crash)."""
    states = ["running"] * 6 + ["exited", "dead", "stopped", "missing", "crashed"]
    causes = [None, "RuntimeError: boom", "DistBackendError: Connection closed by peer",
              "RuntimeError: Ranks 1 failed to pass monitoredBarrier in 8000 ms"]
    views = []
    for r in range(rng.randint(2, 6)):
        st = rng.choice(states)
        seq = rng.choice([0, 9, 10, 10, 10, 11])
        ended = st in ("exited", "dead", "crashed")
        views.append(rv(
            r, node=f"n{r // 2}", node_rank=r // 2, state=st, step=rng.choice([0, 5, 5, 6]),
            phase=rng.choice(["idle", "dataloader", "forward", "backward", "optimizer", "collective", "checkpoint"]),
            in_phase_s=rng.choice([1.0, 30.0]), coll_seq=seq, coll_done=seq if rng.random() < 0.5 else max(0, seq - 1),
            coll_op=rng.choice(["all_reduce", "broadcast", "barrier"]) if seq else None,
            exit_order=rng.choice([0, 1, 2]) if ended else None,
            exit_age_s=rng.choice([1.0, 5.0, 20.0]) if ended else None,
            exit_cause=rng.choice(causes) if st == "crashed" else None, waiting=rng.choice([None, True, False]),
            stack_signature=rng.choice([None, "a", "a", "b"]),
        ))
    return views


CROWD = ("shared cause", "every rank is", "every live rank")
# several ranks with a verb for one ("ranks 1, 2 is stopped")
DISAGREES = re.compile(r"\branks [0-9][0-9–, ]* (is|was|has|waits|exits)\b")


def test_a_verdicts_words_never_contradict_its_own_ranks() -> None:
    """Over 2,000 generated jobs: the reason names every initiating rank, and a verdict naming one rank never
    describes it as a crowd ("every rank is stuck … a shared cause")."""
    rng = random.Random(44)
    for _ in range(2000):
        views = _scenario(rng)
        doc = decide(views, job_id="j", incident_id="i", detected_after_s=30.0).to_json()
        ranks, reason = doc["initiating_ranks"], doc["reason"]
        where = (doc["finding"]["data"].get("shape"), [(v.rank, v.state, v.phase, v.coll_seq) for v in views])
        assert fmt_ranks(ranks) in reason or all(str(r) in reason for r in ranks), (reason, where)
        assert not DISAGREES.search(" ".join([reason, *doc["evidence"]])), (reason, doc["evidence"], where)
        if len(ranks) == 1:
            assert not any(w in reason for w in CROWD), (reason, where)


def test_the_one_live_rank_beside_a_silent_node_is_not_a_crowd() -> None:
    views = [rv(0, state="missing", phase="idle"), rv(1, phase="forward", waiting=False)]
    doc = decide(views, job_id="j", incident_id="i", detected_after_s=31.0).to_json()
    assert doc["initiating_ranks"] == [1] and doc["confidence"] == "low"
    assert doc["finding"]["data"]["shape"] == "only_live"
    assert "only live rank" in doc["reason"], doc["reason"]


def test_offline_words_name_the_ranks_they_decide() -> None:
    logs = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
    seen = 0
    for path in sorted(logs.rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".sh", ".md", ".json"):
            continue
        for job in diagnose_jobs([str(path)]).jobs:
            seen += 1
            doc = job.diagnosis.to_json()
            assert all(str(r) in doc["reason"] for r in doc["initiating_ranks"]), (path, doc["reason"])
            assert not DISAGREES.search(doc["reason"] + doc["next_action"]), (path, doc["reason"])
            if len(doc["initiating_ranks"]) == 1:
                assert not any(w in doc["reason"] for w in CROWD), (path, doc["reason"])
    assert seen > 50


def test_every_evidence_kind_has_words() -> None:
    """An evidence item (``core.evidence_items``) is phrased only in ``report.evidence_words``: a kind without its
    phrase fails here, and every class that is an item is one of the kinds seen (none defined elsewhere)."""
    kinds = list(item_kinds())
    names = [k.KIND for k in kinds]
    assert len(kinds) >= 14 and "" not in names and len(names) == len(set(names)), names
    assert set(names) <= set(evidence_words._WORDS), set(names) - set(evidence_words._WORDS)
    defined = {node.name for path in (CORE.parent).rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)
               and any(isinstance(b, ast.Name) and b.id == "EvidenceItem" for b in node.bases)}
    assert defined == {k.__name__ for k in kinds}, defined ^ {k.__name__ for k in kinds}
