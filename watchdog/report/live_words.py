"""The live verdict's findings and notes in words (reason and evidence lines), one phrase per shape, for
``report.findings.words``. The words are those the verdict document always carried; the rules
(``core.rules``, ``core.engine``) hand over only data, and ``verdict.stage`` writes these lines
into the document. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.engine import AFTER_KILL, WAIT_FOR, Finding
from ..core.facts import Rung
from ..core.live_facts import is_waiting
from ..core.phases import GRAD_SYNC, PHASE_FAMILY
from ..core.ranks import fmt_ranks, ranks_verb
from ..core.rules.names import THREAD_DIED
from ..core.snapshot import CRASHED, EXITED, MISSING, RUNNING, RankView

_PHASE_KIND = {p: f for p, f in PHASE_FAMILY.items() if p != GRAD_SYNC}  # grad_sync: not a stuck phase


def phase_kind(phase: str | None) -> str:
    """What a phase says about the cause, in the words an on-call engineer uses."""
    if phase in _PHASE_KIND:
        return _PHASE_KIND[phase or ""]
    if phase in (None, "idle"):
        return "between phases"
    return f"declared phase '{phase}'"


def _in(phase: str | None) -> str:
    """'compute (forward)': the kind of a phase and the phase."""
    return f"{phase_kind(phase)} ({phase or 'idle'})"


@dataclass
class LiveContext:
    """What live phrases quote besides a finding's data: every rank's view, and every rung's finding."""

    views: Sequence[RankView]
    found: Mapping[str, Finding | None] = field(default_factory=dict)
    # False where no record was read (``rankwatch inspect``): every step counter and phase timer is 0, and
    # "at step 0 for 0.0s" would say nothing
    steps_known: bool = True

    def __post_init__(self) -> None:
        self.by_rank = {v.rank: v for v in self.views}
        self.present = [v for v in self.views if v.state != MISSING]
        self.live = [v for v in self.present if v.state == RUNNING]

    def at_step(self, step: object, in_phase_s: float | None = None) -> str:
        """" at step N" (and " for S s" with ``in_phase_s``), or nothing where steps are unknown."""
        at = "" if not self.steps_known and not step else f" at step {step}"
        if in_phase_s is None or (not self.steps_known and not in_phase_s):
            return at
        return at + f" for {in_phase_s:.1f}s"


Phrase = Callable[[Finding, Mapping[str, Any], LiveContext], tuple[str, list[str]]]


def _coll_lines(c: LiveContext, *, waiting: bool = False) -> list[str]:
    out = []
    for v in c.live:
        line = f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op or ''}, phase {v.phase or 'idle'}"
        if waiting:
            line += f", {'waiting' if is_waiting(v) else 'not waiting'}"
        out.append(line)
    return out


def _finished_but_one(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    what = f"collective #{d['seq']} ({d['op']})" if d.get("op") else f"{d.get('phase')}"
    return (
        f"{ranks_verb(d['stuck'], 'is', 'are')} still in {what}{c.at_step(d.get('step'))} "
        f"after {fmt_ranks(d['finished'])} "
        "finished and exited normally: it issued what no other rank did",
        [f"rank {v.rank}: {v.state} at step {v.step}, phase {v.phase or 'idle'}" for v in c.present],
    )


def _same_failure(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    low, high = d.get("steps") or (0, 0)
    at = c.at_step(low) if low == high else f" at steps {low}–{high}"
    return (
        f"every rank ({len(c.present)}) exited with the same error ({d.get('cause')}){at}: a failure of the job "
        "itself (its code, data or environment), not of one rank",
        [f"{fmt_ranks(v.rank for v in c.present)} exited with: {d.get('cause')}",
         f"phase of rank {d.get('lead')}: {d.get('phase') or 'idle'}"],
    )


_HOW_GONE = {
    CRASHED: "exited with an error",
    EXITED: "left early — exited normally while its peers were still mid-step (uneven data: give every rank "
    "the same number of batches or wrap the loop in DDP's join(); or an early return)",
}


def _first_exit(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    roles, order = d.get("roles") or {}, list(d.get("exit_order") or ())
    cause = f" ({d['cause']})" if d.get("how") == CRASHED and d.get("cause") else ""
    others = len(order) - len(f.ranks)
    reason = (
        f"{fmt_ranks(f.ranks)} {_HOW_GONE.get(d.get('how') or '', 'died (killed, no normal-exit mark)')} first, in "
        f"{_in(d.get('phase'))}{c.at_step(d.get('step'))}{cause}"
        + (f"; {others} other rank(s) exited after it" if others > 0 else "")
    )
    lines = []
    for r in order:
        v = c.by_rank[r]
        why = f" ({v.exit_cause})" if v.state == CRASHED and v.exit_cause else ""
        lines.append(f"rank {v.rank} {v.state} {v.exit_age_s or 0.0:.2f}s ago in phase {v.phase or 'idle'} at step "
                     f"{v.step}{why}: {roles.get(r)}")
    if len(order) > 1:
        lines.append(f"exit order: {' → '.join(str(r) for r in order)}")
    if d.get("consequences_first"):
        lines.append(f"{fmt_ranks(d['consequences_first'])} ended with communication errors or were torn down after "
                     "a peer's failure: consequences, even where seen first")
    if d.get("unverified"):
        lines.append(f"{fmt_ranks(d['unverified'])} ended before rankwatch first saw its process: its exit time is "
                     "when rankwatch noticed, and who it was rests on its record alone")
    if d.get("all_consequences"):
        lines.append("every rank that ended reports a consequence (communication error): the cause may lie outside")
    if d.get("silent_in_collective"):
        lines.append(f"{fmt_ranks(f.ranks)} died without a word inside a collective: a receiver's abort ends the same "
                     "way (gloo's size check on a message a peer sent wrong, NCCL's watchdog after a timeout), so "
                     "its own console decides (a 'Received data size doesn't match' line names a mismatch)")
    return reason, lines


def _stopped(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    return (
        f"{ranks_verb(f.ranks, 'is', 'are')} stopped (SIGSTOP or a debugger) in phase {d.get('phase') or 'idle'}"
        f"{c.at_step(d.get('step'))}; the others wait for it",
        [f"rank {r} process state T (stopped)" for r in f.ranks],
    )


def _aborted(c: LiveContext) -> Finding | None:
    return c.found.get("exits_aborted")


def _odd_counts(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    counts = "; ".join(f"{fmt_ranks(rs)} at collective #{seq}" for seq, rs in sorted(d["counts"].items()))
    lines = live_words(ex, c)[1] if (ex := _aborted(c)) is not None else []
    lines.append(f"python-level collective counts: {counts}")
    fr = c.found.get("flight_recorder")
    if d.get("fr_mismatch_tie") and fr is not None:
        lines.append(f"the flight recorder agrees there is a mismatch but names nobody: {live_words(fr, c)[0]}")
    return (
        f"{fmt_ranks(f.ranks)} issued a different number of collectives than the others ({counts}); "
        f"{fmt_ranks(d['aborted_receivers'])} then died without an exit mark inside a collective — gloo aborts the "
        "rank that receives a mismatched collective",
        lines,
    )


def _fr_mismatch(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    variants: Mapping[str, Sequence[int]] = d["variants"]
    lines = [f"flight recorder: {fmt_ranks(rs)} entered collective #{d['seq']} as {desc}"
             for desc, rs in variants.items()]
    lines += [f"rank {v.rank}: python-level collective #{v.coll_seq} {v.coll_op or ''}" for v in c.live]
    if d.get("untraced"):
        lines.append(f"flight recorder: nothing of {fmt_ranks(d['untraced'])} at collective #{d['seq']} (no dump): "
                     "the majority is the likeliest, not a certainty")
    if d.get("aborted_receivers"):
        ex = _aborted(c)
        lines.append(
            f"{fmt_ranks(d['aborted_receivers'])} died without an exit mark inside a collective: gloo aborts a rank "
            f"that receives a mismatched collective — a consequence of the mismatch "
            f"({live_words(ex, c)[0] if ex is not None else 'its exit'})")
    at = f"at collective #{d['seq']} of process group {d['pg']}"
    if not f.ranks:
        return f"flight recorder shows a {d['mismatch']} mismatch {at}; no majority says which side is wrong", lines
    top = d["majority_op"]
    return (
        f"collective mismatch ({d['mismatch']}) {at}, seen in the flight recorder: {fmt_ranks(f.ranks)} entered it "
        f"as {'; '.join(x for x in variants if x != top)} while {fmt_ranks(variants[top])} entered it as {top}",
        lines,
    )


def fr_detail(detail: Sequence[Mapping[str, Any]]) -> str:
    """'rank 1 entered collective #5 of pg 0 while others entered #6 (all_reduce)', per rank behind."""
    parts = []
    for b in detail:
        parts.append(f"rank {b['rank']} entered collective #{b['seq']} of pg {b['pg']} while others entered "
                     f"#{b['top_seq']}" + (f" ({b['top_op']})" if b.get("top_op") else ""))
    return "; ".join(parts)


def _fr_behind(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    detail, covers = fr_detail(d["detail"]), f"flight recorder covers only {fmt_ranks(d.get('covers') or ())}"
    if d.get("shape") == "fr_behind_uncovered":
        behind = fmt_ranks(d["behind"])
        return (
            f"{behind} waits in a collective its peers got past ({detail}); the rank that never arrived is among "
            f"{fmt_ranks(d['uncovered'])}, which the flight recorder does not cover",
            [f"flight recorder: {detail}; {behind} still in flight (waiting)", covers],
        )
    if d.get("shape") == "fr_wait_cycle":
        behind = fmt_ranks(d["behind"])
        return (
            f"the flight recorder shows {behind} each behind in one process group and waiting in another for the "
            f"other ({detail}): a wait cycle across groups, as when one rank skips a collective of one group and "
            "goes on to the next; the recorder cannot tell which one skipped",
            [f"flight recorder: {detail}; {behind} wait for each other"],
        )
    others = d.get("others") or ()
    reason = (f"{ranks_verb(f.ranks, 'is', 'are')} behind in the flight recorder ({detail}); it is in "
              f"{_in(d.get('phase'))}{c.at_step(d.get('step'))}"
              + (f" while {ranks_verb(others, 'waits', 'wait')} for it" if others else ""))
    return reason, [f"flight recorder: {detail}", *([] if d.get("covered") else [covers])]


def _behind(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    if d.get("by") == "step":
        return (
            f"{ranks_verb(f.ranks, 'is', 'are')} stuck{c.at_step(d['low'])} in {_in(d.get('phase'))} "
            "while the others reached "
            f"step {d['high']}",
            [f"rank {v.rank}: step {v.step}, phase {v.phase or 'idle'}" for v in c.live],
        )
    return (
        f"{ranks_verb(f.ranks, 'is', 'are')} stuck in {_in(d.get('phase'))} "
        f"before collective #{d['high']} ({d.get('op')}) that "
        f"{fmt_ranks(d['ahead'])} already entered",
        _coll_lines(c),
    )


def _extra_collective(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    return (
        f"{fmt_ranks(f.ranks)} entered collective #{d['seq']} ({d.get('op')}) that {fmt_ranks(d['behind'])} never "
        f"issue: they wait in {', '.join(d['phases'])} (a collective Python-level counters do not see, such as "
        "DDP's gradient all-reduce) — a collective only some ranks call",
        _coll_lines(c),
    )


def _skipped(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    return (
        f"{fmt_ranks(f.ranks)} issued fewer Python-level collectives than the others (#{d['at']} against "
        f"#{d['seq']}) yet waits on its peers in {', '.join(d['phases'])}: it skipped collective #{d['seq']} "
        f"({d.get('op')}) that {fmt_ranks(d['ahead'])} wait in, and is inside one they never issue",
        _coll_lines(c, waiting=True),
    )


def _earliest(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    if d.get("shape") == "last_running":
        return (f"{fmt_ranks(f.ranks)} is the only rank still running, in {_in(d.get('phase'))}"
                f"{c.at_step(d.get('step'))}, while {fmt_ranks(d.get('exited', ()))} exited normally: the job "
                "cannot end before it does", [])
    if d.get("shape") == "only_live":
        return (f"{fmt_ranks(f.ranks)} is the only live rank, stuck in {_in(d.get('phase'))}{c.at_step(d.get('step'))} "
                "without waiting on a peer; no other rank's evidence to compare it with", [])
    if d.get("shape") == "shared_cause":
        return (f"every live rank ({fmt_ranks(f.ranks)}) is stuck in {_in(d.get('phase'))}{c.at_step(d.get('step'))}: "
                "a shared cause (filesystem, data service, host) rather than one rank", [])
    return (f"{ranks_verb(f.ranks, 'is', 'are')} stuck earliest in the step, "
            f"in {_in(d.get('phase'))}{c.at_step(d.get('step'))}",
            [f"rank {v.rank}: phase {v.phase or 'idle'}" for v in c.live])


def _thread_died(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    threads: Mapping[Any, str] = d.get("threads") or {}
    lines = [f"rank {r}: {text}" for r, text in sorted(threads.items(), key=lambda x: int(x[0]))]
    return (f"a helper thread of {fmt_ranks(f.ranks)} died with an exception ({'; '.join(lines)}): its training "
            f"loop waits for what that thread would have produced, in {_in(d.get('phase'))}"
            f"{c.at_step(d.get('step'))}", lines)


def _ops(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    ops: Mapping[str, Sequence[int]] = d["ops"]
    if d.get("shape") == "op_tie":
        listed = ", ".join(f"{op} on {fmt_ranks(rs)}" for op, rs in sorted(ops.items()))
        return f"collective #{d['seq']} differs across ranks ({listed}); no majority says which side is wrong", []
    top = d["majority_op"]
    odd = sorted(op for op in ops if op != top)
    desc = odd[0] if len(odd) == 1 else ", ".join(f"{op} ({fmt_ranks(ops[op])})" for op in odd)
    return (
        f"collective mismatch at collective #{d['seq']}: {fmt_ranks(f.ranks)} called {desc} while the others "
        f"({fmt_ranks(ops[top])}) called {top}",
        [f"rank {v.rank}: collective #{v.coll_seq} {v.coll_op}" for v in c.live],
    )


def _wrong_peer(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    """A cycle of send/recv waits whose one new edge is the named rank's (``core.rules.peers``)."""
    arrow = {"send": "sends to", "recv": "receives from"}

    def edge(e: Mapping[str, Any]) -> str:
        return f"rank {e['rank']} {arrow.get(e['op'], 'waits for')} rank {e['peer']}"

    known = d.get("known") or ()
    others = [e for e in d["cycle"] if e["rank"] not in f.ranks]
    lines = [f"{edge(e)}" + (" (a peer it never exchanged with before)" if e["rank"] in f.ranks else "")
             for e in d["cycle"]]
    return (
        f"{fmt_ranks(f.ranks)} waits in a {d['op']} with rank {d['peer']}, a peer it never exchanged a send or recv "
        f"with before (only with {fmt_ranks(known)}), while {ranks_verb([e['rank'] for e in others], 'waits', 'wait')}"
        " on peers they exchanged with before: a cycle of waits whose one new edge is its own — its schedule names "
        "the wrong peer",
        [f"send/recv wait cycle: {'; '.join(lines)}"],
    )


def _odd_stack(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    return (f"{ranks_verb(f.ranks, 'has', 'have')} a stack the other ranks do not share; no other evidence singles a "
            "rank out", [])


def _gpu(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    at = f"collective #{d.get('seq')} ({d.get('op')})"
    if not f.ranks:
        return (f"every rank is waiting in the same {at}: a communication hang (network, NCCL) with no single "
                "initiating rank", [])
    return (
        f"every rank is in {at} but {fmt_ranks(f.ranks)} shows no GPU activity while its peers spin in the "
        "collective kernel",
        [f"rank {v.rank}: gpu {v.gpu_util}%{' (missing from samples)' if v.gpu_missing else ''}" for v in c.live],
    )


def _unknown(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    if d.get("shape") == "no_answer":
        return (f"no evidence from {fmt_ranks(f.ranks)} (node {d.get('node')} did not answer); a node that never "
                "answers is the likeliest cause", [])
    return "no rule singled out a rank", []


_VIA = {
    Rung.FLIGHT_RECORDER: "the flight recorder (per process group: who has not entered what its peers wait in)",
    Rung.COUNTERS: "the hook's record (who has not entered the collective its peers wait in; the peer of a send/recv)",
    Rung.WAITING: "waiting states (ranks blocked on peers whose peer is not named)",
    Rung.STACKS: "stacks blocked in a wait",
    Rung.EXIT_CAUSE: "exits that are consequences (timeouts, lost peers)",
}


def _wait_for_reason(f: Finding, d: Mapping[str, Any], c: LiveContext) -> str:
    who, waiters = fmt_ranks(f.ranks), d.get("waiters", ())
    wait = ranks_verb(waiters, "waits", "wait")
    if f.kind == "comm_hang":
        nodes = ", ".join(d.get("silent_nodes") or ()) or "unknown"
        return (f"every rank that answered waits for {who}, on node(s) {nodes} that never answered: {who} are the "
                "likeliest cause")
    if f.kind == "stopped_rank":
        return f"{ranks_verb(f.ranks, 'is', 'are')} stopped (SIGSTOP or a debugger); {wait} for it"
    if f.kind == "dead_rank" and d.get("silent_nodes"):
        return (f"{who} on node(s) {', '.join(d['silent_nodes'])} never answered and "
                f"{fmt_ranks(d.get('peer_ended', ()))} lost the connection to them (closed or reset by peer): their "
                f"processes are gone; {wait} for them")
    if f.kind == "dead_rank":
        return f"{ranks_verb(f.ranks, 'ended', 'ended')} by its own cause; {wait} for it"
    lead = c.by_rank.get(f.ranks[0]) if f.ranks else None
    where = f" in {_in(lead.phase)}{c.at_step(lead.step, lead.in_phase_s)}" if lead is not None else ""
    died = c.found.get(THREAD_DIED)
    cause = ""
    if died is not None and set(died.ranks) == set(f.ranks):  # the cause the sinks' own state does not show
        cause = "; its helper thread died: " + "; ".join(str(t) for t in (died.data.get("threads") or {}).values())
    return f"{ranks_verb(f.ranks, 'waits', 'wait')} for nobody{where} while {wait} for it{cause}"


def _engine(f: Finding, d: Mapping[str, Any], c: LiveContext) -> tuple[str, list[str]]:
    """The engine's findings: the wait-for graph's sinks, and exits that follow rankwatch's own kill."""
    if f.rule == AFTER_KILL:
        return (f"{fmt_ranks(d.get('ended', ()))} ended after rankwatch killed the job for incident "
                f"{d.get('follows_incident')}: consequences of that kill, not a new failure; the initiator stays "
                f"{fmt_ranks(f.ranks)}", [])
    edge = d.get("edge_strength", Rung.WAITING)
    lines = [f"wait-for graph: {len(d.get('waiters', ()))} rank(s) wait; the sink(s) {fmt_ranks(f.ranks)} wait for "
             f"nobody (edges from {_VIA.get(edge, str(edge))})"]
    if anyone := d.get("via_anyone"):
        lines.append(f"{fmt_ranks(anyone)} cannot say whom they wait for (send/recv peer or timeout unknown)")
    return _wait_for_reason(f, d, c), lines


_LIVE: dict[str, Phrase] = {
    "finished_but_one": _finished_but_one, "same_failure": _same_failure, "first_exit": _first_exit,
    "stopped": _stopped, "abort_with_odd_counts": _odd_counts, "fr_mismatch": _fr_mismatch,
    "fr_mismatch_tie": _fr_mismatch, "fr_behind": _fr_behind, "fr_behind_uncovered": _fr_behind,
    "fr_wait_cycle": _fr_behind,
    "behind": _behind, "extra_collective": _extra_collective, "skipped_collective": _skipped,
    "earliest_in_step": _earliest, "shared_cause": _earliest, "last_running": _earliest,
    "only_live": _earliest,
    "thread_died": _thread_died, "op_tie": _ops, "odd_op": _ops, "wrong_peer": _wrong_peer,
    "odd_stack": _odd_stack, "no_gpu": _gpu, "same_collective": _gpu, "no_answer": _unknown, "nothing": _unknown,
}


def live_words(f: Finding, c: LiveContext) -> tuple[str, list[str]]:
    """A live finding's reason and its own evidence lines."""
    if f.rule in (WAIT_FOR, AFTER_KILL) and "shape" not in f.data:
        return _engine(f, f.data, c)
    return _LIVE.get(f.data.get("shape", ""), _unknown)(f, f.data, c)


def _rung(name: str) -> str:
    return name.replace("_", " ")


def _weighed(d: Mapping[str, Any], c: LiveContext) -> str:
    rung, names = _rung(d["rung"]), fmt_ranks(d["ranks"])
    how = d["how"]
    if how == "named_waiters":
        return (f"{rung} (weaker evidence) names {names}: {fmt_ranks(d['waiters'])} wait(s) for a named peer in the "
                "graph above")
    other = c.found.get(d["rung"])
    why = live_words(other, c)[0] if other is not None else ""
    if how == "agrees":
        return f"{rung} agrees: {why}"
    if how == "instead":
        return f"{rung} (weaker evidence) names {names} instead: {why}"
    if how == "consequence":
        return f"{rung} (weaker evidence) names {names}: an end the stronger evidence above explains as its consequence"
    return f"{rung} (weaker evidence) names {names}, a majority: explained by the stronger evidence above"


def _pct(v: RankView) -> str:
    return "missing from NVML samples" if v.gpu_missing else f"{v.gpu_util:.0f} %"


def note_words(note: tuple[str, Mapping[str, Any]], c: LiveContext) -> str:
    """One note of the verdict (``core.verdict.Verdict.notes``) as its evidence line."""
    what, d = note
    if what == "weighed":
        return _weighed(d, c)
    if what == "weak_majority":
        return (f"naming {d['named']} of {d['of']} ranks on {_rung(d['rung'])} evidence alone: a majority is only "
                "blamed on strong evidence (an exit, a stop, the flight recorder)")
    if what == "gpu_agrees":
        chosen = ", ".join(f"rank {r} {_pct(c.by_rank[r])}" for r in d["chosen"])
        return (f"GPU agrees: {chosen} (no kernel running: a CPU-side stall) while {fmt_ranks(d['read'])} read "
                f"≥{d['busy_pct']:.0f} % (spinning in the collective kernel)")
    if what == "gpu_singles_nobody_out":
        return (f"GPU singles nobody out: every rank reads ≥{d['busy_pct']:.0f} % (ranks spinning in a collective "
                "kernel and a rank stuck inside a kernel look alike)")
    if what == "gpu_disagrees":
        return f"GPU does not back this: {fmt_ranks(d['chosen'])} busy on the GPU while {fmt_ranks(d['idle'])} idle"
    if what == "stacks_agree":
        return f"stack grouping agrees: {ranks_verb(d['ranks'], 'has', 'have')} a stack no other rank shares"
    if what == "stacks_disagree":
        return f"stack grouping disagrees: {fmt_ranks(d['ranks'])} share the majority stack"
    if what == "missing":
        return f"missing evidence from {fmt_ranks(d['ranks'])}"
    return what
