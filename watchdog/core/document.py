"""The verdict document (``rankwatch.verdict/1``) as one typed value: what ``verdict.json``, the store
exchange, the webhooks, ``inspect --json`` and ``diagnose --json`` all carry.

One frozen ``VerdictDocument`` is built by every producer — the live decision (``core.verdict``), the
offline one (``diagnose.reasoning``), completion with the trigger (``finalized``), the leader's slimmed copy
(``slimmed``) — and every reader of a document it did not build (the store, a file on disk) goes through
``from_json``, which checks each field's type and says what is wrong, one phrase per field. So the shape is
declared once: adding a field is one attribute here, and no reader has to ``.get()`` its way through a dict
a hostile node or a hand edit may have bent. Keys this version does not know are kept (``other``) so a
newer writer's document survives a round trip through an older reader.

Pure: no I/O. Text from a job is cleaned where the document is completed (``finalized``, ``text.clean_doc``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .fields import (
    RANKS,
    STRINGS,
    Check,
    Spec,
    check_fields,
    is_bool,
    is_dict,
    is_int,
    is_num,
    is_str,
    list_of,
    opt,
)
from .schema import CONFIDENCES, KINDS, VERDICT_SCHEMA
from .text import clean_doc

Json = dict[str, Any]


class DocumentError(ValueError):
    """A document that is not a verdict this version can use; ``problems`` names each field."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# -- the parts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """The collective a rank was in (``seq`` None offline: a log names the op, not always its number)."""

    seq: int | None
    op: str

    def to_json(self) -> Json:
        return {"seq": self.seq, "op": self.op}


@dataclass(frozen=True)
class RankEntry:
    """One rank as the incident saw it (live: its record and stack; offline: what its log said)."""

    node: str | None = None
    pid: int | None = None
    state: str = "unknown"
    step: int | None = None
    phase: str | None = None
    in_phase_s: float | None = None
    collective: Collective | None = None
    gpu_util: float | None = None
    stack_top: tuple[str, ...] = ()
    other: Mapping[str, Any] = field(default_factory=dict)  # keys this version does not know

    def to_json(self) -> Json:
        return {
            "node": self.node,
            "pid": self.pid,
            "state": self.state,
            "step": self.step,
            "phase": self.phase,
            "in_phase_s": self.in_phase_s,
            "collective": self.collective.to_json() if self.collective is not None else None,
            "gpu_util": self.gpu_util,
            "stack_top": list(self.stack_top),
            **self.other,
        }

    @classmethod
    def from_json(cls, doc: object, where: str) -> tuple[RankEntry, list[str]]:
        """The entry, with each field of the wrong type dropped (and named in the problems)."""
        if not isinstance(doc, dict):
            return cls(), [f"'{where}' must be an object"]
        problems: list[str] = []

        def take(key: str, check: Check, want: str) -> Any:
            v = doc.get(key)
            if v is None or check(v):
                return v
            problems.append(f"'{where}.{key}' must be {want}")
            return None

        coll = doc.get("collective")
        collective = None
        if isinstance(coll, dict) and opt(is_int)(coll.get("seq")) and isinstance(coll.get("op", ""), str):
            collective = Collective(coll.get("seq"), str(coll.get("op", "")))
        elif coll is not None:
            problems.append(f"'{where}.collective' must be an object of seq and op")
        stack = doc.get("stack_top") or []
        if not STRINGS(stack):
            problems.append(f"'{where}.stack_top' must be a list of strings")
            stack = []
        state = take("state", is_str, "a string")
        return cls(
            node=take("node", is_str, "a string"),
            pid=take("pid", is_int, "a pid"),
            state=state if state is not None else "unknown",
            step=take("step", is_int, "a step"),
            phase=take("phase", is_str, "a string"),
            in_phase_s=take("in_phase_s", is_num, "a number of seconds"),
            collective=collective,
            gpu_util=take("gpu_util", is_num, "a number"),
            stack_top=tuple(stack),
            other={k: v for k, v in doc.items() if k not in _RANK_KEYS},
        ), problems


_RANK_KEYS = frozenset(("node", "pid", "state", "step", "phase", "in_phase_s", "collective", "gpu_util", "stack_top"))


@dataclass(frozen=True)
class TriggerRef:
    """What opened the incident on the node that wrote the document."""

    kind: str
    ranks: tuple[int, ...]
    reason: str

    def to_json(self) -> Json:
        return {"kind": self.kind, "ranks": list(self.ranks), "reason": self.reason}


@dataclass(frozen=True)
class Offline:
    """What only a verdict from logs has: whether the logs decide, and what to do or read next."""

    decided: bool = True
    next_action: str = ""
    would_decide: str | None = None
    notes: tuple[str, ...] = ()


# -- the document ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerdictDocument:
    """A verdict as every sink carries it. The first eleven fields are always written (null where a source
    has no value: logs name no job, incident or detection delay); the rest only when set."""

    kind: str
    initiating_ranks: tuple[int, ...]
    confidence: str
    reason: str
    job_id: str | None = None
    incident_id: str | None = None
    phase: str | None = None
    detected_after_s: float | None = None
    ranks: Mapping[str, RankEntry] = field(default_factory=dict)
    evidence: tuple[str, ...] = ()
    # the evidence items behind ``evidence``'s lines beside the finding's own, as data
    # (``core.evidence_items``: ``{"kind": …, fields}``), for readers that need the facts, not the words
    evidence_items: tuple[Mapping[str, Any], ...] | None = None
    # what decided: ``decided_by`` names the rung (live), ``finding`` is its structured conclusion
    decided_by: str | None = None
    finding: Mapping[str, Any] | None = None
    missing_ranks: tuple[int, ...] | None = None
    follows_incident: str | None = None  # a verdict on the consequences of rankwatch's own kill
    flight_recorder: Mapping[str, Any] | None = None
    flight_recorder_sources: Mapping[str, Any] | None = None  # inspect: where each rank's dump came from
    # added when the node completes it (``finalized``) and by the exchange
    trigger: TriggerRef | None = None
    stall_timeout_s: float | None = None
    correlation: str | None = None
    exchange: Mapping[str, Any] | None = None
    ranks_slimmed: bool = False
    # where it was decided from: None live, "inspect", "logs"; offline's own part; diagnose's job grouping
    source: str | None = None
    offline: Offline | None = None
    job: str | None = None
    sources: tuple[str, ...] | None = None
    bundle: str | None = None
    other: Mapping[str, Any] = field(default_factory=dict)  # keys this version does not know

    # -- writing --------------------------------------------------------------------------------------

    def to_json(self) -> Json:
        doc: Json = {
            "schema": VERDICT_SCHEMA,
            "job_id": self.job_id,
            "incident_id": self.incident_id,
            "kind": self.kind,
            "initiating_ranks": list(self.initiating_ranks),
            "phase": self.phase,
            "confidence": self.confidence,
            "reason": self.reason,
            "detected_after_s": round(self.detected_after_s, 3) if self.detected_after_s is not None else None,
            "ranks": {k: e.to_json() for k, e in self.ranks.items()},
            "evidence": list(self.evidence),
        }
        optional: Json = {
            "evidence_items": [dict(i) for i in self.evidence_items] if self.evidence_items is not None else None,
            "decided_by": self.decided_by,
            "finding": dict(self.finding) if self.finding is not None else None,
            "missing_ranks": list(self.missing_ranks) if self.missing_ranks is not None else None,
            "follows_incident": self.follows_incident,
            "flight_recorder": dict(self.flight_recorder) if self.flight_recorder is not None else None,
            "flight_recorder_sources": self.flight_recorder_sources,
            "trigger": self.trigger.to_json() if self.trigger is not None else None,
            "stall_timeout_s": self.stall_timeout_s,
            "correlation": self.correlation,
            "exchange": dict(self.exchange) if self.exchange is not None else None,
            "ranks_slimmed": True if self.ranks_slimmed else None,
            "source": self.source,
            "job": self.job,
            "sources": list(self.sources) if self.sources is not None else None,
            "bundle": self.bundle,
        }
        doc.update((k, v) for k, v in optional.items() if v is not None)
        if self.offline is not None:  # written whole, nulls included: the offline document's contract
            doc.update(
                decided=self.offline.decided,
                next_action=self.offline.next_action,
                would_decide=self.offline.would_decide,
                notes=list(self.offline.notes),
            )
        doc.update((k, v) for k, v in self.other.items() if k not in doc)
        return doc

    # -- new documents from this one ------------------------------------------------------------------

    def finalized(
        self, *, trigger: TriggerRef, timeout_s: float, correlation: str | None, local: Mapping[str, RankEntry] = {}
    ) -> VerdictDocument:
        """This node's copy: its trigger and timeout, how the nodes agreed, its own ranks where the document
        lacks them (a slimmed leader's), every string a job chose cleaned (``text.clean_doc``). Idempotent,
        so a verdict finalized by the leader is finalized again by each follower with its own trigger."""
        ranks = dict(self.ranks)
        for k, e in local.items():
            ranks.setdefault(k, e)
        done = replace(
            self,
            ranks=ranks,
            trigger=trigger,
            stall_timeout_s=round(timeout_s, 3),
            correlation=correlation if correlation is not None else self.correlation,
        )
        return done.cleaned()

    def cleaned(self) -> VerdictDocument:
        """Every string a job chose made safe for any sink (``text.clean_doc``: escapes, line breaks, markup)."""
        return VerdictDocument.from_json(clean_doc(self.to_json()))

    def slimmed(self, above_ranks: int) -> VerdictDocument:
        """What the leader publishes: whole for ordinary jobs; for very large ones only the initiating ranks'
        entries (every node adds its own), so the value stays far below the store limit and 256 nodes do not
        each download megabytes."""
        if len(self.ranks) <= above_ranks:
            return self
        keep = {str(r) for r in self.initiating_ranks}
        return replace(self, ranks={k: e for k, e in self.ranks.items() if k in keep}, ranks_slimmed=True)

    # -- reading --------------------------------------------------------------------------------------

    @classmethod
    def from_json(cls, doc: object, *, acted_on: bool = False) -> VerdictDocument:
        """The document, or ``DocumentError`` naming every field that is wrong. ``acted_on``: read from the
        job store, where a verdict is adopted, alerted on and killed for — it must then be a live verdict of
        a kind and confidence this version knows, with its ranks and evidence."""
        problems = verdict_problems(doc, acted_on=acted_on)
        if problems:
            raise DocumentError(problems)
        assert isinstance(doc, dict)
        ranks: dict[str, RankEntry] = {}
        for k, v in (doc.get("ranks") or {}).items():
            ranks[str(k)], _ = RankEntry.from_json(v, f"ranks.{k}")
        trig = doc.get("trigger")
        trigger = None
        if isinstance(trig, dict):
            trigger = TriggerRef(
                kind=str(trig.get("kind", "")),
                ranks=tuple(r for r in trig.get("ranks") or [] if is_int(r)) if isinstance(trig.get("ranks"), list)
                else (),
                reason=str(trig.get("reason", "")),
            )
        offline = None
        if doc.get("source") == "logs" or "next_action" in doc:
            offline = Offline(
                decided=bool(doc.get("decided", True)),
                next_action=str(doc.get("next_action") or ""),
                would_decide=doc.get("would_decide") if isinstance(doc.get("would_decide"), str) else None,
                notes=tuple(x for x in doc.get("notes") or [] if isinstance(x, str))
                if isinstance(doc.get("notes"), list) else (),
            )
        sources = doc.get("sources")
        items = doc.get("evidence_items")
        return cls(
            kind=doc["kind"],
            initiating_ranks=tuple(doc["initiating_ranks"]),
            confidence=doc["confidence"],
            reason=doc["reason"],
            job_id=doc.get("job_id"),
            incident_id=doc.get("incident_id"),
            phase=doc.get("phase"),
            detected_after_s=doc.get("detected_after_s"),
            ranks=ranks,
            evidence=tuple(doc.get("evidence") or ()),
            evidence_items=tuple(items) if isinstance(items, list) else None,
            decided_by=doc.get("decided_by"),
            finding=doc.get("finding"),
            missing_ranks=tuple(doc["missing_ranks"]) if doc.get("missing_ranks") is not None else None,
            follows_incident=doc.get("follows_incident"),
            flight_recorder=doc.get("flight_recorder"),
            flight_recorder_sources=doc.get("flight_recorder_sources"),
            trigger=trigger,
            stall_timeout_s=doc.get("stall_timeout_s"),
            correlation=doc.get("correlation"),
            exchange=doc.get("exchange"),
            ranks_slimmed=doc.get("ranks_slimmed") is True,
            source=doc.get("source"),
            offline=offline,
            job=doc.get("job"),
            sources=tuple(sources) if isinstance(sources, list) else None,
            bundle=doc.get("bundle"),
            other={k: v for k, v in doc.items() if k not in _DOC_KEYS},
        )


# field -> (required, check, what it must be): the one table of the document's types, for both readings
FIELDS: Spec = {
    # null in an offline verdict (``diagnose``: logs name no job id, no incident, no detection delay)
    "job_id": (True, opt(is_str), "a string or null"),
    "incident_id": (True, opt(is_str), "a string or null"),
    "kind": (True, is_str, "a string"),
    "initiating_ranks": (True, RANKS, "a list of ranks"),
    "confidence": (True, is_str, "a string"),
    "reason": (True, is_str, "a string"),
    "detected_after_s": (True, opt(is_num), "a number of seconds or null"),
    "phase": (False, opt(is_str), "a string or null"),
    "evidence": (False, STRINGS, "a list of strings"),
    "evidence_items": (False, opt(list_of(lambda v: isinstance(v, dict) and is_str(v.get("kind")))),
                       "a list of objects with a kind"),
    "ranks": (False, is_dict, "an object of rank entries"),
    "decided_by": (False, opt(is_str), "a string"),
    "finding": (False, opt(is_dict), "an object"),
    "missing_ranks": (False, opt(RANKS), "a list of ranks"),
    "follows_incident": (False, opt(is_str), "an incident id"),
    "flight_recorder": (False, opt(is_dict), "an object"),
    "flight_recorder_sources": (False, opt(is_dict), "an object"),
    "trigger": (False, opt(is_dict), "an object"),
    "stall_timeout_s": (False, opt(is_num), "a number of seconds"),
    "correlation": (False, opt(is_str), "a string"),
    "exchange": (False, opt(is_dict), "an object"),
    "ranks_slimmed": (False, opt(is_bool), "true or false"),
    "source": (False, opt(is_str), "a string"),
    "decided": (False, opt(is_bool), "true or false"),
    "next_action": (False, opt(is_str), "a string"),
    "would_decide": (False, opt(is_str), "a string or null"),
    "notes": (False, opt(STRINGS), "a list of strings"),
    "job": (False, opt(is_str), "a string"),
    "sources": (False, opt(STRINGS), "a list of strings"),
    "bundle": (False, opt(is_str), "a path"),
}

# the store's reading, tightened: it is acted on
ACTED_ON: Spec = {
    "job_id": (True, is_str, "a string"),
    "incident_id": (True, is_str, "a string"),
    "kind": (True, lambda v: v in KINDS, "a known kind"),
    "confidence": (True, lambda v: v in CONFIDENCES, "a known confidence"),
    "ranks": (True, is_dict, "an object of rank entries"),
    "evidence": (True, STRINGS, "a list of strings"),
}

_DOC_KEYS = frozenset(("schema", *FIELDS))


def verdict_problems(doc: object, *, acted_on: bool = False) -> list[str]:
    """Why ``doc`` is not a verdict document this version can read (``acted_on``: act on), one phrase per
    field; empty when it is."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    if doc.get("schema") != VERDICT_SCHEMA:
        return [f"unknown schema {str(doc.get('schema'))[:64]!r}"]
    spec = {**FIELDS, **ACTED_ON} if acted_on else FIELDS
    problems = check_fields(doc, spec)
    ranks = doc.get("ranks")
    # a rank entry of the wrong type on disk loses only that field (a report still shows the rest); a verdict
    # that is acted on must be whole
    if acted_on and isinstance(ranks, dict) and not problems:
        for k, v in list(ranks.items()):
            problems += RankEntry.from_json(v, f"ranks.{k}")[1]
    return problems
