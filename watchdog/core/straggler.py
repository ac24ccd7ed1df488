"""Straggler diagnosis per rank and phase: a pure function over the ranks' step rings.

In synchronous data parallel training one rank's extra work shows up in every *other* rank as waiting
(inside backward, where DDP all-reduces gradients, or in a collective). So ranks are compared on their
**own work** only: phases where a rank waits for peers (``collective``, ``grad_sync``; and
``backward`` when DDP bucket timing is absent, since it then mixes compute and the gradient wait) are
kept apart. The hook's DDP timing splits backward into own compute (start of backward → the autograd
graph done on this rank, stamped by an engine callback that runs before DDP waits for its all-reduce)
and ``grad_sync`` (graph done → backward end), which lets a straggler whose extra work is inside
backward be named too.

Time spent waiting cannot name a straggler by itself: in a synchronous collective the rank that waits
longest is the *fastest* one. ``COMMUNICATION STRAGGLER`` is therefore only given by evidence that
measures the collective itself (flight recorder, NCCL RAS), not from step rings; from rings a job can
be ``COMMUNICATION-BOUND``.

**Time lost, not medians.** On every step each rank's own work in a phase is compared with the median of
the *other* ranks on the same step (leave-one-out, so two-rank jobs work and one straggler cannot drag
the baseline toward itself; the same step, so a slow step every rank shares is nobody's). A rank's
excess is the trimmed mean of those per-step excesses: the time it costs the job per step on average.
Trimming the few largest steps makes it robust to a single outlier, while a rank that is slow only every
4th step still loses a quarter of its extra time on average — which a median would hide. An excess must
clear ``abs_floor_ms`` and ``rel_threshold`` × the mean step, and come from at least ``min_slow_steps``
steps. ``why`` says how the time was lost: on every step, every N steps, in bursts, or since step K.

**The input pipeline, measured.** The hook times producing each batch (fetch + collate) where it
happens: in the DataLoader's worker processes, or on the training thread when ``num_workers=0``. With
workers, time in ``dataloader`` on the training thread is a *wait* for the pipeline (which rank waits
for input and which waits in ``grad_sync`` is an accident of phase), so when every rank has pipeline
timings the input comparison uses the pipeline's own time per step (batch time ÷ producers) instead.
Every rank's pipeline as slow as the others and slower than half the step is ``INPUT-BOUND``; only a
rank whose pipeline is slower than its peers' is an ``INPUT STRAGGLER``.

Labels by the straggler's phase: ``INPUT STRAGGLER`` (``dataloader``), ``COMPUTE STRAGGLER``
(``forward``, ``backward`` with DDP timing, ``optimizer``, declared phases). A backward straggler
keeps the ``COMPUTE`` label (the ``phase`` field says ``backward``). Without straggler:
``<family>-BOUND`` when one family dominates the step, else ``BALANCED``.

DDP-timing caveats (see ``rankwatch.hooks.ddp_timing``): on CUDA the graph-done time is CPU-side, so
GPU work still queued lands in ``grad_sync`` on every rank; backward passes that are not split (plain
models, FSDP, ``no_sync()`` steps, ``RANKWATCH_DDP_TIMING=0``) produce no ``grad_sync`` and fall back
to treating ``backward`` as waiting.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the step ring type only: the pure core imports no record reader
    from .steps import StepTiming


from .phases import COMPUTE_PHASES, INPUT_PHASES, SYNC_PHASES
from .phases import DATALOADER as INPUT_PHASE
from .ranks import fmt_ranks
from .schema import SUMMARY_SCHEMA


@dataclass(frozen=True)
class StragglerPolicy:
    # fewer common steps than this and no label is given: a handful of steps misleads
    min_steps: int = 5
    # the most recent steps compared (old steps describe a job that may have changed)
    window_steps: int = 200
    # an excess below this is timer and scheduler noise on a busy host (seen up to ~2 ms with 4 ranks
    # sharing 2 cores)
    abs_floor_ms: float = 3.0
    # an excess must also be this share of the mean step to matter to the user
    rel_threshold: float = 0.15
    # share of the steps trimmed from each end before averaging excesses (at least one step each end):
    # one 500 ms hiccup in 40 steps is gone, a rank slow every 4th step keeps ~23 of its 25% of steps
    trim_share: float = 0.02
    # a straggler is slow on at least this many steps: one GC pause or page-cache miss is not a straggler
    min_slow_steps: int = 3
    # slow on at least this share of the steps: "on every step" rather than a pattern
    steady_share: float = 0.8
    # at least this share of the gaps between slow steps equal: "every N steps"
    periodic_share: float = 0.7
    # other ranks with an excess in the same phase of at least this share of the worst are named too
    co_straggler_share: float = 0.5
    # a phase family (or the input pipeline) taking this share of the step makes the job "<family>-BOUND"
    bound_share: float = 0.5
    # a rank-wide straggler is slower by at least this share of the threshold in two or more phases (below
    # it a phase is noise), and the excess summed over all its own phases clears the threshold
    rank_wide_phase_share: float = 0.2
    # ... on at least this share of the steps: a whole-process slowdown is steady; a rank slow on a third of
    # its steps beside CPU hogs is the scheduler's noise (a balanced 2-rank job at 2 hogs: 12 of 39 steps)
    rank_wide_steady_share: float = 0.5
    # a phase straggler that is also this much slower (its excess / its peers' time) in *every* other phase
    # of its own work is rank-wide, its time lost summed over the phases: extra work of its own lands in
    # one phase and leaves the others within noise (a few %), while a whole-process slowdown (a CPU shared
    # with other processes, a quota) stretches every phase by a like factor (measured: x3 and more with two
    # busy processes on its CPU), however unevenly its work is spread over them
    rank_wide_rel_share: float = 0.3
    # ... counting only phases of at least this many ms on its peers: a 0.2 ms phase's relative noise on a
    # busy host is larger than any slowdown
    rank_wide_min_phase_ms: float = 0.5
    # ... and only by a like factor: its largest relative slowdown among those phases at most this many times
    # its smallest. A whole-process slowdown stretches every phase alike (x2-x4 each with two busy processes on
    # its CPU); extra work of its own beside host load stretches its own phase tens of times and the others by
    # the load's share (measured, ddp slow-rank beside a CI run: optimizer +48 ms on ~1.5 ms, forward +2 ms on
    # ~5 ms: read as rank-wide at 0.3 alone)
    rank_wide_like_factor: float = 4.0
    # no rank is named unless its per-step excess beats the run's own noise: its mean excess must be at
    # least this many standard errors (its per-step excesses' standard deviation / sqrt(steps)) above zero.
    # One-sided, about 1 % of a noise-only rank passing on 7 steps (Student's t, 6 degrees of freedom:
    # 3.14) and well under 1 % on 40; a steady straggler's excess is many times that, and a rank slow on
    # every 4th step by 300 ms passes from ~30 steps on. Seven noisy steps of a job about to hang named a
    # straggler it did not have in 2 of 14 runs (issue 41): five big hiccups look like a pattern, not like
    # evidence
    min_evidence_t: float = 3.0


@dataclass
class StragglerDiagnosis:
    label: str
    straggler_ranks: list[int]
    phase: str | None
    why: str
    steps: int
    step_time: dict[str, float]
    phases: dict[str, dict[str, float]]
    ranks: dict[str, dict[str, Any]]
    details: list[str] = field(default_factory=list)
    # how the straggler lost its time: kind (steady, periodic, bursts, since, scattered), period,
    # since_step, slow_steps, slow_step_ms; empty without straggler
    pattern: dict[str, Any] = field(default_factory=dict)
    # the straggler's excess summed over the compared steps (ms): what the job lost to it
    time_lost_ms: float = 0.0
    # the straggler's per-step excess is measured on the input pipeline, not on the dataloader wait
    input_pipeline: bool = False
    # the straggler's excess per step (ms): what the cause must explain
    excess_ms: float = 0.0
    # per rank, the compared steps in wall time: (first step's start ns, last step's end ns, steps)
    windows: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    # why the straggler is slow (``core.straggler_cause``), set by the caller that sampled the host signals
    cause: dict[str, Any] | None = None
    # per rank, each host signal in ms per compared step (``core.straggler_cause.rank_signals``)
    signals: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary_doc(
        self,
        job_id: str,
        incidents: Sequence[str],
        per_rank: Mapping[int, Sequence[StepTiming]] | None = None,
        verdicts: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """The summary document; ``verdicts`` (the run's incidents) come first in what people read: a run
        that hung is a hang, whatever its steps looked like before."""
        doc: dict[str, Any] = {
            "schema": SUMMARY_SCHEMA,
            "job_id": job_id,
            "diagnosis": self.label,
            "straggler_ranks": self.straggler_ranks,
            "phase": self.phase,
            "steps": self.steps,
            "step_time_ms": self.step_time,
            "phases": self.phases,
            "ranks": self.ranks,
            "incidents": list(incidents),
            "why": self.why,
            "pattern": self.pattern,
            "time_lost_ms": round(self.time_lost_ms, 3),
            "excess_ms": round(self.excess_ms, 3),
            "cause": self.cause,
            "signals": self.signals,
            # each incident's verdict without its per-rank table and evidence (those are in the bundle)
            "incident_verdicts": [
                {k: v.get(k) for k in ("job_id", "incident_id", "kind", "initiating_ranks", "phase", "confidence",
                                       "reason", "detected_after_s") if k in v}
                for v in verdicts
            ],
        }
        if per_rank is not None:
            doc["steps_total"] = max((steps_completed(s) for s in per_rank.values()), default=0)
            doc["timeline"] = timeline(per_rank)
        return doc


def steps_completed(steps: Sequence[StepTiming]) -> int:
    """Steps a rank completed: the hook numbers steps from 0, so the last one's number + 1 — exact however
    much of the ring a history kept."""
    return max((t.step for t in steps), default=-1) + 1 if steps else 0


def sync_set(phase_names: set[str]) -> frozenset[str]:
    """The phases that are waits for peers (``backward`` too when DDP timing did not split it)."""
    return SYNC_PHASES if "grad_sync" in phase_names else SYNC_PHASES | {"backward"}


def own_and_wait_ms(t: StepTiming, sync: frozenset[str]) -> tuple[float, float]:
    wait = sum(v for p, v in t.phases_ms.items() if p in sync)
    return sum(t.phases_ms.values()) - wait, wait


def timeline(per_rank: Mapping[int, Sequence[StepTiming]], max_points: int = 500) -> dict[str, list[list[float]]]:
    """Per rank, [step, step ms, own work ms, wait ms] points, evenly thinned to at most ``max_points``.

    In synchronous training every rank's step lasts as long; what differs is how much of it was the
    rank's own work and how much waiting for peers."""
    names = {p for steps in per_rank.values() for t in steps for p in t.phases_ms}
    sync = sync_set(names)
    out = {}
    for rank, steps in sorted(per_rank.items()):
        stride = max(1, -(-len(steps) // max_points))
        points = []
        for t in list(steps)[::stride]:
            own, wait = own_and_wait_ms(t, sync)
            points.append([t.step, round(t.duration_ms, 3), round(own, 3), round(wait, 3)])
        out[str(rank)] = points
    return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else 0.0


def trimmed_mean(xs: Sequence[float], share: float) -> float:
    """Mean without the ``k`` largest and ``k`` smallest values, k = max(1, share × n) (none below 5 values)."""
    n = len(xs)
    if n < 5:
        return _mean(xs)
    k = max(1, int(share * n))
    return _mean(sorted(xs)[k : n - k])


def leave_one_out_medians(values: Sequence[float]) -> list[float]:
    """For each value, the median of the *others* (one sort, O(1) per rank: large jobs stay cheap)."""
    n = len(values)
    if n < 2:
        return [0.0] * n
    order = sorted(range(n), key=values.__getitem__)
    s = [values[i] for i in order]
    m = n - 1
    out = [0.0] * n
    for pos, i in enumerate(order):
        lo, hi = (m - 1) // 2, m // 2
        a = s[lo] if lo < pos else s[lo + 1]
        b = s[hi] if hi < pos else s[hi + 1]
        out[i] = (a + b) / 2
    return out


def _align(per_rank: Mapping[int, Sequence[StepTiming]], window: int) -> tuple[list[int], dict[int, list[StepTiming]]]:
    """The most recent steps every rank completed, in step order, so ranks are compared on the same steps."""
    if not per_rank:
        return [], {}
    by_step = {r: {t.step: t for t in steps} for r, steps in per_rank.items()}
    common = set.intersection(*(set(d) for d in by_step.values()))
    # step 0 carries start-up costs (imports, warm-up) that say nothing about stragglers
    chosen = sorted(s for s in common if s > 0)[-window:] or sorted(common)[-window:]
    return chosen, {r: [d[s] for s in chosen] for r, d in by_step.items()}


def _family(phase: str | None) -> str:
    if phase in INPUT_PHASES:
        return "INPUT"
    if phase in SYNC_PHASES:
        return "COMMUNICATION"
    return "COMPUTE"


def pipeline_ms(t: StepTiming) -> float:
    """The input pipeline's time in this step per producer: batch production time ÷ workers (1 when the
    training thread produces its own batches)."""
    return t.input_ms / max(1, t.input_workers)


def describe_pattern(
    steps: Sequence[int], excess: Sequence[float], slow_ms: float, policy: StragglerPolicy
) -> dict[str, Any]:
    """How a rank's excess is spread over the steps: ``steady``, ``periodic`` (every N steps), ``since``
    (from step K on), ``bursts`` or ``scattered``, with the slow steps and their mean excess."""
    above = [e for e in excess if e >= slow_ms]
    # a step is slow at half the typical slow step's excess or more: a busy host's 5–10 ms hiccups on
    # other steps then do not break up a pattern of 300 ms stalls
    cut = max(slow_ms, 0.5 * _median(above)) if above else slow_ms
    slow = [i for i, e in enumerate(excess) if e >= cut]
    n = len(excess)
    out: dict[str, Any] = {
        "slow_steps": len(slow),
        "of_steps": n,
        "slow_step_ms": round(_mean([excess[i] for i in slow]), 3),
        "first_slow_step": steps[slow[0]] if slow else None,
    }
    if not slow:
        out["kind"] = "scattered"
        return out
    if len(slow) >= policy.steady_share * n:
        out["kind"] = "steady"
        return out
    first = slow[0]
    tail = n - first
    if first >= 0.1 * n and len(slow) >= policy.steady_share * tail:
        out.update(kind="since", since_step=steps[first])
        return out
    gaps = [steps[b] - steps[a] for a, b in itertools.pairwise(slow)]
    if gaps:
        period, count = Counter(gaps).most_common(1)[0]
        if period >= 2 and count >= policy.periodic_share * len(gaps):
            out.update(kind="periodic", period=period)
            return out
        runs = 1 + sum(1 for g in gaps if g > 1)
        if runs >= 2 and len(slow) / runs >= 2:
            out.update(kind="bursts", bursts=runs, burst_steps=round(len(slow) / runs, 1))
            return out
    out["kind"] = "scattered"
    return out


def pattern_text(p: Mapping[str, Any]) -> str:
    kind = p.get("kind")
    each = f"+{p.get('slow_step_ms', 0):.0f} ms"
    if kind == "steady":
        return f"on every step ({p.get('slow_steps')} of {p.get('of_steps')})"
    if kind == "periodic":
        return f"{each} every {p.get('period')} steps ({p.get('slow_steps')} of {p.get('of_steps')} steps)"
    if kind == "since":
        return f"since step {p.get('since_step')} ({each} on {p.get('slow_steps')} of {p.get('of_steps')} steps)"
    if kind == "bursts":
        return f"in {p.get('bursts')} bursts of ~{p.get('burst_steps')} steps ({each} each step)"
    return f"{each} on {p.get('slow_steps')} of {p.get('of_steps')} steps"


@dataclass
class _Window:
    """The statistics of the compared steps that every label below reads."""

    steps: list[int]
    ranks: list[int]
    phase_names: list[str]
    series: dict[int, dict[str, list[float]]]  # rank -> phase -> ms per compared step
    mean: dict[int, dict[str, float]]  # rank -> phase -> mean ms
    sync: frozenset[str]  # the phases that are waits for peers
    has_pipeline: bool  # every rank measured its input pipeline
    pipe: dict[int, list[float]]  # rank -> pipeline ms per step (empty without pipeline)
    pipe_doc: dict[int, dict[str, float]]
    overall: float  # the median of the ranks' mean step (ms)

    def wait(self, r: int) -> float:
        return sum(self.mean[r][p] for p in self.phase_names if p in self.sync)


def _window(aligned: Mapping[int, Sequence[StepTiming]], steps: list[int]) -> _Window:
    ranks = sorted(aligned)
    phase_names = sorted({p for ts in aligned.values() for t in ts for p in t.phases_ms})
    series = {r: {p: [t.phases_ms.get(p, 0.0) for t in aligned[r]] for p in phase_names} for r in ranks}
    # the input pipeline, where every rank measured it (torch DataLoader batches seen in the window)
    has_pipeline = bool(ranks) and all(sum(t.input_batches for t in aligned[r]) > 0 for r in ranks)
    pipe: dict[int, list[float]] = {r: [pipeline_ms(t) for t in aligned[r]] for r in ranks} if has_pipeline else {}
    pipe_doc: dict[int, dict[str, float]] = {}
    for r in pipe:
        batches = sum(t.input_batches for t in aligned[r])
        pipe_doc[r] = {
            "batch_ms": round(sum(t.input_ms for t in aligned[r]) / batches, 3),
            "workers": max((t.input_workers for t in aligned[r]), default=0),
            "per_step_ms": round(_mean(pipe[r]), 3),
        }
    return _Window(
        steps=steps,
        ranks=ranks,
        phase_names=phase_names,
        series=series,
        mean={r: {p: _mean(series[r][p]) for p in phase_names} for r in ranks},
        sync=sync_set(set(phase_names)),
        has_pipeline=has_pipeline,
        pipe=pipe,
        pipe_doc=pipe_doc,
        overall=_median([_mean([t.duration_ms for t in aligned[r]]) for r in ranks]),
    )


def _documents(
    w: _Window, per_rank: Mapping[int, Sequence[StepTiming]], aligned: Mapping[int, Sequence[StepTiming]]
) -> tuple[dict[str, float], dict[str, dict[str, float]], dict[str, dict[str, Any]]]:
    """The step, phase and rank tables of the summary: (step_doc, phases_doc, ranks_doc)."""
    ranks, phase_names, series, mean = w.ranks, w.phase_names, w.series, w.mean
    med = {r: {p: _median(series[r][p]) for p in phase_names} for r in ranks}
    step_worst = {r: max((t.duration_ms for t in aligned[r]), default=0.0) for r in ranks}
    worst_rank = max(ranks, key=lambda r: step_worst[r], default=-1)
    phases_doc = {}
    for p in phase_names:
        worst_r = max(ranks, key=lambda r: max(series[r][p]))
        phases_doc[p] = {
            "mean_ms": round(_median([mean[r][p] for r in ranks]), 3),
            "median_ms": round(_median([med[r][p] for r in ranks]), 3),
            "worst_ms": round(max(series[worst_r][p]), 3),
            "worst_rank": worst_r,
            "skew_ms": round(max(mean[r][p] for r in ranks) - min(mean[r][p] for r in ranks), 3),
        }
    ranks_doc: dict[str, dict[str, Any]] = {}
    for r in ranks:
        wait = w.wait(r)
        ranks_doc[str(r)] = {
            "steps": steps_completed(per_rank[r]),
            "step_time_ms": round(_mean([t.duration_ms for t in aligned[r]]), 3),
            "own_ms": round(sum(mean[r].values()) - wait, 3),
            "wait_ms": round(wait, 3),
            "phases": {p: round(mean[r][p], 3) for p in phase_names},
            **({"input_pipeline": w.pipe_doc[r]} if r in w.pipe_doc else {}),
        }
    step_doc = {
        "mean": round(w.overall, 3),
        "median": round(_median([_median([t.duration_ms for t in aligned[r]]) for r in ranks]), 3),
        "worst": round(step_worst.get(worst_rank, 0.0), 3),
        "worst_rank": worst_rank,
    }
    return step_doc, phases_doc, ranks_doc


def _per_step_excess(
    w: _Window, own: Sequence[str], compared: Mapping[str, Mapping[int, Sequence[float]]]
) -> dict[tuple[int, str], list[float]]:
    """Per (rank, compared phase), each step's excess over the median of the other ranks on that step."""
    ranks = w.ranks
    per_step_excess: dict[tuple[int, str], list[float]] = {}
    if len(ranks) < 2:
        return per_step_excess
    for p, by_rank in compared.items():
        cols = [by_rank[r] for r in ranks]
        rows: list[list[float]] = [[] for _ in ranks]
        for i in range(len(w.steps)):
            at_step = [c[i] for c in cols]
            for j, base in enumerate(leave_one_out_medians(at_step)):
                rows[j].append(at_step[j] - base)
        for j, r in enumerate(ranks):
            per_step_excess[(r, p)] = rows[j]
    if w.has_pipeline and INPUT_PHASE in w.series[ranks[0]] and all(w.pipe_doc[r]["workers"] > 0 for r in ranks):
        # with workers the training thread's dataloader time is a wait: a rank whose own work runs longer
        # finds its next batch that much sooner, so the wait it saved is no time lost (one rank's compute
        # slowed by a busy host's scheduler does not make an input-bound job a compute straggler)
        saved: list[list[float]] = [[] for _ in ranks]
        for i in range(len(w.steps)):
            at_step = [w.series[r][INPUT_PHASE][i] for r in ranks]
            for j, base in enumerate(leave_one_out_medians(at_step)):
                saved[j].append(min(0.0, at_step[j] - base))
        for j, r in enumerate(ranks):
            for p in own:
                per_step_excess[(r, p)] = [e + s for e, s in zip(per_step_excess[(r, p)], saved[j], strict=True)]
    return per_step_excess


_Result = Callable[..., "StragglerDiagnosis"]


def diagnose_stragglers(
    per_rank: Mapping[int, Sequence[StepTiming]], policy: StragglerPolicy | None = None
) -> StragglerDiagnosis:
    policy = policy or StragglerPolicy()
    steps, aligned = _align(per_rank, policy.window_steps)
    w = _window(aligned, steps)
    step_doc, phases_doc, ranks_doc = _documents(w, per_rank, aligned)

    windows = {r: (ts[0].start_ns, ts[-1].end_ns, len(ts)) for r, ts in aligned.items() if ts}

    def result(label: str, who: list[int], phase: str | None, why: str, **kw: Any) -> StragglerDiagnosis:
        return StragglerDiagnosis(label, who, phase, why, len(steps), step_doc, phases_doc, ranks_doc,
                                  windows=windows, **kw)

    if len(steps) < policy.min_steps or not w.ranks:
        return result("NOT ENOUGH DATA", [], None, f"only {len(steps)} common step(s); need {policy.min_steps}")

    threshold = max(policy.abs_floor_ms, policy.rel_threshold * w.overall)
    own = [p for p in w.phase_names if p not in w.sync and not (w.has_pipeline and p == INPUT_PHASE)]
    compared: dict[str, dict[int, list[float]]] = {p: {r: w.series[r][p] for r in w.ranks} for p in own}
    if w.has_pipeline:
        compared[INPUT_PHASE] = w.pipe
    per_step_excess = _per_step_excess(w, own, compared)
    phase = _phase_straggler(w, policy, threshold, compared, per_step_excess, result)
    if phase is not None and len(phase.straggler_ranks) == 1 and not phase.input_pipeline:
        # slower in every phase, whatever phase stands out most: a whole-process slowdown, its time summed
        wide = _slower_everywhere(w, phase.straggler_ranks[0], own, compared, per_step_excess, policy)
        if wide is not None:
            return _rank_wide_straggler(w, policy, threshold, own, compared, per_step_excess, result, wide) or phase
    return (
        phase
        or _rank_wide_straggler(w, policy, threshold, own, compared, per_step_excess, result)
        or _bound(w, policy, threshold, result)
    )


def _slower_everywhere(
    w: _Window,
    rank: int,
    own: Sequence[str],
    compared: Mapping[str, Mapping[int, Sequence[float]]],
    per_step_excess: Mapping[tuple[int, str], list[float]],
    policy: StragglerPolicy,
) -> tuple[int, float, dict[str, float]] | None:
    """(rank, summed excess ms/step, excess by phase) when ``rank`` is slower by ``rank_wide_rel_share`` or
    more in every phase of its own work that its peers spend ``rank_wide_min_phase_ms`` in (two or more)."""
    phases = [p for p in own if p in compared and p != "idle"]
    peers = [q for q in w.ranks if q != rank]
    by_phase: dict[str, float] = {}
    relative: list[float] = []
    for p in phases:
        base = _median([_mean(compared[p][q]) for q in peers])
        if base < policy.rank_wide_min_phase_ms:
            e = trimmed_mean(per_step_excess[(rank, p)], policy.trim_share)
            if base > 0 and e >= policy.rank_wide_min_phase_ms:
                # a short phase is no evidence of a slowdown everywhere, but a large excess in it is evidence
                # against one: extra work of its own in a phase its peers pass in 0.3 ms (``like_factor``)
                relative.append(e / base)
            continue
        e = trimmed_mean(per_step_excess[(rank, p)], policy.trim_share)
        if e < policy.rank_wide_rel_share * base:
            return None
        by_phase[p] = e
        relative.append(e / base)
    if len(by_phase) < 2 or max(relative) > policy.rank_wide_like_factor * min(relative):
        return None
    n = len(w.steps)
    summed = [math.fsum(per_step_excess[(rank, p)][i] for p in phases) for i in range(n)]
    return rank, trimmed_mean(summed, policy.trim_share), by_phase


def evidence_t(xs: Sequence[float], share: float) -> float:
    """How many standard errors the trimmed mean of ``xs`` is above zero (inf when every value is alike and
    positive): the same trimming as the excess itself, so one outlier neither makes nor breaks the case."""
    n = len(xs)
    kept = sorted(xs)
    if n >= 5:
        k = max(1, int(share * n))
        kept = kept[k : n - k]
    if len(kept) < 2:
        return 0.0
    mean = _mean(kept)
    sd = statistics.stdev(kept)
    if sd == 0:
        return math.inf if mean > 0 else 0.0
    return mean / (sd / math.sqrt(len(kept)))


def _phase_straggler(
    w: _Window,
    policy: StragglerPolicy,
    threshold: float,
    compared: Mapping[str, Mapping[int, Sequence[float]]],
    per_step_excess: Mapping[tuple[int, str], list[float]],
    result: _Result,
) -> StragglerDiagnosis | None:
    """The rank (and its co-stragglers) whose excess in one phase clears the threshold, and how it lost time."""
    ranks, steps, overall = w.ranks, w.steps, w.overall

    def excess(r: int, p: str) -> float:
        return trimmed_mean(per_step_excess[(r, p)], policy.trim_share)

    def slow_count(r: int, p: str) -> int:
        return sum(1 for e in per_step_excess[(r, p)] if e >= threshold)

    candidates = sorted(
        ((excess(r, p), r, p) for (r, p) in per_step_excess
         if slow_count(r, p) >= policy.min_slow_steps
         and evidence_t(per_step_excess[(r, p)], policy.trim_share) >= policy.min_evidence_t),
        reverse=True,
    )
    if not candidates or candidates[0][0] < threshold:
        return None
    best, rank, phase = candidates[0]
    co_floor = max(threshold, policy.co_straggler_share * best)
    who = sorted(q for e, q, p in candidates if p == phase and e >= co_floor)
    on_pipe = w.has_pipeline and phase == INPUT_PHASE
    values = compared[phase]
    others = [q for q in ranks if q not in who]
    base = _median([_mean(values[q]) for q in others])
    spread = per_step_excess[(rank, phase)]
    if on_pipe and w.pipe_doc[rank]["workers"] > 1:
        # workers finish batches in lumps (0, 1 or 2 per step): the pattern is read over as many steps
        # as there are workers, or alternating steps would look like "every 2 steps"
        n = int(w.pipe_doc[rank]["workers"])
        spread = [_mean(spread[max(0, i - n + 1) : i + 1]) for i in range(len(spread))]
    pattern = describe_pattern(steps, spread, threshold, policy)
    lost = math.fsum(per_step_excess[(rank, phase)])
    if on_pipe:
        what = (
            f"{fmt_ranks(who)}'s input pipeline need{'s' if len(who) == 1 else ''} "
            f"{w.pipe_doc[rank]['per_step_ms']:.1f} ms/step ({_batch_text(w.pipe_doc[rank])}) "
            f"vs {base:.1f} ms on the other ranks"
        )
    else:
        what = (
            f"{fmt_ranks(who)} spend{'s' if len(who) == 1 else ''} {_mean(values[rank]):.1f} ms/step in "
            f"{phase} vs {base:.1f} ms on the other ranks"
        )
    why = (
        f"{what}: +{best:.1f} ms/step ({100 * best / overall:.0f}% of the {overall:.1f} ms mean step), "
        f"{pattern_text(pattern)}; {lost / 1e3:.2f} s lost over {len(steps)} steps; the other ranks wait for it"
    )
    details = [
        f"rank {r}: {phase}{' pipeline' if on_pipe else ''} {_mean(values[r]):.1f} ms/step "
        f"(excess {excess(r, phase):+.1f}), wait {sum(w.mean[r][s] for s in w.sync if s in w.mean[r]):.1f} ms"
        for r in ranks
    ]
    return result(f"{_family(phase)} STRAGGLER", who, phase, why, details=details, pattern=pattern,
                  time_lost_ms=lost, input_pipeline=on_pipe, excess_ms=best)


def _rank_wide_straggler(
    w: _Window,
    policy: StragglerPolicy,
    threshold: float,
    own: Sequence[str],
    compared: Mapping[str, Mapping[int, Sequence[float]]],
    per_step_excess: Mapping[tuple[int, str], list[float]],
    result: _Result,
    wide: tuple[int, float, dict[str, float]] | None = None,
) -> StragglerDiagnosis | None:
    """A rank slower in every phase of its own work (a whole-process slowdown), in words."""
    wide = wide or _rank_wide(w.ranks, own, compared, per_step_excess, threshold, policy)
    if wide is None:
        return None
    rank, best, by_phase = wide
    steps, overall = w.steps, w.overall
    per_step = [math.fsum(per_step_excess[(rank, p)][i] for p in own if p != "idle") for i in range(len(steps))]
    lost = math.fsum(per_step)
    pattern = describe_pattern(steps, per_step, threshold, policy)
    parts = ", ".join(f"{p} {e:+.1f}" for p, e in sorted(by_phase.items(), key=lambda kv: -kv[1]))
    why = (
        f"rank {rank} is slower across the phases of its own work ({parts} "
        f"ms/step), together +{best:.1f} ms/step ({100 * best / overall:.0f}% of the {overall:.1f} ms mean "
        f"step), {pattern_text(pattern)}; {lost / 1e3:.2f} s lost over {len(steps)} steps; the other ranks "
        "wait for it (a whole-process slowdown: CPU contention, a busy thread of its own, a slower host)"
    )
    details = [
        f"rank {r}: own work excess "
        f"{sum(trimmed_mean(per_step_excess[(r, p)], policy.trim_share) for p in by_phase):+.1f} ms/step"
        for r in w.ranks
    ]
    return result("RANK-WIDE STRAGGLER", [rank], None, why, details=details, pattern=pattern, time_lost_ms=lost,
                  excess_ms=best)


def _bound(w: _Window, policy: StragglerPolicy, threshold: float, result: _Result) -> StragglerDiagnosis:
    """Without a straggler: what the step is bound by (a declared phase, the input pipeline, a phase family)."""
    ranks, phase_names, mean, sync, overall = w.ranks, w.phase_names, w.mean, w.sync, w.overall
    no_straggler = f"no straggler (largest per-rank excess below {threshold:.1f} ms/step)"
    # a declared phase (a checkpoint, an evaluation) is named as itself: the other ranks' wait for it in
    # the next collective is its consequence, not a communication problem
    declared = [p for p in phase_names if p not in sync and _family(p) == "COMPUTE" and p not in COMPUTE_PHASES
                and p != "idle"]
    if declared and overall > 0:
        top = max(declared, key=lambda p: max(mean[r][p] for r in ranks))
        holder = max(ranks, key=lambda r: mean[r][top])
        took = mean[holder][top]
        comm = _median([w.wait(r) for r in ranks])
        if took / overall >= policy.bound_share or (took >= comm and took / overall >= policy.rel_threshold):
            on_all = all(mean[r][top] >= 0.5 * took for r in ranks)
            who_txt = "every rank" if on_all else fmt_ranks([r for r in ranks if mean[r][top] >= 0.5 * took])
            return result(
                "DECLARED-PHASE-BOUND",
                [],
                top,
                f"{no_straggler}; the declared phase '{top}' takes {took:.1f} ms/step on {who_txt} "
                f"({100 * took / overall:.0f}% of the {overall:.1f} ms mean step)"
                + ("" if on_all else f"; the other ranks wait for it ({comm:.1f} ms/step in communication)"),
            )
    if w.has_pipeline and overall > 0:
        need = _median([w.pipe_doc[r]["per_step_ms"] for r in ranks])
        if need / overall >= policy.bound_share:
            compute = _median([sum(mean[r][p] for p in phase_names if p not in sync and p != INPUT_PHASE)
                               for r in ranks])
            typical = {"batch_ms": _median([w.pipe_doc[r]["batch_ms"] for r in ranks]),
                       "workers": max(w.pipe_doc[r]["workers"] for r in ranks)}
            return result(
                "INPUT-BOUND",
                [],
                INPUT_PHASE,
                f"{no_straggler}; every rank's input pipeline needs ~{need:.1f} ms per step "
                f"({_batch_text(typical)}), {100 * need / overall:.0f}% of the "
                f"{overall:.1f} ms mean step, while own compute takes {compute:.1f} ms: more DataLoader workers "
                "or a cheaper dataset/collate on every rank",
                input_pipeline=True,
            )
    shares = {}
    for fam, members in (("INPUT", INPUT_PHASES), ("COMPUTE", COMPUTE_PHASES - sync), ("COMMUNICATION", sync)):
        shares[fam] = sum(_median([mean[r][p] for r in ranks]) for p in phase_names if p in members)
    if w.has_pipeline:
        shares.pop("INPUT")  # the dataloader wait is a wait for a pipeline that was not the bottleneck
    fam, value = max(shares.items(), key=lambda kv: kv[1])
    if overall > 0 and value / overall >= policy.bound_share:
        top_phase = max(
            (p for p in phase_names if _family(p) == fam or (fam == "COMMUNICATION" and p in sync)),
            key=lambda p: _median([mean[r][p] for r in ranks]),
            default=None,
        )
        return result(
            f"{fam}-BOUND",
            [],
            top_phase,
            f"{no_straggler}; {fam.lower()} takes {100 * value / overall:.0f}% of the {overall:.1f} ms mean step "
            "on every rank",
        )
    return result("BALANCED", [], None, f"no straggler and no dominant phase ({overall:.1f} ms mean step)")


def _rank_wide(
    ranks: Sequence[int],
    own: Sequence[str],
    compared: Mapping[str, Mapping[int, Sequence[float]]],
    per_step_excess: Mapping[tuple[int, str], list[float]],
    threshold: float,
    policy: StragglerPolicy,
) -> tuple[int, float, dict[str, float]] | None:
    """The rank slower in *every* phase of its own work by a little (each phase below the threshold) whose
    excess summed over those phases clears it, steadily and beyond the run's noise: (rank, summed excess
    ms/step, excess by phase)."""
    phases = [p for p in own if p in compared and p != "idle"]
    if len(ranks) < 2 or len(phases) < 2:
        return None
    best: tuple[int, float, dict[str, float]] | None = None
    for r in ranks:
        by_phase = {p: trimmed_mean(per_step_excess[(r, p)], policy.trim_share) for p in phases}
        slower = {p: e for p, e in by_phase.items() if e >= policy.rank_wide_phase_share * threshold}
        if len(slower) < 2:
            continue  # one phase: that phase's own straggler check already answered
        n = len(per_step_excess[(r, phases[0])])
        summed = [math.fsum(per_step_excess[(r, p)][i] for p in phases) for i in range(n)]
        total = trimmed_mean(summed, policy.trim_share)
        slow = sum(1 for e in summed if e >= threshold)
        steady = slow >= max(policy.min_slow_steps, policy.rank_wide_steady_share * n)
        strong = evidence_t(summed, policy.trim_share) >= policy.min_evidence_t
        if total >= threshold and steady and strong and (best is None or total > best[1]):
            best = (r, total, slower)
    return best


def _batch_text(pipe: Mapping[str, float]) -> str:
    n = int(pipe["workers"])
    if n <= 0:
        return f"{pipe['batch_ms']:.1f} ms per batch, made on the training thread: no DataLoader workers"
    return f"a batch takes {pipe['batch_ms']:.1f} ms in each of {n} DataLoader worker{'s' if n != 1 else ''}"
