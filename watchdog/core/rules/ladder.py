"""The rules over a ``FactSet``, strongest first, as data: the first that concludes decides.

What logs can show, in the order of the evidence (``core.facts.Rung``): rankwatch's own verdict (it saw
more than the log) → an end by its own cause → a collective mismatch → the wait-for graph of the desync
report / NCCL op counts → a lone collective → behind → outside (the sinks of ranks that cannot name whom
they wait for) → everyone in the same collective → a launcher's exit report alone. A new bug class is one
fact extractor (``diagnose.log_facts``) or one rule here. Pure.
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine import Finding
from ..facts import FactSet, Rung
from ..policy import OfflinePolicy
from ..schema import UNKNOWN
from .ended import rule_exit_cause, rule_report_only
from .logged import rule_logged_verdict
from .mismatch import rule_mismatch
from .progress import rule_behind, rule_lone_collective
from .waits import rule_outside, rule_same_collective, rule_wait_for

NONE = "none"

Rule = Callable[[FactSet, OfflinePolicy], Finding | None]

FACT_LADDER: tuple[tuple[str, Rule], ...] = (
    ("rankwatch_verdict", lambda f, p: rule_logged_verdict(f)),
    ("exit_cause", rule_exit_cause),
    ("mismatch", lambda f, p: rule_mismatch(f)),
    ("wait_for", lambda f, p: rule_wait_for(f)),
    ("lone_collective", lambda f, p: rule_lone_collective(f)),
    ("behind", rule_behind),
    ("outside", lambda f, p: rule_outside(f)),
    ("same_collective", lambda f, p: rule_same_collective(f)),
    ("report_only", lambda f, p: rule_report_only(f)),
)


def decide(facts: FactSet, policy: OfflinePolicy) -> Finding:
    """The first rule of ``FACT_LADDER`` that concludes, else a finding that nothing was found."""
    for name, rule in FACT_LADDER:
        found = rule(facts, policy)
        if found is not None:
            found.rule = name
            found.data.setdefault("decided", True)
            found.data.setdefault("phase", None)
            _root_cause_victims(facts, found)
            return found
    return Finding(NONE, UNKNOWN, [], Rung.SILENCE, "low", {"decided": False, "phase": None})


def _root_cause_victims(facts: FactSet, found: Finding) -> None:
    """torchrun's "Root Cause (first observed failure)" names only the first exit it noticed: where that
    rank is not the initiator, it was a victim (``root_cause_victims``), which the report says."""
    root = sorted({x.rank for x in facts.exited if x.root_cause})
    if root and found.ranks and not set(root) & set(found.ranks):
        found.data["root_cause_victims"] = root
