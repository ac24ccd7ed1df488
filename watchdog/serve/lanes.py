"""One job owner's share of the poll loop: a thread per owner (issue 42, "a good neighbour").

Every owner's jobs are discovered, read and decided in that owner's lane, through that owner's reader,
in parallel with the other owners'. The loop kicks every idle lane once per poll and waits for them
under one short deadline (``FairnessPolicy.round_wait_s``); a lane still busy after it — a stopped
reader, 5,000 planted job dirs, records held torn — is *lagging*: its jobs keep their last state, and
neither the loop (nor ``/healthz``) nor any other owner waits for it again until its round is done.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import structlog

log = structlog.get_logger("rankwatch.lanes")


class OwnerLane:
    """The thread that runs one owner's rounds, and what the loop knows about them (lag, pending names)."""

    def __init__(self, uid: int) -> None:
        self.uid = uid
        # names in the shared dir that are this owner's dirs and not yet looked at (the lane opens a few per
        # round; the loop only routes them here)
        self.pending: deque[str] = deque()
        self.jobs: list[str] = []  # job ids this lane polls (replaced wholesale, read by other threads)
        self.over_budget_logged = False
        self._go = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._work: Callable[[OwnerLane], None] | None = None
        self._stop = False
        self.created_ns = time.monotonic_ns()
        self.started_ns: int | None = None  # monotonic start of the round in progress
        self.done_ns: int | None = None  # monotonic end of the newest complete round
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name=f"rankwatch-owner-{uid}", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def kick(self, work: Callable[[OwnerLane], None]) -> bool:
        """Start a round of ``work`` unless one is still running (then False: the lane is lagging)."""
        if self._stop or not self._idle.is_set():
            return False
        self._idle.clear()
        self._work = work
        self.started_ns = time.monotonic_ns()
        self._go.set()
        return True

    def wait(self, deadline: float) -> bool:
        """Whether the round in progress ended by ``deadline`` (monotonic seconds)."""
        return self._idle.wait(max(0.0, deadline - time.monotonic()))

    def age_s(self, now_ns: int | None = None) -> float:
        """How old this owner's newest complete look is: about one poll interval while it keeps up."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        return max(0.0, (now_ns - (self.done_ns or self.created_ns)) / 1e9)

    def lag_s(self, now_ns: int | None = None) -> float:
        """How long the round in progress has run (0 when idle): what this owner costs the loop now."""
        started = self.started_ns
        if started is None or not self.busy:
            return 0.0
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        return max(0.0, (now_ns - started) / 1e9)

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop = True
        self._go.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            work = self._work
            try:
                if work is not None:
                    work(self)
            except Exception:  # one owner's failure never ends its lane
                log.exception("owner_round_failed", owner_uid=self.uid)
            finally:
                self.done_ns = time.monotonic_ns()
                self.started_ns = None
                self.rounds += 1
                self._idle.set()
