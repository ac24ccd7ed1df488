"""rankwatch's own verdict, printed in a log (``rankwatch run``'s console): it saw the stacks, records and
flight recorder the log does not hold, so its first verdict is the answer. Pure."""

from __future__ import annotations

from ..engine import Finding
from ..facts import FactSet, Rung

RANKWATCH_VERDICT = "rankwatch_verdict"


def rule_logged_verdict(facts: FactSet) -> Finding | None:
    v = facts.logged
    if v is None:
        return None
    return Finding(RANKWATCH_VERDICT, v.kind, list(v.ranks), Rung.FLIGHT_RECORDER, v.confidence,
                   {"decided": bool(v.ranks), "phase": v.phase})
