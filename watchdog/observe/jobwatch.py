"""One job on this node: its rank records, verified rank processes and step history, turned into RankViews.

A record is only a claim: the process it names becomes a rank once ``ProcessTable.verify`` proves it
writes the record. Until then the rank is ``unverified`` (never dead, never stalled, never a target);
a record that stops parsing is ``unreadable`` (its own state, never a stall by itself).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from rankwatch.hooks.record import RecordFormatError, RecordSnapshot

from ..core.histogram import RankHistograms
from ..core.host_signals import GpuState, HostPressure, RankCounters
from ..core.policy import ObservePolicy
from ..core.snapshot import CRASHED, DEAD, EXITED, RUNNING, STOPPED, UNREADABLE, UNVERIFIED, ZOMBIE, RankView
from ..core.steps import StepTiming
from ..privsep.readers import ReaderError, Readers, default_readers
from . import jobdir
from .process import NO_PROCESS, Identity, ProcessTable, Unverified
from .reader import JobDir, RecordInfo, open_job
from .signals import read_host

log = structlog.get_logger("rankwatch.jobwatch")

# steps kept per rank for the end-of-run summary and metrics (~400 bytes each: ~1 MB per rank); the
# diagnosis looks at the last 200
HISTORY_STEPS = 2_500


def read_job_info(path: str) -> dict[str, object]:
    """The known, well-typed keys of a job.json at ``path`` ({} for anything else), read as this process:
    only for files of this process's own user (``rankwatch run``); the daemon asks the owner's reader."""
    try:
        fd = jobdir.open_dir(os.path.dirname(path) or ".")
    except OSError:
        return {}
    try:
        return jobdir.job_info_from_bytes(jobdir.read_regular(fd, os.path.basename(path), jobdir.MAX_JOB_JSON))
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


class RemoteRecord:
    """A rank record held open by the job owner's reader: read through it, never opened here."""

    def __init__(self, job: JobDir, name: str, info: RecordInfo) -> None:
        self.job = job
        self.name = name
        self.path = os.path.join(job.name, name)
        self.r, self.inode, self.dev = info.r, info.ino, info.dev
        self.gen = job.gen
        self.prefetched: RecordSnapshot | Exception | None = None
        self.replaced_seen: bool | None = None

    def read(self, since_step: int = -1) -> RecordSnapshot:
        got = self.prefetched
        if got is not None:  # this poll's batch read it already (``JobWatch._prefetch``)
            self.prefetched = None
            if isinstance(got, Exception):
                raise got
            return got
        if self.gen != self.job.gen:
            raise ReaderError("the reader was respawned: the record is reopened")
        return self.job.read_record(self.r, since_step, self.path)

    def replaced(self) -> bool:
        if self.replaced_seen is not None:
            seen, self.replaced_seen = self.replaced_seen, None
            return seen
        if self.gen != self.job.gen:
            return True  # a respawned reader: reopen by name (the same inode keeps its identity)
        return self.job.replaced(self.r)

    def close(self) -> None:
        if self.gen == self.job.gen:
            self.job.close_record(self.r)


@dataclass
class RankState:
    reader: RemoteRecord
    last: RecordSnapshot
    ident: Identity | None = None  # set once the process is proven to write this record
    unverified: str | None = None  # why it is not (yet) verified
    verify_at_poll: int = 0  # next poll at which an unverified rank is tried again
    unreadable: str | None = None  # why the record did not parse at the last read
    cursor: int = -1  # last step already copied into history
    gone_seen_ns: int | None = None
    stopped_since_ns: int | None = None


def open_job_dir(shm_dir: str, job_id: str, readers: Readers | None = None) -> JobDir:
    """The job dir under ``shm_dir``, opened once (never through a symlink) and handed to its owner's reader."""
    base = jobdir.open_dir(shm_dir)
    try:
        return open_job(readers or default_readers(), base, job_id)
    finally:
        os.close(base)


class JobWatch:
    def __init__(
        self,
        shm_dir: str,
        job_id: str,
        procs: ProcessTable,
        policy: ObservePolicy | None = None,
        job: JobDir | None = None,
    ) -> None:
        self.shm_dir = shm_dir
        self.job_id = job_id
        self.job_dir = os.path.join(shm_dir, job_id)  # for messages; every access goes through ``self.job``
        # the dir as opened at discovery: OSError / ReaderError here means the job is not watched at all
        self.job = job if job is not None else open_job_dir(shm_dir, job_id)
        self.owner_uid = self.job.uid
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
        # records of processes that are gone, by (name, inode): never rediscovered as a new run — only a new
        # record (a new inode, created by rename) is
        self._finished: set[tuple[str, int]] = set()
        self._over_budget_logged = False
        self.first_seen_ns = time.monotonic_ns()
        self.retired = False
        self.job_info: dict[str, object] = {}
        # host signals of the live verified ranks, one sample per poll: (monotonic ns, rank -> counters)
        self.signals: deque[tuple[int, dict[int, RankCounters]]] = deque(maxlen=self.policy.signal_samples_kept)
        self.host: HostPressure | None = None  # the host's pressure at the last sample

    @property
    def dir_path(self) -> str:
        """A path to the very dir opened at discovery (through this process's fd), for what root itself must
        reach there (the responder's socket, the state file): a name swapped for a symlink is not followed."""
        return f"/proc/self/fd/{self.job.fd}/."

    def refresh(self) -> int:
        """Pick up new or replaced rank records (returns how many); reject corrupt or foreign files once."""
        found = 0
        try:
            names = self.job.names()
        except ReaderError as exc:
            self._reader_failed(exc)
            return 0
        if not self.job_info and "job.json" in names:
            try:
                self.job_info = self.job.job_info()
            except ReaderError:
                self.job_info = {}
        budget = self.policy.max_records_per_job
        self._prefetch_replaced()
        for name in names:
            m = jobdir.RANK_FILE.match(name)
            if not m:
                continue
            rank = int(m.group(1))
            state = self.ranks.get(rank)
            if state is not None and not state.reader.replaced():
                continue
            if state is None and len(self.ranks) >= budget:
                if not self._over_budget_logged:
                    self._over_budget_logged = True
                    log.warning("records_over_budget", job=self.job_id, budget=budget,
                                detail="more rank records than any job has: the rest are not read")
                break
            try:
                ino = self.job.inode(name)
                if ino is None or (name, ino) in self._rejected or (name, ino) in self._finished:
                    continue
                info = self.job.open_record(name)
            except ReaderError as exc:
                self._reader_failed(exc)
                return found
            if isinstance(info, str):
                self._rejected.add((name, ino))
                log.warning("record_rejected", job=self.job_id, path=os.path.join(self.job_dir, name), error=info)
                continue
            reader = RemoteRecord(self.job, name, info)
            snap = info.snap
            if snap.global_rank != rank:
                reader.close()
                self._rejected.add((name, info.ino))
                log.warning(
                    "record_rejected", job=self.job_id, path=reader.path, error="rank in file differs from name"
                )
                continue
            if state is not None:
                state.reader.close()
                if state.ident is not None and state.reader.inode == info.ino:
                    # the same record reopened by a respawned reader: same process, same proof, kept
                    state.reader, state.last = reader, snap
                    continue
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

    def sample_signals(self, gpu_of: Callable[[int], GpuState | None] | None = None) -> None:
        """One sample of every live verified rank's host counters (through the owner's reader) and the host's
        pressure; a rank whose start time changed (its pid reused) is left out. ``gpu_of(pid)``: the state of
        the rank's GPU at this poll (the daemon's NVML watch), kept beside its counters."""
        if not self.policy.sample_signals:
            return
        live = {rank: st.ident for rank, st in self.ranks.items()
                if st.ident is not None and self._procs.exit_ns(st.ident) is None}
        if not live:
            return
        try:
            got = self.job.signals(sorted({i.pid for i in live.values()}))
        except ReaderError:
            return
        now = time.monotonic_ns()
        sample = {rank: got[i.pid] for rank, i in live.items()
                  if i.pid in got and got[i.pid].start_ticks == i.start_ticks}
        if gpu_of is not None:
            for rank, i in live.items():
                g = gpu_of(i.pid) if rank in sample else None
                if g is not None:
                    sample[rank] = dataclasses.replace(sample[rank], gpu=g)
        if sample:
            self.signals.append((now, sample))
        self.host = read_host()

    def _reader_failed(self, exc: Exception) -> None:
        for st in self.ranks.values():
            if st.unreadable is None:
                log.warning("record_unreadable", job=self.job_id, error=str(exc)[:200])
            st.unreadable = str(exc)[:200]

    def _verify(self, rank: int, st: RankState) -> None:
        """Prove the record's pid maps this very record and runs as the job dir's owner; an unverified rank
        is retried every few polls."""
        if st.ident is not None or self.polls < st.verify_at_poll:
            return
        if st.last.crashed or st.last.exited_normally:
            st.unverified = "the record says its process already ended"
            st.verify_at_poll = 1 << 62  # never: there is no process left to prove anything
            return
        got = self._procs.verify(st.last.pid, st.reader.dev, st.reader.inode, self.owner_uid)
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

    def drop_gone_ranks(self, *, proven_too: bool = True) -> int:
        """Forget ranks whose process is gone (returns how many): a new run reusing this job id starts a new
        generation. ``proven_too=False`` (a job's first look) keeps the ranks this watch proved alive: one
        that died between its verification and the first poll is this run's dead rank, not an earlier run's."""
        dropped = 0
        for rank, st in list(self.ranks.items()):
            if st.reader.replaced() or (st.ident is not None and not proven_too):
                continue
            # never proven to be anyone's: forgotten, unless unreadable (not judged at all)
            gone = st.unreadable is None if st.ident is None else not self._procs.info(st.ident).alive
            if gone:
                self._finished.add((st.reader.name, st.reader.inode))
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
        if info.status == "unknown":
            return UNREADABLE  # /proc could not answer (EMFILE, EACCES): never dead
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

    def _current(self) -> list[RankState]:
        return [st for st in self.ranks.values() if st.reader.gen == self.job.gen]

    def _prefetch(self) -> None:
        """Every record of this job read in one exchange with its reader (not one per record)."""
        for st in self.ranks.values():
            st.reader.replaced_seen = None  # this cycle's refresh has used them
        sts = self._current()
        if len(sts) < 2:
            return
        try:
            got = self.job.read_many([(st.reader.r, st.cursor, st.reader.path) for st in sts])
        except ReaderError:
            return  # each record's own read then says so
        for st, snap in zip(sts, got, strict=True):
            st.reader.prefetched = snap

    def _prefetch_replaced(self) -> None:
        sts = self._current()
        if len(sts) < 2:
            return
        for st, seen in zip(sts, self.job.replaced_many([st.reader.r for st in sts]), strict=True):
            st.reader.replaced_seen = seen

    def _read(self, rank: int, st: RankState) -> RecordSnapshot:
        """The record's newest snapshot, or the last one kept (``st.unreadable`` says why) when it cannot be read."""
        try:
            snap = st.reader.read(since_step=st.cursor)
            if snap.global_rank != rank:
                raise RecordFormatError("rank in the record differs from its file name")
            if st.unreadable is not None:
                log.info("record_readable_again", job=self.job_id, rank=rank)
            st.unreadable = None
            return snap
        except (RecordFormatError, ReaderError, OSError) as exc:
            if st.unreadable is None:
                log.warning("record_unreadable", job=self.job_id, rank=rank, error=str(exc)[:200])
            st.unreadable = str(exc)[:200]
            return st.last

    def _absorb(self, rank: int, st: RankState, snap: RecordSnapshot) -> RecordSnapshot:
        """``snap`` becomes the rank's last look: its identity checked, its new steps added to the history."""
        if snap.pid != st.last.pid and st.ident is not None:
            # the record now names another process: what was verified no longer holds
            self._procs.forget(st.ident)
            st.ident, st.unverified, st.verify_at_poll = None, "the record's pid changed", 0
        st.last = snap
        self._verify(rank, st)
        # only steps past the cursor: a record that could not be read again hands back the last look's
        steps = [t for t in snap.recent_steps if t.step > st.cursor]
        if steps:
            self.history[rank].extend(steps)
            self.step_stats.setdefault(rank, RankHistograms()).add(steps)
            # step 0 carries start-up costs; it must not inflate the learned timeout
            longest_ns = max((t.end_ns - t.start_ns for t in steps if t.step > 0), default=0)
            self.longest_step_s = max(self.longest_step_s, longest_ns / 1e9)
            st.cursor = steps[-1].step
        return snap

    def poll(self) -> list[RankView]:
        self.polls += 1
        now = time.monotonic_ns()
        views = []
        self._prefetch()
        for rank, st in sorted(self.ranks.items()):
            snap = self._absorb(rank, st, self._read(rank, st))
            state = self._state(st, now)
            if state in (DEAD, ZOMBIE) and st.unreadable is None:
                # the record was read before the process was looked at: a rank that ended in between wrote
                # its crash or exit mark after that read (measured under load: a raised exception read as
                # "died, no mark"). Dead now, it writes nothing more, so one more read has its last word
                snap = self._absorb(rank, st, self._read(rank, st))
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
                    thread_died=snap.thread_error or None,
                    p2p_dir=snap.p2p_dir,
                    p2p_peer=snap.p2p_peer,
                    p2p_known=None if snap.p2p_known_full else frozenset(snap.p2p_known),
                    age_s=max(0.0, (now - snap.start_ns) / 1e9),
                    node_rank=snap.node_rank,
                    verified=st.ident is not None,
                )
            )
        if self.policy.track_descendants and now - self._tracked_at_ns > self.policy.descendants_every_s * 1e9:
            self._tracked_at_ns = now
            self._procs.track_descendants(self.identities())
        return views

    def remove_stale_dumps(self, older_than_s: float) -> int:
        """Dump dirs left by a capture that never finished (a SIGKILLed daemon), older than ``older_than_s``."""
        try:
            return self.job.remove_dumps(older_than_s)
        except ReaderError:
            return 0

    def remove_finished_files(self) -> int:
        """Delete what finished runs of this job left in its dir (returns how many entries went).

        Only what is provably rankwatch's: records whose inode this watch saw finish, and — once no other
        record is left — the job.json, control sockets, faulthandler files and dump files named as the hook
        names them, all by the owner's reader through the dir fd. Symlinks and anything else are left alone;
        the job dir goes only when empty (rmdir never follows a symlink).
        """
        try:
            removed, empty = self.job.remove_finished(ino for _, ino in self._finished)
        except ReaderError:
            return 0
        if empty:
            try:
                base = jobdir.open_dir(self.shm_dir)
            except OSError:
                return removed
            try:
                # only if the name still is the dir this watch held (not a dir put there since)
                st = os.stat(self.job_id, dir_fd=base, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == (os.fstat(self.job.fd).st_dev, os.fstat(self.job.fd).st_ino):
                    os.rmdir(self.job_id, dir_fd=base)
            except OSError:
                pass
            finally:
                os.close(base)
        return removed

    def generation_start_unix(self) -> float | None:
        """Wall-clock start of the current run's ranks here (their records' monotonic start), for binding
        store claims to this generation; None before any rank is known."""
        starts = [st.last.start_ns for st in self.ranks.values() if st.last.start_ns > 0]
        if not starts:
            return None
        return time.time() - (time.monotonic_ns() - min(starts)) / 1e9

    def stopped_for_s(self) -> dict[int, float]:
        now = time.monotonic_ns()
        return {r: (now - st.stopped_since_ns) / 1e9 for r, st in self.ranks.items() if st.stopped_since_ns is not None}

    def all_gone(self, views: list[RankView]) -> bool:
        return bool(views) and all(v.state not in (RUNNING, STOPPED, UNREADABLE) for v in views)

    def close(self) -> None:
        for st in self.ranks.values():
            st.reader.close()
            if st.ident is not None:
                self._procs.forget(st.ident)
        self.job.close()
