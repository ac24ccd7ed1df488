"""Ends over facts: a rank that failed by its own cause names itself, earliest first; every rank failing the
same way names nobody; a launcher's exit report alone is only a guess. Pure; words in ``report.findings``.

A SIGABRT is judged where the fact is made (``core.failures.abort_role``): NCCL's watchdog aborts its
process after a timeout (a consequence), gloo the receiver of a mismatched collective. torchrun's "Root
Cause (first observed failure)" is only the first exit it *noticed*; it often names a rank that was merely
waiting, so it is never taken on its own word when better evidence exists.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from ..engine import Finding
from ..facts import Ended, FactSet, Rung
from ..policy import OfflinePolicy
from ..ranks import first_by_time
from ..schema import DEAD_RANK, UNKNOWN

EXIT_CAUSE = "exit_cause"
REPORT_ONLY = "report_only"

T = TypeVar("T")


def earliest_ends(ordered: Sequence[T], *, at: Callable[[T], float], tolerance: float,
                  node: Callable[[T], Hashable] | None = None) -> list[T]:
    """The ends that came first, the one rule live (``rules.exits``) and offline share: the first of
    ``ordered`` (time order, ties pre-broken by the caller), and every other end within ``tolerance`` of it
    (times that close are not ordered with confidence). With ``node``: only ends on another node tie —
    within a node the exit order is exact."""
    if not ordered:
        return []
    first = ordered[0]
    near = first_by_time(ordered, key=at, tolerance=tolerance)
    return [first, *(x for x in near if x is not first and (node is None or node(x) != node(first)))]


def cause_of(e: Ended) -> dict[str, object]:
    """What a renderer needs to name an end's cause."""
    return {"cause": e.cause, "detail": e.detail[:120], "signal": e.signal, "site": e.site, "node": e.node}


_NUMBER = re.compile(r"\d+")


def failure_label(e: Ended) -> tuple[str, str, str] | None:
    """How an end failed, with its numbers blanked (``GPU 3``, ``rank 5``, a pid: the same error on every
    rank differs only there); None when nothing says how (a kill without any mark)."""
    if not e.cause and not e.signal:
        return None
    return (e.cause or "", _NUMBER.sub("N", (e.detail or "")[:120]), "" if e.cause else e.signal or "")


def rule_same_failure(facts: FactSet) -> Finding | None:
    """Every rank ended the same way (one exception, one signal) and none waited on a peer: the job's own
    failure (its code, data or environment), which no rank started — whichever ended a millisecond first
    is named by nobody. The one rule live (``rules.exits``) and offline (``rule_exit_cause``) ask."""
    ended = {e.rank: e for e in facts.ended}
    if len(facts.ranks) < 2 or any(r not in ended for r in facts.ranks) or facts.waiting() - set(ended):
        return None
    labels = {failure_label(e) for e in ended.values()}
    if len(labels) != 1 or None in labels:
        return None
    lead = ended[facts.ranks[0]]
    # the kind is unknown (no rank's failure); the live verdict keeps calling it a dead-rank incident
    return Finding(EXIT_CAUSE, UNKNOWN, [], Rung.EXIT_CAUSE, "low",
                   {"decided": False, "same_failure": True, "failed": sorted(ended), **cause_of(lead)})


def rule_exit_cause(facts: FactSet, policy: OfflinePolicy) -> Finding | None:
    own = [e for e in facts.ended if e.own]
    if not own:
        return None
    if (same := rule_same_failure(facts)) is not None:
        return same
    prim = [e.rank for e in own]
    waiting = sorted(facts.waiting() - set(prim))
    if len(own) == len(facts.ranks) > 1 and not waiting:
        # every rank failed by its own, different cause and none waited on another: no rank held the
        # others back (several jobs' logs read as one, independent failures)
        return Finding(EXIT_CAUSE, UNKNOWN, [], Rung.EXIT_CAUSE, "low",
                       {"decided": False, "same_failure": False, "all_failed": True, "failed": prim,
                        **cause_of(own[0])})
    first = own
    if len(own) > 1 and all(e.ts is not None for e in own):
        first = earliest_ends(sorted(own, key=lambda e: e.ts or 0.0), at=lambda e: e.ts or 0.0,
                              tolerance=policy.tie_s)
    first = sorted(first, key=lambda e: e.rank)
    lead = first[0]
    confidence = "high" if (lead.stated or waiting) and len(first) == 1 else "medium"
    # its own abort and NCCL's watchdog abort after a timed-out collective end alike
    bare_abort = not waiting and not lead.stated and lead.signal == "SIGABRT"
    return Finding(
        EXIT_CAUSE,
        DEAD_RANK,
        [e.rank for e in first],
        Rung.EXIT_CAUSE,
        "low" if bare_abort else confidence,
        {"decided": not bare_abort, "bare_abort": bare_abort, "waiting": waiting, "phase": lead.phase,
         **cause_of(lead)},
    )


def rule_report_only(facts: FactSet) -> Finding | None:
    """Only a launcher's exit report says anything: the rank it says exited first, as a guess. A rank that
    ended by SIGTERM was stopped (by torchrun, a scheduler or a watchdog's --on-stall kill), even when
    torchrun's report calls it the first observed failure: it names nobody."""
    failed = [x for x in facts.exited if x.signal != "SIGTERM"]
    root = [x for x in failed if x.root_cause]
    cands = root or failed
    if not cands:
        return None
    lead = cands[0]
    return Finding(
        REPORT_ONLY,
        DEAD_RANK,
        [lead.rank] if root else [x.rank for x in cands],
        Rung.SILENCE,
        "low",
        {"decided": False, "exited": [x.rank for x in cands], "signal": lead.signal, "exitcode": lead.exitcode},
    )
