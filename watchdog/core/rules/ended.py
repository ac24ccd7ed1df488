"""Ends over facts: a rank that failed by its own cause names itself, earliest first; every rank failing the
same way names nobody; a launcher's exit report alone is only a guess. Pure; words in ``report.findings``.

A SIGABRT is judged where the fact is made (``core.failures.abort_role``): NCCL's watchdog aborts its
process after a timeout (a consequence), gloo the receiver of a mismatched collective. torchrun's "Root
Cause (first observed failure)" is only the first exit it *noticed*; it often names a rank that was merely
waiting, so it is never taken on its own word when better evidence exists.
"""

from __future__ import annotations

from collections import Counter

from ..engine import Finding
from ..facts import Ended, FactSet, Rung
from ..policy import OfflinePolicy
from ..ranks import first_by_time
from ..schema import DEAD_RANK, UNKNOWN

EXIT_CAUSE = "exit_cause"
REPORT_ONLY = "report_only"


def cause_of(e: Ended) -> dict[str, object]:
    """What a renderer needs to name an end's cause."""
    return {"cause": e.cause, "detail": e.detail[:120], "signal": e.signal, "site": e.site, "node": e.node}


def rule_exit_cause(facts: FactSet, policy: OfflinePolicy) -> Finding | None:
    own = [e for e in facts.ended if e.own]
    if not own:
        return None
    prim = [e.rank for e in own]
    waiting = sorted(facts.waiting() - set(prim))
    if len(own) == len(facts.ranks) and len(facts.ranks) > 1 and not waiting:
        # every rank failed alike and nothing orders them: a cause common to all ranks, not one rank
        labels = Counter((e.cause, e.detail[:120], None if e.cause else e.signal) for e in own)
        (cause, detail, signal), _ = labels.most_common(1)[0]
        return Finding(EXIT_CAUSE, UNKNOWN, [], Rung.EXIT_CAUSE, "low",
                       {"decided": False, "same_failure": True, "failed": prim,
                        "cause": cause, "detail": detail, "signal": signal})
    first = own
    if len(own) > 1 and all(e.ts is not None for e in own):
        first = first_by_time(own, key=lambda e: e.ts or 0.0, tolerance=policy.tie_s)
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
