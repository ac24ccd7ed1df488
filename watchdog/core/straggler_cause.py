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
as run-queue wait; it is checked first. The host's counters are time and are set against the time lost; the
GPU's and the network's are states (a clock, a throttle reason, a link's width, a connection's round trip) and
are read only when no host counter explains the loss: a rank whose GPU ran slower clocks than its peers' for
most of the window (``gpu_throttled``), whose PCIe link ran narrower or older than its peers' or replayed
transfers (``gpu_link_degraded``), whose best connection to another node had a far longer round trip or
retransmitted (``network_path``). Each is read against the rank's peers, never alone: a busy GPU under its
power cap, an idle link at Gen1 and a host's own round trips are everybody's.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .host_signals import MISSING, GpuState, HostPressure, NetCounters, RankCounters, link_degraded, slowing_reasons
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
    # memory stall is the cause when it is at least this share of the loss: a thrashing rank's loss splits
    # between what the kernel counts as a memory stall (reclaim, waiting for a page it had evicted and reads
    # back) and what it does not (the faults that map the pages back in, and the wait for a CPU that this extra
    # kernel work brings on a busy host). Measured here (``tests/e2e/test_memory_pressure_cause.py``: a 96 MB
    # file-backed working set under a 64 MB limit): memory stall 43 % of the loss alone on the host, 42-50 % in
    # three jobs at load 10-20; a rank without a limit stalls on memory for 0 ms, so a third is no accident
    memory_min_share: float = 0.3
    # -- states (GPU, network): read over the polls inside the rank's window, against its peers' median --
    # a GPU is throttled when its SM clock ran at most this share of its peers' (median over the window): a
    # GPU that HW slowdown hits is cut by 2x or more (nvmlClocksThrottleReasonHwSlowdown), a power or thermal
    # cap by 10-30 %; boost clocks of healthy GPUs of one model under one load differ by a few % only
    gpu_clock_ratio: float = 0.9
    # ... or a slowing clock-event reason (power cap, thermal, HW slowdown) was set on this share of its polls
    # more than on its peers' (a busy GPU at its power cap sets SwPowerCap often: its peers' share is the base)
    gpu_reason_excess: float = 0.5
    # its PCIe link ran below its maximum (generation or lanes) on this share of its polls more than its
    # peers' (an idle GPU drops to Gen1 to save power: its peers, as busy as it, are the base)
    link_excess: float = 0.5
    # ... or the link replayed at least this many transfers per step more than its peers' (a healthy link
    # replays none: a replay is a transfer that failed its CRC and was sent again)
    link_replays_per_step: float = 1.0
    # the data the rank sends to another node (its busiest TCP path) is delivered at most 1/this of its
    # peers' median rate: its own node's way out is slow (a capped or degraded link). Healthy paths of one
    # job differ by a few x and, in bursts, by up to ~10x (measured here: 0.3-8 GB/s between simulated nodes
    # as ACKs bunch; one uncapped run read 9.6x); capped links read 200-400x below their peers. 30x keeps a
    # healthy burst from naming a path (a slow path that is also late shows in its RTT, the rule below)
    net_delivery_factor: float = 30.0
    # ... or its busiest path's smoothed RTT is at least this factor above its peers' median, and at least
    # ``net_min_rtt_ms`` above it: its data queues on the way out (a round trip between nodes of one cluster
    # is tens to hundreds of µs; a few ms of CPU scheduling on a loaded host is not a path)
    net_rtt_factor: float = 4.0
    net_min_rtt_ms: float = 5.0
    # ... or its sockets retransmitted at least this many segments per step more than its peers' (a healthy
    # path between two nodes of one cluster retransmits none)
    net_retrans_per_step: float = 1.0
    # polls inside the window needed to read a state at all (the window's shorter than two polls says nothing)
    min_state_polls: int = 4


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
ON_CPU = _Signal("on_cpu", "own_work", lambda c: c.run_ns, 1e-6, "", "")
# the signals a rank's own CPU time brings with it on a busy host (see ``attribute_cause``)
POLICED_BY_WORK = ("throttled", "run_queue_wait")


def _base_at(i: int, theirs: Sequence[tuple[float, list[float]]], per_run: float | None,
             my_run: tuple[float, list[float]] | None) -> float:
    """The peers' figure in sampling interval ``i``, or what the rank's own CPU time in it brings, if more."""
    base = statistics.median(t[1][i] for t in theirs)
    if per_run is not None and my_run is not None and i < len(my_run[1]):
        base = max(base, per_run * my_run[1][i])
    return base


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
    my_run = per_step(samples, rank, ON_CPU, windows[rank], policy)
    their_run = {q: per_step(samples, q, ON_CPU, windows[q], policy) for q in peers}
    for sig in SIGNALS:
        mine = per_step(samples, rank, sig, windows[rank], policy)
        peer_sig = {q: per_step(samples, q, sig, windows[q], policy) for q in peers}
        theirs = [x for x in peer_sig.values() if x is not None]
        if mine is None or not theirs:
            continue
        measured = True
        base = statistics.median(t for t, _ in theirs)
        # a wait for a CPU (or a quota) the rank's own CPU time brings: a rank that does more work on a host
        # whose CPUs are oversubscribed (or under a quota every rank shares) waits more in proportion; what
        # the rank waits beyond its peers' wait per ms on a CPU, times its own ms on a CPU, is what others did
        per_run = None
        if sig.name in POLICED_BY_WORK and my_run is not None and my_run[0] > 0:
            ratios = [x[0] / r[0] for q, x in peer_sig.items()
                      if x is not None and (r := their_run.get(q)) is not None and r[0] > 0]
            if ratios:
                per_run = statistics.median(ratios)
                base = max(base, per_run * my_run[0])
        excess = mine[0] - base
        peers_ms = round(statistics.median(t for t, _ in theirs), 3)
        figures[sig.name] = {"rank_ms": round(mine[0], 3), "peers_ms": peers_ms, "excess_ms": round(excess, 3)}
        if per_run is not None and base > figures[sig.name]["peers_ms"]:
            figures[sig.name]["for_its_cpu_time_ms"] = round(base, 3)
        # the same intervals of every rank are the same polls: compare them interval by interval
        n = min([len(mine[1]), *(len(t[1]) for t in theirs)])
        if n == 0:
            continue
        held = sum(1 for i in range(n) if mine[1][i] - _base_at(i, theirs, per_run, my_run) > 0)
        if excess >= policy.min_signal_ms and held >= policy.hold_share * n:
            held_excess[sig.name] = (excess, sig, mine[0], base)
            if excess >= policy.min_share * lost_ms:
                found.append((excess / lost_ms, sig, mine[0], base))
    quota, wait = held_excess.get("throttled"), held_excess.get("run_queue_wait")
    if (quota is not None and not any(f[1].name == "throttled" for f in found)
            and quota[0] >= policy.throttled_min_share * lost_ms
            and quota[0] + (wait[0] if wait is not None else 0.0) >= policy.min_share * lost_ms):
        found.append((quota[0] / lost_ms, quota[1], quota[2], quota[3]))
    mem = held_excess.get("memory_stall")
    if (mem is not None and not any(f[1].name == "memory_stall" for f in found)
            and mem[0] >= policy.memory_min_share * lost_ms):
        found.append((mem[0] / lost_ms, mem[1], mem[2], mem[3]))
    if not measured and not any(c.gpu is not None or c.net is not None for _, by in samples
                                for c in by.values()):
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
    for state in (_gpu_cause, _net_cause):
        got = state(samples, windows, rank, peers, policy)
        if got is not None:
            doc["signals"][got["signal"]] = got.pop("figures")
            doc.update(got, share=None, next=STATE_NEXT[got["cause"]].format(who=names))
            return doc
    if not measured:
        # only states were read (a TCP path, a GPU), none of them the cause, and no host counter covered the
        # window (a watchdog starved of CPU on a loaded host sampled too seldom): "none of the host signals
        # explains it" would be a claim about signals never measured
        return None
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


@dataclass(frozen=True)
class _GpuFigures:
    polls: int
    clock_mhz: float | None  # mean SM clock
    clock_max_mhz: int | None
    reasons_share: float  # polls with a slowing clock-event reason
    reasons: tuple[str, ...]  # which, over the window
    link_share: float | None  # polls whose link ran below its maximum
    link: str  # the link as last seen ("Gen4 x8 of Gen5 x16")
    replays_per_step: float | None
    temperature_c: int | None  # the hottest poll
    slowdown_c: int | None
    health: tuple[str, ...]  # new uncorrected ECC errors or XIDs inside the window
    device: int


def _in_window(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int,
               win: Window) -> list[tuple[int, RankCounters]]:
    return [(t, by[rank]) for t, by in samples if win.start_ns <= t <= win.end_ns and rank in by]


def _delta(seq: Sequence[int | None]) -> int | None:
    """The growth of a cumulative counter over the polls (decreases count nothing), None when unknown."""
    vals = [v for v in seq if v is not None and v != MISSING]
    if len(vals) < 2:
        return None
    return sum(max(0, b - a) for a, b in itertools.pairwise(vals))


def gpu_figures(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int, win: Window,
                policy: CausePolicy) -> _GpuFigures | None:
    """The state of ``rank``'s GPU over the polls inside its window; None with too few polls of it."""
    got = [c.gpu for _, c in _in_window(samples, rank, win) if c.gpu is not None]
    if len(got) < policy.min_state_polls:
        return None
    clocks = [g.sm_clock_mhz for g in got if g.sm_clock_mhz is not None]
    reasons = [slowing_reasons(g.reasons) for g in got if g.reasons is not None]
    links = [x for x in (link_degraded(g) for g in got) if x is not None]
    replays = _delta([g.pcie_replay for g in got])
    last: GpuState = got[-1]
    health = []
    ecc = _delta([g.ecc_volatile for g in got])
    if ecc:
        health.append(f"{ecc} new uncorrected ECC error(s)")
    xids = _delta([g.xids for g in got])
    if xids:
        health.append(f"{xids} critical XID event(s)")
    temps = [g.temperature_c for g in got if g.temperature_c is not None]
    link = ""
    if last.pcie_gen is not None and last.pcie_width is not None:
        link = f"Gen{last.pcie_gen} x{last.pcie_width}"
        if last.pcie_gen_max is not None and last.pcie_width_max is not None:
            link += f" (its maximum Gen{last.pcie_gen_max} x{last.pcie_width_max})"
    return _GpuFigures(
        polls=len(got),
        clock_mhz=statistics.fmean(clocks) if clocks else None,
        clock_max_mhz=last.sm_clock_max_mhz,
        reasons_share=sum(1 for r in reasons if r) / len(reasons) if reasons else 0.0,
        reasons=tuple(sorted({n for r in reasons for n in r})),
        link_share=sum(links) / len(links) if links else None,
        link=link,
        replays_per_step=replays * len(got) / (win.steps * max(1, len(got) - 1)) if replays is not None else None,
        temperature_c=max(temps) if temps else None,
        slowdown_c=last.slowdown_c,
        health=tuple(health),
        device=last.device,
    )


def _gpu_cause(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], windows: Mapping[int, Window],
               rank: int, peers: Sequence[int], policy: CausePolicy) -> dict[str, Any] | None:
    """``gpu_throttled`` or ``gpu_link_degraded`` with its figures, or None when the rank's GPU ran as its
    peers' did (or was not seen)."""
    mine = gpu_figures(samples, rank, windows[rank], policy)
    theirs = [f for f in (gpu_figures(samples, q, windows[q], policy) for q in peers) if f is not None]
    if mine is None or not theirs:
        return None
    med = statistics.median
    clocks = [f.clock_mhz for f in theirs if f.clock_mhz is not None]
    peer_clock = med(clocks) if clocks else None
    peer_reasons = med(f.reasons_share for f in theirs)
    figures: dict[str, Any] = {"device": mine.device, "polls": mine.polls,
                               "sm_clock_mhz": _r(mine.clock_mhz), "peers_sm_clock_mhz": _r(peer_clock),
                               "sm_clock_max_mhz": mine.clock_max_mhz,
                               "slowing_share": round(mine.reasons_share, 3),
                               "peers_slowing_share": round(peer_reasons, 3), "reasons": list(mine.reasons),
                               "temperature_c": mine.temperature_c, "slowdown_c": mine.slowdown_c,
                               "link": mine.link, "link_degraded_share": _r(mine.link_share),
                               "replays_per_step": _r(mine.replays_per_step)}
    if mine.health:
        figures["health"] = list(mine.health)
    slow_clock = (mine.clock_mhz is not None and peer_clock is not None and peer_clock > 0
                  and mine.clock_mhz <= policy.gpu_clock_ratio * peer_clock)
    slow_reason = mine.reasons_share - peer_reasons >= policy.gpu_reason_excess
    health = f"; {', '.join(mine.health)} in the window" if mine.health else ""
    if slow_clock or slow_reason:
        clock = ""
        if mine.clock_mhz is not None and peer_clock is not None:
            of_max = f" ({100 * mine.clock_mhz / mine.clock_max_mhz:.0f} % of its {mine.clock_max_mhz} MHz maximum)" \
                if mine.clock_max_mhz else ""
            clock = f"ran its SM clock at {mine.clock_mhz:.0f} MHz{of_max}, its peers' at {peer_clock:.0f} MHz"
        why = ""
        if mine.reasons:
            theirs_by = sorted({n for f in theirs for n in f.reasons})
            why = (f"slowed by {'/'.join(mine.reasons)} on {100 * mine.reasons_share:.0f} % of polls, its peers "
                   + (f"by {'/'.join(theirs_by)} on {100 * peer_reasons:.0f} %" if theirs_by else "never"))
        temp = ""
        if mine.temperature_c is not None:
            temp = f", {mine.temperature_c} °C" + (f" (slowdown at {mine.slowdown_c} °C)" if mine.slowdown_c else "")
        parts = "; ".join(p for p in (clock, why) if p)
        return {"cause": "gpu_throttled", "signal": "gpu_clock", "figures": figures,
                "text": f"rank {rank}'s GPU {mine.device} {parts}{temp}{health}"}
    peer_link = [f.link_share for f in theirs if f.link_share is not None]
    peer_replays = [f.replays_per_step for f in theirs if f.replays_per_step is not None]
    base_link = med(peer_link) if peer_link else None
    base_replays = med(peer_replays) if peer_replays else None
    narrow = mine.link_share is not None and base_link is not None and mine.link_share - base_link >= policy.link_excess
    replaying = (mine.replays_per_step is not None and base_replays is not None
                 and mine.replays_per_step - base_replays >= policy.link_replays_per_step)
    if narrow or replaying:
        bits = []
        if narrow:
            bits.append(f"its PCIe link ran at {mine.link} on {100 * (mine.link_share or 0):.0f} % of polls, its "
                        f"peers' on {100 * (base_link or 0):.0f} %")
        if replaying:
            bits.append(f"replayed {mine.replays_per_step:.1f} PCIe transfers/step, its peers {base_replays:.1f}")
        return {"cause": "gpu_link_degraded", "signal": "pcie_link", "figures": figures,
                "text": f"rank {rank}'s GPU {mine.device}: {'; '.join(bits)}{health}"}
    return None


@dataclass(frozen=True)
class _NetFigures:
    polls: int
    rtt_ms: float | None  # median over polls of the best busy path's srtt
    retrans_per_step: float | None
    delivery_bps: float | None  # median over polls of the slowest sending socket's delivery rate
    sockets: int


def net_figures(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], rank: int, win: Window,
                policy: CausePolicy) -> _NetFigures | None:
    got: list[NetCounters] = [c.net for _, c in _in_window(samples, rank, win) if c.net is not None]
    if len(got) < policy.min_state_polls:
        return None
    rtts = [n.rtt_us / 1000 for n in got if n.rtt_us != MISSING]
    rates = [float(n.delivery_bps) for n in got if n.delivery_bps != MISSING]
    retrans = _delta([n.retrans for n in got])
    return _NetFigures(
        polls=len(got), rtt_ms=statistics.median(rtts) if rtts else None,
        retrans_per_step=retrans * len(got) / (win.steps * max(1, len(got) - 1)) if retrans is not None else None,
        delivery_bps=statistics.median(rates) if rates else None, sockets=got[-1].sockets,
    )


def _net_cause(samples: Sequence[tuple[int, Mapping[int, RankCounters]]], windows: Mapping[int, Window],
               rank: int, peers: Sequence[int], policy: CausePolicy,
               known: Mapping[int, _NetFigures | None] | None = None) -> dict[str, Any] | None:
    """``network_path`` with its figures, or None when the rank's connections fare as its peers' do (``known``:
    every rank's figures, read once by a caller that asks of every rank)."""

    def of(r: int) -> _NetFigures | None:
        return known[r] if known is not None else net_figures(samples, r, windows[r], policy)

    mine = of(rank)
    theirs = [f for f in (of(q) for q in peers) if f is not None]
    if mine is None or not theirs:
        return None
    med = statistics.median
    rtts = [f.rtt_ms for f in theirs if f.rtt_ms is not None]
    rets = [f.retrans_per_step for f in theirs if f.retrans_per_step is not None]
    rates = [f.delivery_bps for f in theirs if f.delivery_bps is not None]
    base_rtt, base_ret, base_rate = (med(rtts) if rtts else None), (med(rets) if rets else None), \
        (med(rates) if rates else None)
    figures = {"rtt_ms": _r(mine.rtt_ms), "peers_rtt_ms": _r(base_rtt), "retrans_per_step": _r(mine.retrans_per_step),
               "peers_retrans_per_step": _r(base_ret), "delivery_mbps": _r(_mbps(mine.delivery_bps)),
               "peers_delivery_mbps": _r(_mbps(base_rate)), "sockets": mine.sockets, "polls": mine.polls}
    slow = (mine.rtt_ms is not None and base_rtt is not None and mine.rtt_ms >= policy.net_rtt_factor * base_rtt
            and mine.rtt_ms - base_rtt >= policy.net_min_rtt_ms) or (
        mine.delivery_bps is not None and base_rate is not None
        and mine.delivery_bps * policy.net_delivery_factor <= base_rate)
    lossy = (mine.retrans_per_step is not None and base_ret is not None
             and mine.retrans_per_step - base_ret >= policy.net_retrans_per_step)
    if not (slow or lossy):
        return None
    bits = []
    if mine.delivery_bps is not None and base_rate is not None:
        bits.append(f"the data it sends to another node was delivered at {_mbps(mine.delivery_bps):.1f} Mbit/s, "
                    f"its peers' at {_mbps(base_rate):.1f} Mbit/s")
    if mine.rtt_ms is not None and base_rtt is not None:
        bits.append(f"round trip {mine.rtt_ms:.2f} ms, its peers' {base_rtt:.2f} ms")
    if lossy:
        bits.append(f"{mine.retrans_per_step:.1f} retransmits/step, its peers {base_ret:.1f}")
    return {"cause": "network_path", "signal": "tcp", "figures": figures,
            "text": f"rank {rank}: {'; '.join(bits)}"}


def _mbps(bps: float | None) -> float | None:
    return bps * 8 / 1e6 if bps is not None else None


def _r(v: float | None) -> float | None:
    return round(v, 3) if v is not None else None


STATE_NEXT = {
    "gpu_throttled": "look at {who}'s GPU: `nvidia-smi -q -d PERFORMANCE,TEMPERATURE,POWER` (the clock event "
                     "reasons), its cooling and power limit (`nvidia-smi -q -d POWER`), and ask for the node to be "
                     "drained if HW slowdown or XIDs persist",
    "gpu_link_degraded": "look at {who}'s GPU link: `nvidia-smi -q -d PCIE` (current vs max generation and width, "
                         "replay counter), reseat or service the GPU/riser, or drain the node",
    "network_path": "look at the path of {who}'s node: `ss -ti` on it (rtt, retrans), its NIC's link speed and "
                    "errors (`ethtool -S`), the switch port; run `iperf3` between its node and a peer's",
}


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




def by_rank(samples: Sequence[tuple[int, Mapping[int, RankCounters]]]
            ) -> dict[int, list[tuple[int, Mapping[int, RankCounters]]]]:
    """Each rank's own samples, in order: a figure read of every rank then reads each rank's samples only (the
    leader's diagnosis over several nodes holds one entry per node and poll: read whole for every rank, R²)."""
    out: dict[int, list[tuple[int, Mapping[int, RankCounters]]]] = {}
    for t, by in samples:
        for r, c in by.items():
            out.setdefault(r, []).append((t, {r: c}))
    return out


def rank_signals(
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]],
    windows: Mapping[int, Window],
    policy: CausePolicy | None = None,
) -> dict[str, dict[str, float]]:
    """Per rank, each signal in ms per compared step (what the summary shows beside the phases, straggler or
    not: a job slowed alike on every rank shows here, not in the diagnosis), with its busiest TCP path's
    delivery rate (Mbit/s), round trip (ms) and retransmits per step, and its GPU's mean SM clock (MHz)."""
    policy = policy or CausePolicy()
    out: dict[str, dict[str, float]] = {}
    own = by_rank(samples)
    for r, win in sorted(windows.items()):
        row = {}
        mine = own.get(r, [])
        for sig in SIGNALS:
            got = per_step(mine, r, sig, win, policy)
            if got is not None:
                row[sig.name] = round(got[0], 3)
        net = net_figures(mine, r, win, policy)
        if net is not None:  # the link signal, straggler or not: a capped link slows every rank's collectives
            for k, v in (("tcp_delivery_mbps", _mbps(net.delivery_bps)), ("tcp_rtt_ms", net.rtt_ms),
                         ("tcp_retrans_per_step", net.retrans_per_step)):
                if v is not None:
                    row[k] = round(v, 3)
        gpu = gpu_figures(mine, r, win, policy)
        if gpu is not None and gpu.clock_mhz is not None:
            row["gpu_sm_clock_mhz"] = round(gpu.clock_mhz, 1)
        if row:
            out[str(r)] = row
    return out


def path_cause(
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]],
    windows: Mapping[int, Window],
    policy: CausePolicy | None = None,
) -> dict[str, Any] | None:
    """A job that spends its steps in communication, with no straggler in its own work: a rank whose best path
    to another node is slower (or lossier) than its peers' names the path as the cause (``network_path``),
    the rank it is on as ``rank``. Every rank waits alike in a collective a slow link holds up; what sets the
    link's node apart is its connections, not its phases. None when no rank's connections stand out."""
    policy = policy or CausePolicy()
    best: tuple[float, dict[str, Any]] | None = None
    # each rank's figures once: asked of every rank against all its peers, they were read R² times (seconds for
    # the leader's diagnosis over a few hundred ranks of several nodes)
    own = by_rank(samples)
    known = {r: net_figures(own.get(r, []), r, w, policy) for r, w in windows.items()}
    for rank in sorted(windows):
        peers = [r for r in windows if r != rank]
        got = _net_cause(samples, windows, rank, peers, policy, known) if peers else None
        if got is None:
            continue
        f = got["figures"]
        score = ((f["peers_delivery_mbps"] or 0.0) / max(f["delivery_mbps"] or 0.0, 1e-6)
                 + (f["rtt_ms"] or 0.0) / max(f["peers_rtt_ms"] or 0.0, 1e-3) + (f["retrans_per_step"] or 0.0))
        if best is None or score > best[0]:
            best = (score, {"rank": rank, "lost_ms": 0.0, "signals": {got["signal"]: got["figures"]},
                            "cause": got["cause"], "signal": got["signal"], "share": None, "text": got["text"],
                            "next": STATE_NEXT[got["cause"]].format(who=fmt_ranks([rank]))})
    return best[1] if best else None


def thin_samples(samples: Sequence[tuple[int, Mapping[int, RankCounters]]],
                 cap: int) -> list[tuple[int, Mapping[int, RankCounters]]]:
    """At most ``cap`` of ``samples``, spread evenly over them with the first and the last, every sample that
    carries a TCP dump kept first (up to half of ``cap``): the counters are cumulative, so any subset gives the
    same deltas over the window; the TCP figures are read only every few polls and need their dumps. What a node
    shares with the leader (``cluster.correlate``), and what the leader keeps of its own beside it, so that both
    nodes' sampling intervals are alike when compared interval by interval."""
    n = len(samples)
    if n <= cap:
        return list(samples)
    if cap < 2:
        return list(samples[n - cap:])
    nets = [i for i, (_, by) in enumerate(samples) if any(c.net is not None for c in by.values())]
    half = cap // 2
    if len(nets) > half:
        nets = [nets[round(k * (len(nets) - 1) / max(1, half - 1))] for k in range(half)]
    rest = cap - len(nets)
    even = {round(k * (n - 1) / (rest - 1)) for k in range(rest)} if rest >= 2 else {n - 1}
    return [samples[i] for i in sorted(set(nets) | even)]


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
        diag.cause = path_cause(samples, windows, policy) if diag.label == "COMMUNICATION-BOUND" else None
        return diag
    diag.cause = attribute_cause(samples, windows, diag.straggler_ranks[0], diag.excess_ms, host, policy,
                                 who=diag.straggler_ranks)
    return diag


__all__ = ["CAUSES", "SIGNALS", "CausePolicy", "Window", "attribute_cause", "cause_line", "explain", "gpu_figures",
           "net_figures", "path_cause", "per_step", "rank_signals", "thin_samples"]
