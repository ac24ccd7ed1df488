"""Ends over facts: a rank that failed by its own cause names itself, earliest first; every rank failing the
same way names nobody; a launcher's exit report alone is only a guess. Pure; words in ``report.findings``.

A SIGABRT is judged where the fact is made (``core.failures.abort_role``): NCCL's watchdog aborts its
process after a timeout (a consequence), gloo the receiver of a mismatched collective. torchrun's "Root
Cause (first observed failure)" is only the first exit it *noticed*; it often names a rank that was merely
waiting, so it is never taken on its own word when better evidence exists.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..engine import Finding
from ..facts import Ended, FactSet, Rung
from ..failures import CONSEQUENCE, INITIATING
from ..policy import OfflinePolicy
from ..ranks import first_by_time
from ..schema import DEAD_RANK, UNKNOWN
from ..snapshot import DEAD

EXIT_CAUSE = "exit_cause"
REPORT_ONLY = "report_only"


def earliest_ends(ordered: Sequence[Ended], tolerance: float) -> list[Ended]:
    """The ends that came first: the first of ``ordered`` (time order, ties pre-broken by the caller), and
    every other end within ``tolerance`` of it (times that close are not ordered with confidence) — except
    an end on the first one's node where both have a place in the node's exit order (``Ended.order``,
    live): within a node that order is exact."""
    if not ordered:
        return []
    first = ordered[0]
    near = first_by_time(ordered, key=lambda e: e.ts or 0.0, tolerance=tolerance)

    def exact(x: Ended) -> bool:
        return x.order is not None and first.order is not None and x.node == first.node

    return [first, *(x for x in near if x is not first and not exact(x))]


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


def rule_exit_order(facts: FactSet, tolerance: float) -> Finding | None:
    """Who ended first by its own cause — the one exit-ordering rule live (``rules.exits``) and offline
    (``rule_exit_cause``) ask, over the ``Ended`` facts of ``core.live_facts`` and ``diagnose.log_facts``.

    Cause before time: an own end, however late it was seen, beats a consequence seen earlier; only when
    every end is a consequence is the first consequence named (low confidence when there are several).
    Then time (``Ended.ts``, the node's exit order breaking ties), with ends within ``tolerance`` of the
    first named with it (``earliest_ends``); ends of unknown time are not ordered: all are named. A bare
    SIGABRT (no message of its own) while nobody waited stays undecided: a rank's own abort and NCCL's
    watchdog abort after a timeout end alike; so does (live) a rank killed without any mark inside a collective."""
    if not facts.ended:
        return None
    timed = all(e.ts is not None for e in facts.ended)
    ordered = sorted(facts.ended, key=lambda e: (e.ts or 0.0, e.order or 0)) if timed else list(facts.ended)
    candidates = [e for e in ordered if e.own] or ordered
    firsts = earliest_ends(candidates, tolerance) if timed else candidates
    lead = firsts[0]
    all_consequences = not any(e.own for e in ordered)
    if all_consequences and any(e.lost for e in ordered):
        # every end is a consequence and one names whom it waited for (a monitored barrier's report): that is
        # a wait-for edge to the rank that never arrived, whatever ended it later (the launcher's teardown), not
        # an exit order — the wait-for graph decides
        return None
    waiting = sorted(facts.waiting() - {e.rank for e in ordered if e.own})
    unverified = [e.rank for e in firsts if not e.verified]
    confidence = "high" if len(firsts) == 1 and (lead.stated or waiting) and not all_consequences else "medium"
    if unverified and confidence == "high":
        confidence = "medium"
    if all_consequences and len(ordered) > 1:
        confidence = "low"
    bare_abort = not waiting and not lead.stated and lead.signal == "SIGABRT"
    # a death with no message of its own that came after the others had already given up waiting cannot be
    # what they waited for (it ended later); it may be the hung rank's own watchdog abort: the log cannot say
    gave_up = [w.ts for w in facts.waits if w.ts is not None and w.rank != lead.rank]
    after_waits = (not lead.stated and lead.ts is not None and bool(gave_up)
                   and lead.ts - min(gave_up) > tolerance and len(firsts) == 1)
    consequences = [e.rank for e in ordered if not e.own]
    # live: killed without any mark while inside a collective. A receiver's abort ends that way too (gloo's size
    # enforcement on a message a peer sent wrong, NCCL's watchdog after a timeout): a guess, however many wait
    silent_in_collective = lead.how == DEAD and lead.phase == "collective" and lead.signal is None
    undecided = bare_abort or after_waits or silent_in_collective
    return Finding(EXIT_CAUSE, DEAD_RANK, sorted(e.rank for e in firsts), Rung.EXIT_CAUSE,
                   "low" if undecided else confidence, {
                       "shape": "first_exit", "decided": not undecided, "bare_abort": bare_abort,
                       "silent_in_collective": silent_in_collective,
                       "after_waits": round(lead.ts - min(gave_up), 3) if after_waits and lead.ts is not None
                       and gave_up else None,
                       "waiting": waiting, "phase": lead.phase, **cause_of(lead), "lead": lead.rank,
                       "how": lead.how, "step": lead.step, "exit_order": [e.rank for e in ordered],
                       "roles": {e.rank: INITIATING if e.own else CONSEQUENCE for e in ordered},
                       # consequences that were seen before the initiating exit
                       "consequences_first": consequences if consequences and lead is not ordered[0] else [],
                       "all_consequences": all_consequences, "unverified": unverified})


def rule_exit_cause(facts: FactSet, policy: OfflinePolicy) -> Finding | None:
    """Offline: an own end (the same failure everywhere names nobody; so does every rank failing by its
    own, different cause while none waited), ordered by ``rule_exit_order``."""
    own = [e for e in facts.ended if e.own]
    if not own:
        return None
    if (same := rule_same_failure(facts)) is not None:
        return same
    prim = [e.rank for e in own]
    if len(own) == len(facts.ranks) > 1 and not facts.waiting() - set(prim):
        # every rank failed by its own, different cause and none waited on another: no rank held the
        # others back (several jobs' logs read as one, independent failures)
        return Finding(EXIT_CAUSE, UNKNOWN, [], Rung.EXIT_CAUSE, "low",
                       {"decided": False, "same_failure": False, "all_failed": True, "failed": prim,
                        **cause_of(own[0])})
    return rule_exit_order(facts, policy.tie_s)


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
