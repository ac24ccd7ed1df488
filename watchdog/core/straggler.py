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

Each rank is compared with the median of the *other* ranks (leave-one-out), so two-rank jobs work and
one straggler cannot drag the baseline toward itself. Medians over the window ignore a single slow
step. An excess must clear both ``StragglerPolicy.abs_floor_ms`` and ``rel_threshold`` × median step.

Labels by the straggler's phase: ``INPUT STRAGGLER`` (``dataloader``), ``COMPUTE STRAGGLER``
(``forward``, ``backward`` with DDP timing, ``optimizer``, declared phases). A backward straggler
keeps the ``COMPUTE`` label (the ``phase`` field says ``backward``): what the user must look at is the
rank's own compute in that phase, whatever its cause (a slow gradient hook, a slower device). Without
straggler: ``<family>-BOUND`` when one family dominates the step, else ``BALANCED``.

DDP-timing caveats (see ``rankwatch.hooks.ddp_timing``): on CUDA the graph-done time is CPU-side, so
GPU work still queued lands in ``grad_sync`` on every rank; backward passes that are not split (plain
models, FSDP, ``no_sync()`` steps, ``RANKWATCH_DDP_TIMING=0``) produce no ``grad_sync`` and fall back
to treating ``backward`` as waiting.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the step ring type only: the pure core imports no record reader
    from rankwatch.hooks.record import StepTiming


from .ranks import fmt_ranks
from .schema import SUMMARY_SCHEMA

SYNC_PHASES = frozenset({"collective", "grad_sync"})
INPUT_PHASES = frozenset({"dataloader"})
COMPUTE_PHASES = frozenset({"forward", "backward", "optimizer"})


@dataclass(frozen=True)
class StragglerPolicy:
    # fewer common steps than this and no label is given: medians of a handful of steps mislead
    min_steps: int = 5
    # the most recent steps compared (old steps describe a job that may have changed)
    window_steps: int = 200
    # an excess below this is timer and scheduler noise on a busy host (seen up to ~2 ms with 4 ranks
    # sharing 2 cores)
    abs_floor_ms: float = 3.0
    # an excess must also be this share of the median step to matter to the user
    rel_threshold: float = 0.15
    # other ranks with an excess in the same phase of at least this share of the worst are named too
    co_straggler_share: float = 0.5
    # a phase family taking this share of the step makes the job "<family>-BOUND"
    bound_share: float = 0.5


@dataclass
class Diagnosis:
    label: str
    straggler_ranks: list[int]
    phase: str | None
    why: str
    steps: int
    step_time: dict[str, float]
    phases: dict[str, dict[str, float]]
    ranks: dict[str, dict[str, Any]]
    details: list[str] = field(default_factory=list)

    def summary_doc(
        self, job_id: str, incidents: Sequence[str], per_rank: Mapping[int, Sequence[StepTiming]] | None = None
    ) -> dict[str, Any]:
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
        }
        if per_rank is not None:
            doc["timeline"] = timeline(per_rank)
        return doc


def timeline(per_rank: Mapping[int, Sequence[StepTiming]], max_points: int = 500) -> dict[str, list[list[float]]]:
    """Step time per rank as [step, ms] pairs, evenly thinned to at most ``max_points`` per rank."""
    out = {}
    for rank, steps in sorted(per_rank.items()):
        stride = max(1, -(-len(steps) // max_points))
        out[str(rank)] = [[t.step, round(t.duration_ms, 3)] for t in list(steps)[::stride]]
    return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _align(per_rank: Mapping[int, Sequence[StepTiming]], window: int) -> tuple[list[int], dict[int, list[StepTiming]]]:
    """The most recent steps every rank completed, so ranks are compared on the same steps."""
    if not per_rank:
        return [], {}
    common = set.intersection(*(set(t.step for t in steps) for steps in per_rank.values()))
    # step 0 carries start-up costs (imports, warm-up) that say nothing about stragglers
    chosen = sorted(s for s in common if s > 0)[-window:] or sorted(common)[-window:]
    keep = set(chosen)
    return chosen, {r: [t for t in steps if t.step in keep] for r, steps in per_rank.items()}


def _sync_set(phase_names: set[str]) -> frozenset[str]:
    return SYNC_PHASES if "grad_sync" in phase_names else SYNC_PHASES | {"backward"}


def _family(phase: str | None) -> str:
    if phase in INPUT_PHASES:
        return "INPUT"
    if phase in SYNC_PHASES:
        return "COMMUNICATION"
    return "COMPUTE"


def diagnose_stragglers(
    per_rank: Mapping[int, Sequence[StepTiming]], policy: StragglerPolicy | None = None
) -> Diagnosis:
    policy = policy or StragglerPolicy()
    steps, aligned = _align(per_rank, policy.window_steps)
    ranks = sorted(aligned)
    phase_names = sorted({p for ts in aligned.values() for t in ts for p in t.phases_ms})
    med: dict[int, dict[str, float]] = {
        r: {p: _median([t.phases_ms.get(p, 0.0) for t in aligned[r]]) for p in phase_names} for r in ranks
    }
    step_med = {r: _median([t.duration_ms for t in aligned[r]]) for r in ranks}
    step_worst = {r: max((t.duration_ms for t in aligned[r]), default=0.0) for r in ranks}
    worst_rank = max(ranks, key=lambda r: step_worst[r], default=-1)
    phases_doc = {}
    for p in phase_names:
        worst_r = max(ranks, key=lambda r: max(t.phases_ms.get(p, 0.0) for t in aligned[r]))
        phases_doc[p] = {
            "median_ms": round(_median([med[r][p] for r in ranks]), 3),
            "worst_ms": round(max(t.phases_ms.get(p, 0.0) for t in aligned[worst_r]), 3),
            "worst_rank": worst_r,
            "skew_ms": round(max(med[r][p] for r in ranks) - min(med[r][p] for r in ranks), 3),
        }
    ranks_doc = {
        str(r): {
            "steps": len(per_rank[r]),
            "step_time_ms": round(step_med[r], 3),
            "phases": {p: round(med[r][p], 3) for p in phase_names},
        }
        for r in ranks
    }
    overall = _median(list(step_med.values()))
    step_doc = {
        "median": round(overall, 3),
        "worst": round(step_worst.get(worst_rank, 0.0), 3),
        "worst_rank": worst_rank,
    }

    def result(label: str, who: list[int], phase: str | None, why: str, details: list[str] | None = None) -> Diagnosis:
        return Diagnosis(label, who, phase, why, len(steps), step_doc, phases_doc, ranks_doc, details or [])

    if len(steps) < policy.min_steps or not ranks:
        return result("NOT ENOUGH DATA", [], None, f"only {len(steps)} common step(s); need {policy.min_steps}")

    threshold = max(policy.abs_floor_ms, policy.rel_threshold * overall)
    sync = _sync_set(set(phase_names))
    own = [p for p in phase_names if p not in sync]

    def excess(r: int, p: str) -> float:
        others = [med[q][p] for q in ranks if q != r]
        return med[r][p] - _median(others) if others else 0.0

    if len(ranks) > 1:
        candidates = sorted(((excess(r, p), r, p) for r in ranks for p in own), reverse=True)
        best, rank, phase = candidates[0]
        if best >= threshold:
            who = sorted(
                q for e, q, p in candidates if p == phase and e >= max(threshold, policy.co_straggler_share * best)
            )
            base = _median([med[q][phase] for q in ranks if q not in who])
            label = f"{_family(phase)} STRAGGLER"
            why = (
                f"{fmt_ranks(who)} "
                f"spend{'s' if len(who) == 1 else ''} "
                f"{med[rank][phase]:.1f} ms/step in {phase} vs {base:.1f} ms on the other ranks "
                f"(+{best:.1f} ms, {100 * best / overall:.0f}% of the {overall:.1f} ms median step); "
                "the other ranks wait for it"
            )
            details = [
                f"rank {r}: {phase} {med[r][phase]:.1f} ms, wait {sum(med[r][s] for s in sync if s in med[r]):.1f} ms"
                for r in ranks
            ]
            return result(label, who, phase, why, details)
    shares = {}
    for fam, members in (("INPUT", INPUT_PHASES), ("COMPUTE", COMPUTE_PHASES - sync), ("COMMUNICATION", sync)):
        shares[fam] = sum(_median([med[r][p] for r in ranks]) for p in phase_names if p in members)
    fam, value = max(shares.items(), key=lambda kv: kv[1])
    if overall > 0 and value / overall >= policy.bound_share:
        top_phase = max(
            (p for p in phase_names if _family(p) == fam or (fam == "COMMUNICATION" and p in sync)),
            key=lambda p: _median([med[r][p] for r in ranks]),
            default=None,
        )
        return result(
            f"{fam}-BOUND",
            [],
            top_phase,
            f"no straggler (largest per-rank excess below {threshold:.1f} ms); {fam.lower()} takes "
            f"{100 * value / overall:.0f}% of the {overall:.1f} ms median step on every rank",
        )
    return result("BALANCED", [], None, f"no straggler and no dominant phase ({overall:.1f} ms median step)")
