"""Log evidence → the engine's facts (``core.facts``): who waits for whom, as the lines tell it.

The same fact types the live verdict builds from records and the flight recorder: PyTorch's desync report
("[7] finished collective #182, but didn't join collective #183") says every other rank waits for the
lagging ones (it is computed from every rank's trace in the store: flight-recorder strength); NCCL's own
per-op INFO lines ("AllReduce: opCount 2f … [nranks=8]") say a rank that enqueued op N of a communicator
waits for the members whose last op there is below N (counter strength). The ranks waited for are the
sinks of ``core.engine.blame``. A rank that gave up waiting at start-up for a peer's gloo rendezvous key
("DistStoreError: wait timeout after 60000ms, keys: /default_pg/0//cpu//0/3") waits for the rank the key
names, which never reached ``init_process_group`` (counter strength: the key names it, whoever printed it).
Pure.
"""

from __future__ import annotations

from collections import defaultdict

from ..core.facts import FactSet, Rung, Silent, Waits
from . import events as ev
from . import patterns as pt
from .facts import Evidence

DESYNC = "desync_report"
NCCL_OPS = "nccl_op_counts"
STORE_KEYS = "store_key_waits"


def desync_facts(evidence: Evidence) -> FactSet | None:
    """The desync report's lagging ranks, waited for by every other rank the logs know."""
    lagging = frozenset(r for r, f in evidence.ranks.items() if f.counts[ev.DESYNC])
    if not lagging:
        return None
    facts = FactSet(ranks=tuple(sorted(evidence.ranks)))
    facts.waits = [Waits(r, lagging, "", None, None, Rung.FLIGHT_RECORDER) for r in facts.ranks if r not in lagging]
    return facts


def op_count_facts(evidence: Evidence) -> FactSet | None:
    """Per communicator size, the ranks whose last NCCL op is below another member's: waited for."""
    by_group: dict[str, dict[int, int]] = defaultdict(dict)
    for r, f in evidence.ranks.items():
        for pg, e in f.ops.items():
            if e.seq is not None:
                by_group[pg][r] = e.seq
    facts = FactSet(ranks=tuple(sorted(evidence.ranks)))
    for counts in by_group.values():
        if len(counts) < 2 or len(set(counts.values())) < 2:
            continue
        for r, n in counts.items():
            below = frozenset(o for o, m in counts.items() if m < n)
            if below:
                facts.waits.append(Waits(r, below, "", n, None, Rung.COUNTERS))
    return facts if facts.waits else None


def waiting_facts(known: list[int], waiting: list[int]) -> FactSet:
    """Ranks whose lines show them waiting on a peer (a timeout, a lost peer) wait for someone they cannot
    name; a rank that printed no such line is silent about it: the candidate the waiters wait for."""
    facts = FactSet(ranks=tuple(known))
    waiters = set(waiting)
    facts.waits = [Waits(r, None, "", None, None, Rung.WAITING) for r in waiting]
    facts.silent = [Silent(r) for r in known if r not in waiters]
    return facts


def store_key_facts(evidence: Evidence) -> FactSet | None:
    """Ranks whose start-up store wait timed out on a peer's rendezvous key wait for that peer (the default
    group's keys name global ranks). A line without a rank prefix is a rank other than the one it names:
    every known rank but the awaited ones is taken to wait (the usual console: torchrun's report lists
    them all, the tracebacks are unprefixed)."""
    lines = [e for e in evidence.unattributed if e.family == ev.COMM_ERROR]
    lines += [e for f in evidence.ranks.values() if (e := f.first.get(ev.COMM_ERROR)) is not None]
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
    known = set(evidence.ranks) | awaited
    if not awaited or not known - awaited:
        return None
    waiters = (known - awaited) if anonymous else printers - awaited
    facts = FactSet(ranks=tuple(sorted(known)))
    facts.waits = [Waits(r, frozenset(awaited), "", None, None, Rung.COUNTERS) for r in sorted(waiters)]
    return facts if facts.waits else None
