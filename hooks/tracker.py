"""Phase and step bookkeeping on the training thread, written straight into the shm record.

Time is attributed exclusively: entering a nested phase pauses its parent, so the per-phase times of a
step add up to its wall duration (time outside any phase is ``idle``). Every public method swallows
its own errors and disables tracking: the hook must never raise into training.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import warnings
from array import array
from typing import Any

from .record import (
    CANONICAL_PHASES,
    CRASH_LEN,
    FLAG_CRASHED,
    FLAG_DISABLED,
    FLAG_EXITED,
    FLAG_EXPLICIT_STEPS,
    FLAG_GPU_TIMING,
    IDLE_SLOT,
    INPUT_SLOTS,
    MAX_PHASES,
    NAME_LEN,
    NO_PHASE,
    RING_STEPS,
    RecordLayout,
    RecordWriter,
    StepEntry,
)

COLLECTIVE_SLOT = CANONICAL_PHASES.index("collective")
# phases whose GPU work is timed with CUDA events (where the kernels are launched)
GPU_TIMED_SLOTS = frozenset(CANONICAL_PHASES.index(p) for p in ("forward", "backward", "optimizer"))
_now = time.monotonic_ns
_ident = threading.get_ident

# Word indices into the record (same layout as RecordLayout, read by the daemon): a store through a
# memoryview slot costs ~20 ns, a ctypes attribute ~50-70 ns and a ctypes sub-structure (the ring
# entry) ~100 ns to create. Counters the writer alone changes (seq, transitions, ...) are mirrored in
# Python ints, so no hot path reads the mapping back.
_Q = 8  # bytes per uint64 / double word
_SEQ = RecordLayout.seq.offset // _Q
_STEP = RecordLayout.step.offset // _Q
_STEP_START = RecordLayout.step_start_ns.offset // _Q
_DEPTH_I32 = RecordLayout.depth.offset // 4
_PHASE_DEPTH = RecordLayout.phase.offset // _Q  # the pair as one little-endian word: depth << 32 | phase
_I32_MASK = 0xFFFFFFFF
_NO_PHASE_DEPTH0 = NO_PHASE & _I32_MASK  # no phase open, depth 0
_PHASE_START = RecordLayout.phase_start_ns.offset // _Q
_PROGRESS = RecordLayout.last_progress_ns.offset // _Q
_TRANSITIONS = RecordLayout.transitions.offset // _Q
_COLL_ENTERED = RecordLayout.coll_seq_entered.offset // _Q
_COLL_COMPLETED = RecordLayout.coll_seq_completed.offset // _Q
_COLL_OP = RecordLayout.coll_op.offset  # bytes
_BUDGET_D = RecordLayout.budget_s.offset // _Q
_BUDGET_START = RecordLayout.budget_start_ns.offset // _Q
_PHASE_BUDGET_D = RecordLayout.phase_budget_s.offset // _Q
_INPUT_SLOTS = RecordLayout.input_slots.offset // _Q
_STEPS_DONE = RecordLayout.steps_done.offset // _Q
_RING = RecordLayout.ring.offset // _Q
_ENTRY_WORDS = ctypes.sizeof(StepEntry) // _Q
_E_PHASES = StepEntry.phase_ns.offset // _Q
_E_INPUT = StepEntry.input_ns.offset // _Q  # then input_batches, input_workers
assert RecordLayout.depth.offset == RecordLayout.phase.offset + 4 and sys.byteorder == "little"
assert all(
    f.offset % _Q == 0
    for f in (RecordLayout.phase, RecordLayout.seq, RecordLayout.ring, RecordLayout.budget_s, StepEntry.input_ns)
)


class Tracker:
    def __init__(self, writer: RecordWriter) -> None:
        self._writer = writer
        self._rec = writer.rec
        # typed views of the mapping: plain indexed stores on the hot paths (see the offsets above)
        raw = memoryview(writer.map)
        self._b = raw
        self._q = raw.cast("Q")
        self._i32 = raw.cast("i")
        self._d = raw.cast("d")
        self._slots: dict[str, int] = {name: i for i, name in enumerate(CANONICAL_PHASES)}
        # open phases: (slot, start_ns, budget_s)
        self._stack: list[tuple[int, int, float]] = []
        self._cur = IDLE_SLOT  # the slot time is booked to now: the innermost open phase, idle outside any
        # exclusive ns per slot in the running step; copied into the ring entry in one slice store
        self._acc = array("Q", bytes(_Q * MAX_PHASES))
        self._zero = array("Q", bytes(_Q * MAX_PHASES))
        q = self._q
        self._seq = q[_SEQ] + (q[_SEQ] & 1)  # even: no update in progress
        self._transitions = q[_TRANSITIONS]
        self._coll_entered = q[_COLL_ENTERED]
        self._steps_done = q[_STEPS_DONE]
        self._budget = self._d[_BUDGET_D]
        start = q[RecordLayout.start_ns.offset // _Q] or _now()
        self._last = start
        self._step_start = start
        self._op_names: dict[str, bytes] = {}
        self._op_written = b""
        self.explicit_steps = False
        self.thread_id = _ident()
        self.enabled = True
        self._gpu: Any = None  # cuda_timing.EventPool on CUDA ranks
        # an exception left a phase: the record keeps naming that phase until the next enter(), so a rank
        # that dies of it is reported in the phase it failed in, not "idle" after the unwinding
        self._frozen = False
        # input pipeline: batches produced on this thread (num_workers=0), the worker slots in use (the
        # workers write their own slots) and the totals at the last step end
        self._input_ns = 0
        self._input_batches = 0
        self.input_slots_used = 0
        self.input_slot_next = 0
        self.input_workers = 0
        self._seen_ns = 0
        self._seen_batches = 0

    def attach_gpu_timing(self, pool: Any) -> None:
        """Time forward/backward/optimizer on the GPU too (pooled CUDA events, harvested without blocking)."""
        if pool is None:
            return
        self._gpu = pool
        self._rec.flags |= FLAG_GPU_TIMING

    # -- error containment ------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if not self.enabled:
            return
        self.enabled = False
        try:
            self._rec.flags |= FLAG_DISABLED
        except Exception:
            pass
        warnings.warn(f"rankwatch: hook disabled after an internal error: {exc!r}", RuntimeWarning, stacklevel=3)

    def on_thread(self) -> bool:
        """True on the thread that may write the record (the one that initialised the hook)."""
        return _ident() == self.thread_id

    # -- seqlock (the writer's sections; the reader retries while seq is odd or changed) -------------
    def _open_section(self) -> None:
        self._seq += 1
        self._q[_SEQ] = self._seq

    def _close_section(self) -> None:
        self._seq += 1
        self._q[_SEQ] = self._seq

    def slot(self, name: str) -> int:
        """Slot for a phase name, declaring it in the record on first use (-1 when the table is full)."""
        idx = self._slots.get(name)
        if idx is not None:
            return idx
        rec = self._rec
        n = int(rec.n_phases)
        if n >= MAX_PHASES:
            return NO_PHASE
        self._open_section()
        rec.phase_names[n].value = name.encode()[: NAME_LEN - 1]
        rec.n_phases = n + 1
        self._close_section()
        self._slots[name] = n
        return n

    # -- phases -----------------------------------------------------------------------------------
    def _push(self, slot: int, budget_s: float) -> None:
        """Open ``slot`` (inside a section): book the time so far to the current phase, store the live state."""
        now = _now()
        self._frozen = False
        stack = self._stack
        spent = now - self._last
        if spent > 0:  # the slots are unsigned: a clock read out of order books nothing
            self._acc[self._cur] += spent
        self._last = now
        self._cur = slot
        stack.append((slot, now, budget_s))
        q = self._q
        q[_PHASE_DEPTH] = (len(stack) << 32) | (slot & _I32_MASK)  # phase and depth: one word
        q[_PHASE_START] = now
        q[_PROGRESS] = now
        self._transitions = t = self._transitions + 1
        q[_TRANSITIONS] = t
        if budget_s > self._budget:
            self._budget = budget_s
            self._d[_BUDGET_D] = budget_s
            q[_BUDGET_START] = now
            self._d[_PHASE_BUDGET_D + slot] = budget_s

    def enter(self, slot: int, budget_s: float = 0.0) -> None:
        if not self.enabled or slot < 0 or _ident() != self.thread_id:
            return
        try:
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            self._push(slot, budget_s)
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.begin(slot)

    def _pop(self, slot: int, split_ns: int, tail_slot: int, failing: bool) -> int:
        """Close ``slot`` (inside a section): how long it was open (ns), -1 when it was not open."""
        stack = self._stack
        if not stack or stack[-1][0] != slot:
            # unbalanced (an exception skipped an exit): unwind to the matching entry if any
            while stack and stack[-1][0] != slot:
                stack.pop()
            if not stack:
                self._cur = IDLE_SLOT
                return -1
        now = _now()
        last = self._last
        acc = self._acc
        if tail_slot >= 0 and last < split_ns < now:
            acc[slot] += split_ns - last
            acc[tail_slot] += now - split_ns
        else:
            acc[slot] += now - last
        self._last = now
        _, started, budget = stack.pop()
        self._cur = stack[-1][0] if stack else IDLE_SLOT
        q = self._q
        if failing:
            self._frozen = True
        if self._frozen:  # the phase an exception left stays on record until the next phase begins
            self._i32[_DEPTH_I32] = len(stack)
        elif stack:
            top = stack[-1]
            q[_PHASE_DEPTH] = (len(stack) << 32) | top[0]
            q[_PHASE_START] = top[1]
        else:
            q[_PHASE_DEPTH] = _NO_PHASE_DEPTH0
            q[_PHASE_START] = now
        q[_PROGRESS] = now
        self._transitions = t = self._transitions + 1
        q[_TRANSITIONS] = t
        if budget and budget >= self._budget:
            best = max(stack, key=lambda e: e[2], default=None)
            if best is not None and best[2] > 0:
                self._budget = best[2]
                q[_BUDGET_START] = best[1]
            else:
                self._budget = 0.0
                q[_BUDGET_START] = 0
            self._d[_BUDGET_D] = self._budget
        return now - started

    def exit(self, slot: int, split_ns: int = 0, tail_slot: int = NO_PHASE, failing: bool = False) -> None:
        """Close ``slot``. With ``split_ns`` and ``tail_slot``, the time after ``split_ns`` (the last
        attributed moment of the phase's own work) goes to ``tail_slot`` instead: used to move the wait
        for DDP's gradient all-reduce out of ``backward`` into ``grad_sync``. Totals are unchanged.
        ``failing``: an exception is leaving the phase (the record keeps naming it, see ``_frozen``)."""
        if not self.enabled or slot < 0 or _ident() != self.thread_id:
            return
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.end(slot)
        try:
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            self._pop(slot, split_ns, tail_slot, failing)
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    def exit_batch(self, slot: int, produced: bool) -> None:
        """Close ``slot`` (the DataLoader's ``__next__``); ``produced``: this thread made the batch itself
        (no workers), so the phase's own time is the batch's production time (``input_timing.py``)."""
        if not self.enabled or _ident() != self.thread_id:
            return
        try:
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            spent = self._pop(slot, 0, NO_PHASE, False)
            q[_SEQ] = self._seq = seq + 1
            if produced and spent >= 0:
                self._input_ns += spent
                self._input_batches += 1
                self.input_workers = 0
        except Exception as exc:
            self._fail(exc)

    # -- collectives ------------------------------------------------------------------------------
    def collective_enter(self, op: str) -> None:
        """A Python-level collective starts: its sequence number and name, and the ``collective`` phase,
        in one section."""
        if not self.enabled or _ident() != self.thread_id:
            return
        try:
            raw = self._op_names.get(op)
            if raw is None:
                # NUL-padded to the field: one slice store replaces the previous name whole
                raw = self._op_names[op] = op.encode()[: NAME_LEN - 1].ljust(NAME_LEN, b"\0")
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            self._coll_entered += 1
            q[_COLL_ENTERED] = self._coll_entered
            if raw is not self._op_written:
                self._b[_COLL_OP : _COLL_OP + NAME_LEN] = raw
                self._op_written = raw
            self._push(COLLECTIVE_SLOT, 0.0)
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    def collective_exit(self) -> None:
        if not self.enabled or _ident() != self.thread_id:
            return
        try:
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            self._pop(COLLECTIVE_SLOT, 0, NO_PHASE, False)
            q[_COLL_COMPLETED] = self._coll_entered
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    # -- input pipeline ---------------------------------------------------------------------------
    def input_worker_slots(self, workers: int) -> int:
        """First of ``workers`` consecutive slots (modulo ``INPUT_SLOTS``) for a new set of DataLoader workers."""
        base = self.input_slot_next
        self.input_slot_next = (base + workers) % INPUT_SLOTS
        self.input_slots_used = min(INPUT_SLOTS, max(self.input_slots_used, base + workers))
        self.input_workers = workers
        return base

    def _input_totals(self) -> tuple[int, int]:
        n = 2 * self.input_slots_used
        slots = self._q[_INPUT_SLOTS : _INPUT_SLOTS + n].tolist()  # a worker may be mid-update of its own pair
        return self._input_ns + sum(slots[0::2]), self._input_batches + sum(slots[1::2])

    # -- steps ------------------------------------------------------------------------------------
    def step(self, explicit: bool = False) -> None:
        """Close the current step. Once the script calls step() itself, automatic boundaries stop."""
        if not self.enabled or _ident() != self.thread_id:
            return
        if explicit and not self.explicit_steps:
            self.explicit_steps = True
            self._rec.flags |= FLAG_EXPLICIT_STEPS
        elif not explicit and self.explicit_steps:
            return
        try:
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            self._end_step(_now())
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    def exit_step(self, slot: int) -> None:
        """``exit(slot)`` then the automatic ``step()``, in one section: the optimizer's post hook (one
        call and one seqlock section per step fewer than the two)."""
        if not self.enabled or _ident() != self.thread_id:
            return
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.end(slot)
        try:
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            self._pop(slot, 0, NO_PHASE, False)
            if not self.explicit_steps:
                self._end_step(self._last)
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    def _end_step(self, now: int) -> None:
        """The step ending at ``now`` into the ring and the live state (inside a section)."""
        acc = self._acc
        if now > self._last:
            acc[self._cur] += now - self._last
        self._last = now
        if self.input_slots_used:
            busy, batches = self._input_totals()
        else:
            busy, batches = self._input_ns, self._input_batches
        q = self._q
        done = self._steps_done
        base = _RING + (done % RING_STEPS) * _ENTRY_WORDS
        q[base] = done
        q[base + 1] = self._step_start
        q[base + 2] = now
        q[base + _E_PHASES : base + _E_PHASES + MAX_PHASES] = acc
        q[base + _E_INPUT] = max(0, busy - self._seen_ns)
        q[base + _E_INPUT + 1] = max(0, batches - self._seen_batches)
        q[base + _E_INPUT + 2] = self.input_workers
        self._seen_ns = busy
        self._seen_batches = batches
        if self._gpu is not None:
            rec = self._rec
            for gslot, gpu_ms in self._gpu.poll():  # finished event pairs only: never blocks
                rec.gpu_phase_ms[gslot] += gpu_ms
        self._steps_done = done = done + 1
        q[_STEPS_DONE] = done
        q[_STEP] = done
        q[_STEP_START] = now
        q[_PROGRESS] = now
        self._transitions = t = self._transitions + 1
        q[_TRANSITIONS] = t
        self._step_start = now
        acc[:] = self._zero

    def mark_crashed(self, info: str = "") -> None:
        """The script is ending with an exception or non-zero exit; ``info`` ("Type: message") lets the
        daemon tell an own failure from a consequence of a peer's (connection closed, timeout)."""
        try:
            rec = self._rec
            self._open_section()
            if info and not rec.crash_info:  # the first cause wins (atexit may report again)
                raw = info.encode("utf-8", "replace")[: CRASH_LEN - 1]
                rec.crash_info = raw.decode("utf-8", "ignore").encode()
            rec.flags |= FLAG_CRASHED
            self._close_section()
        except Exception:
            pass

    def mark_exit(self) -> None:
        """Normal interpreter exit: tells the daemon this rank did not die."""
        try:
            rec = self._rec
            self._open_section()
            rec.exit_ns = _now()
            rec.flags |= FLAG_EXITED
            self._close_section()
        except Exception:
            pass
        self.enabled = False
