"""Two NCCL RAS queries compared: lagging counts are normal while a job runs (NCCL's docs say so); counts
that did not move between the queries point at a stuck communicator."""

from __future__ import annotations

from .ras_status import RasCommunicator, RasCountGroup, RasFinding, RasStatus


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
    counts did not move between the two queries ("stuck").
    """
    out: list[RasFinding] = []
    for p in cur.dead_processes:
        out.append(
            RasFinding(
                "dead",
                None,
                (),
                (p.pid,) if p.pid else (),
                f"process {p.pid} on {p.host} considered dead by RAS",
            )
        )
    for p in cur.missing_processes:
        out.append(
            RasFinding(
                "incomplete",
                None,
                (),
                (p.pid,) if p.pid else (),
                f"no communicator data from process {p.pid} on {p.host} (GPU {p.gpus})",
            )
        )
    if cur.timeouts:
        out.append(RasFinding("timeout", None, (), (), f"RAS hit {cur.timeouts} timeout(s) collecting data"))
    for c in cur.communicators:
        name = c.label or c.hash
        for m in c.missing_ranks:
            if m.dead:
                kind, what = "dead", "considered dead"
            elif m.unresponsive is False:
                kind, what = "incomplete", "reachable but not reporting this communicator"
            else:
                kind, what = "unresponsive", "did not respond"
            pid = f" (pid {m.pid} on {m.host})" if m.pid is not None else ""
            out.append(
                RasFinding(
                    kind,
                    c.hash,
                    (m.rank,),
                    (m.pid,) if m.pid else (),
                    f"comm {name}: rank {m.rank}{pid} {what}",
                )
            )
        for r, err in sorted(c.rank_errors.items()):
            out.append(RasFinding("error", c.hash, (r,), (), f"comm {name}: rank {r} reported {err}"))
        before = prev.communicator(c.hash) if prev is not None else None
        frozen = before is not None and _counts_frozen(before, c)
        for op, top, count, g in _lagging(c):
            ranks = g.ranks
            who = f"rank(s) {list(ranks)}" if ranks else f"{g.n_ranks} rank(s)"
            tail = " — unchanged since the previous query" if frozen else ""
            out.append(
                RasFinding(
                    "lagging",
                    c.hash,
                    ranks,
                    (),
                    f"comm {name}: {who} at {op} #{count}, others at #{top}{tail}",
                )
            )
        if frozen:
            out.append(
                RasFinding(
                    "stuck",
                    c.hash,
                    tuple(r for _op, _t, _c, g in _lagging(c) for r in g.ranks),
                    (),
                    f"comm {name}: collective counts did not move between two RAS queries",
                )
            )
    return out
