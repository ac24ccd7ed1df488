"""Cross-rank flight-recorder analysis: match collectives by (process group, seq) and name who is behind,
missing or mismatched (pure: traces in, findings out; the same odd-one-out rule as the live verdict)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .facts import Count
from .fr_trace import FrEntry, RankTrace
from .ranks import fmt_ranks, outside_majority
from .rules.behind import behind_of

MAX_REPORTED = 16
"""Findings of one kind kept per process group; the first ones are the ones that matter."""

# Ops whose input sizes must agree on every rank; others (gather, scatter, all_to_all, p2p) legitimately
# differ, so only their op name and dtypes are compared.
SIZE_MUST_MATCH = frozenset(
    {
        "all_reduce",
        "allreduce",
        "allreduce_coalesced",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "allgather",
        "_allgather_base",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "allgather_into_tensor_coalesced",
        "reduce_scatter",
        "_reduce_scatter_base",
        "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
        "barrier",
    }
)


@dataclass(frozen=True)
class CollectiveRef:
    pg: str
    seq: int
    op: str


@dataclass(frozen=True)
class PgProgress:
    """How far one rank got in one pg: highest collective seq entered and finished (-1: none)."""

    entered: int
    completed: int
    entered_op: str | None
    in_flight: tuple[int, ...]


@dataclass(frozen=True)
class MissingCollective:
    """A collective some members entered while others never reached it (their last seq is lower)."""

    pg: str
    seq: int
    op: str
    joined: tuple[int, ...]
    missing: tuple[int, ...]


@dataclass(frozen=True)
class Mismatch:
    """Ranks disagree on the collective at one (pg, seq); ``odd_ranks`` are outside the majority."""

    pg: str
    seq: int
    kind: str  # "op" | "size" | "dtype"
    variants: Mapping[str, tuple[int, ...]]  # description → ranks
    odd_ranks: tuple[int, ...]  # every rank outside the strict majority (core.ranks.outside_majority); empty on a tie


@dataclass(frozen=True)
class PgAnalysis:
    name: str
    desc: str
    members: tuple[int, ...]
    progress: Mapping[int, PgProgress]
    behind: tuple[int, ...]  # at the group's lowest entered count (``core.ranks.behind``); above it they wait
    completion_lag: tuple[int, ...]
    missing: tuple[MissingCollective, ...]
    mismatches: tuple[Mismatch, ...]
    # members' p2p ops still in flight (send/recv): the rank waits for its peer, not for the group
    p2p_in_flight: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    # members' peers (global ranks) of those p2p ops, where the op names them: NCCL's "nccl:send 0->1",
    # "nccl:recv 0<-1" (group ranks, mapped through pg_config)
    p2p_peers: Mapping[int, frozenset[int]] = field(default_factory=dict)
    # False when the group's sequence numbers count p2p ops too (pipeline stages issue different numbers
    # of them by design): then seqs and counters are not compared across members
    comparable: bool = True
    declared: tuple[int, ...] = ()  # members by pg_config (global ranks), traced or not


@dataclass(frozen=True)
class RankFr:
    rank: int
    entries: int
    last_entered: CollectiveRef | None
    last_completed: CollectiveRef | None
    in_flight: tuple[CollectiveRef, ...]
    timed_out: tuple[CollectiveRef, ...]


@dataclass(frozen=True)
class FrAnalysis:
    ranks: tuple[int, ...]
    empty_ranks: tuple[int, ...]
    groups: tuple[PgAnalysis, ...]
    per_rank: Mapping[int, RankFr]
    notes: tuple[str, ...] = field(default=())

    @property
    def behind_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for r in g.behind}))

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for g in self.groups for m in g.missing for r in m.missing}))

    @property
    def mismatches(self) -> tuple[Mismatch, ...]:
        return tuple(m for g in self.groups for m in g.mismatches)

    @property
    def missing(self) -> tuple[MissingCollective, ...]:
        return tuple(m for g in self.groups for m in g.missing)

    def summary_lines(self) -> list[str]:
        """Short human lines, most telling first: mismatches, missing ranks, laggards, then per rank."""
        lines: list[str] = []
        for g in self.groups:
            label = g.name if not g.desc or g.desc == g.name else f"{g.name} ({g.desc})"
            for mm in g.mismatches:
                variants = "; ".join(f"{fmt_ranks(rs)}: {d}" for d, rs in mm.variants.items())
                who = f"odd {fmt_ranks(mm.odd_ranks)}" if mm.odd_ranks else "no majority"
                lines.append(f"pg {label} seq {mm.seq}: {mm.kind} mismatch, {who} ({variants})")
            for mc in g.missing:
                lines.append(
                    f"pg {label} seq {mc.seq} {mc.op}: entered by {fmt_ranks(mc.joined)}; "
                    f"never joined by {fmt_ranks(mc.missing)}"
                )
            if g.behind:
                top = max(p.entered for p in g.progress.values())
                detail = ", ".join(f"rank {r} at seq {g.progress[r].entered}" for r in g.behind)
                lines.append(f"pg {label}: behind (others entered seq {top}): {detail}")
            if g.completion_lag:
                detail = ", ".join(
                    f"rank {r} completed seq {g.progress[r].completed}" for r in g.completion_lag
                )
                lines.append(f"pg {label}: same seq entered but completion lags (weak evidence): {detail}")
        for r in self.empty_ranks:
            lines.append(
                f"rank {r}: flight recorder empty (TORCH_FR_BUFFER_SIZE unset, or no collective yet)"
            )
        for r in sorted(self.per_rank):
            info = self.per_rank[r]
            entered = _fmt_ref(info.last_entered)
            done = _fmt_ref(info.last_completed)
            waiting = ", ".join(_fmt_ref(c) for c in info.in_flight) or "none"
            lines.append(f"rank {r}: last entered {entered}, last completed {done}, in flight: {waiting}")
            for c in info.timed_out:
                lines.append(f"rank {r}: {_fmt_ref(c)} retired without completing (timed out)")
        lines.extend(self.notes)
        return lines


def _fmt_ref(c: CollectiveRef | None) -> str:
    return "none" if c is None else f"{c.op}#{c.seq} (pg {c.pg})"


def _signature(e: FrEntry, kind: str) -> object:
    """What must agree across ranks at one seq, as a hashable key (cheap: every rank's every entry is
    keyed; only a mismatch gets words, ``_describe``)."""
    if kind == "op":
        return e.op
    if kind == "dtype":
        return (e.input_dtypes, e.output_dtypes)
    return e.input_sizes


def _describe(e: FrEntry, kind: str) -> str:
    if kind == "op":
        return e.op
    if kind == "dtype":
        return f"in {list(e.input_dtypes)} out {list(e.output_dtypes)}"
    return f"in {[list(s) for s in e.input_sizes]}"


def _compare_at_seq(pg: str, seq: int, by_rank: Mapping[int, FrEntry]) -> list[Mismatch]:
    if len(by_rank) < 2:
        return []
    out: list[Mismatch] = []
    kinds = ["op", "dtype"]
    ops = {e.op for e in by_rank.values()}
    if len(ops) == 1 and next(iter(ops)) in SIZE_MUST_MATCH:
        kinds.insert(1, "size")
    for kind in kinds:
        sig: dict[object, list[int]] = {}
        for r, e in sorted(by_rank.items()):
            sig.setdefault(_signature(e, kind), []).append(r)
        if len(sig) > 1:
            variants = {_describe(by_rank[rs[0]], kind): tuple(rs) for rs in sig.values()}
            out.append(
                Mismatch(pg=pg, seq=seq, kind=kind, variants=variants, odd_ranks=outside_majority(variants) or ())
            )
            break  # an op mismatch explains size/dtype differences at the same seq
    return out


def _progress(trace: RankTrace, pg: str, entries: list[FrEntry], use_status: bool = True) -> PgProgress:
    entered = max((e.collective_seq_id for e in entries), default=-1)
    completed = max((e.collective_seq_id for e in entries if e.finished), default=-1)
    # pg_status is keyed by the local pg id; it survives ring-buffer wrap-around, so prefer it when higher
    # (not in a group with p2p traffic: its counters count the p2p ops too)
    local_ids = {e.pg_id for e in entries} if use_status else set()
    for pid in local_ids:
        st = trace.pg_status.get(pid)
        newest = max((e for e in entries if e.pg_id == pid), key=lambda e: e.record_id)
        if newest.op_id != newest.collective_seq_id and st is not None and st.last_enqueued >= newest.op_id:
            # gloo's status counts every op id, sends and recvs its recorder does not keep included: a
            # pipeline stage's count is its p2p traffic, not its progress (issue 44 item 5, pp-wrong-peer)
            continue
        if st is not None:
            entered = max(entered, st.last_enqueued)
            completed = max(completed, st.last_completed)
    op = None
    for e in entries:
        if e.collective_seq_id == entered:
            op = e.op
    in_flight = tuple(sorted({e.collective_seq_id for e in entries if not e.finished}))
    return PgProgress(entered=entered, completed=completed, entered_op=op, in_flight=in_flight)


def analyze_fr(traces: Mapping[int, RankTrace]) -> FrAnalysis:
    """Match collectives across ranks by (process group name, collective_seq_id) and report differences.

    Pure: ``traces`` maps global rank → trace. P2P entries (send/recv) are not matched, only listed per
    rank. A rank whose ring buffer wrapped is judged only on the sequence numbers it still holds plus its
    ``pg_status`` counters.
    """
    ranks = tuple(sorted(traces))
    empty = tuple(r for r in ranks if not traces[r].entries)
    notes: list[str] = []
    idx = _index(traces, ranks)
    groups = [_analyze_group(pg, idx, traces, ranks, notes) for pg in sorted(idx.per_pg, key=lambda n: (len(n), n))]
    per_rank = {r: _rank_fr(r, traces[r].entries) for r in ranks}
    return FrAnalysis(
        ranks=ranks, empty_ranks=empty, groups=tuple(groups), per_rank=per_rank, notes=tuple(notes)
    )


@dataclass
class _PgIndex:
    """Every rank's entries sorted by process group, and what the ranks declared of each group."""

    per_pg: dict[str, dict[int, list[FrEntry]]] = field(default_factory=dict)  # pg → rank → collectives
    p2p: dict[str, dict[int, list[FrEntry]]] = field(default_factory=dict)  # pg → rank → sends/recvs
    descs: dict[str, str] = field(default_factory=dict)
    declared: dict[str, set[int]] = field(default_factory=dict)
    order: dict[str, tuple[int, ...]] = field(default_factory=dict)  # pg → its global ranks in group-rank order


def _index(traces: Mapping[int, RankTrace], ranks: Sequence[int]) -> _PgIndex:
    idx = _PgIndex()
    for r in ranks:
        t = traces[r]
        for e in t.entries:
            idx.descs.setdefault(e.pg_name, e.pg_desc)
            if e.is_p2p:
                idx.p2p.setdefault(e.pg_name, {}).setdefault(r, []).append(e)
                idx.per_pg.setdefault(e.pg_name, {}).setdefault(r, [])
                continue
            idx.per_pg.setdefault(e.pg_name, {}).setdefault(r, []).append(e)
        for name, cfg in t.pg_config.items():
            if name and cfg.ranks:
                idx.declared.setdefault(name, set()).update(cfg.ranks)
                idx.order.setdefault(name, cfg.ranks)
    return idx


def _analyze_group(
    pg: str, idx: _PgIndex, traces: Mapping[int, RankTrace], ranks: Sequence[int], notes: list[str]
) -> PgAnalysis:
    """One process group: its members' progress, who is behind, the collectives some members never
    joined and those whose members disagree (a note when there are too many to list)."""
    by_rank = idx.per_pg[pg]
    members = set(by_rank)
    if pg in idx.declared:
        members |= idx.declared[pg] & set(ranks)
    if idx.descs.get(pg) == "default_pg":
        members |= set(ranks)
    members_t = tuple(sorted(members))
    pg_p2p = idx.p2p.get(pg, {})
    # a p2p entry with a collective seq: the group has one counter for both, so members that issue
    # different numbers of sends/recvs (pipeline stages) have incomparable collective seqs
    comparable = not any(e.collective_seq_id > 0 for es in pg_p2p.values() for e in es)
    progress = {r: _progress(traces[r], pg, by_rank.get(r, []), use_status=not pg_p2p) for r in members_t}
    top = max(p.entered for p in progress.values())
    # the one "behind" rule (``rules.behind``) over each member's highest entered seq as a ``Count`` fact
    entered = [Count(r, pg, "entered", progress[r].entered) for r in members_t]
    behind = behind_of(entered, "entered", pg) if comparable else ()
    top_completed = max(p.completed for p in progress.values())
    completion_lag = tuple(
        r for r in members_t if progress[r].entered == top and progress[r].completed < top_completed
    )

    # index by seq
    at_seq: dict[int, dict[int, FrEntry]] = {}
    for r, es in by_rank.items():
        for e in es:
            at_seq.setdefault(e.collective_seq_id, {})[r] = e

    if not comparable:
        at_seq = {}
    missing: list[MissingCollective] = []
    for seq in sorted(at_seq):
        joined = tuple(sorted(at_seq[seq]))
        absent = tuple(r for r in members_t if r not in at_seq[seq] and progress[r].entered < seq)
        if absent and len(missing) < MAX_REPORTED:
            op = Counter(e.op for e in at_seq[seq].values()).most_common(1)[0][0]
            missing.append(MissingCollective(pg=pg, seq=seq, op=op, joined=joined, missing=absent))

    mismatches: list[Mismatch] = []
    for seq in sorted(at_seq):
        if len(mismatches) >= MAX_REPORTED:
            notes.append(f"pg {pg}: more than {MAX_REPORTED} mismatching collectives, rest not listed")
            break
        mismatches.extend(_compare_at_seq(pg, seq, at_seq[seq]))

    return PgAnalysis(
        name=pg,
        desc=idx.descs.get(pg, ""),
        members=members_t,
        progress=progress,
        behind=behind,
        completion_lag=completion_lag,
        missing=tuple(missing),
        mismatches=tuple(mismatches),
        p2p_in_flight={
            r: tuple(e.op for e in es if not e.finished and not e.timed_out)
            for r, es in sorted(pg_p2p.items())
            if any(not e.finished and not e.timed_out for e in es)
        },
        comparable=comparable,
        declared=tuple(sorted(idx.declared.get(pg, set()))),
        p2p_peers=_p2p_peers(pg_p2p, idx.order.get(pg), idx.descs.get(pg) == "default_pg"),
    )


def _rank_fr(r: int, rank_entries: Sequence[FrEntry]) -> RankFr:
    last = rank_entries[-1] if rank_entries else None
    done = [e for e in rank_entries if e.finished]
    return RankFr(
        rank=r,
        entries=len(rank_entries),
        last_entered=_ref(last) if last else None,
        last_completed=_ref(done[-1]) if done else None,
        in_flight=tuple(_ref(e) for e in rank_entries if not e.finished and not e.timed_out),
        timed_out=tuple(_ref(e) for e in rank_entries if e.timed_out),
    )


_P2P_PEER = re.compile(r"(?:send|recv) (\d{1,7})(?:->|<-)(\d{1,7})")


def _p2p_peers(
    by_rank: Mapping[int, list[FrEntry]], order: tuple[int, ...] | None, default: bool
) -> dict[int, frozenset[int]]:
    """Per rank, the global ranks its in-flight sends/recvs wait for, where the op names the peer (a group
    rank: the default group's is global; another group's maps through its pg_config ranks)."""
    out: dict[int, frozenset[int]] = {}
    for r, es in by_rank.items():
        peers: set[int] = set()
        for e in es:
            if e.finished or e.timed_out:
                continue
            m = _P2P_PEER.search(e.profiling_name)
            if m is None:
                return {}  # an op that does not name its peer: whom this group's ranks wait for is unknown
            peer = int(m.group(2))
            if order is not None and peer < len(order):
                peers.add(order[peer])
            elif default:
                peers.add(peer)
            else:
                return {}
        if peers:
            out[r] = frozenset(peers)
    return out


def _ref(e: FrEntry) -> CollectiveRef:
    seq = e.p2p_seq_id if e.is_p2p else e.collective_seq_id
    return CollectiveRef(pg=e.pg_name, seq=seq, op=e.op)
