"""The verdict document as users read it: ``decide()``'s verdict completed in one place.

Everything a bundle, a callback, the store or the terminal shows beyond ``decide()``'s own keys — the
trigger that opened the incident, the stall timeout in force, how the nodes agreed, and this node's own
ranks when the leader sent a slimmed verdict — is added here and nowhere else, so every consumer of an
incident sees the same document.

It is also where the job's own strings are made safe, once for every sink: a host name, phase or op name,
exception text or stack frame a job chose can hold escape sequences, line breaks or markup, and
``verdict.json``, the webhooks, Alertmanager, the ``--on-incident`` environment, the log and the store all
carry this document (``text.clean_doc``). Only the bundle's stack files keep what py-spy read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .detect import Trigger
from .snapshot import RankView
from .text import clean_doc
from .verdict import rank_entry


def trigger_doc(trigger: Trigger) -> dict[str, Any]:
    """The trigger as it is shared with other nodes and stored in the verdict."""
    return {
        "kind": trigger.kind,
        "ranks": list(trigger.ranks),
        "reason": trigger.reason,
        "detected_after_s": round(trigger.detected_after_s, 3),
    }


def finalize_verdict(
    verdict: Mapping[str, Any],
    *,
    trigger: Trigger,
    correlation: str | None,
    local_views: Sequence[RankView] = (),
) -> dict[str, Any]:
    """A new document: ``verdict`` plus trigger, timeout, correlation and any missing local rank entries,
    every string in it cleaned (``clean_doc``).

    Idempotent, so a verdict finalized by the leader can be finalized again by each follower with its own
    trigger and ranks.
    """
    doc = dict(verdict)
    ranks = dict(doc.get("ranks") or {})
    for v in local_views:
        ranks.setdefault(str(v.rank), rank_entry(v))
    doc["ranks"] = ranks
    doc["trigger"] = {k: v for k, v in trigger_doc(trigger).items() if k != "detected_after_s"}
    doc["stall_timeout_s"] = round(trigger.timeout_s, 3)
    if correlation is not None:
        doc["correlation"] = correlation
    cleaned: dict[str, Any] = clean_doc(doc)
    return cleaned
