"""One job on this node: its rank records, verified rank processes and step history, turned into RankViews.

A record is only a claim: the process it names becomes a rank once ``ProcessTable.verify`` proves it
writes the record. Until then the rank is ``unverified`` (never dead, never stalled, never a target);
a record that stops parsing is ``unreadable`` (its own state, never a stall by itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import time
from collections import deque
from dataclasses import dataclass

import structlog
from rankwatch.hooks.record import RecordFormatError, RecordReader, RecordSnapshot, StepTiming

from ..core.histogram import RankHistograms
from ..core.policy import ObservePolicy
from ..core.snapshot import CRASHED, DEAD, EXITED, RUNNING, STOPPED, UNREADABLE, UNVERIFIED, ZOMBIE, RankView
from .process import NO_PROCESS, Identity, ProcessTable, Unverified

log = structlog.get_logger("rankwatch.jobwatch")

_RANK_FILE = re.compile(r"^rank-(\d{1,7})\.hb$")
_CTL_FILE = re.compile(r"^rank-\d{1,7}\.(?:ctl|sock)$")  # the responder's FIFO or socket
_FAULT_FILE = re.compile(r"^rank-\d{1,7}\.faulthandler$")
_DUMP_FILE = re.compile(r"^\.?rank-\d{1,7}\.(?:stacks\.json|fr\.json|fr\.err|done)(?:\.tmp-[0-9a-f]{8})?$")
# steps kept per rank for the end-of-run summary and metrics (~400 bytes each: ~1 MB per rank); the
# diagnosis looks at the last 200
HISTORY_STEPS = 2_500
MAX_JOB_JSON = 64 << 10
# job.json keys the watchdog reads, with their types; anything else in the file is ignored
_JOB_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "job_id": str,
    "world_size": int,
    "node_rank": int,
    "local_world_size": int,
    "hostname": str,
    "master_addr": str,
    "master_port": (str, int),
}


def read_job_info(path: str) -> dict[str, object]:
    """The known, well-typed keys of a job.json; {} for a missing, oversized, malformed or hostile file."""
    try:
        # O_NONBLOCK: a FIFO planted as job.json must not block the poll loop in open(); only a regular file is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            raw = f.read(MAX_JOB_JSON + 1)
        if len(raw) > MAX_JOB_JSON:
            return {}
        doc = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, object] = {}
    for key, kind in _JOB_KEYS.items():
        value = doc.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            if isinstance(value, str):
                value = value[:256]
            elif isinstance(value, int) and not 0 <= value < 1 << 31:
                continue
            out[key] = value
    return out


def _remove_dumps(dumps: str, older_than_s: float = 0.0) -> int:
    """Dump answers the hook wrote under ``dumps/<token>/`` (by name, no symlinks), then the empty dirs."""
    removed = 0
    now = time.time()
    try:
        tokens = os.listdir(dumps)
    except OSError:
        return 0
    for token in tokens:
        tdir = os.path.join(dumps, token)
        try:
            st = os.lstat(tdir)
            if not stat.S_ISDIR(st.st_mode) or now - st.st_mtime < older_than_s:
                continue
            files = os.listdir(tdir)
        except OSError:
            continue
        for name in files:
            path = os.path.join(tdir, name)
            with contextlib.suppress(OSError):
                if _DUMP_FILE.match(name) and stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)
                    removed += 1
        with contextlib.suppress(OSError):
            os.rmdir(tdir)
    with contextlib.suppress(OSError):
        os.rmdir(dumps)
    return removed


def remove_stale_dumps(job_dir: str, older_than_s: float) -> int:
    """Dump dirs left by a capture that never finished (a SIGKILLed daemon), older than ``older_than_s``."""
    return _remove_dumps(os.path.join(job_dir, "dumps"), older_than_s)


@dataclass
class RankState:
    reader: RecordReader
    last: RecordSnapshot
    ident: Identity | None = None  # set once the process is proven to write this record
    unverified: str | None = None  # why it is not (yet) verified
    verify_at_poll: int = 0  # next poll at which an unverified rank is tried again
    unreadable: str | None = None  # why the record did not parse at the last read
    cursor: int = -1  # last step already copied into history
    gone_seen_ns: int | None = None
    stopped_since_ns: int | None = None


class JobWatch:
    def __init__(
        self, shm_dir: str, job_id: str, procs: ProcessTable, policy: ObservePolicy | None = None
    ) -> None:
        self.shm_dir = shm_dir
        self.job_id = job_id
        self.job_dir = os.path.join(shm_dir, job_id)
        self.node = socket.gethostname()
        self.ranks: dict[int, RankState] = {}
        self.history: dict[int, deque[StepTiming]] = {}
        # every step read, as duration histograms (metrics); kept across a rank's restarts
        self.step_stats: dict[int, RankHistograms] = {}
        self.longest_step_s = 0.0
        self._procs = procs
        self.policy = policy or ObservePolicy()
        self.polls = 0
        self._tracked_at_ns = 0  # last descendant scan
        self._rejected: set[tuple[str, int]] = set()
        # records of processes that are gone, by (path, inode): never rediscovered as a new run — only a new
        # record (a new inode, created by rename) is
        self._finished: set[tuple[str, int]] = set()
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
            self.job_info = read_job_info(os.path.join(self.job_dir, "job.json"))
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
                if (path, ino) in self._rejected or (path, ino) in self._finished:
                    continue
                reader = RecordReader(path)
                snap = reader.read()
            except (RecordFormatError, OSError) as exc:
                try:
                    self._rejected.add((path, os.stat(path).st_ino))
                except OSError:
                    pass
                log.warning("record_rejected", job=self.job_id, path=path, error=str(exc))
                continue
            if snap.global_rank != rank:
                reader.close()
                self._rejected.add((path, ino))
                log.warning("record_rejected", job=self.job_id, path=path, error="rank in file differs from name")
                continue
            if state is not None:
                state.reader.close()
                if state.ident is not None:
                    self._procs.forget(state.ident)
                log.info("rank_restarted", job=self.job_id, rank=rank, pid=snap.pid)
            st = RankState(reader=reader, last=snap)
            self.ranks[rank] = st
            found += 1
            self.history[rank] = deque(maxlen=HISTORY_STEPS)
            self._verify(rank, st)
            log.info(
                "rank_discovered",
                job=self.job_id,
                rank=rank,
                pid=snap.pid,
                node=snap.hostname,
                verified=st.ident is not None,
            )
        return found

    def _verify(self, rank: int, st: RankState) -> None:
        """Prove the record's pid writes it; an unverified rank is retried every few polls."""
        if st.ident is not None or self.polls < st.verify_at_poll:
            return
        if st.last.crashed or st.last.exited_normally:
            st.unverified = "the record says its process already ended"
            st.verify_at_poll = 1 << 62  # never: there is no process left to prove anything
            return
        got = self._procs.verify(st.last.pid, st.reader.path)
        if isinstance(got, Unverified):
            if st.unverified != got.reason:
                log.warning("rank_unverified", job=self.job_id, rank=rank, pid=st.last.pid, reason=got.reason)
            st.unverified = got.reason
            st.verify_at_poll = self.polls + self.policy.reverify_every_polls
            return
        st.ident, st.unverified = got, None
        if self.policy.track_descendants:
            self._procs.track_descendants([got])

    def identities(self) -> list[Identity]:
        """The verified ranks of this job (what ``--on-stall kill`` may signal)."""
        return [st.ident for st in self.ranks.values() if st.ident is not None]

    def drop_gone_ranks(self) -> int:
        """Forget ranks whose process is gone (returns how many): a new run reusing this job id starts a new
        generation."""
        dropped = 0
        for rank, st in list(self.ranks.items()):
            if st.reader.replaced():
                continue
            if st.ident is None or not self._procs.info(st.ident).alive:
                self._finished.add((st.reader.path, st.reader.inode))
                st.reader.close()
                if st.ident is not None:
                    self._procs.forget(st.ident)
                del self.ranks[rank]
                # the history stays: `rankwatch run` summarises it after the job ended, however long the
                # launcher took to exit; a new run's record for this rank starts a fresh one (refresh)
                dropped += 1
        return dropped

    def _state(self, st: RankState, now_ns: int) -> str:
        if st.ident is None:
            # ended before this watch could verify it: the record's marks say how (evidence, not a trigger);
            # a pid that exists but does not map the record is someone else — never judged
            snap = st.last
            if snap.crashed:
                return CRASHED
            if snap.exited_normally:
                return EXITED
            return DEAD if st.unverified == NO_PROCESS else UNVERIFIED
        if st.unreadable is not None:
            return UNREADABLE
        snap = st.last
        if snap.crashed:
            return CRASHED
        if snap.exited_normally:
            return EXITED
        info = self._procs.info(st.ident)
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
        self.polls += 1
        now = time.monotonic_ns()
        views = []
        for rank, st in sorted(self.ranks.items()):
            try:
                snap = st.reader.read(since_step=st.cursor)
                if snap.global_rank != rank:
                    raise RecordFormatError("rank in the record differs from its file name")
                if st.unreadable is not None:
                    log.info("record_readable_again", job=self.job_id, rank=rank)
                st.unreadable = None
            except (RecordFormatError, OSError) as exc:
                if st.unreadable is None:
                    log.warning("record_unreadable", job=self.job_id, rank=rank, error=str(exc)[:200])
                st.unreadable = str(exc)[:200]
                snap = st.last
            if snap.pid != st.last.pid and st.ident is not None:
                # the record now names another process: what was verified no longer holds
                self._procs.forget(st.ident)
                st.ident, st.unverified, st.verify_at_poll = None, "the record's pid changed", 0
            st.last = snap
            self._verify(rank, st)
            steps = snap.recent_steps
            if steps:
                self.history[rank].extend(steps)
                self.step_stats.setdefault(rank, RankHistograms()).add(steps)
                # step 0 carries start-up costs; it must not inflate the learned timeout
                longest_ns = max((t.end_ns - t.start_ns for t in steps if t.step > 0), default=0)
                self.longest_step_s = max(self.longest_step_s, longest_ns / 1e9)
                st.cursor = steps[-1].step
            state = self._state(st, now)
            exit_age = None
            exit_order = None
            if state in (DEAD, ZOMBIE, CRASHED, EXITED):
                exit_ns = (self._procs.exit_ns(st.ident) if st.ident else None) or (snap.exit_ns or None)
                if exit_ns is None:
                    st.gone_seen_ns = st.gone_seen_ns or now
                    exit_ns = st.gone_seen_ns
                exit_age = max(0.0, (now - exit_ns) / 1e9)
                exit_order = self._procs.exit_index(st.ident) if st.ident else None
            views.append(
                RankView(
                    rank=rank,
                    node=snap.hostname or self.node,
                    pid=snap.pid,
                    state=state,
                    step=snap.step,
                    phase=snap.phase,
                    # a rank that never entered a phase (waiting before init_process_group) has 0 there:
                    # measured from when the rank started, never from the machine's boot
                    in_phase_s=max(0.0, (now - max(snap.phase_start_ns, snap.start_ns)) / 1e9),
                    since_progress_s=max(0.0, (now - max(snap.last_progress_ns, snap.start_ns)) / 1e9),
                    coll_seq=snap.coll_seq_entered,
                    coll_done=snap.coll_seq_completed,
                    coll_op=snap.coll_op,
                    budget_s=snap.budget_s,
                    budget_elapsed_s=max(0.0, (now - snap.budget_start_ns) / 1e9) if snap.budget_s else 0.0,
                    exit_order=exit_order,
                    exit_age_s=exit_age,
                    exit_cause=(snap.crash_info or None) if state == CRASHED else None,
                    node_rank=snap.node_rank,
                    verified=st.ident is not None,
                )
            )
        if self.policy.track_descendants and now - self._tracked_at_ns > self.policy.descendants_every_s * 1e9:
            self._tracked_at_ns = now
            self._procs.track_descendants(self.identities())
        return views

    def remove_finished_files(self) -> int:
        """Delete what finished runs of this job left in its dir (returns how many entries went).

        Only what is provably rankwatch's: records whose inode this watch saw finish, and — once no other
        record is left — the job.json, control FIFOs, faulthandler files and dump files named as the hook
        names them. Symlinks and anything else are left alone; the job dir goes only when empty.
        """
        removed = 0
        try:
            names = os.listdir(self.job_dir)
        except OSError:
            return 0
        others = False
        for name in names:
            if not _RANK_FILE.match(name):
                continue
            path = os.path.join(self.job_dir, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (path, st.st_ino) in self._finished and stat.S_ISREG(st.st_mode):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed += 1
            else:
                others = True
        if others:
            return removed
        for name in names:
            path = os.path.join(self.job_dir, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            fifo = _CTL_FILE.match(name) and (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode))
            # the state file the watchdog itself published (watchdog.json) goes with the records
            plain = (name in ("job.json", "watchdog.json") or _FAULT_FILE.match(name)) and stat.S_ISREG(st.st_mode)
            if fifo or plain:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed += 1
            elif name == "dumps" and stat.S_ISDIR(st.st_mode):
                removed += _remove_dumps(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.job_dir)
        return removed

    def stopped_for_s(self) -> dict[int, float]:
        now = time.monotonic_ns()
        return {r: (now - st.stopped_since_ns) / 1e9 for r, st in self.ranks.items() if st.stopped_since_ns is not None}

    def all_gone(self, views: list[RankView]) -> bool:
        return bool(views) and all(v.state not in (RUNNING, STOPPED) for v in views)

    def close(self) -> None:
        for st in self.ranks.values():
            st.reader.close()
            if st.ident is not None:
                self._procs.forget(st.ident)
