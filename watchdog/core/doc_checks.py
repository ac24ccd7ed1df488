"""Type checks of the JSON documents rankwatch reads back (verdicts, summaries, watchdog state files).

A document on disk may be hand-edited, truncated by a full disk or written by someone else: before a
report renders it or ``status`` shows it, every field a renderer uses is checked for its type here, so a
wrong type is one clear line ("initiating_ranks must be a list of ranks"), never a traceback deep in a
renderer and never a page that reads "job None". Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .schema import CONFIDENCES, KINDS, STATE_SCHEMA, SUMMARY_SCHEMA, VERDICT_SCHEMA

Check = Callable[[object], bool]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _dict_of(check: Check) -> Check:
    return lambda v: isinstance(v, dict) and all(check(x) for x in v.values())


def _is_dict(v: object) -> bool:
    return isinstance(v, dict)


def _point(v: object) -> bool:
    # [step, step ms] in older summaries; [step, step ms, own work ms, wait ms] since the own/wait timeline
    return isinstance(v, list) and len(v) in (2, 4) and all(_is_num(x) for x in v)


RANKS = _list_of(_is_int)

# field -> (required, check, what it must be)
Spec = Mapping[str, tuple[bool, Check, str]]

VERDICT_FIELDS: Spec = {
    # null in an offline verdict (``diagnose``: logs name no job id, no incident, no detection delay)
    "job_id": (True, _opt(_is_str), "a string or null"),
    "incident_id": (True, _opt(_is_str), "a string or null"),
    "kind": (True, _is_str, "a string"),
    "initiating_ranks": (True, RANKS, "a list of ranks"),
    "confidence": (True, _is_str, "a string"),
    "reason": (True, _is_str, "a string"),
    "detected_after_s": (True, _opt(_is_num), "a number of seconds or null"),
    "phase": (False, _opt(_is_str), "a string or null"),
    "evidence": (False, _list_of(_is_str), "a list of strings"),
    "ranks": (False, _dict_of(_is_dict), "an object of rank entries"),
    "trigger": (False, _opt(_is_dict), "an object"),
    "stall_timeout_s": (False, _opt(_is_num), "a number of seconds"),
}

# A verdict another node put in the job store is acted on (adopted, alerted on, killed for): beside the
# fields a renderer needs, it must be a live verdict of a kind and confidence this version knows. The same
# spec, tightened — one spec per document, whether it is read from disk or from the store.
STORE_VERDICT_FIELDS: Spec = {
    **VERDICT_FIELDS,
    "job_id": (True, _is_str, "a string"),
    "incident_id": (True, _is_str, "a string"),
    "kind": (True, lambda v: v in KINDS, "a known kind"),
    "confidence": (True, lambda v: v in CONFIDENCES, "a known confidence"),
    "ranks": (True, _dict_of(_is_dict), "an object of rank entries"),
    "evidence": (True, _list_of(_is_str), "a list of strings"),
}

SUMMARY_FIELDS: Spec = {
    "job_id": (True, _is_str, "a string"),
    "diagnosis": (True, _is_str, "a string"),
    "straggler_ranks": (True, RANKS, "a list of ranks"),
    "phase": (False, _opt(_is_str), "a string or null"),
    "why": (False, _is_str, "a string"),
    "steps": (True, _is_int, "a step count"),
    "steps_total": (False, _opt(_is_int), "a step count"),
    "step_time_ms": (False, _is_dict, "an object"),
    "phases": (False, _dict_of(_is_dict), "an object of phase entries"),
    "ranks": (False, _dict_of(_is_dict), "an object of rank entries"),
    "timeline": (False, _dict_of(_list_of(_point)), "an object of [step, ms] lists"),
    "incidents": (False, _list_of(_is_str), "a list of incident ids"),
    "incident_verdicts": (False, _list_of(_is_dict), "a list of verdicts"),
}

STATE_FIELDS: Spec = {
    "job_id": (True, _is_str, "a string"),
    "updated_unix": (True, _is_num, "a time"),
    "watchdog_pid": (True, _is_int, "a pid"),
    "stall_timeout_s": (False, _opt(_is_num), "a number of seconds"),
    "open_incident": (False, _opt(_is_dict), "an object or null"),
    "incidents": (False, _list_of(_is_dict), "a list of incidents"),
    "stragglers": (False, _list_of(_is_dict), "a list of stragglers"),
    "diagnosis": (False, _opt(_is_dict), "an object or null"),
}

INCIDENT_REF_FIELDS: Spec = {
    "incident_id": (True, _is_str, "a string"),
    "kind": (True, _is_str, "a string"),
    "initiating_ranks": (True, RANKS, "a list of ranks"),
}

SPECS: Mapping[str, Spec] = {VERDICT_SCHEMA: VERDICT_FIELDS, SUMMARY_SCHEMA: SUMMARY_FIELDS, STATE_SCHEMA: STATE_FIELDS}


def check_fields(doc: Mapping[str, Any], spec: Spec) -> list[str]:
    """What is wrong with ``doc`` against ``spec``, one phrase per field."""
    problems = []
    for name, (required, check, want) in spec.items():
        if name not in doc:
            if required:
                problems.append(f"'{name}' is missing")
        elif not check(doc[name]):
            problems.append(f"'{name}' must be {want}")
    return problems


def document_problems(doc: object) -> list[str]:
    """Why ``doc`` cannot be rendered as the document its ``schema`` says it is (empty: it can)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    spec = SPECS.get(str(doc.get("schema")))
    if spec is None:
        return [f"unknown schema {str(doc.get('schema'))[:64]!r}"]
    problems = check_fields(doc, spec)
    if doc.get("schema") == SUMMARY_SCHEMA:
        for i, v in enumerate(doc.get("incident_verdicts") or []):
            # the summary keeps each verdict's gist (the rest is in the bundle): the fields a headline needs
            problems += [f"incident_verdicts[{i}]: {p}" for p in check_fields(v, INCIDENT_REF_FIELDS)]
    if doc.get("schema") == STATE_SCHEMA:
        listed = doc.get("incidents")
        refs: list[Any] = [doc.get("open_incident"), *(listed if isinstance(listed, list) else [])]
        for ref in refs:
            if isinstance(ref, dict):
                problems += check_fields(ref, INCIDENT_REF_FIELDS)
    return problems


def store_verdict_problems(doc: Mapping[str, Any]) -> list[str]:
    """Why a verdict read from the job store cannot be acted on (empty: it can)."""
    return check_fields(doc, STORE_VERDICT_FIELDS)
