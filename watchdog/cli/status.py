"""``rankwatch status``: a live per-rank table of the jobs on this node, with the current diagnosis."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from rankwatch.hooks.jobinfo import DEFAULT_SHM_DIR

from .. import logs
from ..core.policy import ObservePolicy
from ..core.ranks import fmt_ranks
from ..core.straggler import diagnose_stragglers
from ..core.text import NAME, PROSE, clean
from ..errors import UserError
from ..observe.jobwatch import JobWatch
from ..observe.process import ProcessTable
from .parser import Parser


def build_parser() -> Parser:
    p = Parser(prog="rankwatch status", description="Per-rank table of the jobs running on this node.")
    p.add_argument("--shm-dir", default=os.environ.get("RANKWATCH_SHM_DIR", DEFAULT_SHM_DIR))
    p.add_argument("--job", default=None, help="only this job id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="include finished jobs")
    return p


def collect(shm_dir: str, job: str | None, include_finished: bool) -> list[dict[str, Any]]:
    try:
        names = sorted(os.listdir(shm_dir)) if job is None else [job]
    except OSError as exc:
        raise UserError(f"cannot read shm dir {shm_dir}: {exc.strerror}") from exc
    procs = ProcessTable()
    jobs = []
    try:
        for name in names:
            path = os.path.join(shm_dir, name)
            # anyone may create a job dir in the shared shm dir: never follow a symlink out of it
            if not os.path.isdir(path) or os.path.islink(path):
                if job is not None:
                    raise UserError(f"no job {name!r} under {shm_dir}")
                continue
            watch = JobWatch(shm_dir, name, procs, ObservePolicy(track_descendants=False))
            watch.refresh()
            views = watch.poll()
            if not views or (not include_finished and watch.all_gone(views)):
                watch.close()
                continue
            rows = []
            for v in views:
                ring = list(watch.history.get(v.rank, []))
                rows.append(
                    {
                        "rank": v.rank,
                        "pid": v.pid,
                        "node": clean(v.node, NAME),
                        "state": v.state,
                        "step": v.step,
                        "phase": clean(v.phase or "idle", NAME),
                        "in_phase_s": round(v.in_phase_s, 3),
                        "since_progress_s": round(v.since_progress_s, 3),
                        "last_step_ms": round(ring[-1].duration_ms, 3) if ring else None,
                        "collective": clean(f"{v.coll_op}#{v.coll_seq}", NAME) if v.coll_seq else None,
                        "gpu_phase_ms": watch.ranks[v.rank].last.gpu_phase_ms or None,
                    }
                )
            diag = diagnose_stragglers({r: list(h) for r, h in watch.history.items()})
            jobs.append(
                {
                    "job_id": clean(name, NAME),
                    "ranks": rows,
                    "diagnosis": diag.label,
                    "straggler_ranks": diag.straggler_ranks,
                    "phase": clean(diag.phase, NAME) if diag.phase else None,
                    "why": clean(diag.why, PROSE),
                }
            )
            watch.close()
    finally:
        procs.close()
    return jobs


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(json_output=False, level="error")
    jobs = collect(args.shm_dir, args.job, args.all)
    if args.json:
        sys.stdout.write(json.dumps({"time_unix": time.time(), "jobs": jobs}, indent=2) + "\n")
        return 0
    if not jobs:
        sys.stdout.write(f"no running jobs under {args.shm_dir}\n")
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    for job in jobs:
        # every string shown is cleaned (collect) and passed as Text, never as markup: a phase or job
        # named "[link=…]" is shown as written
        table = Table(title=Text(f"job {clean(job['job_id'], NAME)}"), title_justify="left")
        for col, justify in (
            ("rank", "right"),
            ("pid", "right"),
            ("step", "right"),
            ("phase", "left"),
            ("in phase", "right"),
            ("last step", "right"),
            ("state", "left"),
        ):
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for r in job["ranks"]:
            phase = r["phase"] if r["phase"] != "collective" or not r["collective"] else r["collective"]
            last = f"{r['last_step_ms']:.1f} ms" if r["last_step_ms"] is not None else "-"
            style = "red" if r["state"] not in ("running", "exited") else None
            table.add_row(
                str(r["rank"]),
                str(r["pid"]),
                str(r["step"]),
                Text(clean(phase, NAME)),
                f"{r['in_phase_s']:.1f}s",
                last,
                Text(clean(r["state"], NAME)),
                style=style,
            )
        console.print(table)
        who = f" — {fmt_ranks(job['straggler_ranks'])}" if job["straggler_ranks"] else ""
        line = Text("diagnosis: ")
        line.append(clean(job["diagnosis"], NAME), style="bold")
        line.append(who + (f" in {clean(job['phase'], NAME)}" if job["phase"] else ""))
        console.print(line)
        console.print(Text(f"why: {clean(job['why'], PROSE)}"))
    return 0
