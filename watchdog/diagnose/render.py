"""Text for a person: the verdict first, then the lines that back it, then what everyone else did.

Evidence lines quote the logs (exception messages, hostnames, anything a rank printed): every string is
cleaned and bounded (``core.text``) before it reaches the terminal.
"""

from __future__ import annotations

from ..core.ranks import fmt_ranks
from ..core.text import NAME, PROSE, clean
from .facts import Evidence
from .reasoning import Diagnosis


def render_text(d: Diagnosis, E: Evidence) -> str:
    lines: list[str] = []
    kind = clean(d.kind, NAME)
    if d.initiating_ranks:
        head = f"INITIATOR: {fmt_ranks(d.initiating_ranks)} — {kind}"
    else:
        head = f"NO SINGLE INITIATOR — {kind}"
    phase = f", phase {clean(d.phase, NAME)}" if d.phase else ""
    lines.append(f"{head} (confidence {clean(d.confidence, NAME)}{phase})")
    lines.append(f"why: {clean(d.reason, PROSE)}")
    if not d.decided:
        lines.append("the logs cannot decide this on their own.")
        if d.would_decide:
            lines.append(f"what would decide: {clean(d.would_decide, PROSE)}")
    lines.append(f"next: {clean(d.next_action, PROSE)}")
    if d.evidence:
        lines.append("")
        lines.append("evidence:")
        lines.extend(f"  {clean(e, PROSE)}" for e in d.evidence)
    if d.others:
        lines.append("")
        lines.append("other ranks:")
        lines.extend(f"  {r:>5}: {clean(what, PROSE)}" for r, what in sorted(d.others.items()))
    if d.notes:
        lines.append("")
        lines.extend(f"note: {clean(n, PROSE)}" for n in d.notes)
    lines.append("")
    mb = E.bytes / 1e6
    lines.append(f"read {len(E.files)} source(s), {E.lines} lines, {mb:.1f} MB")
    return "\n".join(lines) + "\n"
