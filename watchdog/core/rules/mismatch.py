"""Collective mismatch over facts: the same sequence number with different ops (NCCL's watchdog), c10d's
fingerprint check, or waiting ranks' stacks in different collectives. Every rank outside the strictly
largest group is named (``core.ranks.outside_majority``, the rule the live verdict and the flight recorder
use). A gloo size enforcement tells only the receiver: the sender stays unknown. Pure; words in
``report.findings``."""

from __future__ import annotations

from ..engine import Finding
from ..facts import FactSet, Rung
from ..ranks import majority, outside_majority
from ..schema import COLLECTIVE_MISMATCH

MISMATCH = "mismatch"

# the sources that say which collective a rank is in, strongest first, with the confidence they give
_SOURCES = (("fingerprint", Rung.FLIGHT_RECORDER, "high"), ("watchdog", Rung.FLIGHT_RECORDER, "high"),
            ("stack", Rung.STACKS, "medium"))


def _groups(facts: FactSet) -> list[tuple[str, int | None, Rung, str, dict[str, list[int]]]]:
    """(source, seq, strength, confidence, op → ranks) in the order the rule asks them."""
    out: list[tuple[str, int | None, Rung, str, dict[str, list[int]]]] = []
    for source, strength, confidence in _SOURCES:
        by_seq: dict[int | None, dict[str, list[int]]] = {}
        for i in facts.in_op:
            if i.source == source and i.op:
                by_seq.setdefault(i.seq if source == "watchdog" else None, {}).setdefault(i.op, []).append(i.rank)
        if source != "watchdog" and not by_seq:
            by_seq[None] = {}
        out.extend((source, seq, strength, confidence, g) for seq, g in by_seq.items())
    return out


def rule_mismatch(facts: FactSet) -> Finding | None:
    groups = _groups(facts)
    for source, seq, strength, confidence, g in groups:
        big, odd = majority(g), outside_majority(g)
        if big is None or odd is None:
            continue  # no majority: nobody is the odd one out
        sites = sorted({i.site for i in facts.in_op if i.source == source and i.rank in odd and i.site})
        return Finding(MISMATCH, COLLECTIVE_MISMATCH, list(odd), strength, confidence, {
            "phase": "collective", "source": source, "seq": seq, "odd_ops": sorted(k for k in g if k != big),
            "majority_op": big, "majority": g[big], "sites": sites})
    for source, seq, _strength, _confidence, g in groups:
        if len(g) > 1:
            return Finding(MISMATCH, COLLECTIVE_MISMATCH, [], Rung.WAITING, "low", {
                "decided": False, "phase": "collective", "source": source, "seq": seq, "groups": g})
    if facts.size_mismatch:
        return Finding(MISMATCH, COLLECTIVE_MISMATCH, [], Rung.WAITING, "medium", {
            "decided": False, "phase": "collective", "source": "size", "noticed": [s.rank for s in facts.size_mismatch],
            "detail": facts.size_mismatch[0].detail})
    return None
