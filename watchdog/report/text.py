"""Text a person reads first: an incident verdict as a headline, evidence and a per-rank table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_HEADLINES = {
    "hang": "HANG",
    "dead_rank": "DEAD RANK",
    "stopped_rank": "STOPPED RANK",
    "collective_mismatch": "COLLECTIVE MISMATCH",
    "comm_hang": "COMMUNICATION HANG",
    "unknown": "STALL (cause unknown)",
}

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


def headline(v: Mapping[str, Any]) -> str:
    ranks = v.get("initiating_ranks") or []
    who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) if ranks else "no single rank"
    phase = v.get("phase")
    return (
        f"{_HEADLINES.get(str(v.get('kind')), str(v.get('kind')).upper())} — initiating {who}"
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
