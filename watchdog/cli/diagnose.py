"""``rankwatch diagnose LOG [LOG…]``: name the initiating rank from logs a job already wrote."""

from __future__ import annotations

import json
import sys

from ..diagnose import diagnose_logs
from ..diagnose.render import render_text
from .parser import Parser

DESCRIPTION = """Name the rank that started a failure from logs a job already wrote: torchrun's console
(--tee 3 prefixes [defaultN]:/[rankN]:), torchrun --log-dir per-rank files, srun --label output, dmesg.
Offline, streamed in constant memory. Exit code 0 when the logs name an initiator, 1 when they cannot
decide, 2 on bad input."""


def _parser() -> Parser:
    p = Parser(prog="rankwatch diagnose", description=DESCRIPTION)
    p.add_argument("logs", nargs="+", metavar="LOG", help="log file, directory (recursive) or - for stdin")
    p.add_argument("--json", action="store_true", help="print a rankwatch.verdict/1 document")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    d, evidence = diagnose_logs(args.logs)
    if args.json:
        sys.stdout.write(json.dumps(d.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(d, evidence))
    return 0 if d.initiating_ranks else 1
