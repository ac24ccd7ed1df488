"""Phase and step bookkeeping on the training thread: one event word per phase transition into the shm record.

The training thread appends ``kind | slot | ns`` words to the record's event ring (one store for the
word, one for the count) and, once per step, a checkpoint of its open phases; the reader rebuilds the
exclusive per-phase times (entering a nested phase pauses its parent, so the phases of a step add up to
its wall duration; time outside any phase is ``idle``) and the live state (``record.decode``). Every
public method swallows its own errors and disables tracking: the hook must never raise into training.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from .record import (
    CANONICAL_PHASES,
    COLLECTIVE_SLOT,
    CRASH_LEN,
    EV_COLL_ENTER,
    EV_COLL_EXIT,
    EV_ENTER,
    EV_EXIT,
    EV_EXIT_BATCH,
    EV_EXIT_FAIL,
    EV_SPLIT,
    EVENT_MASK,
    FLAG_CRASHED,
    FLAG_DISABLED,
    FLAG_EXITED,
    FLAG_EXPLICIT_STEPS,
    FLAG_GPU_TIMING,
    FOLD_EVENTS,
    INPUT_SLOTS,
    MAX_OPS,
    MAX_PHASES,
    MAX_STACK,
    NAME_LEN,
    NO_PHASE,
    NS_BITS,
    NS_MASK,
    P2P_PEER_BITS,
    P2P_SEQ_BITS,
    P2P_SLOTS,
    P2P_UNKNOWN,
    RING_SLOTS,
    RecordLayout,
    RecordWriter,
    StepEntry,
    event_code,
    event_origin,
)

__all__ = ["COLLECTIVE_SLOT", "GPU_TIMED_SLOTS", "IMPLEMENTATIONS", "PyTracker", "Tracker"]

# phases whose GPU work is timed with CUDA events (where the kernels are launched)
GPU_TIMED_SLOTS = frozenset(CANONICAL_PHASES.index(p) for p in ("forward", "backward", "optimizer"))
_now = time.monotonic_ns
_ident = threading.get_ident

# Word indices into the record (same layout as RecordLayout, read by the daemon): a store through a
# memoryview slot costs ~20 ns, a ctypes attribute ~50-70 ns. Counters the writer alone changes are
# mirrored in Python ints, so no hot path reads the mapping back.
_Q = 8  # bytes per uint64 / double word
_SEQ = RecordLayout.seq.offset // _Q
_EV = RecordLayout.events.offset // _Q
_EV_COUNT = RecordLayout.ev_count.offset // _Q
_FOLD = RecordLayout.fold.offset // _Q
_BUDGET_D = RecordLayout.budget_s.offset // _Q
_BUDGET_START = RecordLayout.budget_start_ns.offset // _Q
_PHASE_BUDGET_D = RecordLayout.phase_budget_s.offset // _Q
_INPUT_SLOTS = RecordLayout.input_slots.offset // _Q
_STEPS_DONE = RecordLayout.steps_done.offset // _Q
_RING = RecordLayout.ring.offset // _Q
_P2P_LAST = RecordLayout.p2p_last.offset // _Q
_P2P_KNOWN_N = RecordLayout.p2p_known_n.offset // _Q
_P2P_KNOWN = RecordLayout.p2p_known.offset // _Q
_P2P_DIR_SHIFT = P2P_SEQ_BITS + P2P_PEER_BITS
_P2P_SEQ_MASK = (1 << P2P_SEQ_BITS) - 1
_ENTRY_WORDS = ctypes.sizeof(StepEntry) // _Q
_E_CP = StepEntry.cp.offset // _Q
_TOP = NS_BITS  # the event word's code byte
_ENTER_CODE = [(EV_ENTER << 5) | s for s in range(MAX_PHASES)]  # an open phase's word >> _TOP
_COLL_CODE = _ENTER_CODE[COLLECTIVE_SLOT]
OPTIMIZER_SLOT = CANONICAL_PHASES.index("optimizer")
assert sys.byteorder == "little"
assert all(f.offset % _Q == 0 for f in (RecordLayout.seq, RecordLayout.events, RecordLayout.fold, RecordLayout.ring))


def _layout(origin: int) -> dict[str, int]:
    """The record's layout and event codes for a core's ``_bind`` (one copy: record.py's numbers)."""
    return {
        "seq": _SEQ, "events": _EV, "ev_count": _EV_COUNT, "steps_done": _STEPS_DONE, "ring": _RING,
        "input_slots": _INPUT_SLOTS, "event_mask": EVENT_MASK, "ring_slots": RING_SLOTS, "entry_words": _ENTRY_WORDS,
        "entry_cp": _E_CP, "max_stack": MAX_STACK, "max_phases": MAX_PHASES, "ns_bits": NS_BITS,
        "gpu_slots": sum(1 << s for s in GPU_TIMED_SLOTS), "collective_slot": COLLECTIVE_SLOT,
        "optimizer_slot": OPTIMIZER_SLOT, "origin": origin, "ev_enter": EV_ENTER, "ev_exit": EV_EXIT,
        "ev_exit_fail": EV_EXIT_FAIL, "ev_exit_batch": EV_EXIT_BATCH, "ev_split": EV_SPLIT,
        "ev_coll_exit": EV_COLL_EXIT, "p2p_last": _P2P_LAST, "p2p_known_n": _P2P_KNOWN_N, "p2p_known": _P2P_KNOWN,
        "p2p_slots": P2P_SLOTS, "p2p_seq_bits": P2P_SEQ_BITS, "p2p_unknown": P2P_UNKNOWN,
    }


class PyCore:
    """The hot paths in Python: the event word, the count, the writer's own stack, the step's end. All else
    (budgets, a phase an exception left, the fold checkpoint, unbalanced exits) is the rare path behind one
    test, in ``Tracker``. ``_fastpath.Core`` is the same in C (one C call per transition instead of a
    frame of ~40 bytecodes); this class is the fallback where it was not built, and the reference the tests
    hold it to. Attributes are set by the tracker's ``__init__``."""

    _q: Any  # the record as uint64 words (memoryview)
    _tid: int
    _ev_n: int
    _slow_at: int
    _seq: int
    _stack: list[int]
    _budgets: list[tuple[int, float, int]]
    _gpu: Any
    _ops: dict[str, int]
    _colls: int
    _last_op: int
    _frozen: tuple[int, int] | None
    _steps_done: int
    _step_start: int
    _seen_ns: int
    _seen_batches: int
    _origin: int
    _after_step: Any
    _p2p_n: int
    _p2p_known: list[int]
    explicit_steps: bool
    input_slots_used: int
    input_workers: int

    def _bind(self, raw: memoryview, layout: dict[str, int]) -> None:
        start = layout["origin"]
        q = self._q
        self._p2p_n = q[_P2P_KNOWN_N]  # the peers already on record (a tracker bound to a record again)
        self._p2p_known = q[_P2P_KNOWN : _P2P_KNOWN + min(self._p2p_n, P2P_SLOTS)].tolist()
        # event words less the clock: word = constant + now (the ns field counts from the record's origin)
        self._k_in = [event_code(EV_ENTER, s) - start for s in range(MAX_PHASES)]
        self._k_out = [event_code(EV_EXIT, s) - start for s in range(MAX_PHASES)]
        self._k_fail = [event_code(EV_EXIT_FAIL, s) - start for s in range(MAX_PHASES)]
        self._k_batch = [event_code(EV_EXIT_BATCH, s) - start for s in range(MAX_PHASES)]
        self._k_split = [event_code(EV_SPLIT, s) - start for s in range(MAX_PHASES)]
        self._k_coll_in = event_code(EV_ENTER, COLLECTIVE_SLOT) - start  # the open-phase form, on the stack
        self._k_coll_out = event_code(EV_COLL_EXIT, 0) - start

    def _release(self) -> None:
        pass

    if TYPE_CHECKING:  # the rare paths, in _TrackerBase (declared here only, as above)

        def _entered_slow(self, budget_s: float, n: int) -> None: ...
        def _exited_slow(self, slot: int, n: int, failing: bool) -> None: ...
        def _op_word(self, op: str) -> int: ...
        def _fail(self, exc: BaseException) -> None: ...
        def _harvest_gpu(self) -> None: ...

    def enter(self, slot: int, budget_s: float = 0.0) -> None:
        if _ident() != self._tid or slot < 0:
            return
        try:
            w = self._k_in[slot] + _now()
            n = self._ev_n
            q = self._q
            q[_EV + (n & EVENT_MASK)] = w
            self._ev_n = n = n + 1
            q[_EV_COUNT] = n
            self._stack.append(w)
            if n >= self._slow_at or budget_s:
                self._entered_slow(budget_s, n)
        except Exception as exc:
            self._fail(exc)
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.begin(slot)

    def _closed(self, n: int, word: int, slot: int, code: int, failing: bool = False) -> None:
        """An exit's tail (``closed`` in the C core): ``word`` as event ``n``, the count, then the innermost
        open phase popped when it is ``code`` and nothing rare is pending, else the rare path."""
        q = self._q
        q[_EV + (n & EVENT_MASK)] = word
        self._ev_n = n = n + 1
        q[_EV_COUNT] = n
        st = self._stack
        if st and st[-1] >> _TOP == code and not failing and not self._budgets:
            st.pop()
        else:
            self._exited_slow(slot, n, failing)

    def exit(self, slot: int, split_ns: int = 0, tail_slot: int = NO_PHASE, failing: bool = False) -> None:
        """Close ``slot``. With ``split_ns`` and ``tail_slot``, the time after ``split_ns`` (the last
        attributed moment of the phase's own work) goes to ``tail_slot`` instead: used to move the wait
        for DDP's gradient all-reduce out of ``backward`` into ``grad_sync``. Totals are unchanged.
        ``failing``: an exception is leaving the phase (the record keeps naming it until the next enter)."""
        if _ident() != self._tid or slot < 0:
            return
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.end(slot)
        try:
            q = self._q
            n = self._ev_n
            # the split word first: the reader applies it to the exit
            if split_ns and tail_slot >= 0 and split_ns > self._origin:
                q[_EV + (n & EVENT_MASK)] = self._k_split[tail_slot] + split_ns
                n += 1
            word = (self._k_fail if failing else self._k_out)[slot] + _now()
            self._closed(n, word, slot, _ENTER_CODE[slot], failing)
        except Exception as exc:
            self._fail(exc)

    def exit_batch(self, slot: int, produced: bool) -> None:
        """Close ``slot`` (the DataLoader's ``__next__``); ``produced``: this thread made the batch itself
        (no workers), so the phase's own time is the batch's production time (``input_timing.py``)."""
        if _ident() != self._tid:
            return
        try:
            word = (self._k_batch if produced else self._k_out)[slot] + _now()
            self._closed(self._ev_n, word, slot, _ENTER_CODE[slot])
            if produced and self.input_workers:
                self.input_workers = 0
        except Exception as exc:
            self._fail(exc)

    def collective_enter(self, op: str) -> None:
        """A Python-level collective starts: its op and the ``collective`` phase, in one event (the reader
        counts them: the collective sequence number)."""
        if _ident() != self._tid:
            return
        try:
            k = self._ops.get(op)
            if k is None:
                k = self._op_word(op)
            t = _now()
            n = self._ev_n
            q = self._q
            q[_EV + (n & EVENT_MASK)] = k + t
            self._ev_n = n = n + 1
            q[_EV_COUNT] = n
            self._stack.append(self._k_coll_in + t)
            self._colls += 1
            self._last_op = k
            if n >= self._slow_at:
                self._entered_slow(0.0, n)
        except Exception as exc:
            self._fail(exc)

    def p2p_enter(self, peer: int, direction: int) -> None:
        """A send (``direction`` 1) or recv (2) with global rank ``peer`` (< 0: not named) enters next: one word,
        tagged with the collective count its ``collective_enter`` gives it (the reader matches the two)."""
        if _ident() != self._tid:
            return
        try:
            p = peer if isinstance(peer, int) and 0 <= peer < P2P_UNKNOWN else P2P_UNKNOWN
            self._q[_P2P_LAST] = ((direction & 3) << _P2P_DIR_SHIFT) | (p << P2P_SEQ_BITS) | (
                (self._colls + 1) & _P2P_SEQ_MASK)
        except Exception as exc:
            self._fail(exc)

    def p2p_learn(self, peer: int) -> None:
        """A send/recv with ``peer`` completed (or a batch posted one): a peer this rank exchanged with. A new
        one goes on record in a seqlock section (a few per job); past the slots the set is marked full."""
        if _ident() != self._tid or not isinstance(peer, int) or not 0 <= peer < P2P_UNKNOWN:
            return
        try:
            n = self._p2p_n
            if n > P2P_SLOTS or peer in self._p2p_known:
                return
            q = self._q
            q[_SEQ] = seq = self._seq + 1
            if n < P2P_SLOTS:
                q[_P2P_KNOWN + n] = peer
                self._p2p_known.append(peer)
            self._p2p_n = n = n + 1
            q[_P2P_KNOWN_N] = n
            q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    def collective_exit(self) -> None:
        if _ident() != self._tid:
            return
        try:
            self._closed(self._ev_n, self._k_coll_out + _now(), COLLECTIVE_SLOT, _COLL_CODE)
        except Exception as exc:
            self._fail(exc)

    def exit_step(self, slot: int) -> None:
        """``exit(slot)`` then the automatic ``step()`` at the exit's clock read: the optimizer's post hook
        (one call per step fewer than the two)."""
        if _ident() != self._tid:
            return
        if self._gpu is not None and slot in GPU_TIMED_SLOTS:
            self._gpu.end(slot)
        try:
            t = _now()
            self._closed(self._ev_n, self._k_out[slot] + t, slot, _ENTER_CODE[slot])
            if not self.explicit_steps:
                q = self._q
                q[_SEQ] = seq = self._seq + 1
                self._end_step(t)
                q[_SEQ] = self._seq = seq + 1
        except Exception as exc:
            self._fail(exc)

    def opt_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer pre-step hook: the ``optimizer`` phase begins."""
        self.enter(OPTIMIZER_SLOT)

    def opt_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer post-step hook: the phase and (automatic steps) the step end."""
        self.exit_step(OPTIMIZER_SLOT)
        if self._after_step is not None:
            try:
                self._after_step()
            except Exception as exc:
                self._fail(exc)

    def _input_totals(self) -> tuple[int, int]:
        n = 2 * self.input_slots_used
        slots = self._q[_INPUT_SLOTS : _INPUT_SLOTS + n].tolist()  # a worker may be mid-update of its own pair
        return sum(slots[0::2]), sum(slots[1::2])

    def _write_cp(self, base: int, n: int, at: int) -> None:
        """A checkpoint (record.Checkpoint) at word ``base``: the state the reader replays events from."""
        q = self._q
        q[base] = n
        q[base + 1] = at
        q[base + 2] = self._colls
        q[base + 3] = ((self._last_op + self._origin) >> _TOP) & 31 if self._last_op >= 0 else (1 << 64) - 1
        q[base + 4] = self._frozen[0] if self._frozen is not None else 0
        st = self._stack
        q[base + 5] = len(st)
        for i, w in enumerate(st[-MAX_STACK:]):
            q[base + 6 + i] = w

    def _end_step(self, now: int) -> None:
        """The step ending at ``now`` into the step ring, with its checkpoint (inside a section)."""
        if self.input_slots_used:
            busy, batches = self._input_totals()
        else:
            busy = batches = 0
        q = self._q
        done = self._steps_done
        base = _RING + (done % RING_SLOTS) * _ENTRY_WORDS
        q[base] = done
        q[base + 1] = self._step_start
        q[base + 2] = now
        q[base + 3] = max(0, busy - self._seen_ns)
        q[base + 4] = max(0, batches - self._seen_batches)
        q[base + 5] = self.input_workers
        self._seen_ns = busy
        self._seen_batches = batches
        self._write_cp(base + _E_CP, self._ev_n, now)
        if self._gpu is not None:
            self._harvest_gpu()
        self._steps_done = done = done + 1
        q[_STEPS_DONE] = done
        self._step_start = now


_THREAD_ERROR_LOCK = threading.Lock()
"""Orders two helper threads dying at once (``mark_thread_died``); never taken on the training thread."""


class _TrackerBase:
    """What a tracker is besides its hot paths: set-up, the rare paths the cores call back, declarations,
    explicit steps, the end. Mixed into a core (``PyCore`` or ``_fastpath.Core``)."""

    _rec: Any
    _stack: list[int]
    _budgets: list[tuple[int, float, int]]
    _tid: int
    _seq: int
    _slow_at: int
    _frozen: tuple[int, int] | None
    _origin: int
    _gpu: Any
    _ops: dict[str, int]
    explicit_steps: bool

    if TYPE_CHECKING:  # the core's (declared here only: a definition would shadow the core's in the MRO)

        def _bind(self, raw: memoryview, layout: dict[str, int]) -> None: ...
        def _end_step(self, now: int) -> None: ...
        def _write_cp(self, base: int, n: int, at: int) -> None: ...

    def __init__(self, writer: RecordWriter) -> None:
        self._writer = writer
        self._rec = writer.rec
        raw = memoryview(writer.map)
        self._b = raw
        self._q = raw.cast("Q")
        self._d = raw.cast("d")
        self._slots: dict[str, int] = {name: i for i, name in enumerate(CANONICAL_PHASES)}
        q = self._q
        self._seq = q[_SEQ] + (q[_SEQ] & 1)  # even: no update in progress
        start = int(self._rec.start_ns) or _now()
        self._origin = start = event_origin(start)
        # a scripted clock (tests) is called by the C core too; None: CLOCK_MONOTONIC, read in C
        self._clock = None if _now is time.monotonic_ns else _now
        self._ev_n = q[_EV_COUNT]  # events written (the ring index is this modulo EVENTS)
        self._fold_at = self._ev_n + FOLD_EVENTS
        self._slow_at = self._fold_at  # an enter at this event count takes the slow path: the fold, or 0 while frozen
        # open phases: their enter words (slot and start in one int), outermost first; the reader rebuilds
        # the same stack from the events, this copy is for the checkpoints
        self._stack: list[int] = []
        self._budgets: list[tuple[int, float, int]] = []  # (stack index, budget_s, start_ns) of budgeted phases
        self._budget = 0.0
        self._colls = 0
        self._last_op = -1
        self._ops: dict[str, int] = {}  # op name -> the collective-enter word less the clock
        # an exception left a phase: (enter word, event index of the failing exit); the record keeps naming
        # that phase until the next enter, so a rank that dies of it is reported in the phase it failed in
        self._frozen: tuple[int, int] | None = None
        self._steps_done = q[_STEPS_DONE]
        self._step_start = int(self._rec.start_ns) or _now()
        self.explicit_steps = False
        self.thread_id = _ident()
        self._gpu: Any = None  # cuda_timing.EventPool on CUDA ranks
        # input pipeline: the DataLoader worker slots in use (the workers write their own slots) and their
        # totals at the last step end; batches made on this thread are EV_EXIT_BATCH events
        self.input_slots_used = 0
        self.input_slot_next = 0
        self.input_workers = 0
        self._seen_ns = 0
        self._seen_batches = 0
        # called after each automatic step end until it returns (instrument.py: swapping the forward hooks)
        self._after_step: Any = None
        self._bind(raw, _layout(start))
        # the hot paths' one test: this thread's ident while tracking is on, -1 (no thread's) once disabled
        self._tid = self.thread_id

    def attach_gpu_timing(self, pool: Any) -> None:
        """Time forward/backward/optimizer on the GPU too (pooled CUDA events, harvested without blocking)."""
        if pool is None:
            return
        self._gpu = pool
        self._rec.flags |= FLAG_GPU_TIMING

    @property
    def enabled(self) -> bool:
        return self._tid != -1

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._tid = self.thread_id if on else -1

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

    # -- seqlock (rare sections: checkpoints, declarations, budgets, the end; the reader retries on them) --
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

    # -- the rare paths (the cores call them) -----------------------------------------------------
    def _entered_slow(self, budget_s: float, n: int) -> None:
        """After an enter: a new phase ends the naming of the one an exception left; budgets; the fold."""
        self._frozen = None
        self._slow_at = self._fold_at
        if budget_s > 0:
            w = self._stack[-1]
            started = (w & NS_MASK) + self._origin
            self._budgets.append((len(self._stack) - 1, budget_s, started))
            if budget_s > self._budget:
                self._open_section()
                self._budget = budget_s
                self._d[_BUDGET_D] = budget_s
                self._q[_BUDGET_START] = started
                self._d[_PHASE_BUDGET_D + ((w >> _TOP) & 31)] = budget_s
                self._close_section()
        if n >= self._fold_at:
            self._fold(n)

    def _fold(self, n: int) -> None:
        """A mid-step checkpoint after event ``n``-1, at its time: the reader never replays more than
        about FOLD_EVENTS events for the live state, however long a step runs (or if none ever ends)."""
        self._fold_at = n + FOLD_EVENTS
        if self._frozen is None:
            self._slow_at = self._fold_at
        self._open_section()
        self._write_cp(_FOLD, n, (self._q[_EV + ((n - 1) & EVENT_MASK)] & NS_MASK) + self._origin)
        self._close_section()

    def _exited_slow(self, slot: int, n: int, failing: bool) -> None:
        """The stack after an exit that is not the plain close of the innermost phase: unwind to the
        matching phase (an exception skipped an exit; none matches: every phase is closed), note the
        phase a failing exit left, recompute the budget. The reader applies the same rule to the events."""
        st = self._stack  # the C core's is a copy: assigned back below
        code = _ENTER_CODE[slot]
        while st and st[-1] >> _TOP != code:
            st.pop()
        if st:
            w = st.pop()
            if failing:
                self._frozen = (w, n - 1)
                self._slow_at = 0  # the next enter ends it
        self._stack = st
        if self._budgets and any(depth >= len(st) for depth, _, _ in self._budgets):
            self._budgets = [b for b in self._budgets if b[0] < len(st)]
            best = max(self._budgets, key=lambda b: b[1], default=None)
            self._budget = best[1] if best is not None else 0.0
            self._open_section()
            self._d[_BUDGET_D] = self._budget
            self._q[_BUDGET_START] = best[2] if best is not None else 0
            self._close_section()
        if n >= self._fold_at:  # exits without enters (unbalanced calls) must not outrun the checkpoints
            self._fold(n)

    # -- collectives ------------------------------------------------------------------------------
    def _op_word(self, op: str) -> int:
        """The collective-enter word less the clock for ``op``, its name declared in the record's op table
        on first use (a full table reuses the last entry)."""
        rec = self._rec
        idx = min(int(rec.n_ops), MAX_OPS - 1)
        if idx == int(rec.n_ops):
            self._open_section()
            rec.op_names[idx].value = op.encode()[: NAME_LEN - 1]
            rec.n_ops = idx + 1
            self._close_section()
        k = self._ops[op] = event_code(EV_COLL_ENTER, idx) - self._origin
        return k

    # -- input pipeline ---------------------------------------------------------------------------
    def input_worker_slots(self, workers: int) -> int:
        """First of ``workers`` consecutive slots (modulo ``INPUT_SLOTS``) for a new set of DataLoader workers."""
        base = self.input_slot_next
        self.input_slot_next = (base + workers) % INPUT_SLOTS
        self.input_slots_used = min(INPUT_SLOTS, max(self.input_slots_used, base + workers))
        self.input_workers = workers
        return base

    # -- steps ------------------------------------------------------------------------------------
    def step(self, explicit: bool = False) -> None:
        """Close the current step. Once the script calls step() itself, automatic boundaries stop."""
        if _ident() != self._tid:
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

    def _harvest_gpu(self) -> None:
        """Add the finished CUDA event pairs to the record (never blocks), at a step's end."""
        rec = self._rec
        for gslot, gpu_ms in self._gpu.poll():
            rec.gpu_phase_ms[gslot] += gpu_ms

    def mark_thread_died(self, info: str) -> None:
        """A thread other than the training thread is dying with an exception (called on that thread, never
        on the training thread): the first such death is kept for the daemon. Outside the seqlock, whose only
        writer is the training thread: the bytes go first, NUL-terminated in a zeroed field, so a reader sees
        nothing, a prefix, or the whole line; a lock orders two helpers dying at once."""
        try:
            with _THREAD_ERROR_LOCK:
                rec = self._rec
                if info and not rec.thread_error:
                    raw = info.encode("utf-8", "replace")[: CRASH_LEN - 1]
                    rec.thread_error = raw.decode("utf-8", "ignore").encode()
        except Exception:
            pass

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



class PyTracker(_TrackerBase, PyCore):
    """The tracker on the Python hot paths."""


try:
    from ._fastpath import Core as _CCore
    from ._fastpath import PhaseState as _CPhaseState
except ImportError:  # not built (no compiler where it was installed): the Python hot paths
    _CCore = None  # type: ignore[assignment, misc]
    _CPhaseState = None  # type: ignore[assignment, misc]

if _CCore is not None:

    class CTracker(_TrackerBase, _CCore):
        """The tracker on the C hot paths."""

    IMPLEMENTATIONS: dict[str, type[_TrackerBase]] = {"c": CTracker, "python": PyTracker}
else:
    IMPLEMENTATIONS = {"python": PyTracker}



class PyPhaseState:
    """What a wrapper keeps between calls (the base of OutermostForward and DDPTiming, which set every field
    in their ``__init__``): ``_fastpath.PhaseState`` is the same as C fields, used where built, so the C
    wrappers and DDP timing's engine callback reach them without attribute lookups (the Python wrappers
    read the same fields as attributes)."""

    ready_ns = 0

    def _stamp(self) -> None:
        """DDP timing's engine callback at the end of the backward graph (any thread): one store."""
        self.ready_ns = time.monotonic_ns()


if TYPE_CHECKING:
    from ._fastpath import PhaseState  # the fields both have
elif _CPhaseState is None:
    PhaseState = PyPhaseState
else:
    PhaseState = _CPhaseState

if TYPE_CHECKING:
    Tracker = PyTracker  # the interface both cores have
else:
    # RANKWATCH_HOOK_IMPL=python: the Python hot paths even where the C core is built (debugging, A/B)
    Tracker = IMPLEMENTATIONS.get(os.environ.get("RANKWATCH_HOOK_IMPL", "c"), PyTracker)
