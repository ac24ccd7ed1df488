"""The verdict document as users read it: ``decide()``'s verdict completed in one place.

Everything a bundle, a callback, the store or the terminal shows beyond ``decide()``'s own keys — the
trigger that opened the incident, the stall timeout in force, how the nodes agreed, and this node's own
ranks when the leader sent a slimmed verdict — is added here and nowhere else
(``VerdictDocument.finalized``), so every consumer of an incident sees the same document.

It is also where the job's own strings are made safe, once for every sink: a host name, phase or op name,
exception text or stack frame a job chose can hold escape sequences, line breaks or markup, and
``verdict.json``, the webhooks, Alertmanager, the ``--on-incident`` environment, the log and the store all
carry this document (``text.clean_doc``). Only the bundle's stack files keep what py-spy read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .detect import Trigger
from .document import TriggerRef, VerdictDocument
from .snapshot import RankView
from .verdict import rank_entry


def trigger_doc(trigger: Trigger) -> dict[str, Any]:
    """The trigger as it is shared with other nodes in the incident claim."""
    return {
        "kind": trigger.kind,
        "ranks": list(trigger.ranks),
        "reason": trigger.reason,
        "detected_after_s": round(trigger.detected_after_s, 3),
    }


def finalize_verdict(
    verdict: VerdictDocument,
    *,
    trigger: Trigger,
    correlation: str | None,
    local_views: Sequence[RankView] = (),
) -> VerdictDocument:
    """A new document: ``verdict`` plus trigger, timeout, correlation and any missing local rank entries,
    every string in it cleaned (``clean_doc``). Idempotent, so a verdict finalized by the leader can be
    finalized again by each follower with its own trigger and ranks."""
    return verdict.finalized(
        trigger=TriggerRef(trigger.kind, tuple(trigger.ranks), trigger.reason),
        timeout_s=trigger.timeout_s,
        correlation=correlation,
        local={str(v.rank): rank_entry(v) for v in local_views},
    )
