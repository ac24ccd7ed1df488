"""A rank whose helper thread died: the hook's record keeps the first exception that ended a thread other than
the training thread (a prefetch or I/O producer); the training loop that waits on that thread's queue hangs with
no error of its own, so the dead thread is the cause to show. Pure; words in ``report.live_words``."""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import Finding
from ..facts import Rung
from ..schema import HANG
from ..snapshot import RUNNING, RankView
from .names import THREAD_DIED


def rule_thread_died(present: Sequence[RankView]) -> Finding | None:
    """The live ranks that lost a helper thread to an exception (a minority: a thread dying on every rank
    is a shared cause, which the other rungs weigh)."""
    died = [v for v in present if v.state == RUNNING and v.thread_died]
    if not died or len(died) * 2 > len(present):
        return None
    return Finding(THREAD_DIED, HANG, [v.rank for v in died], Rung.STACKS, "medium",
                   {"shape": "thread_died", "threads": {v.rank: v.thread_died for v in died},
                    "phase": died[0].phase, "step": died[0].step})
