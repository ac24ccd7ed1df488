"""What the flight recorder says, reduced to what the verdict uses (built by ``evidence.flight_recorder``).

Kept in ``core`` so the verdict stays a pure function over plain data: per process group its members, each
member's progress and what it has in flight (collectives and p2p ops), plus the cross-rank findings
(ranks behind or missing, mismatches) of ``core.fr_analysis``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .fr_analysis import Mismatch, MissingCollective


@dataclass(frozen=True)
class FrGroup:
    """One process group as the wait-for graph needs it."""

    pg: str
    members: tuple[int, ...]  # traced members
    declared: tuple[int, ...]  # members by pg_config, traced or not (default_pg: every rank)
    entered: Mapping[int, int]  # member → highest collective seq entered (-1: none)
    in_flight: Mapping[int, int]  # member → newest collective seq it entered and has not finished
    p2p_in_flight: frozenset[int] = frozenset()  # members with a send/recv in flight
    p2p_peers: Mapping[int, frozenset[int]] = field(default_factory=dict)  # their peers, where named
    comparable: bool = True  # seqs comparable across members (False: one counter for collectives and p2p)
    default: bool = False  # the default (world) group


@dataclass(frozen=True)
class FrBehind:
    """One rank's progress in one process group, when it is behind there (``core.ranks.behind``: at the
    group's lowest entered count, below another member's)."""

    pg: str
    rank: int
    seq: int  # highest collective seq this rank entered (-1: none)
    top_seq: int  # highest seq any member entered
    top_op: str | None  # op of that collective, as the furthest rank recorded it
    # its newest collective is still in flight although another member got past it: it waits for a peer
    # (data relayed through a ring or tree), it is not the one that never arrived
    waiting: bool = False


@dataclass(frozen=True)
class FrHints:
    """What the flight recorder says, reduced to what the verdict uses (built by ``evidence.fr_evidence``).

    Kept here rather than in ``evidence`` so the verdict stays a pure function over plain data.
    """

    ranks: tuple[int, ...]  # ranks whose dump was analysed; conclusions cover only these
    behind: tuple[FrBehind, ...] = ()
    missing: tuple[MissingCollective, ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    groups: tuple[FrGroup, ...] = field(default=(), compare=False)

    @property
    def behind_ranks(self) -> tuple[int, ...]:
        """The ranks behind in some process group (``core.ranks.behind``: at its lowest count). A rank that
        never joined a collective others entered (``missing``) is one of them or, above the lowest, a
        waiter: not named for it."""
        return tuple(sorted({b.rank for b in self.behind}))

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "behind": [
                {"pg": b.pg, "rank": b.rank, "seq": b.seq, "top_seq": b.top_seq, "top_op": b.top_op,
                 "waiting": b.waiting}
                for b in self.behind
            ],
            "missing": [
                {"pg": m.pg, "seq": m.seq, "op": m.op, "joined": list(m.joined), "missing": list(m.missing)}
                for m in self.missing
            ],
            "mismatches": [
                {
                    "pg": m.pg,
                    "seq": m.seq,
                    "kind": m.kind,
                    "odd_ranks": list(m.odd_ranks),
                    "variants": {k: list(v) for k, v in m.variants.items()},
                }
                for m in self.mismatches
            ],
        }
