"""Live sources → facts: rank views (records, process states, stacks, GPU use, other nodes' evidence, silent
nodes) become the ``core.facts`` the engine and the live rungs read, joined with the flight recorder's own
facts (``core.fr_facts``). Pure.

Edges, strongest first: the flight recorder (a rank with collective N of group G in flight waits for the
members of G that have not entered N; a send/recv in flight waits for its peer), the hook's record (a send
or recv it is in waits for the peer it names: a send for its receiver, a recv for its sender; a rank in
Python-level collective N waits for ranks whose count is below N; never by count for p2p ops, whose count
differs by design across pipeline stages), and waiting without a known target (a stack blocked in a
wait, DDP's sync in backward, a consequence exit, a send/recv whose peer is not named).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence

from .facts import (
    FR_ENTRY,
    IN_COLLECTIVE,
    P2P_PEER,
    Busy,
    Count,
    Ended,
    FactSet,
    GpuUse,
    InOp,
    KilledByRankwatch,
    KnownPeers,
    PriorVerdict,
    Progress,
    Rung,
    SameStack,
    Silent,
    Stopped,
    ThreadDied,
    Waits,
)
from .failures import CONSEQUENCE, INITIATING, PEER_ENDED, crash_role, waited_for
from .ranks import outside_majority
from .snapshot import CRASHED, EXITED, GONE_STATES, MISSING, RUNNING, STOPPED, RankView

P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list"})
"""Ops that wait for one peer, not for a group: their counts differ by design across pipeline stages."""


def is_waiting(v: RankView) -> bool:
    """Blocked on peers: in a Python collective, a stack blocked in a wait, or DDP's sync in backward."""
    if v.in_collective or v.waiting:
        return True
    return v.waiting is None and v.phase == "backward"


def waits_on_peers(p: Progress) -> bool:
    """``is_waiting`` over a rank's ``Progress`` fact: in a Python collective, its stack blocked in a wait, or
    (no stack) DDP's sync in backward."""
    if p.in_collective or p.blocked:
        return True
    return p.blocked is None and p.phase == "backward"


def inside_step(p: Progress) -> bool:
    """Still inside a step: alive, stopped, or ended by what the others' leaving did to it (a connection
    error), in a phase of the step."""
    return p.how != EXITED and p.how in (RUNNING, STOPPED, *GONE_STATES) and p.phase not in (None, "idle")


def early_leavers(progress: Sequence[Progress]) -> list[Progress]:
    """Normal exits while a peer still inside a step was at least as far along: the peer still needed them
    (uneven data — its shard ran out —, an early ``return``, a rank-conditional ``break``). A step not known
    (a log) is as far along as any."""
    stuck = [o for o in progress if inside_step(o)]
    if not stuck:
        return []
    steps = [o.step for o in stuck]
    top = None if None in steps else max(s for s in steps if s is not None)
    return [p for p in progress if p.how == EXITED and (top is None or p.step is None or p.step <= top)]


def exit_roles(gone: Sequence[RankView], tolerance_s: float) -> dict[int, str]:
    """Initiating or consequence, per gone rank (``core.failures``).

    A crash is judged by its exception (a communication error is a peer's fault). A rank killed without
    any mark is initiating unless another rank *of its node* ended clearly (beyond the tolerance) before
    it: then it is the launcher tearing the node's workers down after that first failure.
    """
    roles: dict[int, str] = {}
    for v in gone:
        if v.state == EXITED:  # only early leavers get here (``early_leavers``): their peers still needed them
            roles[v.rank] = INITIATING
            continue
        if v.state == CRASHED:
            roles[v.rank] = crash_role(v.exit_cause)
            continue
        age = v.exit_age_s or 0.0
        # clearly earlier: a launcher notices a failure at its next monitor tick, so its teardown comes
        # after the tolerance; a kill and a peer's crash milliseconds apart are a tie, decided by cause
        earlier = any(
            o.node_key == v.node_key and o is not v and (o.exit_age_s or 0.0) - age > tolerance_s for o in gone
        )
        roles[v.rank] = CONSEQUENCE if earlier else INITIATING
    return roles


def live_facts(
    views: Sequence[RankView],
    fr: FactSet | None,
    *,
    exit_tolerance_s: float,
    in_motion_s: float = 0.0,
    prior: PriorVerdict | None = None,
    killed: Collection[int] = (),
    ended: list[Ended] | None = None,
) -> FactSet:
    """Every view (all nodes) and the flight recorder's facts (``core.fr_facts``) as one fact set: a waiting
    rank's recorder waits where it has some, else its counters'; ``ended``: the views' ends where the
    caller already made them (``exit_facts``: a node that never answered has none); ``in_motion_s``:
    a busy rank that progressed more recently is ``moving`` (``VerdictPolicy.in_motion_s``)."""
    facts = FactSet(ranks=tuple(v.rank for v in views), prior=prior)
    facts.killed = [KilledByRankwatch(r) for r in sorted(killed)]
    facts.ended = ended if ended is not None else ended_facts(views, exit_tolerance_s)
    live: list[RankView] = []
    for v in views:
        if v.state == RUNNING:
            live.append(v)
        elif v.state == STOPPED:
            facts.stopped.append(_stopped(v))
        elif v.state == MISSING:
            facts.silent.append(Silent(v.rank, v.node))
    by_fr = _fr_waits(fr, views) if fr is not None else {}
    counted = _counter_targets(views)
    busy, waits = facts.busy, facts.waits
    for v in live:
        inside = v.coll_seq > v.coll_done
        if not (inside or v.waiting or (v.waiting is None and v.phase == "backward")):  # ``is_waiting``
            moving = min(v.in_phase_s, v.since_progress_s) < in_motion_s
            busy.append(Busy(v.rank, v.phase, moving=moving))
        elif v.rank in by_fr:
            waits.extend(by_fr[v.rank])
        elif inside and v.p2p_peer is not None and v.p2p_dir == v.coll_op:
            # the send/recv it is in names its peer: a send waits for its receiver, a recv for its sender
            waits.append(Waits(v.rank, frozenset({v.p2p_peer}), "", v.coll_seq, v.coll_op, Rung.COUNTERS, P2P_PEER))
        elif inside and v.coll_seq in counted:
            waits.append(Waits(v.rank, counted[v.coll_seq], "", v.coll_seq, v.coll_op, Rung.COUNTERS))
        else:
            how = Rung.WAITING if inside or v.waiting is None else Rung.STACKS
            waits.append(Waits(v.rank, None, "", v.coll_seq or None, v.coll_op, how))
    facts.peers = [KnownPeers(v.rank, v.p2p_known) for v in live if v.p2p_dir is not None]
    return facts


def ended_facts(
    views: Sequence[RankView], exit_tolerance_s: float, progress: Sequence[Progress] | None = None
) -> list[Ended]:
    """Every gone rank (and early normal exit), initiating or a consequence (``exit_roles``), with when it
    ended (minus its exit age: one clock for every node) and its place in its node's exact exit order."""
    # the gone before the early leavers: ends of one time and node place keep this order
    gone = [v for v in views if v.state in GONE_STATES]
    if any(v.state == EXITED for v in views):
        early = {p.rank for p in early_leavers(progress if progress is not None else progress_facts(views))}
        gone += [v for v in views if v.state == EXITED and v.rank in early]
    roles = exit_roles(gone, exit_tolerance_s)
    out = []
    for v in gone:
        own = roles[v.rank] == INITIATING
        peer_ended = not own and bool(v.exit_cause) and PEER_ENDED.search(v.exit_cause or "") is not None
        node = v.node if v.node_rank < 0 else f"#{v.node_rank}"  # ``node_key``: hostnames repeat across nodes
        # a consequence whose message names whom it waited for (a monitored barrier's report) points there
        lost = None if own else waited_for(v.exit_cause)
        out.append(Ended(v.rank, own=own, cause=v.exit_cause, lost=lost, pid=v.pid, peer_ended=peer_ended,
                         ts=-(v.exit_age_s or 0.0), order=v.exit_order if v.exit_order is not None else 0,
                         verified=v.verified, how=v.state, step=v.step, phase=v.phase, node=node))
    return out


def progress_facts(views: Sequence[RankView]) -> list[Progress]:
    """Where every view's rank is: its state, phase, step and Python-level collective (what the exit rules
    of ``rules.exits`` read)."""
    return [Progress(v.rank, v.state, v.phase, v.step, v.in_collective, v.coll_seq, v.coll_op, v.waiting)
            for v in views]


STEP, COLLECTIVE_SEQ, FR_ENTERED = "step", "collective_seq", "entered"
"""The live counters "behind" is read from (``rules.behind``): the hook's step and Python-level collective
count (one group: the hook counts every collective the script calls), the flight recorder's per group."""


def count_facts(progress: Sequence[Progress], counter: str) -> list[Count]:
    """The hook's ``STEP`` or ``COLLECTIVE_SEQ`` counter of every rank (its ``Progress``), as ``Count`` facts
    (group "")."""
    if counter == STEP:
        return [Count(p.rank, "", STEP, p.step or 0) for p in progress]
    if any((p.op or "") in P2P_OPS for p in progress):
        # the count includes sends and recvs, whose numbers differ by design (pipeline stages): nobody is behind
        # by it (issue 44 item 5, pp-wrong-peer: the last stage's lower count was read as "stuck")
        return []
    return [Count(p.rank, "", COLLECTIVE_SEQ, p.seq or 0) for p in progress]


def _stopped(v: RankView) -> Stopped:
    return Stopped(v.rank, v.phase, v.step)


def stopped_facts(views: Sequence[RankView]) -> list[Stopped]:
    """The stopped ranks (SIGSTOP, state ``T``) and where each stopped: the ``stopped`` rung's facts."""
    return [_stopped(v) for v in views if v.state == STOPPED]


def exit_facts(views: Sequence[RankView], exit_tolerance_s: float) -> FactSet:
    """The facts the exit and stop rungs read, made once per verdict: who ended how (``ended_facts``), where
    every rank is (``progress_facts``) and who is stopped, over the ranks that answered. Where no rank ended
    (none gone, none exited) no exit rule has anything to read: no ``Progress`` is made (8,192 ranks: one
    object each, per verdict)."""
    ended_any = any(v.state in GONE_STATES or v.state == EXITED for v in views)
    progress = progress_facts(views) if ended_any else []
    return FactSet(ranks=tuple(v.rank for v in views), ended=ended_facts(views, exit_tolerance_s, progress),
                   progress=progress, stopped=stopped_facts(views))


def mismatch_facts(fr: FactSet, live_ranks: Collection[int]) -> list[InOp]:
    """The flight recorder's entries at each (group, seq) where ranks disagree (``InOp`` facts, source
    ``flight_recorder``), as ``rules.mismatch`` reads them (offline it reads fingerprints and watchdog SeqNums
    alike). A mismatch whose odd ranks are not all alive is left out: a gone rank's last entry is no evidence
    of a live one."""
    live = set(live_ranks)
    at: dict[tuple[str | None, int | None], list[InOp]] = {}
    for i in fr.in_op:
        if i.source == FR_ENTRY:
            at.setdefault((i.group, i.seq), []).append(i)
    out: list[InOp] = []
    for entries in at.values():
        variants: dict[str, list[int]] = defaultdict(list)
        for i in entries:
            variants[i.op].append(i.rank)
        if set(outside_majority(variants) or ()) <= live:
            out.extend(entries)
    return out


def stack_groups(views: Sequence[RankView]) -> list[tuple[str, list[int]]]:
    """Ranks grouped by stack signature, largest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for v in views:
        if v.stack_signature:
            groups[v.stack_signature].append(v.rank)
    return sorted(((sig, sorted(r)) for sig, r in groups.items()), key=lambda g: (-len(g[1]), g[1][0]))


def stack_facts(views: Sequence[RankView]) -> list[SameStack]:
    """The views' stack equivalence classes (``stack_groups``) as facts, largest first: what the ``stacks``
    rung and the stack backing read."""
    return [SameStack(sig, tuple(ranks)) for sig, ranks in stack_groups(views)]


def in_collective_facts(live: Sequence[RankView]) -> FactSet:
    """The live ranks (``ranks``) and which of them the hook's record shows inside a Python-level collective:
    an ``IN_COLLECTIVE`` wait and the call (``InOp`` source ``counters``) each; what ``rules.weak`` asks of
    "everyone in one collective"."""
    inside = [v for v in live if v.in_collective]
    return FactSet(
        ranks=tuple(v.rank for v in live),
        waits=[Waits(v.rank, None, "", v.coll_seq, v.coll_op, Rung.COUNTERS, IN_COLLECTIVE) for v in inside],
        in_op=[InOp(v.rank, v.coll_op or "", "counters", seq=v.coll_seq) for v in inside],
    )


def thread_facts(present: Sequence[RankView]) -> list[ThreadDied]:
    """The live ranks whose helper thread died with an exception (the hook's record)."""
    return [ThreadDied(v.rank, v.thread_died) for v in present if v.state == RUNNING and v.thread_died]


def gpu_facts(live: Sequence[RankView]) -> list[GpuUse]:
    """What NVML said of each live rank that it read (a utilisation, or absent from the samples)."""
    return [GpuUse(v.rank, v.gpu_util, v.gpu_missing) for v in live if v.gpu_util is not None or v.gpu_missing]


def _counter_targets(views: Sequence[RankView]) -> dict[int, frozenset[int]]:
    """Per collective count a rank is inside: the ranks whose count is below it (one shared set per count)."""
    counted = [v for v in views if v.state != EXITED]
    seqs: set[int] = set()
    for v in counted:
        if v.coll_seq > v.coll_done:
            if (v.coll_op or "") in P2P_OPS:
                return {}  # p2p counts differ by design: counters say nothing about who is behind
            seqs.add(v.coll_seq)
    # a silent rank's counts are its last snapshot before it went quiet: a waiter may wait for it
    silent = frozenset(v.rank for v in counted if v.state == MISSING)
    return {n: frozenset(v.rank for v in counted if v.coll_seq < n) | silent for n in seqs}


def _fr_waits(fr: FactSet, views: Sequence[RankView]) -> dict[int, list[Waits]]:
    """Per rank, the recorder's waits (``core.fr_facts``), a collective's waiters completed with the members of
    its group that no recorder traced (the default group's: every rank): they never said they entered it."""
    everyone = {v.rank for v in views}
    untraced = {g.name: frozenset(((set(g.declared) | (everyone if g.default else set())) & everyone)
                                  - set(g.members)) for g in fr.groups}
    completed: dict[tuple[str, int | None], frozenset[int]] = {}  # one shared target set per collective
    out: dict[int, list[Waits]] = {}
    for w in fr.waits:
        extra = untraced.get(w.group)
        if w.on is not None and w.seq is not None and extra:
            on = completed.get((w.group, w.seq))
            if on is None:
                on = completed[(w.group, w.seq)] = w.on | extra
            w = Waits(w.rank, on, w.group, w.seq, w.op, w.strength, w.source)
        out.setdefault(w.rank, []).append(w)
    return out
