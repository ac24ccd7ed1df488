"""A rank whose helper thread died: the hook's record keeps the first exception that ended a thread other than
the training thread (a prefetch or I/O producer); the training loop that waits on that thread's queue hangs with
no error of its own, so the dead thread is the cause to show. Pure; words in ``report.live_words``."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import Finding
from ..facts import FactSet, Progress, Rung
from ..schema import HANG
from .names import THREAD_DIED


def rule_thread_died(facts: FactSet, live: Sequence[Progress]) -> Finding | None:
    """The live ranks that lost a helper thread to an exception (``ThreadDied`` facts; a minority of
    ``facts.ranks``, the ranks that answered: a thread dying on every rank is a shared cause, which the other
    rungs weigh); ``live``: where the live ranks are."""
    died = sorted(facts.threads, key=lambda t: t.rank)
    if not died or len(died) * 2 > len(facts.ranks):
        return None
    lead = next((p for p in live if p.rank == died[0].rank), None)
    return Finding(THREAD_DIED, HANG, [t.rank for t in died], Rung.STACKS, "medium",
                   {"shape": "thread_died", "threads": {t.rank: t.error for t in died},
                    "phase": lead.phase if lead else None, "step": lead.step if lead else None})
