"""One job on this node: its rank records, process probes and step history, turned into RankViews."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections import deque
from dataclasses import dataclass

import structlog
from rankwatch.hooks.record import RecordFormatError, RecordReader, RecordSnapshot, StepTiming

from ..core.snapshot import CRASHED, DEAD, EXITED, RUNNING, STOPPED, ZOMBIE, RankView
from .process import ExitWatcher, ProcessProbe

log = structlog.get_logger("rankwatch.jobwatch")

_RANK_FILE = re.compile(r"^rank-(\d{1,7})\.hb$")
# steps kept per rank for the end-of-run summary and metrics (~400 bytes each: ~1 MB per rank); the
# diagnosis looks at the last 200
HISTORY_STEPS = 2_500


@dataclass
class RankState:
    reader: RecordReader
    last: RecordSnapshot
    cursor: int = -1  # last step already copied into history
    gone_seen_ns: int | None = None
    stopped_since_ns: int | None = None


class JobWatch:
    def __init__(self, shm_dir: str, job_id: str, exits: ExitWatcher, procs: ProcessProbe) -> None:
        self.shm_dir = shm_dir
        self.job_id = job_id
        self.job_dir = os.path.join(shm_dir, job_id)
        self.node = socket.gethostname()
        self.ranks: dict[int, RankState] = {}
        self.history: dict[int, deque[StepTiming]] = {}
        self.longest_step_s = 0.0
        self._exits = exits
        self._procs = procs
        self._rejected: set[tuple[str, int]] = set()
        self.first_seen_ns = time.monotonic_ns()
        self.retired = False
        self.job_info: dict[str, object] = {}

    def refresh(self) -> int:
        """Pick up new or replaced rank records (returns how many); reject corrupt or foreign files once."""
        found = 0
        try:
            names = os.listdir(self.job_dir)
        except OSError:
            return 0
        if not self.job_info and "job.json" in names:
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(self.job_dir, "job.json"), "rb") as f:
                    info = json.loads(f.read(65536))
                if isinstance(info, dict):
                    self.job_info = info
        for name in names:
            m = _RANK_FILE.match(name)
            if not m:
                continue
            rank = int(m.group(1))
            path = os.path.join(self.job_dir, name)
            state = self.ranks.get(rank)
            if state is not None and not state.reader.replaced():
                continue
            try:
                ino = os.stat(path).st_ino
                if (path, ino) in self._rejected:
                    continue
                reader = RecordReader(path)
                snap = reader.read()
            except (RecordFormatError, OSError) as exc:
                with contextlib.suppress(OSError):
                    self._rejected.add((path, os.stat(path).st_ino))
                log.warning("record_rejected", job=self.job_id, path=path, error=str(exc))
                continue
            if snap.global_rank != rank:
                reader.close()
                self._rejected.add((path, ino))
                log.warning("record_rejected", job=self.job_id, path=path, error="rank in file differs from name")
                continue
            if state is not None:
                state.reader.close()
                self._exits.forget(state.last.pid)
                log.info("rank_restarted", job=self.job_id, rank=rank, pid=snap.pid)
            self.ranks[rank] = RankState(reader=reader, last=snap)
            found += 1
            self.history[rank] = deque(maxlen=HISTORY_STEPS)
            self._exits.watch(snap.pid)
            log.info("rank_discovered", job=self.job_id, rank=rank, pid=snap.pid, node=snap.hostname)
        return found

    def drop_gone_ranks(self) -> int:
        """Forget ranks whose process is gone (returns how many): a new run reusing this job id starts a new
        generation."""
        dropped = 0
        for rank, st in list(self.ranks.items()):
            if st.reader.replaced():
                continue
            info = self._procs.probe(st.last.pid, st.reader.path)
            if not info.alive:
                st.reader.close()
                self._procs.forget(st.last.pid)
                self._exits.forget(st.last.pid)
                del self.ranks[rank]
                self.history.pop(rank, None)
                dropped += 1
        return dropped

    def _state(self, st: RankState, now_ns: int) -> str:
        snap = st.last
        if snap.crashed:
            return CRASHED
        if snap.exited_normally:
            return EXITED
        info = self._procs.probe(snap.pid, st.reader.path)
        if info.status == "zombie":
            return ZOMBIE
        if not info.alive:
            return DEAD
        if info.status == "stopped":
            if st.stopped_since_ns is None:
                st.stopped_since_ns = now_ns
            return STOPPED
        st.stopped_since_ns = None
        return RUNNING

    def poll(self) -> list[RankView]:
        now = time.monotonic_ns()
        views = []
        for rank, st in sorted(self.ranks.items()):
            try:
                snap = st.reader.read(since_step=st.cursor)
            except (RecordFormatError, OSError) as exc:
                log.warning("record_read_failed", job=self.job_id, rank=rank, error=str(exc))
                snap = st.last
            st.last = snap
            steps = snap.recent_steps
            if steps:
                self.history[rank].extend(steps)
                # step 0 carries start-up costs; it must not inflate the learned timeout
                longest_ns = max((t.end_ns - t.start_ns for t in steps if t.step > 0), default=0)
                self.longest_step_s = max(self.longest_step_s, longest_ns / 1e9)
                st.cursor = steps[-1].step
            state = self._state(st, now)
            exit_age = None
            exit_order = None
            if state in (DEAD, ZOMBIE, CRASHED, EXITED):
                exit_ns = self._exits.exit_ns(snap.pid) or (snap.exit_ns or None)
                if exit_ns is None:
                    st.gone_seen_ns = st.gone_seen_ns or now
                    exit_ns = st.gone_seen_ns
                exit_age = max(0.0, (now - exit_ns) / 1e9)
                exit_order = self._exits.exit_index(snap.pid)
            views.append(
                RankView(
                    rank=rank,
                    node=snap.hostname or self.node,
                    pid=snap.pid,
                    state=state,
                    step=snap.step,
                    phase=snap.phase,
                    in_phase_s=max(0.0, (now - snap.phase_start_ns) / 1e9),
                    since_progress_s=max(0.0, (now - snap.last_progress_ns) / 1e9),
                    coll_seq=snap.coll_seq_entered,
                    coll_done=snap.coll_seq_completed,
                    coll_op=snap.coll_op,
                    budget_s=snap.budget_s,
                    budget_elapsed_s=max(0.0, (now - snap.budget_start_ns) / 1e9) if snap.budget_s else 0.0,
                    exit_order=exit_order,
                    exit_age_s=exit_age,
                )
            )
        return views

    def stopped_for_s(self) -> dict[int, float]:
        now = time.monotonic_ns()
        return {r: (now - st.stopped_since_ns) / 1e9 for r, st in self.ranks.items() if st.stopped_since_ns is not None}

    def all_gone(self, views: list[RankView]) -> bool:
        return bool(views) and all(v.state not in (RUNNING, STOPPED) for v in views)

    def close(self) -> None:
        for st in self.ranks.values():
            st.reader.close()
            self._procs.forget(st.last.pid)
            self._exits.forget(st.last.pid)
