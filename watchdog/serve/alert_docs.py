"""What an alert says, as pure functions: the JSON document a plain webhook gets and the alert
Alertmanager's v2 API (``POST /api/v2/alerts``) takes, for an incident or a live straggler, firing or
resolved.

Alertmanager identifies an alert by its label set and resolves it at ``endsAt``: a firing alert carries an
``endsAt`` a few minutes ahead and is re-sent before then (as Prometheus does), so an alert whose sender
died resolves by itself, and the resolved notice sets ``endsAt`` to now. ``incident_id`` is a label too:
two incidents of one job with the same kind and ranks stay two alerts, each resolved on its own.
"""

from __future__ import annotations

import datetime
import json
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.text import NAME, PROSE, clean
from ..report.text import headline, int_ranks

FIRING, RESOLVED = "firing", "resolved"
INCIDENT_ALERT, STRAGGLER_ALERT = "RankwatchIncident", "RankwatchStraggler"
STRAGGLER_SCHEMA = "rankwatch.straggler/1"


def is_alertmanager(url: str) -> bool:
    """Alertmanager's v2 alerts endpoint (any prefix: behind a proxy it is often ``/alertmanager/api/v2/alerts``)."""
    return urllib.parse.urlsplit(url).path.rstrip("/").endswith("/api/v2/alerts")


def iso(unix_s: float) -> str:
    """RFC 3339 in UTC, as Alertmanager parses it."""
    return datetime.datetime.fromtimestamp(unix_s, datetime.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


@dataclass(frozen=True)
class Notice:
    """One thing to tell: ``key`` names the alert (firing and resolved notices of one alert share it),
    ``job_id`` is whose queue share it uses, ``doc`` goes to plain webhooks, ``labels``/``annotations`` to
    Alertmanager, ``bundle`` to the --on-incident command (incidents only)."""

    key: tuple[str, ...]
    job_id: str
    status: str
    doc: dict[str, Any]
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_unix: float
    bundle: str | None = None
    incident: bool = True
    verdict: Mapping[str, Any] = field(default_factory=dict)
    owner: int = -1  # the job owner's uid: whose share of the queue it uses, beside its job's

    def body(self) -> bytes:
        return json.dumps(self.doc, default=str).encode()


def _nodes(verdict: Mapping[str, Any]) -> str:
    """Where the initiating ranks ran (the node to look at), else this host."""
    ranks = verdict.get("ranks") if isinstance(verdict.get("ranks"), Mapping) else {}
    nodes: list[str] = []
    for r in verdict.get("initiating_ranks") or []:
        entry = ranks.get(str(r)) if isinstance(ranks, Mapping) else None
        node = entry.get("node") if isinstance(entry, Mapping) else None
        if isinstance(node, str) and node and clean(node, NAME) not in nodes:
            nodes.append(clean(node, NAME))
    return ",".join(nodes[:8]) or socket.gethostname()


def incident_text(verdict: Mapping[str, Any], status: str = FIRING, why: str | None = None) -> str:
    """The one line a chat message or a pager shows."""
    line = f"rankwatch [{clean(verdict.get('job_id'), NAME)}]: {headline(verdict)}"
    return line if status == FIRING else f"RESOLVED ({clean(why or 'job recovered', NAME)}): {line}"


def incident_notice(
    verdict: Mapping[str, Any], bundle: str | None, starts_unix: float, status: str = FIRING, why: str | None = None
) -> Notice:
    job_id = clean(verdict.get("job_id"), NAME)
    incident_id = clean(verdict.get("incident_id"), NAME)
    text = incident_text(verdict, status, why)
    doc: dict[str, Any] = {**verdict, "status": status, "text": text, "bundle": bundle}
    if status == RESOLVED:
        doc["resolved_because"] = clean(why or "job recovered", NAME)
    labels = {
        "alertname": INCIDENT_ALERT,
        "severity": "critical",
        "job_id": job_id,
        "incident_id": incident_id,
        "kind": clean(verdict.get("kind"), NAME),
        "initiating_ranks": ",".join(str(r) for r in int_ranks(verdict.get("initiating_ranks"))[:64]),
        "phase": clean(verdict.get("phase") or "", NAME),
        "node": _nodes(verdict),
    }
    annotations = {
        "summary": text,
        "description": clean(verdict.get("reason") or "", PROSE),
        "bundle": bundle or "",
        "confidence": clean(verdict.get("confidence") or "", NAME),
    }
    return Notice(("incident", job_id, incident_id), job_id, status, doc, labels, annotations, starts_unix,
                  bundle, True, verdict)


def straggler_notice(job_id: str, node: str, s: Mapping[str, Any], starts_unix: float, status: str = FIRING) -> Notice:
    """A live straggler (``LiveStraggler.doc()``) that started or ended."""
    job = clean(job_id, NAME)
    rank = s.get("rank") if isinstance(s.get("rank"), int) else -1
    label, phase = clean(s.get("label") or "", NAME), clean(s.get("phase") or "", NAME)
    line = f"rankwatch [{job}]: {label} rank {rank}" + (f" in phase '{phase}'" if phase else "")
    text = line if status == FIRING else f"RESOLVED (no longer slower than its peers): {line}"
    doc = {"schema": STRAGGLER_SCHEMA, "status": status, "job_id": job, "node": clean(node, NAME), **s,
           "text": text}
    labels = {"alertname": STRAGGLER_ALERT, "severity": "warning", "job_id": job, "rank": str(rank),
              "phase": phase, "label": label, "node": clean(node, NAME)}
    annotations = {"summary": text, "description": clean(s.get("why") or "", PROSE)}
    return Notice(("straggler", job, str(rank), phase), job, status, doc, labels, annotations, starts_unix,
                  None, False)


def alertmanager_alert(n: Notice, now_unix: float, hold_s: float) -> dict[str, Any]:
    """The v2 ``postableAlert``: firing ones end ``hold_s`` from now unless re-sent, resolved ones now."""
    ends = now_unix if n.status == RESOLVED else now_unix + hold_s
    return {"labels": n.labels, "annotations": n.annotations, "startsAt": iso(n.starts_unix), "endsAt": iso(ends)}


def command_env(n: Notice) -> dict[str, str]:
    """What ``--on-incident`` learns besides the bundle path, without reading the bundle."""
    v = n.verdict
    return {
        "RANKWATCH_STATUS": n.status,
        "RANKWATCH_INCIDENT_ID": clean(v.get("incident_id"), NAME),
        "RANKWATCH_JOB_ID": clean(v.get("job_id"), NAME),
        "RANKWATCH_KIND": clean(v.get("kind"), NAME),
        "RANKWATCH_INITIATING_RANKS": ",".join(str(r) for r in int_ranks(v.get("initiating_ranks"))),
        "RANKWATCH_PHASE": clean(v.get("phase") or "", NAME),
        "RANKWATCH_CONFIDENCE": clean(v.get("confidence") or "", NAME),
        "RANKWATCH_REASON": clean(v.get("reason") or "", PROSE),
        "RANKWATCH_TEXT": clean(n.doc.get("text") or "", PROSE),
        "RANKWATCH_BUNDLE": n.bundle or "",
    }
