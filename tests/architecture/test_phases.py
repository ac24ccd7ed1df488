"""One phase table (core.phases): the hook's slot table and every reader agree with it."""

from __future__ import annotations

from rankwatch.hooks.record import CANONICAL_PHASES
from rankwatch.watchdog.core import phases
from rankwatch.watchdog.core.snapshot import STEP_PHASE_ORDER
from rankwatch.watchdog.report.html import DISPLAY_PHASE_ORDER
from rankwatch.watchdog.report.live_words import phase_kind


def test_the_hook_writes_the_canonical_phases_of_the_table() -> None:
    assert CANONICAL_PHASES == phases.CANONICAL


def test_readers_take_the_table() -> None:
    assert STEP_PHASE_ORDER == {"dataloader": 1, "forward": 2, "backward": 3, "optimizer": 4}
    assert DISPLAY_PHASE_ORDER == phases.DISPLAY_ORDER
    assert [phase_kind(p) for p in ("dataloader", "forward", "collective", "idle")] == [
        "input", "compute", "communication", "between phases"]
    assert phases.SYNC_PHASES == {"collective", "grad_sync"}
