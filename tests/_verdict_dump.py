"""Verdict diff harness: every verdict a test makes, as JSON lines per test id, to compare two code versions.

Load as a pytest plugin with the dump folder in ``RANKWATCH_VERDICT_DUMP`` (does nothing without it)::

    RANKWATCH_VERDICT_DUMP=/tmp/vd/base PYTHONPATH=tests python -m pytest -p _verdict_dump tests/test_x.py
    python tests/_verdict_dump.py /tmp/vd/base /tmp/vd/new    # "N differences in M verdicts"

It wraps ``core.verdict.decide`` (the live verdict; its words are filled later by ``verdict.stage``,
so each one is written when its test ends) and ``diagnose.reasoning.diagnose_evidence`` (offline), in every
module that already holds them by name and in their own modules (later imports get the wrapper).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/popen-gw\d+/|/tmp/pytest-of-[^/]+/pytest-\d+/")

DUMP = os.environ.get("RANKWATCH_VERDICT_DUMP")
_seen: list[tuple[str, Any]] = []


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted(_plain(v) for v in x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, str):
        return _TMP.sub("<tmp>/", x)
    if isinstance(x, (int, float, bool)) or x is None:
        return x
    return repr(x)


def _doc(src: str, v: Any) -> dict[str, Any]:
    if src == "live":
        finding = v.extra.get("finding")
        return {"src": src, "kind": v.kind, "ranks": list(v.initiating_ranks), "confidence": v.confidence,
                "reason": _plain(v.reason), "evidence": _plain(v.evidence), "decided_by": v.extra.get("decided_by"),
                "finding": _plain(finding), "phase": v.phase, "fr": _plain(v.extra.get("flight_recorder"))}
    doc = v.to_json()
    return {"src": src, "kind": doc["kind"], "ranks": doc["initiating_ranks"], "confidence": doc["confidence"],
            "reason": _plain(doc["reason"]), "evidence": _plain(doc["evidence"]), "decided": doc["decided"],
            "finding": _plain(doc["finding"]), "phase": doc["phase"], "notes": _plain(doc["notes"])}


def _wrap(module: str, name: str, src: str) -> None:
    mod = sys.modules[module]
    orig = getattr(mod, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        out = orig(*a, **k)
        _seen.append((src, out))
        return out

    for m in list(sys.modules.values()):
        if m is not None and getattr(m, "__name__", "").startswith("rankwatch") and getattr(m, name, None) is orig:
            setattr(m, name, wrapper)


if DUMP:
    import rankwatch.watchdog.core.verdict
    import rankwatch.watchdog.diagnose.reasoning
    import rankwatch.watchdog.verdict  # noqa: F401

    _wrap("rankwatch.watchdog.core.verdict", "decide", "live")
    _wrap("rankwatch.watchdog.diagnose.reasoning", "diagnose_evidence", "offline")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _seen.clear()
    yield
    if not DUMP or not _seen:
        return
    out = Path(DUMP)
    out.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(out / f"{worker}.jsonl", "a") as fh:
        for i, (src, v) in enumerate(_seen):
            fh.write(json.dumps({"test": item.nodeid, "i": i, **_doc(src, v)}, sort_keys=True, default=repr) + "\n")
    _seen.clear()


def _load(folder: str) -> dict[tuple[str, int], dict[str, Any]]:
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for p in sorted(Path(folder).glob("*.jsonl")):
        for line in p.read_text().splitlines():
            d = json.loads(line)
            out[(d.pop("test"), d.pop("i"))] = d
    return out


def main(base: str, new: str) -> int:
    a, b = _load(base), _load(new)
    diffs = 0
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        diffs += 1
        print(f"DIFF {key[0]} #{key[1]}")
        for field in sorted(set(x or {}) | set(y or {})):
            if (x or {}).get(field) != (y or {}).get(field):
                print(f"  {field}:\n    base: {(x or {}).get(field)!r}\n    new:  {(y or {}).get(field)!r}")
    print(f"{diffs} differences in {len(set(a) | set(b))} verdicts")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
