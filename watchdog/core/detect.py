"""Pure incident detection: which rank states justify opening an incident now."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .live_facts import is_waiting
from .policy import StallPolicy
from .ranks import fmt_ranks
from .snapshot import GONE_STATES, RUNNING, STOPPED, RankView


@dataclass(frozen=True)
class Trigger:
    kind: str  # "dead" | "stopped" | "stall"
    ranks: tuple[int, ...]
    reason: str
    timeout_s: float
    detected_after_s: float  # onset → now, as a duration


def first_step_s(views: Sequence[RankView], policy: StallPolicy, longest_step_s: float) -> float | None:
    """How long a rank that has not completed a step may go without progress once some rank of the job waits
    in a collective (``live_facts.is_waiting``: a Python-level collective, a stack in a wait, DDP's gradient
    sync): start-up is over for the waiters and they can only go on once the others arrive, so a rank blocked
    before its first step is a hang like any other, not a slow start. It gets the waiters' own start-up times
    1 + ``StallPolicy.first_step_skew``, at least the stall timeout, at most the start-up budget. None: nobody
    waits yet, or a waiter's start-up is not known (the start-up budget applies)."""
    waiters = [v for v in views if v.state == RUNNING and is_waiting(v)]
    if not waiters or any(v.age_s is None for v in waiters):
        return None
    reached = max(max(0.0, (v.age_s or 0.0) - v.since_progress_s) for v in waiters)
    return min(policy.startup_for(), max(policy.timeout_for(longest_step_s), (1 + policy.first_step_skew) * reached))


def allowance_s(
    view: RankView, policy: StallPolicy, longest_step_s: float, first_step: float | None = None
) -> float:
    """How long this rank may go without progress before it counts as stalled (``first_step``: what
    ``first_step_s`` gives the job's views, for a rank that has not completed a step)."""
    if view.step == 0:
        base = first_step if first_step is not None else policy.startup_for()
    else:
        base = policy.timeout_for(longest_step_s)
    if view.budget_s > 0:
        # inside a declared phase (checkpoint, eval) the declared budget replaces a shorter timeout
        return max(base, view.budget_s)
    return base


def stalled_ranks(views: Sequence[RankView], policy: StallPolicy, longest_step_s: float) -> list[int]:
    """Live ranks past their stall allowance right now: what ``status`` highlights, by the rule detection uses."""
    first = first_step_s(views, policy, longest_step_s)
    return sorted(
        v.rank for v in views
        if v.state == RUNNING and v.since_progress_s > allowance_s(v, policy, longest_step_s, first)
    )


def excused(view: RankView) -> bool:
    """A rank inside a declared phase and within its budget: the others may legitimately wait for it."""
    return view.state == RUNNING and view.budget_s > 0 and view.budget_elapsed_s < view.budget_s


def find_trigger(
    views: Sequence[RankView], policy: StallPolicy, longest_step_s: float, stopped_for_s: dict[int, float]
) -> Trigger | None:
    """The strongest reason to open an incident, or None when the job looks healthy or finished."""
    if not views:
        return None
    timeout = policy.timeout_for(longest_step_s)
    # only a verified rank's end opens an incident: a record alone (forged, or of a process that ended
    # before rankwatch saw it) is evidence for a verdict, never a trigger
    gone = [v for v in views if v.state in GONE_STATES and v.verified]
    if gone:
        ages = [v.exit_age_s or 0.0 for v in gone]
        return Trigger(
            kind="dead",
            ranks=tuple(sorted(v.rank for v in gone)),
            reason=f"{len(gone)} rank(s) exited without the normal-exit mark",
            timeout_s=timeout,
            detected_after_s=max(ages),
        )
    stopped = [v for v in views if v.state == STOPPED and stopped_for_s.get(v.rank, 0.0) >= policy.stopped_grace_s]
    if stopped:
        return Trigger(
            kind="stopped",
            ranks=tuple(sorted(v.rank for v in stopped)),
            reason=f"{len(stopped)} rank(s) stopped (SIGSTOP / state T)",
            timeout_s=timeout,
            detected_after_s=max(stopped_for_s.get(v.rank, 0.0) for v in stopped),
        )
    live = [v for v in views if v.state in (RUNNING, STOPPED)]
    if not live or any(excused(v) for v in live):
        return None
    first = first_step_s(views, policy, longest_step_s)
    stalled = [v for v in live if v.since_progress_s > allowance_s(v, policy, longest_step_s, first)]
    if not stalled:
        return None
    worst = max(v.since_progress_s for v in stalled)
    return Trigger(
        kind="stall",
        ranks=tuple(sorted(v.rank for v in stalled)),
        reason=f"no progress for {worst:.1f}s (stall timeout {timeout:.1f}s)",
        timeout_s=timeout,
        detected_after_s=worst,
    )


def recovered(views: Sequence[RankView], policy: StallPolicy, longest_step_s: float) -> bool:
    """Every live rank has progressed within the timeout again: the incident can close."""
    live = [v for v in views if v.state in (RUNNING, STOPPED)]
    if not live or any(v.state in GONE_STATES or v.state == STOPPED for v in views):
        return False
    first = first_step_s(views, policy, longest_step_s)
    return all(v.since_progress_s < allowance_s(v, policy, longest_step_s, first) for v in live)


# -- claims and verdicts from other nodes that no store secret authenticates ---------------------------


def local_stall_signs(
    views: Sequence[RankView], policy: StallPolicy, longest_step_s: float, fraction: float
) -> str | None:
    """What this node's own ranks show of a stall (None: nothing), the test an unauthenticated remote claim
    must pass before this node captures for it. A rank gone or stopped here, or a live rank without
    progress for ``fraction`` of its stall allowance: in a real hang every rank stops progressing within a
    step of the one that started it, while a healthy rank progresses at every phase. A rank inside a
    declared phase and within its budget explains the others' waiting, as in ``find_trigger``."""
    gone = [v.rank for v in views if v.state in GONE_STATES or v.state == STOPPED]
    if gone:
        return f"{fmt_ranks(gone)} gone or stopped here"
    live = [v for v in views if v.state == RUNNING]
    if not live or any(excused(v) for v in live):
        return None
    first = first_step_s(views, policy, longest_step_s)
    stuck = [v for v in live if v.since_progress_s >= fraction * allowance_s(v, policy, longest_step_s, first)]
    if not stuck:
        return None
    worst = max(v.since_progress_s for v in stuck)
    return f"{fmt_ranks(v.rank for v in stuck)} without progress here for up to {worst:.1f}s"


def progressing_here(views: Sequence[RankView], ranks: Sequence[int], timeout_s: float) -> list[int]:
    """Those of ``ranks`` that this node sees healthy: running and progressed within the stall timeout. A
    verdict naming one of them as the initiator contradicts this node's own observation."""
    named = set(ranks)
    return sorted(
        v.rank for v in views if v.rank in named and v.state == RUNNING and v.since_progress_s < timeout_s
    )
