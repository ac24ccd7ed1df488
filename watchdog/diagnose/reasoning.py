"""Evidence from logs → who started it. A pure function; rules strongest first (DESIGN.md, adapted to
what logs can show):

1. A rank that failed by itself (CUDA error or OOM, ECC/Xid, host OOM kill, a non-communication Python
   exception, or a death by signal that torchrun did not send and that no peer error explains) is the
   initiator, earliest first. The others' timeouts and "connection closed by peer" are downstream.
   A SIGABRT is NCCL's watchdog aborting its process after a timeout (``core.failures.abort_role``):
   a consequence when the rank's own lines show the watchdog, or when it aborted together with peers
   whose watchdog fired; only an abort with neither is a candidate. A SIGABRT next to a gloo size
   enforcement that no rank prefix claims (``std::terminate`` prints it unprefixed) is gloo's abort of
   the receiving rank: a mismatch (rule 2), not a crash.
   torchrun's "Root Cause (first observed failure)" is only the first exit it *noticed*; it often
   names a rank that was merely waiting, so it is never taken on its own word when better evidence
   exists.
2. Collective mismatch: same sequence number with different ops (NCCL watchdog, c10d DETAIL
   fingerprints) or tracebacks stuck in different collectives: every rank outside the strictly largest
   group is named (``core.ranks.outside_majority``, the rule the live verdict and the FR use). A gloo size
   enforcement names only the rank that *noticed*; the sender stays unknown unless 1 decides.
3. A lone collective: ranks that timed out in a collective while the majority was in none (finished
   the run, or — told by the store — had completed every NCCL work it enqueued) entered a collective
   nobody else issued (an extra / rank-conditional collective, one more batch). If those others are
   known to have reached that collective's number, the lone ranks arrived late instead (behind, low
   confidence). The other way round — a minority finished while the majority timed out — the minority
   left early (uneven data, an early return). A rank missing from its agent's failure report had
   exited 0 (``facts.Collector._absent_workers``); it left early when every other rank ended badly.
4. Behind: the rank(s) whose last enqueued collective is lower than the others'.
5. Outside: ranks that did not wait themselves (printed no timeout or lost peer; only being *told* by the
   store that a peer timed out does not count) while a majority waited never entered the collective.
6. Everyone waiting in the same collective: communication hang, no initiator from logs alone.

"Waited" is own evidence: a timeout, a lost peer, a DUMP_SIGNAL "from this local rank", or another
rank's "dump signal … from rank N" about N. "Observed flight recorder dump signal from another rank" and
"… from rank N" say the *printing* rank was told, not that it timed out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core import engine
from ..core.failures import INITIATING, abort_role
from ..core.policy import OfflinePolicy
from ..core.ranks import behind as ranks_behind
from ..core.ranks import first_by_time, fmt_ranks, majority, outside_majority
from ..core.schema import VERDICT_SCHEMA
from . import events as ev
from . import log_facts
from .facts import Evidence, RankFacts

__all__ = ["DEFAULT_POLICY", "Diagnosis", "Policy", "diagnose_evidence", "fmt_ranks", "quote"]

Policy = OfflinePolicy  # the thresholds live in core.policy with the others; the old name stays
DEFAULT_POLICY = OfflinePolicy()


@dataclass
class Diagnosis:
    kind: str
    initiating_ranks: list[int]
    confidence: str
    reason: str
    next_action: str
    phase: str | None = None
    evidence: list[str] = field(default_factory=list)
    others: dict[int, str] = field(default_factory=dict)  # what every other rank was doing
    decided: bool = True
    would_decide: str = ""  # when undecided: what evidence would decide
    notes: list[str] = field(default_factory=list)
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)
    rule: str = "none"  # which rule decided (the document's ``finding``)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": VERDICT_SCHEMA,
            "job_id": None,
            "incident_id": None,
            "kind": self.kind,
            "initiating_ranks": self.initiating_ranks,
            "phase": self.phase,
            "confidence": self.confidence,
            "reason": self.reason,
            "detected_after_s": None,
            "ranks": self.ranks,
            "evidence": self.evidence,
            "source": "logs",
            "decided": self.decided,
            "next_action": self.next_action,
            "would_decide": self.would_decide or None,
            "notes": self.notes,
            "finding": {"rule": self.rule, "ranks": list(self.initiating_ranks), "data": {"decided": self.decided}},
        }


# -- helpers -----------------------------------------------------------------------------------------
def quote(e: ev.Event) -> str:
    if e.family == ev.RANK_SEEN:
        return f"{e.file}:0: (this rank's own log is empty of errors)"
    return f"{e.file}:{e.line}: {e.text}"


def _waited(f: RankFacts) -> bool:
    """It waited on a peer itself and gave up: its own timeout, lost peer, mismatch (or a peer says so)."""
    return f.has(ev.WAITED) or f.has(ev.MISMATCH) or f.own_dump


def _signalled(f: RankFacts) -> bool:
    """Only told by the store that a peer timed out (it did not time out itself)."""
    return f.told is not None and not _waited(f)


def _in_collective(f: RankFacts) -> bool:
    """Its NCCL status shows work enqueued and not completed."""
    s = f.status
    return s is not None and s.enqueued is not None and s.completed is not None and s.enqueued > s.completed


def _idle(f: RankFacts) -> bool:
    """Told a peer timed out, with every NCCL work it enqueued completed: it was in no collective."""
    s = f.status
    return _signalled(f) and s is not None and s.enqueued is not None and s.enqueued == s.completed


def _is_waiting(f: RankFacts) -> bool:
    return _waited(f) or _signalled(f)


def _finished(f: RankFacts) -> bool:
    """Reached its normal end and nothing of its own went wrong."""
    if f.finished is None or f.has(ev.PRIMARY) or _is_waiting(f):
        return False
    return f.exit is None or f.exit.exitcode == 0 or f.exit.signal == "SIGTERM"


def _ended_nonzero(f: RankFacts) -> bool:
    return f.exit is not None and (f.exit.signal is not None or (f.exit.exitcode or 0) != 0)


def _last_seq(f: RankFacts) -> int | None:
    """The highest collective number the rank is known to have entered."""
    vals = [v for v in (f.status.enqueued if f.status else None, f.nccl_timeout.seq if f.nccl_timeout else None)
            if v is not None]
    return max(vals) if vals else None


def _last_pg(f: RankFacts) -> str | None:
    """The group ``_last_seq`` counts in, when its lines say."""
    return (f.status.pg if f.status else None) or (f.nccl_timeout.pg if f.nccl_timeout else None)


def _aborted_with_timed_out_peers(logs: Evidence, f: RankFacts, p: Policy) -> bool:
    """Another rank whose NCCL watchdog fired aborted too, at the same time (when both times are known)."""
    me = f.exit.ts if f.exit is not None else None
    for o in logs.ranks.values():
        if o is f or o.exit is None or o.exit.signal != "SIGABRT" or not o.has(ev.WATCHDOG):
            continue
        if me is None or o.exit.ts is None or abs(o.exit.ts - me) <= p.tie_s:
            return True
    return False


def _unowned_size_mismatch(logs: Evidence) -> ev.Event | None:
    """A gloo size enforcement that no rank prefix claims. Gloo raises it in its own thread as a C++
    ``EnforceNotMet`` that nothing catches: ``std::terminate`` prints it without torchrun's or torch's
    ``[rankN]:`` prefix and the process dies by SIGABRT, so it belongs to a rank that died by SIGABRT."""
    return next((e for e in logs.unattributed if e.family == ev.SIZE_MISMATCH), None)


def _enforce_aborted(logs: Evidence | None, f: RankFacts) -> bool:
    """Died by SIGABRT while the log holds an unclaimed gloo size enforcement: gloo's abort of a
    mismatched collective on the receiving rank, a consequence of the mismatch, not its own crash."""
    return (
        logs is not None
        and f.exit is not None
        and f.exit.signal == "SIGABRT"
        and not f.has(ev.PRIMARY)
        and _unowned_size_mismatch(logs) is not None
    )


def _unexplained_death(f: RankFacts, p: Policy, logs: Evidence | None = None) -> bool:
    """Died by a fatal signal nobody sent, with no peer trouble of its own to explain it. A SIGABRT is
    judged by ``core.failures.abort_role``: NCCL's watchdog aborts after a timeout, gloo after a size
    enforcement."""
    if f.exit is None or f.exit.signal not in p.fatal_signals or f.agent_terminated:
        return False
    if f.exit.signal == "SIGABRT":
        own = f.has(ev.WATCHDOG) or _is_waiting(f) or f.has(ev.MISMATCH) or _enforce_aborted(logs, f)
        peers = logs is not None and _aborted_with_timed_out_peers(logs, f, p)
        return abort_role(own, peers) == INITIATING
    return not _is_waiting(f)


def _is_primary(f: RankFacts, p: Policy, logs: Evidence | None = None) -> bool:
    return f.has(ev.PRIMARY) or _unexplained_death(f, p, logs)


def _primary_events(f: RankFacts, p: Policy) -> list[ev.Event]:
    out = f.firsts(ev.PRIMARY)
    if f.exit is not None and (not out or f.exit.signal in p.fatal_signals):
        out.append(f.exit)
    return out


def _first_ts(events: list[ev.Event]) -> float | None:
    ts = [e.ts for e in events if e.ts is not None]
    return min(ts) if ts else None


def _activity(f: RankFacts) -> str:
    """One line: what this rank was doing / how it ended, from its own messages."""
    parts: list[str] = []
    for fam, what in (
        (ev.NCCL_TIMEOUT, "NCCL watchdog timeout"),
        (ev.GLOO_TIMEOUT, "gloo timeout"),
        (ev.PEER_LOST, "lost its peer"),
        (ev.TIMEOUT_REPORTED, "timed out"),
        (ev.DUMP_SIGNAL, "told to dump by another rank"),
        (ev.HEARTBEAT, "heartbeat monitor abort"),
        (ev.WATCHDOG_ABORT, "taken down by its NCCL watchdog"),
        (ev.SIZE_MISMATCH, "received a wrong-sized message"),
        (ev.OP_MISMATCH, "collective fingerprint mismatch"),
        (ev.COMM_ERROR, "communication error"),
        (ev.CUDA_ERROR, "CUDA error"),
        (ev.CUDA_OOM, "CUDA out of memory"),
        (ev.HW_FAULT, "GPU hardware fault"),
        (ev.HOST_OOM, "killed by the OOM killer"),
        (ev.PY_ERROR, "Python exception"),
        (ev.FINISHED, "finished"),
    ):
        e = f.first.get(fam)
        if e is None:
            continue
        extra = ""
        if fam == ev.DUMP_SIGNAL:
            if f.told is None:
                what = "its own watchdog signalled a flight-recorder dump"
            else:
                what = f"told that {f.told.detail} timed out (not its own timeout)"
        elif fam == ev.NCCL_TIMEOUT and e.seq is not None:
            extra = f" in {e.op} #{e.seq}"
        elif e.detail and fam != ev.FINISHED:
            extra = f" ({e.detail[:80]})"
        parts.append(what + extra)
    if f.status is not None and f.status.enqueued is not None:
        parts.append(f"last enqueued #{f.status.enqueued}, completed #{f.status.completed}")
    tb = f.traceback
    if tb is not None and (tb.op or tb.detail):
        where = tb.op or tb.phase or "?"
        parts.append(f"stack in {where}" + (f" at {tb.detail}" if tb.detail else ""))
    if f.exit is not None:
        how = f.exit.signal or f"exit code {f.exit.exitcode}"
        by = " from torchrun" if f.agent_terminated and f.exit.signal == "SIGTERM" else ""
        parts.append(f"ended by {how}{by}")
    return "; ".join(parts) if parts else "no messages from this rank"


def _rank_doc(f: RankFacts) -> dict[str, Any]:
    e = f.exit
    state = "unknown"
    if f.has(ev.PRIMARY):
        state = "failed"
    elif _is_waiting(f):
        state = "waiting"
    elif _finished(f):
        state = "exited"
    if e is not None and e.signal:
        state = "killed" if e.signal in ("SIGKILL", "SIGTERM") else "crashed"
    elif e is not None and e.exitcode is not None:
        state = "exited"
    coll = None
    if f.nccl_timeout is not None:
        coll = {"seq": f.nccl_timeout.seq, "op": f.nccl_timeout.op}
    elif f.traceback is not None and f.traceback.op:
        coll = {"seq": None, "op": f.traceback.op}
    host = next((x.host for x in f.first.values() if x.host), None)
    pid = e.pid if e is not None else None
    return {
        "node": host,
        "pid": pid,
        "state": state,
        "step": None,
        "phase": f.traceback.phase if f.traceback is not None else None,
        "in_phase_s": None,
        "collective": coll,
        "gpu_util": None,
        "stack_top": [f.traceback.detail] if f.traceback is not None and f.traceback.detail else [],
    }


# -- the rules -----------------------------------------------------------------------------------------
def diagnose_evidence(logs: Evidence, p: Policy = DEFAULT_POLICY) -> Diagnosis:
    known = sorted(logs.ranks)
    facts = logs.ranks
    rules: tuple[tuple[str, Callable[[], Diagnosis | None]], ...] = (
        ("rankwatch_verdict", lambda: _rule_rankwatch(logs)),
        ("exit_cause", lambda: _rule_primary(logs, known, p)),
        ("mismatch", lambda: _rule_mismatch(logs, known)),
        ("wait_for", lambda: _rule_waited_for(logs)),
        ("lone_collective", lambda: _rule_lone_collective(logs, known)),
        ("behind", lambda: _rule_behind(logs, known, p)),
        ("outside", lambda: _rule_outside(logs, known, p)),
        ("same_collective", lambda: _rule_same_collective(logs, known)),
        ("report_only", lambda: _rule_report_only(logs, known)),
    )
    d = None
    for name, rule in rules:
        d = rule()
        if d is not None:
            d.rule = name
            break
    if d is None:
        d = _nothing(logs, known)
    d.ranks = {str(r): _rank_doc(facts[r]) for r in known}
    d.others = {r: _activity(facts[r]) for r in known if r not in d.initiating_ranks}
    # back the verdict with each initiator's own lines, then a few from the others
    quoted: list[str] = list(d.evidence)
    for r in d.initiating_ranks + [r for r in known if r not in d.initiating_ranks]:
        f = facts.get(r)
        if f is None:
            continue
        told = [e for e in f.first.values() if e.family != ev.RANK_SEEN]
        mine = sorted(told, key=lambda e: (e.file, e.line))
        if r not in d.initiating_ranks:
            # one line per other rank: what it waited on, else whatever it said
            mine = [e for e in mine if e.family in ev.WAITING | ev.MISMATCH][:1] or mine[:1]
        silent = [e for e in f.first.values() if e.family == ev.RANK_SEEN and e.detail == "path"]
        if silent and not any(e.file == silent[0].file for e in told):
            mine.append(silent[0])  # its own log exists and says nothing: evidence of absence
        for e in mine[: p.evidence_per_rank]:
            q = quote(e)
            if q not in quoted:
                quoted.append(q)
    for e in logs.unattributed[:3]:
        quoted.append(quote(e))
    d.evidence = quoted[: p.max_evidence]
    root = [r for r in known if facts[r].exit is not None and facts[r].exit.root_cause]  # type: ignore[union-attr]
    if root and d.initiating_ranks and not set(root) & set(d.initiating_ranks):
        d.notes.append(
            f"torchrun's 'Root Cause (first observed failure)' names {fmt_ranks(root)}: that is only the "
            "first exit torchrun noticed, and that rank was a victim, not the cause."
        )
    if logs.local_only:
        d.notes.append(
            "some ranks are named by local rank only (per-rank log paths or [defaultN] prefixes, no "
            "failure report to map them): they equal global ranks only on a single-node job."
        )
    if logs.slurm_cancel is not None:
        d.notes.append(f"Slurm: {logs.slurm_cancel.detail} ({quote(logs.slurm_cancel)})")
    if logs.dump_paths:
        d.notes.append("flight-recorder dumps were written to: " + ", ".join(logs.dump_paths[:4]))
    return d


def _rule_rankwatch(logs: Evidence) -> Diagnosis | None:
    """rankwatch's own verdict line in the log (``rankwatch run``'s console): it saw stacks, records and the
    flight recorder that the log does not hold, so its first verdict is the answer."""
    lines = [e for f in logs.ranks.values() if (e := f.first.get(ev.RANKWATCH)) is not None]
    lines += [e for e in logs.unattributed if e.family == ev.RANKWATCH]
    if not lines:
        return None
    first = min(lines, key=lambda e: (e.file, e.line))
    named = sorted({e.rank for e in lines if e.rank is not None and (e.file, e.line) == (first.file, first.line)})
    kind, confidence, phase = [*first.detail.split("|"), "", "", ""][:3]
    return Diagnosis(
        kind=kind or "unknown",
        initiating_ranks=named,
        confidence=confidence if confidence in ("high", "medium", "low") else "low",
        phase=phase or None,
        decided=bool(named),
        reason=f"rankwatch's own verdict, printed in this log: {first.text}",
        next_action="read that incident's bundle (rankwatch report DIR/incidents/<id>): it holds the stacks and "
        "the flight-recorder analysis the verdict rests on",
        evidence=[quote(first)],
    )


def _rule_waited_for(logs: Evidence) -> Diagnosis | None:
    """The sinks of the wait-for graph the lines describe (``diagnose.log_facts``): the ranks PyTorch's
    desync report names as lagging, else the ranks whose NCCL op count is behind their communicator's."""
    graphs = (
        (log_facts.DESYNC, log_facts.desync_facts(logs)),
        (log_facts.NCCL_OPS, log_facts.op_count_facts(logs)),
        (log_facts.STORE_KEYS, log_facts.store_key_facts(logs)),
    )
    for rule, facts in graphs:
        if facts is None:
            continue
        found = engine.blame(facts)
        if found is None or not found.ranks:
            continue
        who = fmt_ranks(found.ranks)
        lead = logs.ranks.get(found.ranks[0])
        line = (lead.first.get(ev.DESYNC) or next(iter(lead.ops.values()), None)) if lead is not None else None
        if rule == log_facts.DESYNC:
            reason = (f"PyTorch's desync report names {who} as the lagging rank(s)"
                      f" ({line.detail if line else 'lagging'}): every other rank waited for it")
        elif rule == log_facts.STORE_KEYS:
            line = next((e for e in logs.unattributed if "keys: " in e.text), line)
            reason = (f"{who} never published its rendezvous key: the other ranks' start-up store waits timed out "
                      f"on it ({line.text.strip() if line else 'DistStoreError'}), so it never reached "
                      "init_process_group")
        else:
            reason = (f"{who} enqueued fewer NCCL operations than its communicator's other members "
                      "(NCCL INFO opCount): they waited for it")
        return Diagnosis(
            kind="hang",
            initiating_ranks=list(found.ranks),
            # the desync report is torch's own analysis of every rank's trace in the store
            confidence="high" if rule == log_facts.DESYNC and found.confidence != "low" else "medium",
            phase="collective" if line is not None and "joined" in line.detail else None,
            reason=reason,
            next_action=(
                f"find what {who} was doing instead of the next collective: a stack during the hang (rankwatch run "
                "captures it), data loading / I/O / rank-specific work"
            ),
            evidence=[quote(line)] if line is not None else [],
            notes=[f"decided by the wait-for graph ({rule})"],
        )
    return None


def _rule_primary(logs: Evidence, known: list[int], p: Policy) -> Diagnosis | None:
    prim = [r for r in known if _is_primary(logs.ranks[r], p, logs)]
    if not prim:
        return None
    waiting = [r for r in known if _is_waiting(logs.ranks[r]) and r not in prim]
    evs = {r: _primary_events(logs.ranks[r], p) for r in prim}
    if len(prim) == len(known) and len(known) > 1 and not waiting:
        kinds = Counter(_failure_label(logs.ranks[r], evs[r]) for r in prim)
        label, _ = kinds.most_common(1)[0]
        return Diagnosis(
            kind="unknown",
            initiating_ranks=[],
            confidence="low",
            decided=False,
            reason=(
                f"every rank ({fmt_ranks(prim)}) failed the same way ({label}) with nothing that orders "
                "them: a cause common to all ranks (environment, launcher option, shared code path), "
                "not one rank holding the others back"
            ),
            next_action=(
                "reproduce with one rank (or world size 2) to see the crash itself; enable "
                "faulthandler (PYTHONFAULTHANDLER=1) and core dumps so a native crash leaves a stack"
            ),
            would_decide="per-rank stderr with the crash message or a faulthandler stack from each rank",
            evidence=[quote(evs[r][0]) for r in prim[:4] if evs[r]],
        )
    first = prim
    ts = {r: _first_ts(evs[r]) for r in prim}
    if len(prim) > 1 and all(t is not None for t in ts.values()):
        first = sorted(first_by_time(prim, key=lambda r: ts[r] or 0.0, tolerance=p.tie_s))
    lead = logs.ranks[first[0]]
    lead_events = evs[first[0]]
    label = _failure_label(lead, lead_events)
    conf = "high" if (lead.has(ev.PRIMARY) or waiting) and len(first) == 1 else "medium"
    reason = f"{fmt_ranks(first)} failed first: {label}"
    if waiting:
        reason += f"; {fmt_ranks(waiting)} then waited on it (timeouts / lost peer) — downstream"
    bare_abort = not waiting and not lead.has(ev.PRIMARY) and lead.exit is not None and lead.exit.signal == "SIGABRT"
    if bare_abort:
        # its own abort and NCCL's watchdog abort after a timed-out collective (a consequence) end alike
        conf = "low"
        reason += (": a SIGABRT with no message of its own — the rank's own abort and ProcessGroupNCCL's "
                   "watchdog abort after a timed-out collective end the same way")
    phase = next((e.phase for e in lead_events if e.phase), None)
    if phase is None and lead.traceback is not None:
        phase = lead.traceback.phase
    return Diagnosis(
        kind="dead_rank",
        initiating_ranks=first,
        confidence=conf,
        reason=reason,
        next_action=_primary_action(lead, lead_events, first),
        phase=phase,
        evidence=[quote(e) for e in lead_events[:3]],
        decided=not bare_abort,
        would_decide="the rank's own stderr (a watchdog timeout line, or its own crash message)" if bare_abort else "",
    )


def _failure_label(f: RankFacts, events: list[ev.Event]) -> str:
    for e in events:
        if e.family == ev.CUDA_OOM:
            return "CUDA out of memory"
        if e.family == ev.CUDA_ERROR:
            return f"CUDA error: {e.detail}" if e.detail else "CUDA error"
        if e.family == ev.HW_FAULT:
            return f"GPU hardware fault ({e.detail})"
        if e.family == ev.HOST_OOM:
            return "killed by the host OOM killer"
        if e.family == ev.PY_ERROR:
            return f"Python exception {e.detail[:120]}"
    if f.exit is not None and f.exit.signal:
        return f"died by {f.exit.signal} that torchrun did not send"
    return "failed"


def _primary_action(f: RankFacts, events: list[ev.Event], ranks: list[int]) -> str:
    who = fmt_ranks(ranks)
    fams = {e.family for e in events}
    host = next((e.host for e in f.first.values() if e.host), None)
    on = f" on {host}" if host else ""
    if ev.HW_FAULT in fams:
        return (
            f"take the GPU of {who}{on} out of service and check it (nvidia-smi -q -d ECC, dcgmi diag, "
            "dmesg for Xid); restart the job on other hardware — the other ranks' timeouts are consequences"
        )
    if ev.CUDA_OOM in fams:
        return (
            f"{who} ran out of GPU memory: lower its memory use (batch/sequence length, activation "
            "checkpointing) and check for uneven work across ranks; the other ranks only timed out"
        )
    if ev.CUDA_ERROR in fams:
        return (
            f"debug the kernel failure on {who}: rerun with CUDA_LAUNCH_BLOCKING=1 (and "
            "compute-sanitizer) to find the faulting op; the other ranks only waited for it"
        )
    if ev.HOST_OOM in fams:
        return (
            f"{who} was killed for host RAM{on}: reduce DataLoader workers / prefetch / pinned memory, or "
            "request more memory; check dmesg / the Slurm step's memory limit"
        )
    if ev.PY_ERROR in fams:
        loc = next((e.where for e in events if e.family == ev.PY_ERROR), "")
        return f"fix the exception on {who} (traceback ending at {loc}); the other ranks failed because it left"
    sig = f.exit.signal if f.exit is not None else None
    if sig == "SIGKILL":
        return (
            f"find what killed {who}{on}: the kernel OOM killer (dmesg -T | grep -i 'killed process'), "
            "the scheduler (preemption, memory limit) or a person; the other ranks only lost their peer"
        )
    if sig in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
        return (
            f"{who} crashed natively ({sig}): rerun with PYTHONFAULTHANDLER=1 and core dumps enabled to get "
            "its stack; check extensions / custom kernels it alone runs"
        )
    return f"look at {who}'s own log first; the other ranks' errors are consequences"


def _minority(groups: dict[str, list[int]]) -> tuple[list[int], str, str] | None:
    """(odd ranks, their ops, the majority op): every rank outside the strictly largest group
    (``core.ranks.outside_majority``); None when the groups agree or tie."""
    big_key = majority(groups)
    odd = outside_majority(groups)
    if big_key is None or odd is None:
        return None  # no majority: nobody is the odd one out
    odd_key = ", ".join(sorted(k for k in groups if k != big_key))
    return list(odd), odd_key, big_key


def _rule_mismatch(logs: Evidence, known: list[int]) -> Diagnosis | None:
    facts = logs.ranks
    # c10d DETAIL fingerprints name ops directly
    fp: dict[str, list[int]] = {}
    for r in known:
        e = facts[r].first.get(ev.OP_MISMATCH)
        if e is not None and e.op:
            fp.setdefault(e.op, []).append(r)
    # NCCL watchdog: same SeqNum, different OpType
    by_seq: dict[int, dict[str, list[int]]] = {}
    for r in known:
        t = facts[r].nccl_timeout
        if t is not None and t.seq is not None and t.op:
            by_seq.setdefault(t.seq, {}).setdefault(f"{t.op}", []).append(r)
    # tracebacks: waiting ranks stuck in different collectives
    tb: dict[str, list[int]] = {}
    for r in known:
        t = facts[r].traceback
        if t is not None and t.op and _is_waiting(facts[r]):
            tb.setdefault(t.op, []).append(r)
    for groups, how, conf in (
        (fp, "c10d's collective fingerprint check", "high"),
        *((g, f"the NCCL watchdog (same collective #{s})", "high") for s, g in by_seq.items()),
        (tb, "their stacks", "medium"),
    ):
        mm = _minority(groups)
        if mm is None:
            continue
        odd, odd_op, big_op = mm
        where = ""
        if groups is tb:
            sites = {facts[r].traceback.detail for r in odd if facts[r].traceback}  # type: ignore[union-attr]
            where = f" at {', '.join(sorted(s for s in sites if s))}" if sites else ""
        return Diagnosis(
            kind="collective_mismatch",
            initiating_ranks=odd,
            confidence=conf,
            phase="collective",
            reason=(
                f"{fmt_ranks(odd)} called {odd_op}{where} while {fmt_ranks(groups[big_op])} called "
                f"{big_op} (per {how}); nobody could complete"
            ),
            next_action=(
                f"make {fmt_ranks(odd)} issue the same collectives in the same order as the others (look "
                "for rank-dependent branches around that call); TORCH_DISTRIBUTED_DEBUG=DETAIL checks "
                "this at every call"
            ),
        )
    for groups in (fp, *by_seq.values(), tb):
        if len(groups) > 1:
            desc = "; ".join(f"{fmt_ranks(v)} in {k}" for k, v in sorted(groups.items()))
            return Diagnosis(
                kind="collective_mismatch",
                initiating_ranks=[],
                confidence="low",
                decided=False,
                phase="collective",
                reason=f"ranks disagree on the collective ({desc}) and no group is a minority",
                next_action="make every rank issue the same collectives in the same order",
                would_decide="the expected call order (code review) or flight-recorder dumps from each rank",
            )
    det = [r for r in known if facts[r].counts[ev.SIZE_MISMATCH]]
    unowned = _unowned_size_mismatch(logs)
    if not det and unowned is not None:
        det = [r for r in known if _enforce_aborted(logs, facts[r])]  # the receiver(s) gloo aborted
    e = facts[det[0]].first.get(ev.SIZE_MISMATCH) or unowned if det else None
    if e is not None:
        return Diagnosis(
            kind="collective_mismatch",
            initiating_ranks=[],
            confidence="medium",
            decided=False,
            phase="collective",
            reason=(
                f"{fmt_ranks(det)} received a message of the wrong size ({e.detail or 'size mismatch'}): "
                "a peer called a collective with a different size or op. Gloo only tells the receiver, "
                "so the logs do not say which peer sent it"
            ),
            next_action=(
                "check that every rank passes tensors of the same shape/dtype to each collective "
                "(rank-dependent sizes, uneven last batch)"
            ),
            would_decide=(
                "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (names both ranks and their tensor shapes) or "
                "capture flight-recorder dumps (rankwatch run) that list each rank's sizes"
            ),
            evidence=[quote(e)],
        )
    return None


def _rule_lone_collective(logs: Evidence, known: list[int]) -> Diagnosis | None:
    """Ranks in a collective against ranks in none (finished, or idle when the store told them)."""
    facts = logs.ranks
    fin = [r for r in known if _finished(facts[r])]
    idle = [r for r in known if _idle(facts[r])]
    inside = [r for r in known if _waited(facts[r]) or (_signalled(facts[r]) and _in_collective(facts[r]))]
    out = sorted(set(fin) | set(idle))
    if not inside or not out:
        return None
    odd = outside_majority({"in a collective": inside, "in none": out})
    silent = [r for r in known if r not in inside and r not in out]
    if odd is None and fin and not idle:
        # the others all ended badly (waited / lost a peer, or stopped non-zero while waiting silently):
        # the few that exited 0 among them left while they still needed them
        rest = [r for r in known if r not in out]
        if all(_is_waiting(facts[r]) or _ended_nonzero(facts[r]) for r in rest):
            odd = outside_majority({"still needed": rest, "in none": out})
    if odd is None:
        return None
    seqs = [v for r in inside if (v := _last_seq(facts[r])) is not None]
    n = max(seqs) if seqs else None
    others = [v for r in out if (v := _last_seq(facts[r])) is not None]
    reached = max(others) if others else None
    left = []
    if fin:
        left.append(f"{fmt_ranks(fin)} had finished")
    if idle:
        done = max((facts[r].status.completed or 0) for r in idle)  # type: ignore[union-attr]
        left.append(
            f"{fmt_ranks(idle)} had no NCCL work pending (all completed up to #{done}) when told of the timeout"
        )
    silent_note = f"; {fmt_ranks(silent)} left no message" if silent else ""
    if list(odd) == inside:
        who = fmt_ranks(inside)
        coll = f"collective #{n}" if n is not None else "a collective"
        if n is not None and reached is not None and n <= reached:
            # the others got past this number and left without waiting for it: it arrived late
            return Diagnosis(
                kind="hang",
                initiating_ranks=inside,
                confidence="low",
                phase="collective",
                reason=(
                    f"{who} timed out in {coll}, which the others had already issued (they reached "
                    f"#{reached}) before they stopped: {who} arrived late — behind — and "
                    + "; ".join(left) + silent_note
                ),
                next_action=(
                    f"find what delayed {who} before {coll} (a stack during the hang, data loading, rank-specific "
                    "work); end the run with a barrier or destroy_process_group() so no rank leaves before the "
                    "others' last collective completes"
                ),
                would_decide="flight-recorder dumps from every rank (the ops each one issued last)",
            )
        return Diagnosis(
            kind="collective_mismatch",
            initiating_ranks=inside,
            confidence="low" if silent else "medium",
            phase="collective",
            reason=f"{who} entered {coll} that no other rank issued; " + "; ".join(left) + silent_note,
            next_action=(
                f"find the collective {who} issues after the others' last one: a rank-conditional collective "
                "(if rank == …: all_reduce), one more batch on that rank (uneven shards: DistributedSampler "
                "drop_last or the Join context manager), or a final metric/barrier only it reaches; "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL or flight-recorder dumps show its op and call site"
            ),
        )
    if not fin or set(odd) - set(fin):
        return None  # an idle minority (told, no work pending) is for the behind / outside rules
    coll = f" in collective #{n}" if n is not None else ""
    return Diagnosis(
        kind="dead_rank",
        initiating_ranks=list(odd),
        confidence="medium",
        reason=(
            f"{fmt_ranks(odd)} left early — exited normally while its peers were still mid-step (uneven data, "
            f"an early return): {fmt_ranks(inside)} then timed out waiting for it or lost it{coll}" + silent_note
        ),
        next_action=(
            f"find why {fmt_ranks(odd)} ran out of work first: uneven shards (DistributedSampler drop_last, "
            "the Join context manager), an early return or a rank-dependent break in its loop"
        ),
    )


def _one_group(values: dict[int, tuple[str | None, int]], p: Policy) -> dict[int, int]:
    """Sequence numbers that count in one process group. SeqNums count per group: never compared across
    groups. Of several known groups the one most ranks report is kept; numbers of no stated group (the old
    "[Rank N]" prefix every group printed alike) only when they lie close (``Policy.unknown_pg_max_gap``)."""
    groups: dict[str | None, dict[int, int]] = {}
    for r, (pg, v) in values.items():
        groups.setdefault(pg, {})[r] = v
    known = {pg: vs for pg, vs in groups.items() if pg is not None}
    if known:
        best = max(known.values(), key=len)
        return best if len(best) > 1 else {}
    vals = groups.get(None, {})
    if vals and max(vals.values()) - min(vals.values()) > p.unknown_pg_max_gap:
        return {}
    return vals


def _rule_behind(logs: Evidence, known: list[int], p: Policy = DEFAULT_POLICY) -> Diagnosis | None:
    facts = logs.ranks
    enq = _one_group({r: (s.pg, s.enqueued) for r in known if (s := facts[r].status) is not None
                      and s.enqueued is not None}, p)
    seqs = _one_group({r: (t.pg, t.seq) for r in known if (t := facts[r].nccl_timeout) is not None
                       and t.seq is not None}, p)
    key: dict[int, int] = {}
    how = ""
    if len(set(enq.values())) > 1:
        key = enq
        how = "last enqueued collective"
    elif len(set(seqs.values())) > 1:
        key = seqs
        how = "collective sequence number at the timeout"
    else:
        # one rank's timeout number against another's status (torch without the PG status line)
        last = _one_group({r: (_last_pg(facts[r]), v) for r in known if (v := _last_seq(facts[r])) is not None}, p)
        if len(set(last.values())) > 1:
            key, how = last, "last collective entered"
    if not key:
        return None
    low = min(key.values())
    behind = list(ranks_behind(key))
    ahead = sorted(r for r, v in key.items() if v != low)
    if len(behind) > len(ahead) and len(key) > 2:
        # most ranks agree on the low number: the few ahead ran extra collectives (a mismatch)
        return Diagnosis(
            kind="collective_mismatch",
            initiating_ranks=ahead,
            confidence="medium",
            phase="collective",
            reason=(
                f"{fmt_ranks(ahead)} issued more collectives ({how} {max(key.values())}) than "
                f"{fmt_ranks(behind)} ({low}): an extra collective nobody else joined"
            ),
            next_action=f"find the collective {fmt_ranks(ahead)} issues that the others do not (rank-dependent code)",
        )
    high = max(key.values())
    return Diagnosis(
        kind="hang",
        initiating_ranks=behind,
        confidence="high",
        reason=(
            f"{fmt_ranks(behind)} is behind: {how} {low} while {fmt_ranks(ahead)} reached {high}; the others "
            "timed out waiting for it to join"
        ),
        next_action=(
            f"find what {fmt_ranks(behind)} was doing instead of collective #{low + 1}: a stack during the "
            "hang (py-spy dump, or rankwatch run which captures it), data loading / I/O / rank-specific "
            "work; flight-recorder dumps show the op it last issued"
        ),
    )


def _rule_outside(logs: Evidence, known: list[int], p: Policy) -> Diagnosis | None:
    facts = logs.ranks
    waiting = [r for r in known if _waited(facts[r]) or (_signalled(facts[r]) and _in_collective(facts[r]))]
    # the sinks of the waiters (who wait for someone they cannot name): the ranks that printed no wait
    found = engine.blame(log_facts.waiting_facts(known, waiting))
    outside = list(found.ranks) if found is not None else []
    if not waiting or not outside:
        return None
    told = [r for r in outside if _signalled(facts[r])]
    told_note = (
        f" ({fmt_ranks(told)} only received another rank's flight-recorder dump signal: told of the timeout, "
        "not timed out)"
        if told
        else ""
    )
    peer_only = all(
        facts[r].counts[ev.PEER_LOST] and not facts[r].counts[ev.GLOO_TIMEOUT] and not facts[r].counts[ev.NCCL_TIMEOUT]
        for r in waiting
    )
    if len(outside) >= len(waiting):
        return Diagnosis(
            kind="hang",
            initiating_ranks=[],
            confidence="low",
            decided=False,
            reason=(
                f"{fmt_ranks(waiting)} timed out or lost a peer, but {fmt_ranks(outside)} printed no timeout "
                "of its own: any of them could be the one that never arrived" + told_note
            ),
            next_action="collect each rank's own stderr (torchrun --log-dir … --tee 3) before deciding",
            would_decide=(
                "per-rank logs of the silent ranks, or stacks taken during the hang (rankwatch run / py-spy "
                "dump), or NCCL watchdog messages with sequence numbers"
            ),
        )
    kind = "dead_rank" if peer_only else "hang"
    what = (
        "lost the connection to a peer (a peer process went away)"
        if peer_only
        else "timed out waiting in a collective"
    )
    return Diagnosis(
        kind=kind,
        initiating_ranks=outside,
        confidence="medium",
        reason=(
            f"{fmt_ranks(waiting)} {what}; {fmt_ranks(outside)} printed no such error: it never entered "
            "the collective the others waited in" + told_note
        ),
        next_action=(
            f"find what {fmt_ranks(outside)} was doing: "
            + (
                "why it exited (its own stderr, dmesg for the OOM killer, the scheduler)"
                if peer_only
                else "its stack during the hang (rankwatch run captures py-spy stacks; py-spy dump by hand), "
                "e.g. data loading, I/O, a rank-specific branch before the collective"
            )
        ),
    )


def _rule_same_collective(logs: Evidence, known: list[int]) -> Diagnosis | None:
    facts = logs.ranks
    waiting = [r for r in known if _waited(facts[r]) or (_signalled(facts[r]) and _in_collective(facts[r]))]
    if not waiting or len(waiting) != len(known):
        return None
    sites = {facts[r].traceback.detail for r in waiting if facts[r].traceback is not None}  # type: ignore[union-attr]
    ops = {facts[r].traceback.op for r in waiting if facts[r].traceback is not None}  # type: ignore[union-attr]
    same = ""
    if len(ops) == 1 and len(sites) == 1:
        same = f" ({next(iter(ops)) or 'same call'} at {next(iter(sites))})"
    return Diagnosis(
        kind="comm_hang",
        initiating_ranks=[],
        confidence="low",
        decided=False,
        phase="collective",
        reason=(
            f"every rank ({fmt_ranks(waiting)}) timed out in the same collective{same}: the logs do not "
            "single out a rank — a communication hang, or a mismatch in sizes/order that these messages "
            "cannot show"
        ),
        next_action=(
            "check the transport (NCCL_DEBUG=WARN output, NCCL RAS, network/fabric errors on the nodes) and "
            "that all ranks pass tensors of the same size"
        ),
        would_decide=(
            "flight-recorder dumps (sizes and sequence numbers per rank), TORCH_DISTRIBUTED_DEBUG=DETAIL "
            "(names mismatching ranks), or stacks from a live hang (rankwatch run)"
        ),
    )


def _rule_report_only(logs: Evidence, known: list[int]) -> Diagnosis | None:
    exits = [r for r in known if logs.ranks[r].exit is not None]
    # a rank that ended by SIGTERM was stopped (by torchrun, a scheduler or a watchdog's --on-stall kill),
    # even when torchrun's report calls it the first observed failure: it names nobody
    failed = [r for r in exits if logs.ranks[r].exit.signal != "SIGTERM"]  # type: ignore[union-attr]
    root = [r for r in failed if logs.ranks[r].exit.root_cause]  # type: ignore[union-attr]
    cands = root or failed
    if not cands:
        return None
    return Diagnosis(
        kind="dead_rank",
        initiating_ranks=cands[:1] if root else cands,
        confidence="low",
        decided=False,
        reason=(
            f"only torchrun's exit report says anything: {fmt_ranks(cands)} exited first "
            f"({_activity(logs.ranks[cands[0]])}); without the ranks' own messages that is a guess"
        ),
        next_action="look at that rank's own output; rerun with torchrun --log-dir DIR --tee 3 to keep it",
        would_decide="each rank's stderr (Python tracebacks, NCCL/gloo errors)",
    )


def _nothing(logs: Evidence, known: list[int]) -> Diagnosis:
    seen = f" ({fmt_ranks(known)} seen)" if known else ""
    return Diagnosis(
        kind="unknown",
        initiating_ranks=[],
        confidence="low",
        decided=False,
        reason=f"no failure, timeout or exit message in these logs{seen}",
        next_action="pass the job's full output: torchrun's console and the per-rank logs",
        would_decide=(
            "torchrun's failure report, per-rank stderr with tracebacks, NCCL watchdog or gloo timeout "
            "messages, or dmesg/Slurm output from the nodes"
        ),
    )
