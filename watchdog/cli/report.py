"""``rankwatch report PATH``: render an incident bundle or a run summary (text, ``--json``, ``--html``)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..core.doc_checks import document_problems
from ..core.schema import SUMMARY_SCHEMA, VERDICT_SCHEMA
from ..core.text import PROSE, clean
from ..errors import UserError
from ..report.html import write_html
from ..report.text import summary_text, verdict_text
from .argparser import Parser


def build_parser() -> Parser:
    p = Parser(prog="rankwatch report", description="Render an incident bundle or a run summary.")
    p.add_argument("path", help="an incident bundle dir, a run's --out dir, verdict.json or summary.json")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--html", metavar="FILE", default=None, help="write a self-contained HTML report to FILE")
    return p


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = f.read(64 << 20)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not valid JSON (not UTF-8)") from exc
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(doc, dict) or doc.get("schema") not in (VERDICT_SCHEMA, SUMMARY_SCHEMA):
        raise UserError(f"{path} is not a rankwatch verdict or summary")
    problems = document_problems(doc)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{path} is not a valid {doc['schema']} document: {clean(problems[0], PROSE)}{more}")
    return doc


def resolve(path: str) -> list[str]:
    """The JSON documents a path stands for: a bundle, a run dir (summary + its incidents) or a file."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise UserError(f"no such file or directory: {path}")
    if os.path.isfile(os.path.join(path, "verdict.json")):
        return [os.path.join(path, "verdict.json")]
    docs = []
    incidents = os.path.join(path, "incidents")
    if os.path.isdir(incidents):
        for name in sorted(os.listdir(incidents)):
            candidate = os.path.join(incidents, name, "verdict.json")
            if not name.startswith(".") and os.path.isfile(candidate):
                docs.append(candidate)
    if os.path.isfile(os.path.join(path, "summary.json")):
        docs.append(os.path.join(path, "summary.json"))
    if not docs:
        raise UserError(f"{path} holds no verdict.json or summary.json")
    return docs


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    paths = resolve(args.path)
    docs = [_load(p) for p in paths]
    if args.html:
        write_html(args.html, docs, base_dir=args.path if os.path.isdir(args.path) else os.path.dirname(args.path))
        sys.stdout.write(f"wrote {args.html}\n")
        return 0
    if args.json:
        sys.stdout.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
        return 0
    for path, doc in zip(paths, docs, strict=True):
        # a bundle's verdict: its stacks name each rank's first frame of user code and the stack file
        bundle = os.path.dirname(os.path.abspath(path)) if os.path.basename(path) == "verdict.json" else None
        text = verdict_text(doc, bundle=bundle) if doc["schema"] == VERDICT_SCHEMA else summary_text(doc)
        sys.stdout.write(text + "\n")
    return 0
