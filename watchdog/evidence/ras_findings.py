"""Two NCCL RAS queries compared: lagging counts are normal while a job runs (NCCL's docs say so); counts
that did not move between the queries point at a stuck communicator."""

from __future__ import annotations

from ..core.evidence_items import RasFinding
from .ras_status import RasCommunicator, RasCountGroup, RasStatus


def _lagging(c: RasCommunicator) -> list[tuple[str, int, int, RasCountGroup]]:
    """(op, top count, this count, group) for every count group below the highest count of its op."""
    out = []
    tops: dict[str, int] = {}
    for g in c.count_groups:
        tops[g.op] = max(tops.get(g.op, g.count), g.count)
    for g in c.count_groups:
        if g.count < tops[g.op]:
            out.append((g.op, tops[g.op], g.count, g))
    return out


def _counts_frozen(prev: RasCommunicator, cur: RasCommunicator) -> bool:
    """True when the two queries show the same collective counts (per rank, or the same count groups)."""
    if prev.ranks and cur.ranks and all(r.collective_counts for r in cur.ranks):
        p = {r.rank: dict(r.collective_counts) for r in prev.ranks}
        q = {r.rank: dict(r.collective_counts) for r in cur.ranks}
        return p == q and any(v for counts in q.values() for v in counts.values())
    # text: counts are printed only when ranks disagree; same groups twice means nobody caught up
    return bool(cur.count_groups) and set(prev.count_groups) == set(cur.count_groups)


def ras_findings(prev: RasStatus | None, cur: RasStatus) -> list[RasFinding]:
    """Structured evidence from the latest query, sharpened by the previous one when given.

    Lagging ranks alone are normal in a running job (NCCL's docs say so); they become evidence when the
    counts did not move between the two queries ("stuck"). Data only: ``report.evidence_words`` phrases them.
    """
    out: list[RasFinding] = []
    for p in cur.dead_processes:
        out.append(RasFinding("dead", None, (), (p.pid,) if p.pid else (), pid=p.pid, host=p.host))
    for p in cur.missing_processes:
        out.append(RasFinding("incomplete", None, (), (p.pid,) if p.pid else (), pid=p.pid, host=p.host,
                              gpus=p.gpus))
    if cur.timeouts:
        out.append(RasFinding("timeout", None, (), (), count=cur.timeouts))
    for c in cur.communicators:
        name = c.label or c.hash
        for m in c.missing_ranks:
            what = "dead" if m.dead else "incomplete" if m.unresponsive is False else "unresponsive"
            out.append(RasFinding(what, c.hash, (m.rank,), (m.pid,) if m.pid else (), name=name, pid=m.pid,
                                  host=m.host))
        for r, err in sorted(c.rank_errors.items()):
            out.append(RasFinding("error", c.hash, (r,), (), name=name, error=err))
        before = prev.communicator(c.hash) if prev is not None else None
        frozen = before is not None and _counts_frozen(before, c)
        for op, top, count, g in _lagging(c):
            out.append(RasFinding("lagging", c.hash, g.ranks, (), name=name, op=op, count=count, top=top,
                                  n_ranks=g.n_ranks, frozen=frozen))
        if frozen:
            out.append(RasFinding("stuck", c.hash, tuple(r for _op, _t, _c, g in _lagging(c) for r in g.ranks), (),
                                  name=name))
    return out
