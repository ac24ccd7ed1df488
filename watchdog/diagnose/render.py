"""Text for a person: the verdict first, then the lines that back it, then what everyone else did.

Evidence lines quote the logs (exception messages, hostnames, anything a rank printed): every string is
cleaned and bounded (``core.text``) before it reaches the terminal.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.text import NAME, PROSE, clean
from ..report.text import headline
from .facts import Evidence

if TYPE_CHECKING:
    from . import JobsResult
    from .reasoning import Diagnosis

MAX_FILES_SHOWN = 8  # source names listed per job header


def render_text(d: Diagnosis, E: Evidence) -> str:
    lines: list[str] = [headline(d.to_json())]  # the live verdict's headline: one renderer for both
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


def render_jobs(result: JobsResult) -> str:
    """One section per job, each the single-job text under a header naming the job and its sources; a
    single job with nothing left over prints exactly as ``render_text``."""
    if len(result.jobs) == 1 and not result.ungrouped:
        j = result.jobs[0]
        return render_text(j.diagnosis, j.evidence)
    parts: list[str] = []
    n = len(result.jobs)
    if n > 1:
        decided = sum(1 for j in result.jobs if j.decided)
        parts.append(f"{n} jobs in these logs (their ranks are not mixed); {decided} of {n} decided\n")
    for i, j in enumerate(result.jobs, 1):
        name = clean(j.label, NAME) if j.label else "no job id in its logs"
        shown = ", ".join(clean(f, NAME) for f in j.files[:MAX_FILES_SHOWN])
        more = f" and {len(j.files) - MAX_FILES_SHOWN} more" if len(j.files) > MAX_FILES_SHOWN else ""
        parts.append(f"=== job {i} of {n}: {name} — {len(j.files)} source(s): {shown}{more}")
        parts.append(render_text(j.diagnosis, j.evidence))
    if result.ungrouped:
        parts.append(ungrouped_note(result.ungrouped) + "\n")
    return "\n".join(parts)


def ungrouped_note(files: list[str]) -> str:
    shown = ", ".join(clean(f, NAME) for f in files[:MAX_FILES_SHOWN])
    more = f" and {len(files) - MAX_FILES_SHOWN} more" if len(files) > MAX_FILES_SHOWN else ""
    return (
        f"not assigned to any job: {shown}{more} (no job id, ranks or times tie it to exactly one job; pass "
        "it together with that job's logs alone to include it)"
    )
