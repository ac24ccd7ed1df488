"""``rankwatch status``: the jobs on this node — open incidents and stalled ranks first, then the per-rank
table and the current straggler diagnosis; ``--watch`` keeps it on screen, refreshed in place.

The ranks' records say what each rank does; only the job's watchdog knows whether an incident is open,
so status also reads the state file the watchdog publishes (``serve.state``), and says how old it is:
a stale file means the watchdog is gone, and its last word is shown as such. The straggler diagnosis is the
watchdog's own (computed once per poll, the one its metrics and alerts read) while its state is fresh;
only without a watchdog does status diagnose the records itself (``diagnosis_from`` says which). On a follower
node of a multi-node job the state also carries the leader's job-wide diagnosis (``job_diagnosis``): shown first,
marked as the leader's, with this node's own below it — the job's straggler may run on another node.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

from rankwatch.hooks.files import read_in

from .. import logs
from ..core.detect import stalled_ranks
from ..core.doc_checks import document_problems
from ..core.policy import ObservePolicy, ServePolicy, StallPolicy
from ..core.ranks import fmt_ranks
from ..core.schema import headline_of
from ..core.snapshot import RankView
from ..core.straggler import diagnose_stragglers
from ..core.straggler_live import LiveStraggler, straggler_item
from ..core.text import NAME, PROSE, clean
from ..errors import UserError
from ..observe.jobwatch import JobWatch
from ..observe.process import ProcessTable
from ..report.evidence_words import straggler_line
from ..serve.state import (
    MAX_STATE_BYTES,
    OUT_STATE_FILE,
    STATE_FILE,
    diagnosis_ref,
    incident_ref,
    job_diagnosis_ref,
)
from .argparser import Parser
from .options import add_shm_dir, positive_float

PIPE_WIDTH = 400  # columns when stdout is not a terminal: wide enough that no phase or why is cut


def build_parser() -> Parser:
    p = Parser(prog="rankwatch status", description="The jobs on this node: open incidents, stalled ranks, a "
               "per-rank table and the straggler diagnosis.")
    add_shm_dir(p)
    p.add_argument(
        "--daemon-out",
        default=os.environ.get("RANKWATCH_OUT", "/var/lib/rankwatch"),
        help="the daemon's --out, where it also keeps each job's state (default: $RANKWATCH_OUT or %(default)s)",
    )
    p.add_argument("--job", default=None, help="only this job id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="include finished jobs")
    p.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument(
        "--interval", type=positive_float, default=1.0, metavar="SECONDS", help="--watch refresh (default: 1)"
    )
    return p


def read_state(shm_dir: str, daemon_out: str, job: str, now: float) -> dict[str, Any] | None:
    """The freshest well-formed state file of ``job`` (beside its records, or under the daemon's --out),
    with its age; None when no watchdog published one that this user can read."""
    best: dict[str, Any] | None = None
    for directory, name in ((os.path.join(shm_dir, job), STATE_FILE), (os.path.join(daemon_out, job), OUT_STATE_FILE)):
        try:
            raw = read_in(directory, name, MAX_STATE_BYTES)
            doc = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or document_problems(doc) or doc.get("job_id") != job:
            continue  # hand-made or torn: status shows what the records say instead
        doc["age_s"] = round(max(0.0, now - float(doc["updated_unix"])), 1)
        if best is None or doc["age_s"] < best["age_s"]:
            best = doc
    return best


def _incident(ref: object) -> dict[str, Any] | None:
    if not isinstance(ref, dict):
        return None
    return incident_ref(ref, bundle=ref.get("bundle"), decided=ref.get("decided", True) is True)


def job_status(
    watch: JobWatch, views: list[RankView], state: dict[str, Any] | None, stale_after_s: float
) -> dict[str, Any]:
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
    timeout = state.get("stall_timeout_s") if state else None
    policy = StallPolicy(timeout_s=timeout) if isinstance(timeout, int | float) and timeout > 0 else StallPolicy()
    # the records' own view, by the rule detection uses (with the watchdog's timeout when it published one)
    stalled = stalled_ranks(views, policy, watch.longest_step_s)
    fresh = state is not None and state["age_s"] <= stale_after_s
    diag = diagnosis_ref(state.get("diagnosis")) if state is not None and fresh else None
    # a follower's: the leader's job-wide diagnosis beside this node's own (only while the watchdog is alive)
    job_diag = job_diagnosis_ref(state.get("job_diagnosis")) if state is not None and fresh else None
    source = "watchdog"
    if diag is None:  # no watchdog (or a silent one, or none diagnosed yet): the records, as they are now
        own = diagnose_stragglers({r: list(h) for r, h in watch.history.items()})
        diag = {"label": own.label, "straggler_ranks": own.straggler_ranks,
                "phase": clean(own.phase, NAME) if own.phase else None, "why": clean(own.why, PROSE),
                "cause": None, "cause_rank": None, "cause_text": "", "remote_ranks": {}}
        source = "records"
    stragglers = [s for s in (LiveStraggler.from_doc(d) for d in (state or {}).get("stragglers") or []) if s]
    return {
        "job_id": clean(watch.job_id, NAME),
        "watchdog": (
            {
                "state": "stale" if state["age_s"] > stale_after_s else "fresh",
                "age_s": state["age_s"],
                "pid": state["watchdog_pid"],
                "mode": clean(state.get("mode"), NAME),
                "on_stall": clean(state.get("on_stall"), NAME),
                "owner_lag_s": lag if isinstance(lag := state.get("owner_lag_s"), int | float) and lag > 0 else 0,
            }
            if state
            else {"state": "none"}
        ),
        "open_incident": _incident(state.get("open_incident")) if state else None,
        "incidents": [i for i in (_incident(x) for x in (state or {}).get("incidents") or []) if i],
        "stalled_ranks": stalled,
        "stall_timeout_s": round(policy.timeout_for(watch.longest_step_s), 3),
        "stragglers": [s.doc() | {"line": straggler_line(straggler_item(s, time.time()))} for s in stragglers],
        "ranks": rows,
        "diagnosis": diag["label"],
        "straggler_ranks": diag["straggler_ranks"],
        "phase": diag["phase"],
        "why": diag["why"],
        "cause": diag["cause"],
        "cause_rank": diag["cause_rank"],
        "cause_text": diag["cause_text"],
        "remote_ranks": diag["remote_ranks"],
        "diagnosis_from": source,
        "job_diagnosis": job_diag,
    }


def collect(shm_dir: str, job: str | None, include_finished: bool, daemon_out: str = "") -> list[dict[str, Any]]:
    try:
        names = sorted(os.listdir(shm_dir)) if job is None else [job]
    except OSError as exc:
        raise UserError(f"cannot read shm dir {shm_dir}: {exc.strerror}") from exc
    procs = ProcessTable()
    stale_after = ServePolicy.state_stale_after_s
    jobs = []
    try:
        for name in names:
            path = os.path.join(shm_dir, name)
            # anyone may create a job dir in the shared shm dir: never follow a symlink out of it
            if name.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
                if job is not None:
                    raise UserError(f"no job {name!r} under {shm_dir}")
                continue
            watch = JobWatch(shm_dir, name, procs, ObservePolicy(track_descendants=False))
            try:
                watch.refresh()
                views = watch.poll()
                if not views or (not include_finished and watch.all_gone(views)):
                    continue
                jobs.append(job_status(watch, views, read_state(shm_dir, daemon_out, name, time.time()), stale_after))
            finally:
                watch.close()
    finally:
        procs.close()
    return jobs


# -- rendering ------------------------------------------------------------------------------------------


def render(jobs: list[dict[str, Any]], shm_dir: str) -> Any:
    """A rich renderable of every job; every string is cleaned (collect) and passed as Text, never as
    markup: a phase or job named "[link=…]" is shown as written."""
    from rich.console import Group
    from rich.text import Text

    if not jobs:
        return Text(f"no running jobs under {shm_dir}")
    parts: list[Any] = []
    for job in jobs:
        parts += _job_head(job)
        parts.append(_rank_table(job))
        parts += _job_tail(job)
        parts.append(Text(""))
    return Group(*parts)


def _job_head(job: dict[str, Any]) -> list[Any]:
    """The job's title (who watches it), its open incident and its stalled ranks."""
    from rich.text import Text

    inc = job["open_incident"]
    stalled = set(job["stalled_ranks"])
    title = Text(f"job {job['job_id']}", style="bold")
    wd = job["watchdog"]
    if wd["state"] == "none":
        title.append("  · no watchdog state (is `rankwatch run` or the daemon watching it?)", style="yellow")
    elif wd["state"] == "stale":
        title.append(f"  · watchdog silent for {wd['age_s']:.0f}s (pid {wd['pid']}): its last word below",
                     style="yellow")
    else:
        title.append(f"  · watched by {wd['mode']} (pid {wd['pid']}, on stall: {wd['on_stall']})", style="dim")
        if wd.get("owner_lag_s"):
            title.append(f"  · this user's jobs are looked at {wd['owner_lag_s']:.0f}s late (their own volume)",
                         style="yellow")
    parts: list[Any] = [title]
    if inc and not inc["decided"]:
        parts.append(Text(f"OPEN INCIDENT {inc['incident_id']}: deciding… (evidence being captured; "
                          f"trigger: {inc['kind']})", style="bold red"))
    elif inc:
        what = headline_of(inc["kind"])
        who = fmt_ranks(inc["initiating_ranks"]) if inc["initiating_ranks"] else "no single rank"
        line = Text(f"OPEN INCIDENT {inc['incident_id']}: {what} — initiating {who}", style="bold red")
        if inc["phase"]:
            line.append(f" in phase '{inc['phase']}'", style="bold red")
        if inc["confidence"]:
            line.append(f" (confidence {inc['confidence']})", style="red")
        parts.append(line)
        if inc["reason"]:
            parts.append(Text(f"  why: {inc['reason']}", style="red"))
        if inc["bundle"]:
            parts.append(Text(f"  bundle: {inc['bundle']}"))
    if stalled:
        parts.append(
            Text(
                f"STALLED: {fmt_ranks(sorted(stalled))} — no progress for longer than "
                f"{job['stall_timeout_s']:.0f}s",
                style="bold red",
            )
        )
    return parts


def _rank_table(job: dict[str, Any]) -> Any:
    """One row per rank; the incident's initiating ranks marked ◀ and, like stalled ranks, in red."""
    from rich.table import Table
    from rich.text import Text

    inc = job["open_incident"]
    # until the verdict is decided nobody is named: the trigger's ranks are only those seen stalled
    initiating = set(inc["initiating_ranks"]) if inc and inc["decided"] else set()
    stalled = set(job["stalled_ranks"])
    table = Table(title_justify="left")
    table.add_column("", justify="left")  # ◀ marks the incident's initiating ranks
    for col, justify in (
        ("rank", "right"),
        ("pid", "right"),
        ("step", "right"),
        ("phase", "left"),
        ("in phase", "right"),
        ("no progress", "right"),
        ("last step", "right"),
        ("state", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in job["ranks"]:
        phase = r["phase"] if r["phase"] != "collective" or not r["collective"] else r["collective"]
        last = f"{r['last_step_ms']:.1f} ms" if r["last_step_ms"] is not None else "-"
        state = "STALLED" if r["rank"] in stalled and r["state"] == "running" else r["state"]
        style = None
        if r["rank"] in initiating or r["rank"] in stalled:
            style = "bold red"
        elif r["state"] not in ("running", "exited"):
            style = "red"
        elif inc:
            style = "yellow"  # waiting on the incident's ranks, not steady state
        table.add_row(
            "◀" if r["rank"] in initiating else "",
            str(r["rank"]),
            str(r["pid"]),
            str(r["step"]),
            Text(phase),
            f"{r['in_phase_s']:.1f}s",
            f"{r['since_progress_s']:.1f}s",
            last,
            Text(state),
            style=style,
        )
    return table


def _job_tail(job: dict[str, Any]) -> list[Any]:
    """The live straggler lines, the diagnosis of the steps so far and the earlier incidents."""
    from rich.text import Text

    inc = job["open_incident"]
    parts: list[Any] = [Text(f"live: {s['line']}", style="yellow") for s in job["stragglers"]]
    job_diag = job.get("job_diagnosis")
    if job_diag:
        parts += _leader_lines(job_diag)
    who = f" — {fmt_ranks(job['straggler_ranks'])}" if job["straggler_ranks"] else ""
    line = Text("diagnosis: " if not inc else "steps so far: ")
    if job_diag:
        line = Text("this node's diagnosis: " if not inc else "this node's steps so far: ")
    line.append(job["diagnosis"], style="bold")
    line.append(who + (f" in {job['phase']}" if job["phase"] else ""))
    remote = job["remote_ranks"]
    if remote:  # the leader's diagnosis compares the ranks other nodes share with it
        nodes = sorted(set(remote.values()))
        line.append(f" (with {fmt_ranks([int(r) for r in remote])} of {', '.join(nodes[:4])}"
                    f"{' …' if len(nodes) > 4 else ''})", style="dim")
    parts.append(line)
    parts.append(Text(f"why: {job['why']}"))
    if job["cause_text"]:
        where = remote.get(str(job["cause_rank"]))
        parts.append(Text(job["cause_text"] + (f" [rank {job['cause_rank']} runs on {where}]" if where else "")))
    for i in job["incidents"][-3:]:
        if not inc or i["incident_id"] != inc["incident_id"]:
            who = fmt_ranks(i["initiating_ranks"]) if i["initiating_ranks"] else "no single rank"
            earlier = f"earlier incident {i['incident_id']}: {headline_of(i['kind'])} — {who}"
            parts.append(Text(earlier, style="dim"))
    return parts


def _leader_lines(d: dict[str, Any]) -> list[Any]:
    """A follower's lines for the leader's job-wide diagnosis: which node said it (and that anyone could have, with
    no store secret), the ranks it names with the node each runs on, why, and the cause."""
    from rich.text import Text

    src = f"from leader node {d['leader']}" + ("" if d["authenticated"] else ", unauthenticated")
    line = Text(f"job diagnosis ({src}): ")
    line.append(d["label"], style="bold")
    ranks = d["straggler_ranks"]
    if ranks:
        line.append(f" — {fmt_ranks(ranks)}" + (f" in {d['phase']}" if d["phase"] else ""))
        where = sorted({d["nodes"][str(r)] for r in ranks if str(r) in d["nodes"]})
        if where:
            line.append(f" on {', '.join(where[:4])}{' …' if len(where) > 4 else ''}")
        if d["excess_ms"]:
            line.append(f" (+{d['excess_ms']:.1f} ms/step)")
    parts: list[Any] = [line, Text(f"  why: {d['why']}")]
    if d["cause_text"]:
        where = d["nodes"].get(str(d["cause_rank"]))
        parts.append(Text(f"  {d['cause_text']}" + (f" [rank {d['cause_rank']} runs on {where}]" if where else "")))
    return parts


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.watch and args.json:
        raise UserError("--watch refreshes a table on a terminal; for JSON, poll 'rankwatch status --json'")
    logs.configure(json_output=False, level="error")

    def snapshot() -> list[dict[str, Any]]:
        return collect(args.shm_dir, args.job, args.all, args.daemon_out)

    if args.json:
        sys.stdout.write(json.dumps({"time_unix": time.time(), "jobs": snapshot()}, indent=2) + "\n")
        return 0
    from rich.console import Console

    # to a pipe or file: nothing is cut to a terminal's 80 columns (rich's default when it cannot ask)
    console = Console() if sys.stdout.isatty() else Console(width=PIPE_WIDTH, soft_wrap=True)
    if not args.watch:
        console.print(render(snapshot(), args.shm_dir))
        return 0
    from rich.live import Live

    # a terminal tool owns Ctrl-C: started from a shell without job control (``cmd &``, some CI runners) it
    # inherits SIGINT ignored, or blocked, and would then never stop on it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not sys.stdout.isatty():  # no cursor to redraw in place: each refresh is printed whole, at once
        try:
            while True:
                console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
                console.print(render(snapshot(), args.shm_dir))
                sys.stdout.flush()
                time.sleep(args.interval)
        except (KeyboardInterrupt, BrokenPipeError):
            return 0
    try:
        with Live(render(snapshot(), args.shm_dir), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(snapshot(), args.shm_dir), refresh=True)
    except KeyboardInterrupt:
        return 0
