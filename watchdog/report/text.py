"""Text a person reads first: an incident verdict as a headline, evidence and a per-rank table."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..core.ranks import fmt_ranks
from ..core.schema import headline_of

NEXT_STEPS = {
    "hang": "Read the initiating rank's stack (stacks/rank-<g>.txt): it shows where it is stuck. "
    "The other ranks only wait for it.",
    "dead_rank": "Check the initiating rank's own log and the host (dmesg for OOM kills, XID errors).",
    "stopped_rank": "Something sent SIGSTOP (a debugger, a job scheduler suspend, Ctrl-Z): resume with "
    "SIGCONT or find the sender.",
    "collective_mismatch": "The ranks named called a different collective from the others at the same point: "
    "look for rank-dependent control flow around that call.",
    "comm_hang": "All ranks wait in the same collective: check the network/NCCL (NCCL_DEBUG=INFO, NCCL RAS) "
    "and the GPUs of the slowest node.",
    "unknown": "Inspect stacks/groups.txt: the minority stack is the first suspect.",
}


def int_ranks(values: Iterable[object]) -> list[int]:
    """The integer ranks of a list read from a document (anything else is dropped)."""
    return [int(r) for r in values if isinstance(r, int) and not isinstance(r, bool)]


def headline(v: Mapping[str, Any]) -> str:
    ranks = int_ranks(v.get("initiating_ranks") or [])
    who = fmt_ranks(ranks) if ranks else "no single rank"
    phase = v.get("phase")
    return (
        f"{headline_of(str(v.get('kind')))} — initiating {who}"
        + (f" in phase '{phase}'" if phase else "")
        + f" (confidence {v.get('confidence')})"
    )


def verdict_text(v: Mapping[str, Any]) -> str:
    ranks = v.get("initiating_ranks") or []
    lines = [
        f"rankwatch: {headline(v)}",
        f"job {v.get('job_id')} · incident {v.get('incident_id')} · detected {v.get('detected_after_s')}s after onset",
        "",
        f"why: {v.get('reason')}",
    ]
    evidence = v.get("evidence") or []
    if evidence:
        lines += ["", "evidence:"] + [f"  - {e}" for e in evidence]
    table = v.get("ranks") or {}
    if table:
        lines += [
            "",
            f"{'rank':>5} {'node':<14} {'pid':>8} {'state':<9} {'step':>6} {'phase':<12} {'in phase':>9}  top of stack",
        ]
        for key in sorted(table, key=lambda k: int(k)):
            r = table[key]
            mark = "*" if int(key) in ranks else " "
            top = (r.get("stack_top") or ["-"])[0]
            coll = r.get("collective")
            phase_txt = str(r.get("phase"))
            if coll and r.get("phase") == "collective":
                phase_txt = f"{coll.get('op')}#{coll.get('seq')}"
            lines.append(
                f"{mark}{key:>4} {str(r.get('node'))[:14]:<14} {r.get('pid'):>8} {r.get('state'):<9} "
                f"{r.get('step'):>6} {phase_txt[:12]:<12} {r.get('in_phase_s'):>8}s  {top}"
            )
    lines += ["", f"next: {NEXT_STEPS.get(str(v.get('kind')), NEXT_STEPS['unknown'])}"]
    return "\n".join(lines) + "\n"


def summary_text(doc: Mapping[str, Any]) -> str:
    """The end-of-run table: phase, median, worst, worst rank, skew; then the diagnosis and why."""
    st = doc.get("step_time_ms", {})
    lines = [
        f"rankwatch summary — job {doc.get('job_id')}, {doc.get('steps')} common steps, "
        f"{len(doc.get('ranks', {}))} ranks",
        "",
        f"{'phase':<14} {'median ms':>10} {'worst ms':>10} {'worst rank':>11} {'skew ms':>9}",
    ]
    for p, s in sorted(doc.get("phases", {}).items(), key=lambda kv: -kv[1].get("median_ms", 0.0)):
        lines.append(
            f"{p:<14} {s.get('median_ms', 0):>10.1f} {s.get('worst_ms', 0):>10.1f} {s.get('worst_rank', -1):>11} "
            f"{s.get('skew_ms', 0):>9.1f}"
        )
    lines.append(
        f"{'step':<14} {st.get('median', 0):>10.1f} {st.get('worst', 0):>10.1f} {st.get('worst_rank', -1):>11}"
    )
    label = doc.get("diagnosis")
    who = [r for r in doc.get("straggler_ranks") or [] if isinstance(r, int) and not isinstance(r, bool)]
    lines += [
        "",
        f"diagnosis: {label}"
        + (f" — {fmt_ranks(who)}" if who else "")
        + (f" in {doc.get('phase')}" if doc.get("phase") else ""),
        f"why: {doc.get('why', '')}",
    ]
    incidents = doc.get("incidents") or []
    if incidents:
        lines.append(f"incidents: {', '.join(incidents)}")
    return "\n".join(lines) + "\n"
