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
# production time and the DataLoader workers' slots); 4: the event ring (the training thread appends one
# word per phase transition; per-phase times and the live state are rebuilt by the reader); 5: thread_error
# (a helper thread of the rank died with an exception); 6: the peer of the last send/recv entered and the peers
# this rank completed a send/recv with (p2p_last, p2p_known). Any other version is rejected, never misread.
VERSION = 6
MAX_PHASES = 16  # slot table; canonical phases take the first six
RING_STEPS = 512  # steps kept; at 5 ms steps a 1 Hz poll needs ~200
INPUT_SLOTS = 32  # DataLoader workers timed at once per rank (more share slots modulo this)
NAME_LEN = 24
HOST_LEN = 64
JOB_LEN = 64
# Event ring: 2**14 words (128 KiB). A step of the demo is ~10 events, so the ring holds ~1,600 such
# steps (more than RING_STEPS); a step with more events than the ring is reported by no one (never with
# wrong totals). A fold checkpoint every EVENTS // 4 events bounds the live replay of a step that never ends.
EVENTS = 1 << 14
EVENT_MASK = EVENTS - 1
FOLD_EVENTS = EVENTS // 4
MAX_STACK = 8  # innermost open phases kept in a checkpoint (deeper ones are booked as idle once reached)
MAX_OPS = 32  # collective op names (torch.distributed has 19 wrapped)
# Peers a rank completed a send/recv with, kept in order of first exchange: a pipeline stage has two (the stages
# before and after it), an interleaved schedule a few more. A peer past the slots marks the set full: the reader
# then cannot say a peer is new (never guessed).
P2P_SLOTS = 8

# p2p_last, one word written before the send/recv's collective-enter event (no seqlock: a reader matches it to
# the op by its sequence number): the collective count of the op (low 32 bits) | the peer's global rank (30 bits,
# P2P_UNKNOWN: not named, e.g. a recv from any source) | the direction (2 bits). 0: no send/recv yet.
P2P_SEQ_BITS = 32
P2P_PEER_BITS = 30
P2P_UNKNOWN = (1 << P2P_PEER_BITS) - 1
P2P_SEND, P2P_RECV = 1, 2
P2P_DIRS = {P2P_SEND: "send", P2P_RECV: "recv"}

CANONICAL_PHASES = ("dataloader", "forward", "backward", "optimizer", "collective", "idle")
IDLE_SLOT = CANONICAL_PHASES.index("idle")
COLLECTIVE_SLOT = CANONICAL_PHASES.index("collective")

FLAG_EXITED = 1  # interpreter exited normally (atexit ran)
FLAG_DISABLED = 2  # hook disabled itself after an internal error
FLAG_EXPLICIT_STEPS = 4  # the script calls step() itself; optimizer hooks no longer end steps
FLAG_CRASHED = 8  # the script ended with an exception or a non-zero exit
FLAG_GPU_TIMING = 16  # gpu_phase_ms is being filled from CUDA events

NO_PHASE = -1

# An event word: kind (3 bits) | arg (5 bits: phase slot, op index or tail slot) | ns since
# event_origin(start_ns) (56 bits). A zero word was never written.
NS_BITS = 56
NS_MASK = (1 << NS_BITS) - 1
EV_ENTER = 1  # arg: slot
EV_EXIT = 2  # arg: slot
EV_EXIT_FAIL = 3  # arg: slot; an exception left it (the record keeps naming it until the next enter)
EV_EXIT_BATCH = 4  # arg: slot; the phase's time was also this thread's batch production (no workers)
EV_COLL_ENTER = 5  # arg: op index; opens the collective slot
EV_COLL_EXIT = 6  # closes the collective slot
EV_SPLIT = 7  # arg: tail slot; ns: the split moment of the exit event that follows (backward → grad_sync)


def event_origin(start_ns: int) -> int:
    """What an event word's ns count from: 2**54 ns (208 days) before the record's start, so a clock read
    a little older than the start (a test's clock, a DDP split stamp) still fits; 1.7 years after it."""
    return max(0, start_ns - (1 << 54))


def event_code(kind: int, arg: int) -> int:
    """The top byte of an event word, shifted in place."""
    return ((kind << 5) | (arg & 31)) << NS_BITS


class RecordFormatError(Exception):
    """A file in the shm dir is not a valid rankwatch record (corrupt, truncated, foreign, other version)."""


class Checkpoint(ctypes.Structure):
    """The state the reader replays events from: written once per step (and every FOLD_EVENTS events),
    inside a seqlock section, by the training thread."""

    _pack_ = 8
    _fields_ = (
        ("ev", ctypes.c_uint64),  # events written before this point
        ("at_ns", ctypes.c_uint64),  # when (absolute ns)
        ("colls", ctypes.c_uint64),  # collectives entered so far
        ("last_op", ctypes.c_int64),  # op index of the last one, -1: none yet
        ("frozen", ctypes.c_uint64),  # enter word of the phase a failing exit left (still named), 0: none
        ("depth", ctypes.c_uint64),  # open phases
        ("stack", ctypes.c_uint64 * MAX_STACK),  # enter words of the innermost open phases, outermost first
    )


class StepEntry(ctypes.Structure):
    _pack_ = 8
    _fields_ = (
        ("step", ctypes.c_uint64),
        ("start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        # batches the DataLoader workers finished during this step, their production time (summed over
        # workers) and the producers: workers, 0 = the training thread itself (its own batches are in the
        # events: EV_EXIT_BATCH)
        ("input_ns", ctypes.c_uint64),
        ("input_batches", ctypes.c_uint64),
        ("input_workers", ctypes.c_uint64),
        ("cp", Checkpoint),  # the state at the step's end
    )


class RecordHeader(ctypes.Structure):
    """Everything before the two rings (what ``decode`` reads as fields; the rings are read as words)."""

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
        ("n_ops", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("op_names", (ctypes.c_char * NAME_LEN) * MAX_OPS),
        # written in seqlock sections, rarely: declared budgets (phase(..., budget_s=...)) and the end
        ("budget_s", ctypes.c_double),  # largest declared budget among the open phases, 0 if none
        ("budget_start_ns", ctypes.c_uint64),  # when the phase holding that budget began
        ("exit_ns", ctypes.c_uint64),
        # "ExceptionType: message" of the exception that ended the script (bounded, UTF-8), set with FLAG_CRASHED
        ("crash_info", ctypes.c_char * CRASH_LEN),
        # "thread NAME: ExceptionType: message" of the first thread other than the main one that died with an
        # exception (a prefetch or I/O helper whose queue the training loop now waits on forever); written once,
        # by the dying thread, outside the seqlock (the training thread is the seqlock's only writer)
        ("thread_error", ctypes.c_char * CRASH_LEN),
        # the last send/recv entered on the training thread (P2P_SEQ_BITS: its collective count, the peer, the
        # direction), one plain store per send/recv; the peers a send/recv completed with (in a seqlock section,
        # once per new peer; p2p_known_n > P2P_SLOTS: more peers than slots, the set is not complete)
        ("p2p_last", ctypes.c_uint64),
        ("p2p_known_n", ctypes.c_uint64),
        ("p2p_known", ctypes.c_uint64 * P2P_SLOTS),
        # GPU time per phase slot (ms, cumulative) from CUDA events; only on ranks that use CUDA
        ("gpu_phase_ms", ctypes.c_double * MAX_PHASES),
        # per DataLoader worker slot: [production ns, batches], cumulative; each slot is written only by
        # its worker process (hooks/input_timing.py), read by the training thread at step end
        ("input_slots", ctypes.c_uint64 * (2 * INPUT_SLOTS)),
        ("fold", Checkpoint),  # the latest mid-step checkpoint (every FOLD_EVENTS events)
        # events written so far: the only word besides the event itself stored per event, after it
        ("ev_count", ctypes.c_uint64),
        ("ev_count_after", ctypes.c_uint64),  # never written by the hook: the reader's second look at ev_count
        # ring of completed steps: entry i holds step s where s % RING_SLOTS == i (one more than RING_STEPS:
        # the entry before a step is where its replay starts)
        ("steps_done", ctypes.c_uint64),
    )


class RecordLayout(ctypes.Structure):
    _pack_ = 8
    _fields_ = (
        *RecordHeader._fields_,
        ("ring", StepEntry * (RING_STEPS + 1)),
        # event ring: event e at index e % EVENTS
        ("events", ctypes.c_uint64 * EVENTS),
    )


RING_SLOTS = RING_STEPS + 1
RECORD_SIZE = ctypes.sizeof(RecordLayout)
_SEQ_OFFSET = RecordLayout.seq.offset
_RING_OFFSET = RecordLayout.ring.offset
_EVENTS_OFFSET = RecordLayout.events.offset
_STEPS_DONE_OFFSET = RecordLayout.steps_done.offset
_EV_COUNT_OFFSET = RecordLayout.ev_count.offset
_EV_AFTER_OFFSET = RecordLayout.ev_count_after.offset
_ENTRY_SIZE = ctypes.sizeof(StepEntry)
_ENTRY_WORDS = _ENTRY_SIZE // 8
_CP_WORDS = ctypes.sizeof(Checkpoint) // 8
_E_CP = StepEntry.cp.offset // 8  # the checkpoint's first word within an entry
assert ctypes.sizeof(RecordHeader) == _RING_OFFSET and all(
    off % 8 == 0 for off in (_RING_OFFSET, _EVENTS_OFFSET, RecordLayout.fold.offset, _ENTRY_SIZE)
)


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
    thread_error: str = ""
    gpu_phase_ms: dict[str, float] = field(default_factory=dict)
    recent_steps: tuple[StepTiming, ...] = field(default=())
    # the send/recv the rank is in, or issued last, when it is its newest collective (``coll_seq_entered``):
    # "send" or "recv" and its peer's global rank (None: the op named none, e.g. a recv from any source)
    p2p_dir: str | None = None
    p2p_peer: int | None = None
    # the peers a send/recv of this rank completed with, first exchange first; ``p2p_known_full``: it had more
    # peers than the record keeps (a peer not listed may have been one)
    p2p_known: tuple[int, ...] = ()
    p2p_known_full: bool = False

    @property
    def exited_normally(self) -> bool:
        return bool(self.flags & FLAG_EXITED)

    @property
    def crashed(self) -> bool:
        return bool(self.flags & FLAG_CRASHED)

    @property
    def in_collective(self) -> bool:
        return self.coll_seq_entered > self.coll_seq_completed


def decode_p2p(word: int, coll_seq: int) -> tuple[str | None, int | None]:
    """(direction, peer) of a ``p2p_last`` word when it belongs to collective ``coll_seq`` (else the rank's newest
    collective is not that send/recv: nothing)."""
    direction = P2P_DIRS.get(word >> (P2P_SEQ_BITS + P2P_PEER_BITS))
    if direction is None or word & ((1 << P2P_SEQ_BITS) - 1) != coll_seq & ((1 << P2P_SEQ_BITS) - 1):
        return None, None
    peer = (word >> P2P_SEQ_BITS) & P2P_UNKNOWN
    return direction, None if peer == P2P_UNKNOWN else peer


def _decode_str(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


_INITIAL_CP = (0, 0, 0, -1, 0, 0)  # ev, at_ns (start_ns is added), colls, last_op, frozen, depth


class _Replay:
    """The writer's old bookkeeping, redone by the reader from a checkpoint and the events after it:
    exclusive time per slot (entering a nested phase pauses its parent), the open phases, collectives."""

    __slots__ = ("acc", "colls", "colls_done", "frozen", "in_batches", "in_ns", "last", "last_op", "seen", "stack")

    def __init__(self, w: memoryview, base: int, start_ns: int, origin: int) -> None:
        """From the checkpoint at word ``base`` of ``w`` (``base`` < 0: the record's start); event and stack
        words count ns from ``origin``."""
        _ev, at, colls, last_op, frozen, depth = (w[base + i] for i in range(6)) if base >= 0 else _INITIAL_CP
        if base < 0:
            at = start_ns
        words = [w[base + 6 + i] for i in range(min(depth, MAX_STACK))]
        self.stack = [((x >> NS_BITS) & 31, (x & NS_MASK) + origin) for x in words]
        self.frozen = ((frozen >> NS_BITS) & 31, (frozen & NS_MASK) + origin) if frozen else None
        in_coll = any(slot == COLLECTIVE_SLOT for slot, _ in self.stack)
        self.colls, self.colls_done = colls, colls - 1 if in_coll and colls else colls
        self.last_op = last_op - (1 << 64) if last_op >= 1 << 63 else last_op
        self.last = self.seen = at
        self.acc = [0] * 32  # indexed by a 5-bit slot; slots past the phase table are dropped at the end
        self.in_ns = self.in_batches = 0

    def run(self, events: memoryview, lo: int, hi: int, origin: int) -> None:
        """Apply events ``lo``..``hi``-1. Any word is safe: unknown kinds are skipped, durations clamp at 0."""
        stack, acc, last, seen = self.stack, self.acc, self.last, self.seen
        split: tuple[int, int] | None = None
        for e in range(lo, hi):
            word = events[e & EVENT_MASK]
            kind, arg, t = word >> 61, (word >> NS_BITS) & 31, (word & NS_MASK) + origin
            if kind == EV_SPLIT:
                split = (arg, t)
                continue
            seen = t  # the latest transition's time (the writer's clock order, as the writer saw it)
            if kind in (EV_ENTER, EV_COLL_ENTER):
                if kind == EV_COLL_ENTER:
                    self.colls += 1
                    self.last_op = arg
                    arg = COLLECTIVE_SLOT
                if t > last:
                    acc[stack[-1][0] if stack else IDLE_SLOT] += t - last
                last = t
                stack.append((arg, t))
                self.frozen = None
            elif EV_EXIT <= kind <= EV_COLL_EXIT:
                if kind == EV_COLL_EXIT:
                    arg = COLLECTIVE_SLOT
                    self.colls_done = self.colls
                if not stack or stack[-1][0] != arg:  # an exception skipped an exit: unwind to the match
                    while stack and stack[-1][0] != arg:
                        stack.pop()
                    if not stack:
                        split = None
                        continue
                if split is not None and last < split[1] < t:
                    acc[arg] += split[1] - last
                    acc[split[0]] += t - split[1]
                elif t > last:
                    acc[arg] += t - last
                last = t
                started = stack.pop()[1]
                if kind == EV_EXIT_FAIL:
                    self.frozen = (arg, started)
                elif kind == EV_EXIT_BATCH:
                    self.in_ns += max(0, t - started)
                    self.in_batches += 1
            split = None
        self.last, self.seen = last, seen

    def end_step(self, end_ns: int) -> None:
        if end_ns > self.last:
            self.acc[self.stack[-1][0] if self.stack else IDLE_SLOT] += end_ns - self.last
        self.last = end_ns


def _header_words(buf: bytes) -> memoryview:
    return memoryview(buf)[: _RING_OFFSET + RING_SLOTS * _ENTRY_SIZE].cast("Q")


def _plan(w: memoryview, since_step: int) -> tuple[int, int, int, int]:
    """(first step to rebuild, steps done, the live checkpoint's word index or -1, oldest event needed)."""
    done = w[_STEPS_DONE_OFFSET // 8]
    first = max(since_step + 1, done - RING_STEPS, 0)
    ev_count = w[_EV_COUNT_OFFSET // 8]
    live = _entry_cp(done - 1) if done else -1
    fold = RecordLayout.fold.offset // 8
    if 0 < w[fold] <= ev_count and (live < 0 or w[fold] > w[live]):
        live = fold
    lo = min(w[_entry_cp(first - 1)] if first else 0, w[live] if live >= 0 else 0)
    return first, done, live, max(lo, ev_count - EVENTS, 0)


def _entry_cp(step: int) -> int:
    """Word index of step ``step``'s checkpoint in the record."""
    return _RING_OFFSET // 8 + (step % RING_SLOTS) * _ENTRY_WORDS + _E_CP


def _rebuild_steps(
    w: memoryview, events: memoryview, names: tuple[str, ...], span: tuple[int, int, int, int], start_ns: int
) -> list[StepTiming]:
    """Steps ``first``..``done``-1 replayed from the entry before each; a step whose entries were not
    written for it, or whose events the ring no longer holds, is left out (never reported with wrong times)."""
    from rankwatch.watchdog.core.steps import StepTiming  # here, not at the top: the hook never builds one

    first, done, valid_lo, ev_count = span
    n = len(names)
    steps: list[StepTiming] = []
    for s in range(first, done):
        base = _entry_cp(s) - _E_CP
        prev = _entry_cp(s - 1) if s else -1
        if w[base] != s or (prev >= 0 and w[prev - _E_CP] != s - 1):
            continue
        lo = w[prev] if prev >= 0 else 0
        hi = w[base + _E_CP]
        if not valid_lo <= lo <= hi <= ev_count:
            continue
        rp = _Replay(w, prev, start_ns, event_origin(start_ns))
        rp.run(events, lo, hi, event_origin(start_ns))
        rp.end_step(w[base + 2])
        steps.append(
            StepTiming(
                step=s,
                start_ns=w[base + 1],
                end_ns=w[base + 2],
                phases_ms={names[i]: v / 1e6 for i, v in enumerate(rp.acc[:n]) if v},
                input_ms=(w[base + 3] + rp.in_ns) / 1e6,
                input_batches=min(w[base + 4] + rp.in_batches, 1 << 32),
                input_workers=min(w[base + 5], 1 << 16),
            )
        )
    return steps


def decode(buf: bytes, path: str = "<buffer>", since_step: int = -1) -> RecordSnapshot:
    """Decode a record copy; ``since_step`` limits the ring to steps after it (the daemon's cursor)."""
    if len(buf) >= 8 and buf[:8] != MAGIC:
        raise RecordFormatError(f"{path}: not a rankwatch record (bad magic)")
    if len(buf) >= 12 and (version := int.from_bytes(buf[8:12], "little")) != VERSION:
        # another release's layout (version 3 kept per-phase times in the ring): rejected, never misread
        raise RecordFormatError(
            f"{path}: record version {version}, expected {VERSION} (written by another rankwatch release)"
        )
    if len(buf) < RECORD_SIZE:
        raise RecordFormatError(f"{path}: truncated record ({len(buf)} of {RECORD_SIZE} bytes)")
    rec = RecordHeader.from_buffer_copy(buf)  # the header only: the rings are read as words
    if rec.magic != MAGIC:
        raise RecordFormatError(f"{path}: not a rankwatch record (bad magic)")
    if rec.version != VERSION or rec.size != RECORD_SIZE:
        raise RecordFormatError(
            f"{path}: record version {rec.version} size {rec.size}, expected {VERSION}/{RECORD_SIZE}"
        )
    n = rec.n_phases
    if not 0 < n <= MAX_PHASES or rec.n_ops > MAX_OPS or rec.global_rank < 0 or rec.world_size <= 0:
        raise RecordFormatError(f"{path}: corrupt record (phase table or identity out of range)")
    names = tuple(_decode_str(bytes(rec.phase_names[i])) for i in range(n))
    ops = tuple(_decode_str(bytes(rec.op_names[i])) for i in range(rec.n_ops))
    start = int(rec.start_ns)
    w = _header_words(buf)
    events = memoryview(buf)[_EVENTS_OFFSET : _EVENTS_OFFSET + EVENTS * 8].cast("Q")
    ev_count = int(rec.ev_count)
    # events the writer may have overwritten while the reader copied them: older than its second look
    valid_lo = max(0, max(ev_count, int(rec.ev_count_after)) - EVENTS)
    first, done, live, _ = _plan(w, since_step)
    if not valid_lo <= (w[live] if live >= 0 else 0) <= ev_count:
        raise RecordFormatError(f"{path}: corrupt record (the event ring overran its last checkpoint)")
    steps = _rebuild_steps(w, events, names, (first, done, valid_lo, ev_count), start)
    rp = _Replay(w, live, start, event_origin(start))
    rp.run(events, w[live] if live >= 0 else 0, ev_count, event_origin(start))
    if rp.frozen is not None:  # an exception left this phase: it stays on record until the next enter
        phase_slot, phase_start = rp.frozen
    elif rp.stack:
        phase_slot, phase_start = rp.stack[-1]
    else:
        phase_slot, phase_start = NO_PHASE, rp.last
    p2p_dir, p2p_peer = decode_p2p(int(rec.p2p_last), rp.colls)
    known_n = int(rec.p2p_known_n)
    last_entry = _entry_cp(done - 1) - _E_CP if done else -1
    step_start = w[last_entry + 2] if done and w[last_entry] == done - 1 else start
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
        start_ns=start,
        flags=int(rec.flags),
        phase_names=names,
        phase_budget_s=tuple(float(rec.phase_budget_s[i]) for i in range(n)),
        step=done,
        step_start_ns=step_start,
        phase=names[phase_slot] if 0 <= phase_slot < n else None,
        phase_start_ns=phase_start,
        last_progress_ns=rp.seen,
        transitions=ev_count + done,
        coll_seq_entered=rp.colls,
        coll_seq_completed=rp.colls_done,
        coll_op=(ops[rp.last_op] or None) if 0 <= rp.last_op < len(ops) else None,
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
        thread_error=_decode_str(rec.thread_error),
        recent_steps=tuple(steps),
        p2p_dir=p2p_dir,
        p2p_peer=p2p_peer,
        p2p_known=tuple(int(rec.p2p_known[i]) for i in range(min(known_n, P2P_SLOTS))),
        p2p_known_full=known_n > P2P_SLOTS,
    )


def _spans(start: int, count: int, size: int) -> list[tuple[int, int]]:
    """Index ranges of ``count`` ring slots from ``start`` (one, or two when they wrap)."""
    count = min(count, size)
    spans = [(start, min(size, start + count))]
    if start + count > size:
        spans.append((0, start + count - size))
    return spans


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
        """Header and checkpoints, the step entries after ``since_step`` (and the one before them), the
        events from there on, then ``ev_count`` once more: events older than that second look minus the
        ring's size may have been overwritten during the copy and are not used (``decode``)."""
        buf = bytearray(RECORD_SIZE)
        head = os.pread(self._fd, _RING_OFFSET, 0)
        buf[: len(head)] = head
        if len(head) < _RING_OFFSET:
            return buf[: len(head)]
        hw = memoryview(head).cast("Q")
        done = hw[_STEPS_DONE_OFFSET // 8]
        first = max(since_step + 1, done - RING_STEPS, 0)
        lo_step = max(first - 1, 0, done - RING_SLOTS)
        count = done - lo_step
        if count > 0:
            start = lo_step % RING_SLOTS
            for a, b in _spans(start, count, RING_SLOTS):
                off = _RING_OFFSET + a * _ENTRY_SIZE
                chunk = os.pread(self._fd, (b - a) * _ENTRY_SIZE, off)
                buf[off : off + len(chunk)] = chunk
        ev_count = hw[_EV_COUNT_OFFSET // 8]
        with memoryview(buf) as view, view[: _RING_OFFSET + RING_SLOTS * _ENTRY_SIZE].cast("Q") as words:
            ev_lo = _plan(words, since_step)[3]
        if ev_count > ev_lo:
            for a, b in _spans(ev_lo % EVENTS, ev_count - ev_lo, EVENTS):
                off = _EVENTS_OFFSET + a * 8
                chunk = os.pread(self._fd, (b - a) * 8, off)
                buf[off : off + len(chunk)] = chunk
        buf[_EV_AFTER_OFFSET : _EV_AFTER_OFFSET + 8] = os.pread(self._fd, 8, _EV_COUNT_OFFSET).ljust(8, b"\0")
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
    for i, name in enumerate(phases):
        rec.phase_names[i].value = name.encode()[: NAME_LEN - 1]
    rec.n_phases = len(phases)
    writer.end()
    writer.publish()
