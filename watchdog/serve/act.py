"""The only action rankwatch takes on training processes, and only with ``--on-stall kill``.

Detect ≠ act: observing is the default. When asked, the job's *verified* ranks get SIGTERM (and SIGCONT,
so a stopped rank can act on it), and after a grace period SIGKILL goes to the ranks still alive and to
every descendant pinned since discovery (DataLoader workers blocked in ``collate`` survive their rank and
hold host memory, pinned buffers, possibly CUDA contexts). Every signal goes through a pidfd
(``ProcessTable.send_signal``): a pid that was reused since is never touched, nor PID 1, rankwatch or its
ancestors. It runs in a thread of its own so the incident pipeline is not held up.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence

import structlog

from ..core.policy import KillPolicy
from ..observe.process import Identity, ProcessTable

log = structlog.get_logger("rankwatch.act")


class Killer:
    def __init__(self, procs: ProcessTable, policy: KillPolicy) -> None:
        self.procs = procs
        self.policy = policy
        self.killed_jobs: set[str] = set()  # jobs whose ranks this killer signalled (the run's last words)

    def kill_job(self, job_id: str, ranks: Sequence[Identity]) -> threading.Thread:
        """SIGTERM + SIGCONT to every live verified rank now; SIGKILL to what is left after ``term_grace_s``."""
        procs = self.procs
        procs.track_descendants(ranks)  # a last scan while the ranks are alive and still their children's parent
        family = {r: procs.descendants(r) for r in ranks}
        termed = [r for r in ranks if procs.send_signal(r, signal.SIGTERM)]
        if termed:
            self.killed_jobs.add(job_id)
        for r in termed:
            procs.send_signal(r, signal.SIGCONT)
        log.warning(
            "killing_job",
            job=job_id,
            pids=[r.pid for r in termed],
            descendants=sorted(c.pid for kids in family.values() for c in kids),
        )

        def finish() -> None:
            deadline = time.monotonic() + self.policy.term_grace_s
            while time.monotonic() < deadline and any(procs.exit_ns(r) is None for r in termed):
                time.sleep(0.1)
            killed = [r.pid for r in termed if procs.exit_ns(r) is None and procs.send_signal(r, signal.SIGKILL)]
            # descendants: whatever is left of each rank's tree (an exited one is no longer signalable)
            left = [c for r in ranks for c in procs.descendants(r) or family[r]]
            for c in left:
                procs.send_signal(c, signal.SIGCONT)
            swept = [c.pid for c in left if procs.send_signal(c, signal.SIGKILL)]
            log.warning("job_killed", job=job_id, sigkilled_ranks=killed, sigkilled_descendants=swept)

        thread = threading.Thread(target=finish, name="rankwatch-kill", daemon=True)
        thread.start()
        return thread
