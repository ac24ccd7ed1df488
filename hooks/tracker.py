"""Phase and step bookkeeping on the training thread, written straight into the shm record.

Time is attributed exclusively: entering a nested phase pauses its parent, so the per-phase times of a
step add up to its wall duration (time outside any phase is ``idle``). Every public method swallows
its own errors and disables tracking: the hook must never raise into training.
"""

from __future__ import annotations

import threading
import time
import warnings
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
    RecordWriter,
)

COLLECTIVE_SLOT = CANONICAL_PHASES.index("collective")
# phases whose GPU work is timed with CUDA events (where the kernels are launched)
GPU_TIMED_SLOTS = frozenset(CANONICAL_PHASES.index(p) for p in ("forward", "backward", "optimizer"))
_now = time.monotonic_ns


class Tracker:
    def __init__(self, writer: RecordWriter) -> None:
        self._writer = writer
        self._rec = writer.rec
        self._slots: dict[str, int] = {name: i for i, name in enumerate(CANONICAL_PHASES)}
        # open phases: (slot, start_ns, budget_s)
        self._stack: list[tuple[int, int, float]] = []
        self._acc = [0] * MAX_PHASES
        start = int(self._rec.start_ns) or _now()
        self._last = start
        self._step_start = start
        self._op_names: dict[str, bytes] = {}
        self.explicit_steps = False
        self.thread_id = threading.get_ident()
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
        self._input_seen = (0, 0)

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
        return threading.get_ident() == self.thread_id

    def slot(self, name: str) -> int:
        """Slot for a phase name, declaring it in the record on first use (-1 when the table is full)."""
        idx = self._slots.get(name)
        if idx is not None:
            return idx
        rec = self._rec
        n = int(rec.n_phases)
        if n >= MAX_PHASES:
            return NO_PHASE
        rec.seq += 1
        rec.phase_names[n].value = name.encode()[: NAME_LEN - 1]
        rec.n_phases = n + 1
        rec.seq += 1
        self._slots[name] = n
        return n

    # -- phases -----------------------------------------------------------------------------------
    def enter(self, slot: int, budget_s: float = 0.0) -> None:
        if not self.enabled or slot < 0 or threading.get_ident() != self.thread_id:
            return
        try:
            now = _now()
            self._frozen = False
            stack = self._stack
            cur = stack[-1][0] if stack else IDLE_SLOT
            self._acc[cur] += now - self._last
            self._last = now
            stack.append((slot, now, budget_s))
            rec = self._rec
            rec.seq += 1
            rec.phase = slot
            rec.depth = len(stack)
            rec.phase_start_ns = now
            rec.last_progress_ns = now
            rec.transitions += 1
            if budget_s > rec.budget_s:
                rec.budget_s = budget_s
                rec.budget_start_ns = now
                rec.phase_budget_s[slot] = budget_s
            rec.seq += 1
        except Exception as exc:
            self._fail(exc)
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.begin(slot)

    def exit(self, slot: int, split_ns: int = 0, tail_slot: int = NO_PHASE, failing: bool = False) -> None:
        """Close ``slot``. With ``split_ns`` and ``tail_slot``, the time after ``split_ns`` (the last
        attributed moment of the phase's own work) goes to ``tail_slot`` instead: used to move the wait
        for DDP's gradient all-reduce out of ``backward`` into ``grad_sync``. Totals are unchanged.
        ``failing``: an exception is leaving the phase (the record keeps naming it, see ``_frozen``)."""
        if not self.enabled or slot < 0 or threading.get_ident() != self.thread_id:
            return
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.end(slot)
        try:
            stack = self._stack
            if not stack or stack[-1][0] != slot:
                # unbalanced (an exception skipped an exit): unwind to the matching entry if any
                while stack and stack[-1][0] != slot:
                    stack.pop()
                if not stack:
                    return
            now = _now()
            last = self._last
            if tail_slot >= 0 and last < split_ns < now:
                self._acc[slot] += split_ns - last
                self._acc[tail_slot] += now - split_ns
            else:
                self._acc[slot] += now - last
            self._last = now
            _, _, budget = stack.pop()
            rec = self._rec
            rec.seq += 1
            if failing:
                self._frozen = True
            if self._frozen:
                pass  # the phase an exception left stays on record until the next phase begins
            elif stack:
                parent, parent_start, _ = stack[-1]
                rec.phase = parent
                rec.phase_start_ns = parent_start
            else:
                rec.phase = NO_PHASE
                rec.phase_start_ns = now
            rec.depth = len(stack)
            rec.last_progress_ns = now
            rec.transitions += 1
            if budget and budget >= rec.budget_s:
                best = max(stack, key=lambda e: e[2], default=None)
                if best is not None and best[2] > 0:
                    rec.budget_s = best[2]
                    rec.budget_start_ns = best[1]
                else:
                    rec.budget_s = 0.0
                    rec.budget_start_ns = 0
            rec.seq += 1
        except Exception as exc:
            self._fail(exc)

    # -- collectives ------------------------------------------------------------------------------
    def collective_enter(self, op: str) -> None:
        if not self.enabled or threading.get_ident() != self.thread_id:
            return
        try:
            raw = self._op_names.get(op)
            if raw is None:
                raw = self._op_names[op] = op.encode()[: NAME_LEN - 1]
            rec = self._rec
            rec.seq += 1
            rec.coll_seq_entered += 1
            rec.coll_op = raw
            rec.seq += 1
        except Exception as exc:
            self._fail(exc)
            return
        self.enter(COLLECTIVE_SLOT)

    def collective_exit(self) -> None:
        if not self.enabled or threading.get_ident() != self.thread_id:
            return
        self.exit(COLLECTIVE_SLOT)
        try:
            rec = self._rec
            rec.seq += 1
            rec.coll_seq_completed = rec.coll_seq_entered
            rec.seq += 1
        except Exception as exc:
            self._fail(exc)

    # -- input pipeline ---------------------------------------------------------------------------
    def input_produced(self, ns: int) -> None:
        """A batch produced on the training thread (a DataLoader without workers) took ``ns``."""
        if self.enabled and threading.get_ident() == self.thread_id:
            self._input_ns += ns
            self._input_batches += 1
            self.input_workers = 0

    def input_worker_slots(self, workers: int) -> int:
        """First of ``workers`` consecutive slots (modulo ``INPUT_SLOTS``) for a new set of DataLoader workers."""
        base = self.input_slot_next
        self.input_slot_next = (base + workers) % INPUT_SLOTS
        self.input_slots_used = min(INPUT_SLOTS, max(self.input_slots_used, base + workers))
        self.input_workers = workers
        return base

    def _input_totals(self) -> tuple[int, int]:
        n = 2 * self.input_slots_used
        if not n:
            return self._input_ns, self._input_batches
        slots = self._rec.input_slots[:n]  # one copy; a worker may be mid-update of its own pair (harmless)
        return self._input_ns + sum(slots[0::2]), self._input_batches + sum(slots[1::2])

    # -- steps ------------------------------------------------------------------------------------
    def step(self, explicit: bool = False) -> None:
        """Close the current step. Once the script calls step() itself, automatic boundaries stop."""
        if not self.enabled or threading.get_ident() != self.thread_id:
            return
        if explicit and not self.explicit_steps:
            self.explicit_steps = True
            self._rec.flags |= FLAG_EXPLICIT_STEPS
        elif not explicit and self.explicit_steps:
            return
        try:
            now = _now()
            stack = self._stack
            acc = self._acc
            acc[stack[-1][0] if stack else IDLE_SLOT] += now - self._last
            self._last = now
            rec = self._rec
            done = int(rec.steps_done)
            entry = rec.ring[done % RING_STEPS]
            rec.seq += 1
            entry.step = done
            entry.start_ns = self._step_start
            entry.end_ns = now
            entry.phase_ns[:] = acc
            busy, batches = self._input_totals()
            entry.input_ns = max(0, busy - self._input_seen[0])
            entry.input_batches = max(0, batches - self._input_seen[1])
            entry.input_workers = self.input_workers
            self._input_seen = (busy, batches)
            if self._gpu is not None:
                for gslot, gpu_ms in self._gpu.poll():  # finished event pairs only: never blocks
                    rec.gpu_phase_ms[gslot] += gpu_ms
            rec.steps_done = done + 1
            rec.step = done + 1
            rec.step_start_ns = now
            rec.last_progress_ns = now
            rec.transitions += 1
            rec.seq += 1
            self._step_start = now
            self._acc = [0] * MAX_PHASES
        except Exception as exc:
            self._fail(exc)

    def mark_crashed(self, info: str = "") -> None:
        """The script is ending with an exception or non-zero exit; ``info`` ("Type: message") lets the
        daemon tell an own failure from a consequence of a peer's (connection closed, timeout)."""
        try:
            rec = self._rec
            rec.seq += 1
            if info and not rec.crash_info:  # the first cause wins (atexit may report again)
                raw = info.encode("utf-8", "replace")[: CRASH_LEN - 1]
                rec.crash_info = raw.decode("utf-8", "ignore").encode()
            rec.flags |= FLAG_CRASHED
            rec.seq += 1
        except Exception:
            pass

    def mark_exit(self) -> None:
        """Normal interpreter exit: tells the daemon this rank did not die."""
        try:
            rec = self._rec
            rec.seq += 1
            rec.exit_ns = _now()
            rec.flags |= FLAG_EXITED
            rec.seq += 1
        except Exception:
            pass
        self.enabled = False
