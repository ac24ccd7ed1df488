"""Field checks for the JSON documents rankwatch reads back: a document on disk or in the store may be
hand-edited, truncated or written by someone else, so each field a reader uses is checked for its type and
a wrong one is named in one phrase ("'initiating_ranks' must be a list of ranks") instead of surfacing as a
traceback deep in a renderer. The verdict's table lives with its type (``core.document``), the summary's
and state's in ``core.doc_checks``; both check with these. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[object], bool]
# field -> (required, check, what it must be)
Spec = Mapping[str, tuple[bool, Check, str]]


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def is_str(v: object) -> bool:
    return isinstance(v, str)


def is_bool(v: object) -> bool:
    return isinstance(v, bool)


def is_dict(v: object) -> bool:
    return isinstance(v, dict)


def opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def list_of(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def dict_of(check: Check) -> Check:
    return lambda v: isinstance(v, dict) and all(check(x) for x in v.values())


RANKS = list_of(is_int)
STRINGS = list_of(is_str)


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
