"""Log evidence → the engine's facts (``core.facts``): the one place offline reads what a rank's lines mean.

The same fact types the live verdict builds from records and the flight recorder, plus the ones only logs
carry: a rank that failed by its own cause is ``Ended(own=True)`` (a CUDA error, an OOM, a Python exception,
a death by a signal nobody sent and no peer trouble explains); a rank whose own lines show a timeout or a
lost peer ``Waits`` for someone it cannot name; PyTorch's desync report ("[7] finished collective #182, but
didn't join collective #183") says every other rank waits for the lagging ones (computed from every rank's
trace in the store: flight-recorder strength); NCCL's per-op INFO lines ("AllReduce: opCount 2f …
[nranks=8]") say a rank that enqueued op N of a communicator waits for the members whose last op there is
below N (counter strength); fingerprints, watchdog SeqNums and stacks are ``InOp``; PG status and timeout
numbers ``Count``; launcher exit reports ``Exited``; rankwatch's own line ``LoggedVerdict``. Decisions are
the rules' (``core.rules``), words the report's. Pure.

"Waited" is own evidence: a timeout, a lost peer, a DUMP_SIGNAL "from this local rank", or another rank's
"dump signal … from rank N" about N. "Observed flight recorder dump signal from another rank" and "… from
rank N" say the *printing* rank was told, not that it timed out (``Told``).
"""

from __future__ import annotations

from collections import defaultdict

from ..core.facts import (
    DESYNC_REPORT,
    NAMED_IN_MESSAGE,
    NCCL_OP_COUNTS,
    OWN_TIMEOUT,
    PEER_GONE,
    STORE_KEYS,
    Count,
    Ended,
    Exited,
    FactSet,
    Finished,
    InOp,
    LoggedVerdict,
    Progress,
    Rung,
    SizeMismatch,
    Told,
    Waits,
)
from ..core.failures import INITIATING, abort_role
from ..core.policy import OfflinePolicy
from ..core.snapshot import EXITED, RUNNING
from . import events as ev
from . import patterns as pt
from .facts import Evidence, RankFacts

DEFAULT_POLICY = OfflinePolicy()
MAX_UNSEEN_WORLD = 65_536
"""A stated world size above this is not turned into one silent rank each (a stray number, not a job)."""


def waited(f: RankFacts) -> bool:
    """It waited on a peer itself and gave up: its own timeout, lost peer, mismatch (or a peer says so)."""
    return f.has(ev.WAITED) or f.has(ev.MISMATCH) or f.own_dump


def signalled(f: RankFacts) -> bool:
    """Only told by the store that a peer timed out (it did not time out itself)."""
    return f.told is not None and not waited(f)


def is_waiting(f: RankFacts) -> bool:
    return waited(f) or signalled(f)


def finished(f: RankFacts) -> bool:
    """Reached its normal end and nothing of its own went wrong."""
    if f.finished is None or f.has(ev.PRIMARY) or is_waiting(f):
        return False
    return f.exit is None or f.exit.exitcode == 0 or f.exit.signal == "SIGTERM"


def unowned_size_mismatch(logs: Evidence) -> ev.Event | None:
    """A gloo size enforcement that no rank prefix claims. Gloo raises it in its own thread as a C++
    ``EnforceNotMet`` that nothing catches: ``std::terminate`` prints it without torchrun's or torch's
    ``[rankN]:`` prefix and the process dies by SIGABRT, so it belongs to a rank that died by SIGABRT."""
    return next((e for e in logs.unattributed if e.family == ev.SIZE_MISMATCH), None)


def enforce_aborted(logs: Evidence | None, f: RankFacts) -> bool:
    """Died by SIGABRT while the log holds an unclaimed gloo size enforcement: gloo's abort of a
    mismatched collective on the receiving rank, a consequence of the mismatch, not its own crash."""
    return (
        logs is not None
        and f.exit is not None
        and f.exit.signal == "SIGABRT"
        and not f.has(ev.PRIMARY)
        and unowned_size_mismatch(logs) is not None
    )


def _aborted_with_timed_out_peers(logs: Evidence, f: RankFacts, p: OfflinePolicy) -> bool:
    """Another rank whose NCCL watchdog fired aborted too, at the same time (when both times are known)."""
    me = f.exit.ts if f.exit is not None else None
    for o in logs.ranks.values():
        if o is f or o.exit is None or o.exit.signal != "SIGABRT" or not o.has(ev.WATCHDOG):
            continue
        if me is None or o.exit.ts is None or abs(o.exit.ts - me) <= p.tie_s:
            return True
    return False


def unexplained_death(f: RankFacts, p: OfflinePolicy, logs: Evidence | None = None) -> bool:
    """Died by a fatal signal nobody sent, with no peer trouble of its own to explain it. A SIGABRT is
    judged by ``core.failures.abort_role``: NCCL's watchdog aborts after a timeout, gloo after a size
    enforcement."""
    if f.exit is None or f.exit.signal not in p.fatal_signals or f.agent_terminated:
        return False
    if f.exit.signal == "SIGABRT":
        own = f.has(ev.WATCHDOG) or is_waiting(f) or f.has(ev.MISMATCH) or enforce_aborted(logs, f)
        peers = logs is not None and _aborted_with_timed_out_peers(logs, f, p)
        return abort_role(own, peers) == INITIATING
    return not is_waiting(f)


def primary_events(f: RankFacts, p: OfflinePolicy) -> list[ev.Event]:
    """The lines that show a rank failing by itself: its own failure messages, and a fatal exit."""
    out = f.firsts(ev.PRIMARY)
    if f.exit is not None and (not out or f.exit.signal in p.fatal_signals):
        out.append(f.exit)
    return out


def adopted_failure(logs: Evidence) -> tuple[int, ev.Event] | None:
    """An own failure no rank prefix claims, and the one rank it can only belong to: torchrun's agent saw
    exactly one worker end with an exit code of its own (not a signal, not its own SIGTERM) and sent every
    other worker its closing signal, and every unclaimed traceback that is not about communication says the
    same thing. (A console without ``[rankN]:`` prefixes: older torch, a pasted log.) The agent tears the
    others down once it notices the first failure, so the lone exit is the worker that failed; the unclaimed
    exception is its message. Unclaimed communication errors are the others' (they lost it), and a lone exit
    with no such exception stays the report's guess: a waiter timing out exits 1 too."""
    own = [e for e in logs.unattributed if e.family in ev.PRIMARY]
    if not own or len({(e.family, e.detail) for e in own}) != 1:
        return None
    exits = [(f, f.exit) for f in logs.ranks.values() if f.exit is not None and f.exit.exitcode is not None]
    lone = [f for f, x in exits if (x.exitcode or 0) > 0 and not f.agent_terminated and not f.has(ev.PRIMARY)]
    rest = [(f, x) for f, x in exits if f not in lone]
    if len(lone) != 1 or not rest or not all(f.agent_terminated or x.signal == "SIGTERM" for f, x in rest):
        return None
    return lone[0].rank, own[0]


def _ended(f: RankFacts, p: OfflinePolicy, adopted: ev.Event | None = None) -> Ended:
    events = primary_events(f, p) if adopted is None else [adopted]
    lead = next((e for e in events if e.family in ev.PRIMARY), None)
    ts = [e.ts for e in events if e.ts is not None]
    phase = next((e.phase for e in events if e.phase), None)
    if phase is None and f.traceback is not None:
        phase = f.traceback.phase
    return Ended(
        f.rank,
        own=True,
        cause=lead.family if lead is not None else None,
        ts=min(ts) if ts else None,
        signal=f.exit.signal if f.exit is not None else None,
        # a failure srun states of its task (a task is a rank only where srun started the ranks) is the launcher's
        # word, not the rank's own message
        stated=any(e.family in ev.PRIMARY and not e.detail.startswith(pt.SRUN_EXIT) for e in f.first.values()),
        detail=(lead.detail if lead is not None else "") or "",
        phase=phase,
        site=lead.where if lead is not None and lead.family == ev.PY_ERROR else "",
        node=next((x.host for x in f.first.values() if x.host), None),
    )


def _progress(f: RankFacts) -> Progress | None:
    """Where a rank's lines say it ended: a normal end (exited), or inside the collective it timed out in
    (its phase a collective, at the number its watchdog states); None when they do not say."""
    if finished(f):
        return Progress(f.rank, EXITED, None)
    if not waited(f):
        return None
    t = f.nccl_timeout
    return Progress(f.rank, RUNNING, "collective", None, True, t.seq if t else None, t.op if t else None)


def _last_seq(f: RankFacts) -> tuple[int, str | None] | None:
    """The highest collective number the rank is known to have entered, and the group it counts in."""
    vals = [v for v in (f.status.enqueued if f.status else None, f.nccl_timeout.seq if f.nccl_timeout else None)
            if v is not None]
    if not vals:
        return None
    return max(vals), (f.status.pg if f.status else None) or (f.nccl_timeout.pg if f.nccl_timeout else None)


def facts_of(logs: Evidence, p: OfflinePolicy = DEFAULT_POLICY) -> FactSet:
    """Every fact the logs hold about their ranks."""
    facts = FactSet(ranks=tuple(sorted(logs.ranks)))
    lagging = frozenset(r for r, f in logs.ranks.items() if f.counts[ev.DESYNC])
    adopted = adopted_failure(logs)
    for r in facts.ranks:
        f = logs.ranks[r]
        if adopted is not None and adopted[0] == r:
            facts.ended.append(_ended(f, p, adopted[1]))
        elif f.has(ev.PRIMARY) or unexplained_death(f, p, logs):
            facts.ended.append(_ended(f, p))
        if f.waited_on:  # its own message names whom it waited for (a monitored barrier's report)
            facts.waits.append(Waits(r, f.waited_on, "", None, None, Rung.COUNTERS, NAMED_IN_MESSAGE))
        elif waited(f):
            t = f.nccl_timeout
            # a rank that only lost its peer (no timeout of its own): the peer's process went away
            gone = f.counts[ev.PEER_LOST] and not f.counts[ev.GLOO_TIMEOUT] and not f.counts[ev.NCCL_TIMEOUT]
            when = [e.ts for fam in ev.WAITED if (e := f.first.get(fam)) is not None and e.ts is not None]
            facts.waits.append(
                Waits(r, None, (t.pg or "") if t else "", t.seq if t else None, t.op if t else None, Rung.WAITING,
                      PEER_GONE if gone else OWN_TIMEOUT, ts=min(when) if when else None)
            )
        elif signalled(f):
            s = f.status
            pending = None
            if s is not None and s.enqueued is not None and s.completed is not None:
                pending = s.enqueued > s.completed
            facts.told.append(Told(r, pending, s.completed if s is not None else None))
        if finished(f):
            facts.finished.append(Finished(r))
        if (where := _progress(f)) is not None:
            facts.progress.append(where)
        if f.exit is not None:
            facts.exited.append(Exited(r, f.exit.signal, f.exit.exitcode, bool(f.exit.root_cause)))
        if f.counts[ev.SIZE_MISMATCH]:
            e = f.first[ev.SIZE_MISMATCH]
            facts.size_mismatch.append(SizeMismatch(r, e.detail))
        fp = f.first.get(ev.OP_MISMATCH)
        if fp is not None and fp.op:
            facts.in_op.append(InOp(r, fp.op, "fingerprint"))
        t = f.nccl_timeout
        if t is not None and t.seq is not None and t.op:
            facts.in_op.append(InOp(r, t.op, "watchdog", seq=t.seq))
        tb = f.traceback
        if tb is not None and (tb.op or tb.detail) and is_waiting(f):
            facts.in_op.append(InOp(r, tb.op or "", "stack", site=tb.detail or None))  # "": a call site, no op
        if f.status is not None and f.status.enqueued is not None:
            facts.counts.append(Count(r, f.status.pg, "enqueued", f.status.enqueued))
        if t is not None and t.seq is not None:
            facts.counts.append(Count(r, t.pg, "timeout", t.seq))
        last = _last_seq(f)
        if last is not None:
            facts.counts.append(Count(r, last[1], "last", last[0]))
        if lagging and r not in lagging:
            facts.waits.append(Waits(r, lagging, "", None, None, Rung.FLIGHT_RECORDER, DESYNC_REPORT))
        d = f.first.get(ev.DESYNC)
        if d is not None:
            facts.in_op.append(InOp(r, d.detail, DESYNC_REPORT, seq=d.seq))
    if not facts.size_mismatch and (unowned := unowned_size_mismatch(logs)) is not None:
        # gloo's abort of the receiver of a mismatched collective (the unclaimed enforcement is its line)
        facts.size_mismatch = [SizeMismatch(r, unowned.detail) for r in facts.ranks
                               if enforce_aborted(logs, logs.ranks[r])]
    facts.waits += _op_count_waits(logs)
    facts.waits += _store_key_waits(logs)
    facts.logged = _logged_verdict(logs)
    facts.unseen = unseen_ranks(logs)
    return facts


def unseen_ranks(logs: Evidence) -> tuple[int, ...]:
    """Ranks that exist but no line is about: ranks are 0 … world-1, so every index below the highest seen
    one, and below the most ranks a line states (WORLD_SIZE, torchrun's world sizes, NCCL's ``nranks`` of a
    communicator, its op lines' ``[nranks=N]``), is a rank. A node killed at once leaves no line at all."""
    if not logs.ranks:
        return ()
    sizes = [int(pg[7:]) for f in logs.ranks.values() for pg in f.ops if pg.startswith("nranks=") and pg[7:].isdigit()]
    world = max([max(logs.ranks) + 1, *sizes, logs.world if logs.world <= MAX_UNSEEN_WORLD else 0])
    return tuple(r for r in range(min(world, MAX_UNSEEN_WORLD)) if r not in logs.ranks)


def _op_count_waits(logs: Evidence) -> list[Waits]:
    """Per communicator size, the ranks whose last NCCL op is below another member's: waited for."""
    by_group: dict[str, dict[int, int]] = defaultdict(dict)
    for r, f in logs.ranks.items():
        for pg, e in f.ops.items():
            if e.seq is not None:
                by_group[pg][r] = e.seq
    out: list[Waits] = []
    for pg, counts in by_group.items():
        if len(counts) < 2 or len(set(counts.values())) < 2:
            continue
        for r, n in counts.items():
            below = frozenset(o for o, m in counts.items() if m < n)
            if below:
                out.append(Waits(r, below, pg, n, None, Rung.COUNTERS, NCCL_OP_COUNTS))
    return out


def _store_key_waits(logs: Evidence) -> list[Waits]:
    """Ranks whose start-up store wait timed out on a peer's gloo rendezvous key ("DistStoreError: wait
    timeout after 60000ms, keys: /default_pg/0//cpu//0/3") wait for that peer, which never reached
    ``init_process_group`` (the default group's keys name global ranks). A line without a rank prefix is a
    rank other than the one it names: every known rank but the awaited ones is taken to wait (the usual
    console: torchrun's report lists them all, the tracebacks are unprefixed)."""
    lines = [e for e in logs.unattributed if e.family == ev.COMM_ERROR]
    lines += [e for f in logs.ranks.values() if (e := f.first.get(ev.COMM_ERROR)) is not None]
    awaited: set[int] = set()
    printers: set[int] = set()
    anonymous = False
    for e in lines:
        m = pt.STORE_WAIT_KEY.search(e.text) if "keys: " in e.text else None
        if m is None or m.group(2) != "0":  # "0": the default group's name (its group ranks are global)
            continue
        awaited.add(int(m.group(3)))
        if e.rank is None:
            anonymous = True
        else:
            printers.add(e.rank)
    known = set(logs.ranks) | awaited
    if not awaited or not known - awaited:
        return []
    waiters = (known - awaited) if anonymous else printers - awaited
    return [Waits(r, frozenset(awaited), "", None, None, Rung.COUNTERS, STORE_KEYS) for r in sorted(waiters)]


def _logged_verdict(logs: Evidence) -> LoggedVerdict | None:
    """rankwatch's first verdict line in the logs: kind, confidence, phase and the ranks it named."""
    lines = rankwatch_lines(logs)
    if not lines:
        return None
    first = lines[0]
    at = (first.file, first.line)
    named = tuple(sorted({e.rank for e in lines if e.rank is not None and (e.file, e.line) == at}))
    kind, confidence, phase = [*first.detail.split("|"), "", "", ""][:3]
    return LoggedVerdict(named, kind or "unknown", confidence if confidence in ("high", "medium", "low") else "low",
                         phase or None)


def rankwatch_lines(logs: Evidence) -> list[ev.Event]:
    """rankwatch's verdict lines in the logs, the first one first."""
    lines = [e for f in logs.ranks.values() if (e := f.first.get(ev.RANKWATCH)) is not None]
    lines += [e for e in logs.unattributed if e.family == ev.RANKWATCH]
    return sorted(lines, key=lambda e: (e.file, e.line))
