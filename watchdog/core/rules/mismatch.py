"""Collective mismatch over facts: the same (process group, sequence number) entered with different ops,
sizes or dtypes (the flight recorder live, ``core.live_facts.mismatch_facts``; NCCL's watchdog offline),
c10d's fingerprint check, or waiting ranks' stacks in different collectives. Every rank outside the
strictly largest group is named (``core.ranks.outside_majority``). A gloo size enforcement tells only the
receiver: the sender stays unknown. Pure; words in ``report.findings`` (live: ``rules.recorder``)."""

from __future__ import annotations

from ..engine import Finding
from ..facts import FactSet, Rung
from ..ranks import majority, outside_majority
from ..schema import COLLECTIVE_MISMATCH

MISMATCH = "mismatch"

FLIGHT_RECORDER = "flight_recorder"
# the sources that say which collective a rank is in, strongest first, with the confidence they give
_SOURCES = ((FLIGHT_RECORDER, Rung.FLIGHT_RECORDER, "high"), ("fingerprint", Rung.FLIGHT_RECORDER, "high"),
            ("watchdog", Rung.FLIGHT_RECORDER, "high"), ("stack", Rung.STACKS, "medium"))
_NUMBERED = (FLIGHT_RECORDER, "watchdog")  # sources that say at which (group, seq): compared there only

Group = tuple[str, int | None, str | None, Rung, str, dict[str, list[int]]]


def _groups(facts: FactSet) -> list[Group]:
    """(source, seq, group, strength, confidence, op → ranks) in the order the rule asks them."""
    out: list[Group] = []
    for source, strength, confidence in _SOURCES:
        by_seq: dict[tuple[str | None, int | None], dict[str, list[int]]] = {}
        for i in facts.in_op:
            if i.source == source and i.op:
                at = (i.group, i.seq) if source in _NUMBERED else (None, None)
                by_seq.setdefault(at, {}).setdefault(i.op, []).append(i.rank)
        out.extend((source, seq, pg, strength, confidence, g) for (pg, seq), g in by_seq.items())
    return out


def rule_mismatch(facts: FactSet) -> Finding | None:
    groups = _groups(facts)
    for source, seq, pg, strength, confidence, g in groups:
        big, odd = majority(g), outside_majority(g)
        if big is None or odd is None:
            continue  # no majority: nobody is the odd one out
        sites = sorted({i.site for i in facts.in_op if i.source == source and i.rank in odd and i.site})
        return Finding(MISMATCH, COLLECTIVE_MISMATCH, list(odd), strength, confidence, {
            "phase": "collective", "source": source, "seq": seq, "group": pg,
            "odd_ops": sorted(k for k in g if k != big), "majority_op": big, "majority": g[big], "sites": sites})
    for source, seq, pg, _strength, _confidence, g in groups:
        if len(g) > 1:
            return Finding(MISMATCH, COLLECTIVE_MISMATCH, [], Rung.WAITING, "low", {
                "decided": False, "phase": "collective", "source": source, "seq": seq, "group": pg, "groups": g})
    if facts.size_mismatch:
        return Finding(MISMATCH, COLLECTIVE_MISMATCH, [], Rung.WAITING, "medium", {
            "decided": False, "phase": "collective", "source": "size", "noticed": [s.rank for s in facts.size_mismatch],
            "detail": facts.size_mismatch[0].detail})
    return None
