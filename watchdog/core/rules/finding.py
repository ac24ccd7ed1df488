"""One rung's conclusion on the evidence ladder (``core.verdict``): kind, ranks, confidence, words and data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine import Finding


@dataclass
class RuleFinding:
    kind: str
    initiators: list[int]
    confidence: str
    reason: str
    evidence: list[str] = field(default_factory=list)
    rule: str = ""  # the EVIDENCE_LADDER rung that produced it
    data: dict[str, Any] = field(default_factory=dict)  # what the words say, as data (the document's ``finding``)
    structured: Finding | None = None  # the engine's own finding, when the engine produced it
