"""Why a straggler is slow: the kernel's per-rank counters set against the time it loses per step.

``core.straggler`` names the rank and the time it costs the job per step; it cannot tell a rank doing more
work from one whose work waits — for a CPU shared with other processes, for a CPU quota, for memory or
disk. The watchdog samples those waits from outside the rank (``observe.signals``, ``core.host_signals``).
Here each signal becomes a per-step figure over the very steps the diagnosis compared (the counter's
increase from the first compared step's start to the last one's end, divided by the steps), and the
straggler's figure is compared with its peers' median — the same per-rank comparison as the phases, so a
host-wide load that slows every rank alike is nobody's cause. The signal whose excess explains enough of
the time lost per step is the cause; none is ``own_work``.

Precedence: a throttled cgroup's tasks stay runnable while the quota is spent, so CPU throttling also shows
as run-queue wait; it is checked first. GPU and network causes (``gpu_throttled``, ``gpu_link_degraded``,
``network_path``) are in the vocabulary but not measured yet: no signal here gives them.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .host_signals import MISSING, HostPressure, RankCounters
from .ranks import fmt_ranks
from .straggler import StragglerDiagnosis

CAUSES = (
    "cpu_contention",
    "cpu_throttled",
    "memory_pressure",
    "io_pressure",
    "gpu_throttled",
    "gpu_link_degraded",
    "network_path",
    "own_work",
)


@dataclass(frozen=True)
class CausePolicy:
    # a signal is the cause when the straggler's excess in it is at least this share of the time it loses
    # per step: a cause must explain most of the loss, not a corner of it (a rank slowed by CPU contention
    # waits for a CPU for ~all of its extra time; one doing more work waits a few % more at most, because a
    # longer step is simply more chances to be preempted)
    min_share: float = 0.5
    # ... and at least this many ms per step: below it a signal is the scheduler's ordinary noise (a thread
    # waking on a busy 2-core host waits ~0.1-1 ms for a CPU)
    min_signal_ms: float = 1.0
    # the excess must hold on at least this share of the sampling intervals inside the window: a burst of
    # another process during one poll interval does not explain a loss spread over the whole window
    hold_share: float = 0.6
    # the samples must cover at least this share of the compared steps' wall time: a window sampled for a
    # tenth of its length says little about the rest
    min_coverage: float = 0.5
    # a quota is the cause when its throttled time is at least this share of the loss and, with the run-queue
    # wait beside it, covers ``min_share``: once the quota refills, the throttled threads come back runnable
    # at once and wait for a CPU, so a throttled rank's loss splits between the two (measured on this host
    # beside other load: 25 % quota, throttled 30-45 % of the loss, the rest run-queue wait)
    throttled_min_share: float = 0.2


@dataclass(frozen=True)
class _Signal:
    name: str
    cause: str
    get: Callable[[RankCounters], int]
    scale_ms: float  # counter units -> ms
    words: str  # "rank N <words>, its peers Y ms", with {x} the rank's ms/step
    next_step: str


SIGNALS = (
    _Signal("throttled", "cpu_throttled", lambda c: c.throttled_us, 1e-3,
            "was held back by its cgroup's CPU quota {x:.1f} ms/step",
            "raise or remove the CPU quota of {who}'s cgroup {cgroup} (cpu.max, or cpu.cfs_quota_us on cgroup v1), "
            "or give every rank the same quota"),
    _Signal("run_queue_wait", "cpu_contention", lambda c: c.wait_ns, 1e-6,
            "waited {x:.1f} ms/step for a CPU",
            "see what else runs on {who}'s CPUs (`top -H`, `ps -eLo psr,pid,comm`), keep other workloads off the "
            "node or pin each rank to its own cores (taskset/numactl, the launcher's --cpu-bind)"),
    _Signal("memory_stall", "memory_pressure", lambda c: c.mem_some_us, 1e-3,
            "stalled {x:.1f} ms/step on memory (its cgroup's memory.pressure)",
            "{who}'s cgroup {cgroup} is short of memory: raise memory.high/memory.max, or lower what the rank "
            "keeps resident (the DataLoader's prefetch, caches); major faults: see the figures"),
    _Signal("io_stall", "io_pressure", lambda c: c.io_some_us, 1e-3,
            "stalled {x:.1f} ms/step on I/O (its cgroup's io.pressure)",
            "look at the storage {who} reads (its input files, checkpoints, swap): stage the data on local disk "
            "or spread the reads"),
)
OWN_WORK_NEXT = (
    "none of the host signals explains it: profile {who}'s step (py-spy record, torch.profiler) and look for work "
    "only it does (a bigger shard, extra logging or evaluation, another code path)"
)


def _at(samples: Sequence[tuple[int, int]], t: int) -> float | None:
    """A cumulative counter at ``t`` (ns), linear between the samples around it; None outside them."""
    if not samples or t < samples[0][0] or t > samples[-1][0]:
        return None
    lo, hi = 0, len(samples) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if samples[mid][0] <= t:
            lo = mid
        else:
            hi = mid
    (t0, v0), (t1, v1) = samples[lo], samples[hi]
    if t1 == t0:
        return float(v1)
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def _series(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int,
            get: Callable[[RankCounters], int]) -> list[tuple[int, int]]:
    """(t, counter) of one rank, one signal, made monotonic: an interval in which the counter went back (a
    thread that ended takes its time out of the sum over threads), the process changed (a restart, a reused
    pid) or the rank moved to another cgroup adds nothing, instead of a negative or foreign delta."""
    out: list[tuple[int, int]] = []
    prev: RankCounters | None = None
    acc = 0
    for t, by_rank in samples:
        c = by_rank.get(rank)
        if c is None:
            continue
        v = get(c)
        if v == MISSING:
            return []
        if prev is not None:
            pv = get(prev)
            if c.start_ticks == prev.start_ticks and c.cgroup == prev.cgroup and pv != MISSING and v >= pv:
                acc += v - pv
        prev = c
        out.append((t, acc))
    return out


@dataclass(frozen=True)
class Window:
    """The compared steps in wall time (CLOCK_MONOTONIC ns, the hook's and the watchdog's clock)."""

    start_ns: int
    end_ns: int
    steps: int


def per_step(
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int, sig: _Signal, win: Window,
    policy: CausePolicy,
) -> tuple[float, list[float]] | None:
    """(ms per step over the window, ms per step in each sampling interval inside it), or None when the
    samples do not cover enough of the window."""
    s = _series(samples, rank, sig.get)
    if len(s) < 2 or win.end_ns <= win.start_ns or win.steps <= 0:
        return None
    a, b = max(win.start_ns, s[0][0]), min(win.end_ns, s[-1][0])
    span = win.end_ns - win.start_ns
    if b <= a or (b - a) < policy.min_coverage * span:
        return None
    va, vb = _at(s, a), _at(s, b)
    if va is None or vb is None:
        return None
    steps_per_ns = win.steps / span
    total = (vb - va) * sig.scale_ms / ((b - a) * steps_per_ns)
    parts = []
    inside = [p for p in s if a <= p[0] <= b]
    for (t0, v0), (t1, v1) in itertools.pairwise(inside):
        if t1 > t0:
            parts.append((v1 - v0) * sig.scale_ms / ((t1 - t0) * steps_per_ns))
    return total, parts


def attribute_cause(
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]],
    windows: Mapping[int, Window],
    rank: int,
    lost_ms: float,
    host: HostPressure | None = None,
    policy: CausePolicy | None = None,
    who: Sequence[int] = (),
) -> dict[str, Any] | None:
    """The cause of ``rank``'s loss of ``lost_ms`` per step over its compared ``windows`` (per rank): a
    document with the cause, the figures and the next step; None when the rank was not sampled (another
    node's rank, a job watched for too short a time)."""
    policy = policy or CausePolicy()
    peers = [r for r in windows if r != rank]
    if rank not in windows or not peers or lost_ms <= 0:
        return None
    figures: dict[str, dict[str, float]] = {}
    found: list[tuple[float, _Signal, float, float]] = []
    held_excess: dict[str, tuple[float, _Signal, float, float]] = {}  # signals whose excess held, by name
    measured = False
    for sig in SIGNALS:
        mine = per_step(samples, rank, sig, windows[rank], policy)
        theirs = [x for x in (per_step(samples, q, sig, windows[q], policy) for q in peers) if x is not None]
        if mine is None or not theirs:
            continue
        measured = True
        base = statistics.median(t for t, _ in theirs)
        excess = mine[0] - base
        figures[sig.name] = {"rank_ms": round(mine[0], 3), "peers_ms": round(base, 3), "excess_ms": round(excess, 3)}
        # the same intervals of every rank are the same polls: compare them interval by interval
        n = min([len(mine[1]), *(len(t[1]) for t in theirs)])
        if n == 0:
            continue
        held = sum(1 for i in range(n) if mine[1][i] - statistics.median(t[1][i] for t in theirs) > 0)
        if excess >= policy.min_signal_ms and held >= policy.hold_share * n:
            held_excess[sig.name] = (excess, sig, mine[0], base)
            if excess >= policy.min_share * lost_ms:
                found.append((excess / lost_ms, sig, mine[0], base))
    quota, wait = held_excess.get("throttled"), held_excess.get("run_queue_wait")
    if (quota is not None and not any(f[1].name == "throttled" for f in found)
            and quota[0] >= policy.throttled_min_share * lost_ms
            and quota[0] + (wait[0] if wait is not None else 0.0) >= policy.min_share * lost_ms):
        found.append((quota[0] / lost_ms, quota[1], quota[2], quota[3]))
    if not measured:
        return None
    names = fmt_ranks(list(who) or [rank])
    doc: dict[str, Any] = {"rank": rank, "lost_ms": round(lost_ms, 3), "signals": figures}
    if host is not None and host.cpu_some_us != MISSING:
        doc["host"] = {"cpu_some_avg10": host.cpu_avg10, "memory_some_avg10": host.mem_avg10,
                       "io_some_avg10": host.io_avg10}
    cgroup = _cgroup(samples, rank)
    if found:
        throttled = [f for f in found if f[1].cause == "cpu_throttled"]
        share, sig, x, y = throttled[0] if throttled else max(found, key=lambda f: f[0])
        doc.update(
            cause=sig.cause,
            signal=sig.name,
            share=round(min(share, 9.99), 3),
            text=f"rank {rank} {sig.words.format(x=x)}, its peers {y:.1f} ms; "
            f"{100 * min(share, 1.0):.0f} % of its {lost_ms:.1f} ms/step excess",
            next=sig.next_step.format(who=names, cgroup=cgroup or "(unknown)"),
        )
        if sig.cause == "memory_pressure":
            faults = _faults_per_step(samples, rank, peers, windows, policy)
            if faults is not None:
                doc["text"] += f" ({faults[0]:.0f} major faults/step, its peers {faults[1]:.0f})"
        return doc
    parts = ", ".join(f"{k} {v['excess_ms']:+.1f}" for k, v in figures.items())
    doc.update(
        cause="own_work",
        signal=None,
        share=0.0,
        text=f"rank {rank}'s {lost_ms:.1f} ms/step excess is not explained by the host's signals "
        f"(excess over its peers, ms/step: {parts}): its own work",
        next=OWN_WORK_NEXT.format(who=names),
    )
    return doc


def _cgroup(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int) -> str:
    for _, by_rank in reversed(samples):
        c = by_rank.get(rank)
        if c is not None:
            return c.cgroup
    return ""


def _faults_per_step(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int, peers: Sequence[int],
                     windows: Mapping[int, Window], policy: CausePolicy) -> tuple[float, float] | None:
    sig = _Signal("majflt", "memory_pressure", lambda c: c.majflt, 1.0, "", "")
    mine = per_step(samples, rank, sig, windows[rank], policy)
    theirs = [x for x in (per_step(samples, q, sig, windows[q], policy) for q in peers) if x is not None]
    if mine is None or not theirs:
        return None
    return mine[0], statistics.median(t for t, _ in theirs)


def cause_line(cause: Mapping[str, Any] | None) -> str:
    """One line for the summary, status and an incident's evidence."""
    if not cause or not isinstance(cause.get("cause"), str):
        return ""
    return f"cause: {cause['cause']} — {cause.get('text', '')}; next: {cause.get('next', '')}"




def rank_signals(
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]],
    windows: Mapping[int, Window],
    policy: CausePolicy | None = None,
) -> dict[str, dict[str, float]]:
    """Per rank, each signal in ms per compared step (what the summary shows beside the phases, straggler or
    not: a job slowed alike on every rank shows here, not in the diagnosis)."""
    policy = policy or CausePolicy()
    out: dict[str, dict[str, float]] = {}
    for r, win in sorted(windows.items()):
        row = {}
        for sig in SIGNALS:
            got = per_step(samples, r, sig, win, policy)
            if got is not None:
                row[sig.name] = round(got[0], 3)
        if row:
            out[str(r)] = row
    return out


def explain(
    diag: StragglerDiagnosis,
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]],
    host: HostPressure | None = None,
    policy: CausePolicy | None = None,
) -> StragglerDiagnosis:
    """``diag`` with its ``cause`` set (for its first straggler rank) when it names one and the ranks were
    sampled; unchanged otherwise. The causes of co-stragglers are one and the same diagnosis's."""
    if not samples:
        return diag
    windows = {r: Window(*w) for r, w in diag.windows.items()}
    diag.signals = rank_signals(samples, windows, policy)
    if not diag.straggler_ranks or diag.excess_ms <= 0:
        return diag
    diag.cause = attribute_cause(samples, windows, diag.straggler_ranks[0], diag.excess_ms, host, policy,
                                 who=diag.straggler_ranks)
    return diag


__all__ = ["CAUSES", "SIGNALS", "CausePolicy", "Window", "attribute_cause", "cause_line", "explain", "per_step",
           "rank_signals"]
