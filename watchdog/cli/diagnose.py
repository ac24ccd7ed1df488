"""``rankwatch diagnose LOG [LOG…]``: name the initiating rank from logs a job already wrote."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from ..core.document import VerdictDocument
from ..diagnose import Job, JobsResult, diagnose_jobs
from ..diagnose.render import render_jobs, ungrouped_note
from .argparser import Parser

DESCRIPTION = """Name the rank that started a failure from logs a job already wrote: torchrun's console
(--tee 3 prefixes [defaultN]:/[rankN]:), torchrun --log-dir per-rank files, srun --label output, mpirun
--tag-output, dmesg. Offline, streamed in constant memory. Logs of several jobs (different run ids, Slurm
job ids, master ports, or the same rank at other times / on other hosts) are diagnosed one job at a time.
Exit code 0 when the logs decide an initiator (for every job), 1 when they cannot decide, 2 on bad
input (a file named here that is not text too)."""


def build_parser() -> Parser:
    p = Parser(prog="rankwatch diagnose", description=DESCRIPTION)
    p.add_argument("logs", nargs="+", metavar="LOG", help="log file, directory (recursive) or - for stdin")
    p.add_argument(
        "--json",
        action="store_true",
        help="print a rankwatch.verdict/1 document (a list of them when the logs hold several jobs)",
    )
    return p


def _doc(job: Job, result: JobsResult, several: bool) -> VerdictDocument:
    doc = job.diagnosis.document()
    if several:  # one job keeps the single document exactly as before
        doc = replace(doc, job_id=job.job_id, job=job.label, sources=tuple(job.files[:1000]))
    if result.ungrouped and doc.offline is not None:
        doc = replace(doc, offline=replace(doc.offline, notes=(*doc.offline.notes, ungrouped_note(result.ungrouped))))
    return doc


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    result = diagnose_jobs(args.logs)
    several = len(result.jobs) > 1
    if args.json:
        docs = [_doc(j, result, several).to_json() for j in result.jobs]
        out: Any = docs if several else docs[0]
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        sys.stdout.write(render_jobs(result))
    return 0 if result.decided else 1
