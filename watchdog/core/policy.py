"""Thresholds, one frozen dataclass per concern, with the reason for each number beside it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StallPolicy:
    # Fixed stall timeout in seconds; None means "auto": learned from observed step times.
    timeout_s: float | None = None
    # auto: longest completed step × factor. 4× covers periodic slow steps (eval, logging bursts)
    # without waiting NCCL's 10 minutes (NVRx's heartbeat monitor uses the same longest-interval idea).
    auto_factor: float = 4.0
    # auto never goes below this: GC pauses, page-cache misses and preemption on busy hosts reach tens
    # of seconds; a false hang alarm costs an on-call page.
    auto_floor_s: float = 30.0
    # Before the first step completes (imports, compile, data warm-up, NCCL init) nothing is learned
    # yet and first steps are often 10-100× slower.
    startup_s: float = 300.0
    # A stopped process (SIGSTOP, state T) is reported once it stays stopped this long: short enough to
    # beat the stall timeout, long enough to skip a debugger's momentary stop.
    stopped_grace_s: float = 1.0

    def timeout_for(self, longest_step_s: float) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return max(self.auto_floor_s, self.auto_factor * longest_step_s)

    def startup_for(self) -> float:
        # With a fixed timeout larger than the start-up budget, the fixed one wins.
        if self.timeout_s is not None:
            return max(self.timeout_s, self.startup_s)
        return self.startup_s


@dataclass(frozen=True)
class CapturePolicy:
    # py-spy on a healthy process takes ~0.1 s; a busy 2-core host can take 10×.
    pyspy_timeout_s: float = 5.0
    # the dump responder answers within a GIL switch interval unless the rank is truly wedged
    responder_timeout_s: float = 3.0
    # frames per stack kept in the verdict's stack_top
    stack_top_frames: int = 5
    # frames used for grouping ranks by stack signature (deep enough to separate call sites)
    signature_frames: int = 12
    include_locals: bool = False


@dataclass(frozen=True)
class KillPolicy:
    # after SIGTERM, ranks get this long to exit before SIGKILL (stopped ranks get SIGCONT first)
    term_grace_s: float = 5.0
