"""Cumulative step and phase duration histograms per rank, for Prometheus.

A gauge of the last step samples one arbitrary step per scrape; a histogram counts every step the
daemon read, so rates, quantiles and the share of slow steps over any range come out right. Counts only
grow (a rank's restart keeps adding to the same series), as Prometheus expects of a histogram.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the step type only: the pure core imports no record reader
    from rankwatch.hooks.record import StepTiming

# upper bounds in seconds, 5 ms to 2 minutes (beyond: +Inf, a checkpoint step). Steps and dataloader waits
# of real jobs sit between 5 ms and 2 s: there the bounds are at most ~1.7x apart (no 50 -> 100 ms jump,
# which read a 61 ms p50 as 75 ms), so histogram_quantile's linear interpolation stays within ~20%.
# 20 bounds: with +Inf, _sum and _count, 23 series per histogram (the series budget, serve.metrics).
BUCKETS_S = (0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 5.0,
             10.0, 30.0, 120.0)
# phase names per rank with a histogram of their own (a record declares at most 16; restarts may rename)
MAX_PHASES = 32


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))  # last: above every bound
    sum_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """Prometheus buckets [(le, count ≤ le)…, ("+Inf", all)] and the sum, from one copy of the counts
        (another thread may be adding: the buckets stay consistent with each other)."""
        counts = list(self.counts)
        total, out = 0, []
        for bound, n in zip((*(f"{b:g}" for b in BUCKETS_S), "+Inf"), counts, strict=True):
            total += n
            out.append((bound, float(total)))
        return out, self.sum_s


@dataclass
class RankHistograms:
    step: Histogram = field(default_factory=Histogram)
    phases: dict[str, Histogram] = field(default_factory=dict)

    def add(self, steps: tuple[StepTiming, ...] | list[StepTiming]) -> None:
        for t in steps:
            self.step.add(t.duration_ms / 1e3)
            for p, ms in t.phases_ms.items():
                h = self.phases.get(p)
                if h is None:
                    if len(self.phases) >= MAX_PHASES:
                        continue
                    h = self.phases[p] = Histogram()
                h.add(ms / 1e3)
