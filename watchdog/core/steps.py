"""A completed step as the core's rules see it: the record reader (``rankwatch.hooks.record``) builds these
from a rank's step ring; straggler diagnosis, histograms, metrics and the cross-node exchange read them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTiming:
    """One completed step: wall duration and exclusive time per phase (they sum to the duration)."""

    step: int
    start_ns: int
    end_ns: int
    phases_ms: dict[str, float]
    # input pipeline during this step: production time of the batches finished (ms, summed over
    # producers), how many, and by how many DataLoader workers (0: the training thread)
    input_ms: float = 0.0
    input_batches: int = 0
    input_workers: int = 0

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6
