"""Text a person reads first: an incident verdict as a headline, evidence and a per-rank table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.ranks import fmt_ranks
from ..core.schema import headline_of
from ..core.text import NAME, PROSE, clean
from .stackfiles import read_rank_stack

NEXT_STEPS = {
    "hang": "Read the initiating rank's stack ({stack}): it shows where it is stuck. "
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


def int_ranks(values: object) -> list[int]:
    """The integer ranks of a list read from a document (anything else is dropped; not a list: none)."""
    if not isinstance(values, list | tuple):
        return []
    return [int(r) for r in values if isinstance(r, int) and not isinstance(r, bool)]


def headline(v: Mapping[str, Any]) -> str:
    ranks = int_ranks(v.get("initiating_ranks") or [])
    who = fmt_ranks(ranks) if ranks else "no single rank"
    phase = v.get("phase")
    return (
        f"{clean(headline_of(str(v.get('kind'))), NAME)} — initiating {who}"
        + (f" in phase '{clean(phase, NAME)}'" if phase else "")
        + f" (confidence {clean(v.get('confidence'), NAME)})"
    )


def next_step(v: Mapping[str, Any], bundle: str | None = None) -> str:
    """What to do next; the stack file named by its real path when the bundle is known."""
    ranks = int_ranks(v.get("initiating_ranks") or [])
    stack = "stacks/rank-<g>.txt in the bundle"
    if bundle and ranks:
        stack = read_rank_stack(bundle, ranks[0]).text_path or stack
    elif ranks:
        stack = f"stacks/rank-{ranks[0]}.txt in the bundle"
    return NEXT_STEPS.get(str(v.get("kind")), NEXT_STEPS["unknown"]).format(stack=stack)


def verdict_text(v: Mapping[str, Any], bundle: str | None = None) -> str:
    """Every value comes from a document (records, stacks, the store, a hand-edited file): each one is
    cleaned (``core.text``) and bounded, so no escape sequence or 10 MB field reaches a terminal.

    With the ``bundle`` dir, each rank's first frame of user code (from its full stack) is shown, and the
    next step names the initiating rank's stack file by its path."""
    ranks = int_ranks(v.get("initiating_ranks") or [])
    lines = [
        f"rankwatch: {headline(v)}",
        " · ".join(
            part
            for key, part in (
                ("job_id", f"job {clean(v.get('job_id'), NAME)}"),
                ("incident_id", f"incident {clean(v.get('incident_id'), NAME)}"),
                ("detected_after_s", f"detected {clean(v.get('detected_after_s'), NAME)}s after onset"),
            )
            if v.get(key) is not None
        )
        or "from logs (offline)",
        "",
        f"why: {clean(v.get('reason'), PROSE)}",
    ]
    evidence = v.get("evidence") or []
    if evidence and isinstance(evidence, list):
        lines += ["", "evidence:"] + [f"  - {clean(e, PROSE)}" for e in evidence]
    table = v.get("ranks") or {}
    fr_numbered = isinstance(v.get("flight_recorder"), dict)
    if table and isinstance(table, dict):
        lines += [
            "",
            f"{'rank':>5} {'node':<14} {'pid':>8} {'state':<9} {'step':>6} {'phase':<12} {'in phase':>9}  "
            + ("first frame of user code" if bundle else "top of stack"),
        ]
        for key in sorted(table, key=_rank_key):
            r = table[key] if isinstance(table[key], dict) else {}
            mark = "*" if _rank_key(key)[0] in ranks else " "
            stack = r.get("stack_top") if isinstance(r.get("stack_top"), list) else None
            top = clean(stack[0] if stack else "-")
            if bundle and _rank_key(key)[0] < 1 << 30:
                top = read_rank_stack(bundle, _rank_key(key)[0]).user_frame_text() or top
            coll = r.get("collective")
            phase_txt = clean(r.get("phase"), NAME)
            if isinstance(coll, dict) and r.get("phase") == "collective":
                # one numbering: where the flight recorder's sequence numbers are quoted, the hook's own
                # per-process call count (a different number for the same call) is left out
                seq = "" if fr_numbered else f"#{clean(coll.get('seq'), NAME)}"
                phase_txt = f"{clean(coll.get('op'), NAME)}{seq}"
            lines.append(
                f"{mark}{clean(key, 8):>4} {clean(r.get('node'), 14):<14} {clean(r.get('pid'), 12):>8} "
                f"{clean(r.get('state'), 16):<9} {clean(r.get('step'), 16):>6} {phase_txt[:12]:<12} "
                f"{clean(r.get('in_phase_s'), 16):>8}s  {top}"
            )
    lines += ["", f"next: {next_step(v, bundle)}"]
    return "\n".join(lines) + "\n"


def final_block(v: Mapping[str, Any], bundle: str | None) -> str:
    """The verdict as the last thing ``rankwatch run`` prints: headline, why, where the initiating rank
    stands in the user's code and the file with its whole stack, and the bundle."""
    ranks = int_ranks(v.get("initiating_ranks") or [])
    lines = [f"rankwatch: {headline(v)}", f"why: {clean(v.get('reason'), PROSE)}"]
    if ranks and bundle:
        st = read_rank_stack(bundle, ranks[0])
        frame = st.user_frame_text()
        if frame:  # a dead rank has no stack: its own log says where it failed
            stack = f" — whole stack: {st.text_path}" if st.text_path else ""
            lines.append(f"rank {ranks[0]} is at: {frame}{stack}")
    lines.append(
        f"bundle: {bundle}  (rankwatch report {bundle})"
        if bundle
        else "bundle: NOT WRITTEN (the disk refused it; the verdict is in the log)"
    )
    return "\n".join(lines) + "\n"


def _rank_key(key: object) -> tuple[int, str]:
    try:
        return int(str(key)), str(key)
    except ValueError:
        return 1 << 30, str(key)


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _ms(value: object) -> float:
    """A number from a document, 0 for anything else (hand-edited or hostile files)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return 0.0


def summary_text(doc: Mapping[str, Any], *, incidents: bool = True) -> str:
    """The end-of-run text: the run's incidents first (a hang outranks any straggler diagnosis), then the
    phase table (mean and median per step, worst, worst rank, skew), the diagnosis and why.

    Phase names and every other string are cleaned and bounded (``core.text``), as in ``verdict_text``."""
    st = _dict(doc.get("step_time_ms"))
    phases = _dict(doc.get("phases"))
    ranks_doc = doc.get("ranks")
    total = doc.get("steps_total")
    verdicts = [v for v in doc.get("incident_verdicts") or [] if isinstance(v, dict)]
    shown = verdicts[:8] if incidents else []  # rankwatch run prints its incidents after the summary
    lines = [f"rankwatch: {headline(v)}\n    why: {clean(v.get('reason'), PROSE)}" for v in shown]
    if incidents and len(verdicts) > 8:
        lines.append(f"… and {len(verdicts) - 8} more incident(s)")
    if lines:
        lines.append("")
    lines += [
        f"rankwatch summary — job {clean(doc.get('job_id'), NAME)}, "
        + (f"{clean(total, 24)} steps, " if total is not None else "")
        + f"the last {clean(doc.get('steps'), 24)} common steps compared, "
        f"{len(ranks_doc) if isinstance(ranks_doc, dict) else 0} ranks",
        "",
        f"{'phase':<14} {'mean ms':>9} {'median ms':>10} {'worst ms':>10} {'worst rank':>11} {'skew ms':>9}",
    ]
    rows = [(p, s) for p, s in phases.items() if isinstance(s, dict)]
    for p, s in sorted(rows, key=lambda kv: -_ms(kv[1].get("mean_ms", kv[1].get("median_ms")))):
        lines.append(
            f"{clean(p, NAME):<14} {_ms(s.get('mean_ms')):>9.1f} {_ms(s.get('median_ms')):>10.1f} "
            f"{_ms(s.get('worst_ms')):>10.1f} {clean(s.get('worst_rank', -1), 24):>11} {_ms(s.get('skew_ms')):>9.1f}"
        )
    lines.append(
        f"{'step':<14} {_ms(st.get('mean')):>9.1f} {_ms(st.get('median')):>10.1f} {_ms(st.get('worst')):>10.1f} "
        f"{clean(st.get('worst_rank', -1), 24):>11}"
    )
    label = doc.get("diagnosis")
    who = int_ranks(doc.get("straggler_ranks") or [])
    lines += [
        "",
        ("before the incident, " if verdicts else "")
        + f"diagnosis: {clean(label, NAME)}"
        + (f" — {fmt_ranks(who)}" if who else "")
        + (f" in {clean(doc.get('phase'), NAME)}" if doc.get("phase") else ""),
        f"why: {clean(doc.get('why', ''), PROSE)}",
    ]
    cause = doc.get("cause")
    if isinstance(cause, dict) and isinstance(cause.get("cause"), str):
        lines += [f"cause: {clean(cause['cause'], NAME)} — {clean(cause.get('text', ''), PROSE)}",
                  f"next: {clean(cause.get('next', ''), PROSE)}"]
    ids = doc.get("incidents") or []
    if incidents and ids and isinstance(ids, list):
        lines.append(f"incidents: {clean(', '.join(clean(i, NAME) for i in ids), PROSE)}")
    return "\n".join(lines) + "\n"
