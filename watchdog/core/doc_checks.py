"""Type checks of the JSON documents rankwatch reads back (verdicts, summaries, watchdog state files).

A document on disk may be hand-edited, truncated by a full disk or written by someone else: before a
report renders it or ``status`` shows it, every field a renderer uses is checked for its type here, so a
wrong type is one clear line ("initiating_ranks must be a list of ranks"), never a traceback deep in a
renderer and never a page that reads "job None". Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .document import verdict_problems
from .fields import RANKS, Spec, check_fields, dict_of, is_dict, is_int, is_num, is_str, list_of, opt
from .schema import STATE_SCHEMA, SUMMARY_SCHEMA, VERDICT_SCHEMA


def _point(v: object) -> bool:
    # [step, step ms] in older summaries; [step, step ms, own work ms, wait ms] since the own/wait timeline
    return isinstance(v, list) and len(v) in (2, 4) and all(is_num(x) for x in v)


SUMMARY_FIELDS: Spec = {
    "job_id": (True, is_str, "a string"),
    "diagnosis": (True, is_str, "a string"),
    "straggler_ranks": (True, RANKS, "a list of ranks"),
    "phase": (False, opt(is_str), "a string or null"),
    "why": (False, is_str, "a string"),
    "steps": (True, is_int, "a step count"),
    "steps_total": (False, opt(is_int), "a step count"),
    "step_time_ms": (False, is_dict, "an object"),
    "phases": (False, dict_of(is_dict), "an object of phase entries"),
    "ranks": (False, dict_of(is_dict), "an object of rank entries"),
    "timeline": (False, dict_of(list_of(_point)), "an object of [step, ms] lists"),
    "incidents": (False, list_of(is_str), "a list of incident ids"),
    "incident_verdicts": (False, list_of(is_dict), "a list of verdicts"),
}

STATE_FIELDS: Spec = {
    "job_id": (True, is_str, "a string"),
    "updated_unix": (True, is_num, "a time"),
    "watchdog_pid": (True, is_int, "a pid"),
    "stall_timeout_s": (False, opt(is_num), "a number of seconds"),
    "open_incident": (False, opt(is_dict), "an object or null"),
    "incidents": (False, list_of(is_dict), "a list of incidents"),
    "stragglers": (False, list_of(is_dict), "a list of stragglers"),
    "diagnosis": (False, opt(is_dict), "an object or null"),
    "job_diagnosis": (False, opt(is_dict), "an object or null"),
}

INCIDENT_REF_FIELDS: Spec = {
    "incident_id": (True, is_str, "a string"),
    "kind": (True, is_str, "a string"),
    "initiating_ranks": (True, RANKS, "a list of ranks"),
}

SPECS: Mapping[str, Spec] = {SUMMARY_SCHEMA: SUMMARY_FIELDS, STATE_SCHEMA: STATE_FIELDS}


def document_problems(doc: object) -> list[str]:
    """Why ``doc`` cannot be rendered as the document its ``schema`` says it is (empty: it can). A verdict is
    checked by its own type (``core.document``)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    if doc.get("schema") == VERDICT_SCHEMA:
        return verdict_problems(doc)
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
