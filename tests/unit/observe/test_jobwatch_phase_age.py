"""A rank that never entered a phase (blocked before ``init_process_group``: the pre-init class of issue 19)
is "idle" since its record was created, not since the clock's epoch (a verdict said "for 5102 s" of a job
that had run for a minute)."""

from __future__ import annotations

import time

from conftest import new_tracker
from rankwatch.watchdog.observe.jobwatch import JobWatch
from rankwatch.watchdog.observe.process import ProcessTable


def test_a_rank_that_never_entered_a_phase_is_idle_since_its_record_was_made(tmp_path):
    job_dir = tmp_path / "j"
    job_dir.mkdir(mode=0o700)
    started = time.monotonic_ns() - 2_000_000_000  # the rank's hook set up 2 s ago, then blocked
    keep = new_tracker(job_dir / "rank-0.hb", start_ns=started)  # noqa: F841 - keeps the record mapped
    watch = JobWatch(str(tmp_path), "j", ProcessTable(protected={1}))
    watch.refresh()
    (view,) = watch.poll()
    assert view.phase is None
    assert 2.0 <= view.in_phase_s < 600.0, view.in_phase_s
