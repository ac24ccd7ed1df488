"""Text for a person: the verdict first, then the lines that back it, then what everyone else did."""

from __future__ import annotations

from ..core.ranks import fmt_ranks
from .facts import Evidence
from .reasoning import Diagnosis


def render_text(d: Diagnosis, E: Evidence) -> str:
    lines: list[str] = []
    if d.initiating_ranks:
        head = f"INITIATOR: {fmt_ranks(d.initiating_ranks)} — {d.kind}"
    else:
        head = f"NO SINGLE INITIATOR — {d.kind}"
    lines.append(f"{head} (confidence {d.confidence}{', phase ' + d.phase if d.phase else ''})")
    lines.append(f"why: {d.reason}")
    if not d.decided:
        lines.append("the logs cannot decide this on their own.")
        if d.would_decide:
            lines.append(f"what would decide: {d.would_decide}")
    lines.append(f"next: {d.next_action}")
    if d.evidence:
        lines.append("")
        lines.append("evidence:")
        lines.extend(f"  {e}" for e in d.evidence)
    if d.others:
        lines.append("")
        lines.append("other ranks:")
        lines.extend(f"  {r:>5}: {what}" for r, what in sorted(d.others.items()))
    if d.notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in d.notes)
    lines.append("")
    mb = E.bytes / 1e6
    lines.append(f"read {len(E.files)} source(s), {E.lines} lines, {mb:.1f} MB")
    return "\n".join(lines) + "\n"
