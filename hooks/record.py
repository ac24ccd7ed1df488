"""Shared-memory record layout: one fixed-size file per rank, written by the hook, read by the daemon.

The layout is a ctypes structure so the writer updates fields in place on an mmap (no syscalls, no
serialisation on the training thread) and the reader decodes a copied snapshot with the same
definition. Consistency uses a seqlock: the writer makes ``seq`` odd, updates, makes it even again; a
reader retries while ``seq`` is odd or changed during its copy. This module imports no torch so the
daemon can use it cheaply.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the watchdog's vocabulary: only the reader below builds it, never the rank's hook
    from rankwatch.watchdog.core.steps import StepTiming

MAGIC = b"RNKWTCH1"
CRASH_LEN = 240
# 2: crash_info (why the script ended with an exception); 3: input pipeline timing (per-step batch
# production time and the DataLoader workers' slots). Any other version is rejected, never misread.
VERSION = 3
MAX_PHASES = 16  # slot table; canonical phases take the first six
RING_STEPS = 512  # steps kept; at 5 ms steps a 1 Hz poll needs ~200
INPUT_SLOTS = 32  # DataLoader workers timed at once per rank (more share slots modulo this)
NAME_LEN = 24
HOST_LEN = 64
JOB_LEN = 64

CANONICAL_PHASES = ("dataloader", "forward", "backward", "optimizer", "collective", "idle")
IDLE_SLOT = CANONICAL_PHASES.index("idle")

FLAG_EXITED = 1  # interpreter exited normally (atexit ran)
FLAG_DISABLED = 2  # hook disabled itself after an internal error
FLAG_EXPLICIT_STEPS = 4  # the script calls step() itself; optimizer hooks no longer end steps
FLAG_CRASHED = 8  # the script ended with an exception or a non-zero exit
FLAG_GPU_TIMING = 16  # gpu_phase_ms is being filled from CUDA events

NO_PHASE = -1


class RecordFormatError(Exception):
    """A file in the shm dir is not a valid rankwatch record (corrupt, truncated, foreign, other version)."""


class StepEntry(ctypes.Structure):
    _pack_ = 8
    _fields_ = (
        ("step", ctypes.c_uint64),
        ("start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("phase_ns", ctypes.c_uint64 * MAX_PHASES),
        # batches the input pipeline finished during this step, their production time (fetch + collate,
        # summed over producers) and the producers: DataLoader workers, 0 = the training thread itself
        ("input_ns", ctypes.c_uint64),
        ("input_batches", ctypes.c_uint64),
        ("input_workers", ctypes.c_uint64),
    )


class RecordLayout(ctypes.Structure):
    _pack_ = 8
    _fields_ = (
        # header, written once
        ("magic", ctypes.c_char * 8),
        ("version", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("seq", ctypes.c_uint64),
        # identity, written once at init
        ("pid", ctypes.c_int64),
        ("global_rank", ctypes.c_int32),
        ("local_rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("local_world_size", ctypes.c_int32),
        ("node_rank", ctypes.c_int32),
        ("device", ctypes.c_int32),
        ("hostname", ctypes.c_char * HOST_LEN),
        ("job_id", ctypes.c_char * JOB_LEN),
        ("start_ns", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("n_phases", ctypes.c_uint32),
        ("phase_names", (ctypes.c_char * NAME_LEN) * MAX_PHASES),
        ("phase_budget_s", ctypes.c_double * MAX_PHASES),
        # live state, written on every transition
        ("step", ctypes.c_uint64),
        ("step_start_ns", ctypes.c_uint64),
        ("phase", ctypes.c_int32),
        ("depth", ctypes.c_int32),
        ("phase_start_ns", ctypes.c_uint64),
        ("last_progress_ns", ctypes.c_uint64),
        ("transitions", ctypes.c_uint64),
        ("coll_seq_entered", ctypes.c_uint64),
        ("coll_seq_completed", ctypes.c_uint64),
        ("coll_op", ctypes.c_char * NAME_LEN),
        ("budget_s", ctypes.c_double),  # largest declared budget among the open phases, 0 if none
        ("budget_start_ns", ctypes.c_uint64),  # when the phase holding that budget began
        ("exit_ns", ctypes.c_uint64),
        # "ExceptionType: message" of the exception that ended the script (bounded, UTF-8), set with FLAG_CRASHED
        ("crash_info", ctypes.c_char * CRASH_LEN),
        # GPU time per phase slot (ms, cumulative) from CUDA events; only on ranks that use CUDA
        ("gpu_phase_ms", ctypes.c_double * MAX_PHASES),
        # per DataLoader worker slot: [production ns, batches], cumulative; each slot is written only by
        # its worker process (hooks/input_timing.py), read by the training thread at step end
        ("input_slots", ctypes.c_uint64 * (2 * INPUT_SLOTS)),
        # ring of completed steps: entry i holds step s where s % RING_STEPS == i
        ("steps_done", ctypes.c_uint64),
        ("ring", StepEntry * RING_STEPS),
    )


RECORD_SIZE = ctypes.sizeof(RecordLayout)
_SEQ_OFFSET = RecordLayout.seq.offset
_RING_OFFSET = RecordLayout.ring.offset
_STEPS_DONE_OFFSET = RecordLayout.steps_done.offset
_ENTRY_SIZE = ctypes.sizeof(StepEntry)


def record_path(shm_dir: str, job_id: str, global_rank: int) -> str:
    return os.path.join(shm_dir, job_id, f"rank-{global_rank}.hb")


@dataclass(frozen=True)
class RecordSnapshot:
    """A consistent, decoded copy of one rank's record."""

    path: str
    pid: int
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: int
    hostname: str
    job_id: str
    start_ns: int
    flags: int
    phase_names: tuple[str, ...]
    phase_budget_s: tuple[float, ...]
    step: int
    step_start_ns: int
    phase: str | None
    phase_start_ns: int
    last_progress_ns: int
    transitions: int
    coll_seq_entered: int
    coll_seq_completed: int
    coll_op: str | None
    budget_s: float
    budget_start_ns: int
    exit_ns: int
    steps_done: int
    crash_info: str = ""
    gpu_phase_ms: dict[str, float] = field(default_factory=dict)
    recent_steps: tuple[StepTiming, ...] = field(default=())

    @property
    def exited_normally(self) -> bool:
        return bool(self.flags & FLAG_EXITED)

    @property
    def crashed(self) -> bool:
        return bool(self.flags & FLAG_CRASHED)

    @property
    def in_collective(self) -> bool:
        return self.coll_seq_entered > self.coll_seq_completed


def _decode_str(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def _ring_steps(buf: bytes, names: tuple[str, ...], first: int, done: int) -> list[StepTiming]:
    """The ring's completed steps ``first``..``done``-1; a slot not yet written for its step is skipped."""
    from rankwatch.watchdog.core.steps import StepTiming  # here, not at the top: the hook never builds one

    n = len(names)
    steps: list[StepTiming] = []
    if first >= done:
        return steps
    # one cast over the ring instead of a ctypes attribute walk per field: the daemon decodes every
    # step of every rank (hundreds per second at 5 ms steps)
    words = memoryview(buf)[_RING_OFFSET : _RING_OFFSET + RING_STEPS * _ENTRY_SIZE].cast("Q")
    per = _ENTRY_SIZE // 8
    for s in range(first, done):
        base = (s % RING_STEPS) * per
        if words[base] != s:  # slot not yet written for this step (cannot happen under the seqlock)
            continue
        ns = words[base + 3 : base + 3 + n]
        inp = base + 3 + MAX_PHASES
        steps.append(
            StepTiming(
                step=s,
                start_ns=words[base + 1],
                end_ns=words[base + 2],
                phases_ms={names[i]: v / 1e6 for i, v in enumerate(ns) if v},
                input_ms=words[inp] / 1e6,
                input_batches=min(words[inp + 1], 1 << 32),
                input_workers=min(words[inp + 2], 1 << 16),
            )
        )
    return steps


def decode(buf: bytes, path: str = "<buffer>", since_step: int = -1) -> RecordSnapshot:
    """Decode a record copy; ``since_step`` limits the ring to steps after it (the daemon's cursor)."""
    if len(buf) >= 8 and buf[:8] != MAGIC:
        raise RecordFormatError(f"{path}: not a rankwatch record (bad magic)")
    if len(buf) >= 12 and (version := int.from_bytes(buf[8:12], "little")) != VERSION:
        # another release's layout (the ring entries of version 2 were shorter): rejected, never misread
        raise RecordFormatError(
            f"{path}: record version {version}, expected {VERSION} (written by another rankwatch release)"
        )
    if len(buf) < RECORD_SIZE:
        raise RecordFormatError(f"{path}: truncated record ({len(buf)} of {RECORD_SIZE} bytes)")
    rec = RecordLayout.from_buffer_copy(buf[:RECORD_SIZE])
    if rec.magic != MAGIC:
        raise RecordFormatError(f"{path}: not a rankwatch record (bad magic)")
    if rec.version != VERSION or rec.size != RECORD_SIZE:
        raise RecordFormatError(
            f"{path}: record version {rec.version} size {rec.size}, expected {VERSION}/{RECORD_SIZE}"
        )
    n = rec.n_phases
    if not 0 < n <= MAX_PHASES or not -1 <= rec.phase < n or rec.global_rank < 0 or rec.world_size <= 0:
        raise RecordFormatError(f"{path}: corrupt record (phase table or identity out of range)")
    names = tuple(_decode_str(bytes(rec.phase_names[i])) for i in range(n))
    budgets = tuple(float(rec.phase_budget_s[i]) for i in range(n))
    done = int(rec.steps_done)
    steps = _ring_steps(buf, names, max(since_step + 1, done - RING_STEPS, 0), done)
    op = _decode_str(rec.coll_op)
    return RecordSnapshot(
        path=path,
        pid=int(rec.pid),
        global_rank=int(rec.global_rank),
        local_rank=int(rec.local_rank),
        world_size=int(rec.world_size),
        local_world_size=int(rec.local_world_size),
        node_rank=int(rec.node_rank),
        device=int(rec.device),
        hostname=_decode_str(rec.hostname),
        job_id=_decode_str(rec.job_id),
        start_ns=int(rec.start_ns),
        flags=int(rec.flags),
        phase_names=names,
        phase_budget_s=budgets,
        step=int(rec.step),
        step_start_ns=int(rec.step_start_ns),
        phase=names[rec.phase] if rec.phase >= 0 else None,
        phase_start_ns=int(rec.phase_start_ns),
        last_progress_ns=int(rec.last_progress_ns),
        transitions=int(rec.transitions),
        coll_seq_entered=int(rec.coll_seq_entered),
        coll_seq_completed=int(rec.coll_seq_completed),
        coll_op=op or None,
        budget_s=float(rec.budget_s),
        budget_start_ns=int(rec.budget_start_ns),
        exit_ns=int(rec.exit_ns),
        gpu_phase_ms=(
            {names[i]: float(rec.gpu_phase_ms[i]) for i in range(n) if rec.gpu_phase_ms[i]}
            if rec.flags & FLAG_GPU_TIMING
            else {}
        ),
        steps_done=done,
        crash_info=_decode_str(rec.crash_info),
        recent_steps=tuple(steps),
    )


class RecordReader:
    """Reads one rank's record consistently (seqlock) with pread: a file truncated or replaced under us
    yields a short read and a clear error, never a SIGBUS as a mapping would."""

    def __init__(self, path: str, retries: int = 200, *, dir_fd: int | None = None) -> None:
        """``dir_fd``: ``path`` is a name in that dir (the watchdog's readers open records only that way)."""
        self.path = path
        self._retries = retries
        try:
            # O_NONBLOCK: a FIFO planted as a record must not block the (root) daemon's poll loop in open();
            # O_NOCTTY: a tty planted there never becomes the reader's controlling terminal
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK
            self._fd = os.open(path, flags, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RecordFormatError(f"{path}: is a symlink, refusing to read it") from exc
            raise RecordFormatError(f"{path}: cannot open record: {exc.strerror}") from exc
        st = os.fstat(self._fd)
        self.inode, self.dev, self.uid = st.st_ino, st.st_dev, st.st_uid
        if not stat.S_ISREG(st.st_mode):
            os.close(self._fd)
            raise RecordFormatError(f"{path}: not a regular file")
        try:
            decode(os.pread(self._fd, RECORD_SIZE, 0), path)  # validate now: a foreign file fails at open
        except RecordFormatError:
            os.close(self._fd)
            raise

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def replaced(self) -> bool:
        """The path now names another file (the rank restarted and wrote a fresh record)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return False

    def _seq(self) -> int:
        return int.from_bytes(os.pread(self._fd, 8, _SEQ_OFFSET), "little")

    def _copy(self, since_step: int) -> bytearray:
        """Header and live state, plus only the ring slots of steps after ``since_step``: a small copy
        finishes between two writer updates, so the seqlock rarely has to retry."""
        buf = bytearray(RECORD_SIZE)
        head = os.pread(self._fd, _RING_OFFSET, 0)
        buf[: len(head)] = head
        if len(head) < _RING_OFFSET:
            return buf[: len(head)]
        done = int.from_bytes(head[_STEPS_DONE_OFFSET : _STEPS_DONE_OFFSET + 8], "little")
        count = done - max(since_step + 1, done - RING_STEPS, 0)
        if count <= 0:
            return buf
        start = (done - count) % RING_STEPS
        spans = [(start, min(RING_STEPS, start + count))]
        if start + count > RING_STEPS:
            spans.append((0, start + count - RING_STEPS))
        for a, b in spans:
            off = _RING_OFFSET + a * _ENTRY_SIZE
            chunk = os.pread(self._fd, (b - a) * _ENTRY_SIZE, off)
            buf[off : off + len(chunk)] = chunk
        return buf

    def read(self, since_step: int = -1) -> RecordSnapshot:
        """Consistent snapshot; raises RecordFormatError if it stays torn or turns corrupt."""
        for attempt in range(self._retries):
            if attempt > 20:
                time.sleep(0.0002)  # a writer this busy: let it finish a section
            before = self._seq()
            if before & 1:
                os.sched_yield()
                continue
            buf = self._copy(since_step)
            if self._seq() == before:
                return decode(bytes(buf), self.path, since_step)
        raise RecordFormatError(f"{self.path}: record kept changing during {self._retries} reads (torn)")


def read_record(path: str, since_step: int = -1) -> RecordSnapshot:
    reader = RecordReader(path)
    try:
        return reader.read(since_step)
    finally:
        reader.close()


class RecordWriter:
    """Owns one rank's record. Field updates are plain stores into the shared mapping."""

    def __init__(self, path: str) -> None:
        # A fresh file renamed into place: a reader still holding an older record keeps a valid file,
        # and no one ever sees a record shorter than RECORD_SIZE.
        self.path = path
        tmp = f"{path}.new{os.getpid()}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, RECORD_SIZE)
            self._map = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        self.rec = RecordLayout.from_buffer(self._map)
        self._tmp: str | None = tmp

    @property
    def map(self) -> mmap.mmap:
        """The shared mapping, for the tracker's typed views (indexed stores instead of ctypes fields)."""
        return self._map

    def publish(self) -> None:
        """Make the record visible under its final name (after the identity is written)."""
        if self._tmp is not None:
            os.replace(self._tmp, self.path)
            self._tmp = None

    def begin(self) -> None:
        self.rec.seq += 1

    def end(self) -> None:
        self.rec.seq += 1

    def close(self) -> None:
        rec = self.rec
        del self.rec
        del rec
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the mapping dies with the process
            pass


@dataclass
class RankIdentity:
    pid: int
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: int
    hostname: str
    job_id: str
    start_ns: int


def write_identity(writer: RecordWriter, ident: RankIdentity, phases: list[str]) -> None:
    rec = writer.rec
    writer.begin()
    rec.magic = MAGIC
    rec.version = VERSION
    rec.size = RECORD_SIZE
    rec.pid = ident.pid
    rec.global_rank = ident.global_rank
    rec.local_rank = ident.local_rank
    rec.world_size = ident.world_size
    rec.local_world_size = ident.local_world_size
    rec.node_rank = ident.node_rank
    rec.device = ident.device
    rec.hostname = ident.hostname.encode()[: HOST_LEN - 1]
    rec.job_id = ident.job_id.encode()[: JOB_LEN - 1]
    rec.start_ns = ident.start_ns
    rec.step_start_ns = ident.start_ns
    rec.last_progress_ns = ident.start_ns
    rec.phase = NO_PHASE
    for i, name in enumerate(phases):
        rec.phase_names[i].value = name.encode()[: NAME_LEN - 1]
    rec.n_phases = len(phases)
    writer.end()
    writer.publish()
