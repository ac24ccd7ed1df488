"""The C hot paths (hooks/_fastpath.c) write the same record as the Python ones, byte for byte.

Both cores replay the same call sequence — phases, collectives, steps, budgets, failing and unbalanced
exits, splits, bad slots, calls from another thread, enough events to fold and wrap the ring — on their
own record with the same scripted clock; after every call the two records must be identical, and so must
what the tracker's Python side sees (enabled, the open-phase stack, the event count).
"""

from __future__ import annotations

import importlib
import random
import threading
import warnings

import pytest
from conftest import new_tracker
from hypothesis import given, settings
from hypothesis import strategies as st
from rankwatch.hooks import tracker as tracker_mod
from rankwatch.hooks.ddp_timing import DDPTiming
from rankwatch.hooks.record import EVENTS, FOLD_EVENTS, decode

# the module (rankwatch.hooks.instrument is also the name of the function the package exports)
instrument = importlib.import_module("rankwatch.hooks.instrument")
fast = importlib.import_module("rankwatch.hooks._fastpath") if "c" in tracker_mod.IMPLEMENTATIONS else None

START = 10**12
OPS = ("all_reduce", "broadcast", "barrier")

pytestmark = pytest.mark.skipif("c" not in tracker_mod.IMPLEMENTATIONS, reason="hooks/_fastpath.c not built")


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> int:
        self.now += 7_919
        return self.now


def pair(tmp_path, monkeypatch, name: str):
    """A C tracker and a Python tracker on their own records, each with its own copy of the clock."""
    made = []
    for impl in ("c", "python"):
        clock = Clock()
        monkeypatch.setattr(tracker_mod, "_now", clock)
        monkeypatch.setattr(tracker_mod, "Tracker", tracker_mod.IMPLEMENTATIONS[impl])
        t = new_tracker(str(tmp_path / f"{name}-{impl}.hb"), start_ns=START)
        made.append((t, clock))
    return made


def call(t, clock, op: tuple) -> None:
    """One call of the sequence; the module's clock is this tracker's (the Python core reads it)."""
    tracker_mod._now = clock
    kind, *args = op
    if kind == "thread":  # another thread's call: ignored by both
        th = threading.Thread(target=t.enter, args=(1,))
        th.start()
        th.join()
        return
    if kind == "slot":
        t.slot(args[0])
        return
    getattr(t, kind)(*args)


def same(a, b, where: str) -> None:
    (ta, _), (tb, _) = a, b
    ra, rb = bytes(ta._writer.map), bytes(tb._writer.map)
    if ra != rb:
        first = next(i for i in range(len(ra)) if ra[i] != rb[i])
        pytest.fail(f"records differ at byte {first} after {where}")
    seen = [(t.enabled, list(t._stack), t._ev_n, t._colls, t._last_op, list(t._budgets)) for t in (ta, tb)]
    assert seen[0] == seen[1], where


def replay(tmp_path, monkeypatch, ops: list[tuple], name: str = "r") -> None:
    a, b = pair(tmp_path, monkeypatch, name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "hook disabled after an internal error"
            for i, op in enumerate(ops):
                call(*a, op)
                call(*b, op)
                same(a, b, f"call {i} {op}")
        da, db = decode(bytes(a[0]._writer.map)), decode(bytes(b[0]._writer.map))
        assert (da.steps_done, da.phase, da.step) == (db.steps_done, db.phase, db.step)
    finally:
        for t, _ in (a, b):
            t._release()


SLOTS = st.integers(min_value=0, max_value=7)
OP = st.one_of(
    st.tuples(st.just("enter"), SLOTS),
    st.tuples(st.just("enter"), SLOTS, st.sampled_from([0.0, 2.5, 10.0])),
    st.tuples(st.just("exit"), SLOTS),
    st.tuples(st.just("exit"), SLOTS, st.integers(0, 2 * START), st.integers(-1, 7), st.booleans()),
    st.tuples(st.just("exit_batch"), SLOTS, st.booleans()),
    st.tuples(st.just("exit_step"), SLOTS),
    st.tuples(st.just("collective_enter"), st.sampled_from(OPS)),
    st.tuples(st.just("collective_exit")),
    st.tuples(st.just("step"), st.booleans()),
    st.tuples(st.just("opt_pre_hook"), st.none(), st.just(()), st.just({})),
    st.tuples(st.just("opt_post_hook"), st.none(), st.just(()), st.just({})),
    st.tuples(st.just("slot"), st.sampled_from(["grad_sync", "checkpoint", "eval"])),
    st.tuples(st.just("thread")),
    st.tuples(st.just("enter"), st.sampled_from([16, 40, -1])),  # out of the table / no phase
    # send/recv peers: named, not named (-1), past the word's range, not an int; learned, again, past the slots
    st.tuples(st.just("p2p_enter"), st.sampled_from([0, 3, 17, -1, 1 << 40, None]), st.sampled_from([1, 2])),
    st.tuples(st.just("p2p_learn"), st.integers(-1, 11) | st.sampled_from([1 << 40, None])),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OP, max_size=60))
def test_random_call_sequences_write_identical_records(tmp_path_factory, ops):
    mp = pytest.MonkeyPatch()
    try:
        replay(tmp_path_factory.mktemp("eq"), mp, ops)
    finally:
        mp.undo()


def test_deep_nesting_past_the_cores_inline_stack_writes_identical_records(tmp_path, monkeypatch):
    """The C core holds a few open phases in itself and moves them to the heap past that (and grows it
    again): 40 nested enters, unwound in two ways, then nested again from the heap."""
    deep = [("enter", i % 8) for i in range(40)]
    ops = [*deep, *(("exit", (39 - i) % 8) for i in range(20)), ("exit", 0), *deep[:10], ("exit_step", 3)]
    replay(tmp_path, monkeypatch, ops, "deep")


def test_a_long_run_folds_and_wraps_the_event_ring_identically(tmp_path, monkeypatch):
    # a training-like loop with noise, past FOLD_EVENTS and twice around the event ring
    rng = random.Random(7)
    ops: list[tuple] = []
    while len(ops) < 2 * EVENTS + FOLD_EVENTS:
        ops += [("enter", 0), ("exit_batch", 0, True), ("enter", 1), ("exit", 1)]
        ops += [("collective_enter", rng.choice(OPS)), ("collective_exit",)] * rng.randint(0, 3)
        ops += [("enter", 2), ("exit", 2, START + rng.randint(0, 10**9), 6)]
        if rng.random() < 0.05:
            ops += [("enter", 3), ("exit", 3, 0, -1, True)]  # a failing optimizer
        ops += [("opt_pre_hook", None, (), {}), ("opt_post_hook", None, (), {})]
    replay(tmp_path, monkeypatch, [("slot", "grad_sync"), *ops], "long")


def test_the_c_core_calls_the_step_callback_until_it_is_cleared(tmp_path):
    t = new_tracker(str(tmp_path / "cb.hb"))
    assert isinstance(t, tracker_mod.IMPLEMENTATIONS["c"])
    calls = []

    def once() -> None:
        calls.append(1)
        t._after_step = None

    t._after_step = once
    for _ in range(3):
        t.opt_pre_hook(None, (), {})
        t.opt_post_hook(None, (), {})
    assert calls == [1]
    assert decode(bytes(t._writer.map)).steps_done == 3
    t._release()


class _Iter:
    """A DataLoader-like iterator: ``__next__`` is wrapped on the class, as instrument.py does."""

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)

    def __iter__(self) -> _Iter:
        return self

    def __next__(self) -> int:
        what = self.script.pop(0)
        if what == "end":
            raise StopIteration
        if what == "raise":
            raise ValueError("bad batch")
        return 1


def _wrapped(t, kind: str):
    if kind == "next":
        cls = type("It", (_Iter,), {})
        cls.__next__ = instrument._wrap_next(_Iter.__next__, t, cls)
        return cls
    if kind == "coll":
        return instrument._wrap_collective(lambda fail=False: 1 / 0 if fail else 2, t, "all_reduce")
    return instrument._wrap_phase(lambda fail=False: 1 / 0 if fail else 2, t, 2)


def test_the_c_wrappers_write_what_the_python_wrappers_write(tmp_path, monkeypatch):
    (tc, cc), (tp, cp) = pair(tmp_path, monkeypatch, "w")
    script = ["ok", "raise", "ok", "ok", "end"]
    for t, clock in ((tc, cc), (tp, cp)):
        tracker_mod._now = clock
        it = _wrapped(t, "next")(script)
        plain, coll = _wrapped(t, "plain"), _wrapped(t, "coll")
        assert next(it) == 1
        with pytest.raises(ValueError):
            next(it)
        assert [x for x in it] == [1, 1]  # a for loop ends at StopIteration, through the wrapper
        assert plain() == 2 and coll() == 2
        with pytest.raises(ZeroDivisionError):
            plain(fail=True)
        with pytest.raises(ZeroDivisionError):
            coll(True)
        t.exit_step(3)
    assert isinstance(_wrapped(tc, "plain"), fast.Phase) and not isinstance(_wrapped(tp, "plain"), fast.Phase)
    assert _wrapped(tc, "coll").__rankwatch_wrapped__ is not None and _wrapped(tc, "plain").__name__ == "<lambda>"
    same((tc, cc), (tp, cp), "the wrapped calls")
    assert decode(bytes(tc._writer.map)).steps_done == 1
    assert tc._ev_n == 2 * 5 + 2 * 4 + 1  # 5 next() (one failing, one the end), 4 calls, the optimizer exit
    tc._release()
    tp._release()


def ddp_timing(t) -> DDPTiming:
    """DDP timing on tracker ``t`` with its grad_sync slot, no engine (the tests stamp ``ready_ns`` themselves)."""
    timing = DDPTiming(t, lambda cb: None)
    timing.grad_sync_slot = t.slot("grad_sync")
    return timing


def test_the_c_backward_splits_as_the_python_backward(tmp_path, monkeypatch):
    """instrument._wrap_backward with DDP timing: the split at the graph's end, a backward without one,
    a nested (reentrant) backward, a failing one, an error on an autograd thread, another thread's."""
    made = pair(tmp_path, monkeypatch, "bw")
    seen = []
    for t, clock in made:
        tracker_mod._now = clock
        timing = ddp_timing(t)
        box: dict = {}

        def graph(stamp: int = 0, fail: bool = False, nested: bool = False, error: bool = False,
                  timing=timing, box=box, clock=clock):
            if stamp:
                timing.ready_ns = clock.now + stamp  # the engine callback's stamp, mid-backward
            if error:
                timing._error = RuntimeError("hook failed on an autograd thread")
            if nested:
                box["bw"]()
            if fail:
                raise RuntimeError("backward failed")
            return "grads"

        bw = box["bw"] = instrument._wrap_backward(graph, t, timing)
        assert isinstance(bw, fast.Phase) == (t is made[0][0])
        assert bw(stamp=1000) == "grads"  # split
        assert bw() == "grads"  # no stamp: backward whole
        assert bw(stamp=500, nested=True) == "grads"  # the nested one ends first, the outer is split
        with pytest.raises(RuntimeError, match="backward failed"):
            bw(stamp=200, fail=True)
        th = threading.Thread(target=bw, kwargs={"stamp": 5})  # not the training thread: just the call
        th.start()
        th.join()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert bw(stamp=300, error=True) == "grads"  # end() reports it: timing off, no split
        t.exit_step(3)
        seen.append((timing.split_count, timing.depth, timing.waiting, timing.enabled, timing.ready_ns))
    same(*made, "the backward calls")
    assert seen[0] == seen[1]
    # split: the stamped one, the outer of the nested pair, the failing one; then the timing switched off
    assert seen[0][0] == 3 and seen[0][3] is False
    for t, _ in made:
        t._release()


@pytest.mark.parametrize("with_timing", [True, False])
def test_the_gated_engine_wrapper_times_only_backward_calls_as_the_python_one(tmp_path, monkeypatch, with_timing):
    """torch's engine entry wrapped ``gated`` (instrument.backward_entry): a phase for a call with
    ``accumulate_grad=True`` (torch.autograd.backward's), a plain call for ``False`` (torch.autograd.grad's)
    or none; arguments and results pass through unchanged, on both cores."""
    made = pair(tmp_path, monkeypatch, f"gate{with_timing}")
    calls = []
    for t, clock in made:
        tracker_mod._now = clock
        timing = ddp_timing(t) if with_timing else None

        def engine(*args, timing=timing, clock=clock, **kwargs):
            calls.append((args, kwargs))
            if timing is not None and kwargs.get("accumulate_grad"):
                timing.ready_ns = clock.now + 100
            return ("grads", args, kwargs)

        w = instrument._wrap_backward(engine, t, timing, gated=True)
        assert isinstance(w, fast.Phase) == (t is made[0][0])
        assert w(1, 2, allow_unreachable=True, accumulate_grad=True) == ("grads", (1, 2), {
            "allow_unreachable": True, "accumulate_grad": True})
        n = t._ev_n
        assert w(1, accumulate_grad=False)[2] == {"accumulate_grad": False}  # torch.autograd.grad's call
        assert w(1)[1] == (1,)
        assert t._ev_n == n  # neither was a phase
        type(w).__call__(w, 3, accumulate_grad=True)  # tp_call (a tuple and a dict), not vectorcall: the same
        t.exit_step(3)
    same(*made, "the gated calls")
    assert made[0][0]._ev_n == 2 * 2 + 1 + (2 if with_timing else 0)  # two backward pairs (+ splits), the step
    assert calls[:4] == calls[4:]
    for t, _ in made:
        t._release()


@pytest.mark.parametrize("with_timing", [True, False])
def test_a_wrapped_c_function_taking_a_tuple_and_dict_gets_them_as_they_came(tmp_path, monkeypatch, with_timing):
    """The wrapper of a C function that takes a tuple and a dict (torch's engine ``run_backward``; here a
    dict's ``update``, the same calling convention) is called through ``tp_call``: the gate reads the
    keyword from the dict, positional and keyword arguments arrive unchanged, an exception goes on; on
    both cores the same record."""
    made = pair(tmp_path, monkeypatch, f"tuple{with_timing}")
    got = []
    for t, clock in made:
        tracker_mod._now = clock
        timing = ddp_timing(t) if with_timing else None
        store: dict = {}
        w = instrument._wrap_backward(store.update, t, timing, gated=True)
        assert isinstance(w, fast.Phase) == (t is made[0][0])
        args, kwargs = ([("a", 1)],), {"allow_unreachable": True, "accumulate_grad": True}
        assert w(*args, **kwargs) is None  # a phase
        n = t._ev_n
        w(b=2, accumulate_grad=False)  # grad()'s call: none
        w({"c": 3})  # no keyword: none
        assert t._ev_n == n
        with pytest.raises(TypeError):
            w(1, 2, accumulate_grad=True)  # update() takes one positional: a failing phase, the error goes on
        t.exit_step(3)
        got.append(store)
    same(*made, "the tuple calls")
    assert got[0] == got[1] == {"a": 1, "allow_unreachable": True, "accumulate_grad": False, "b": 2, "c": 3}
    assert made[0][0]._ev_n == 2 * 2 + 1
    for t, _ in made:
        t._release()


def test_the_c_outermost_forward_times_as_the_python_one(tmp_path, monkeypatch):
    """DistributedDataParallel.forward wrapped on the class: only the outermost call is ``forward``; a
    failing one leaves it failing; the nesting count is shared with OutermostForward's module hooks."""
    made = pair(tmp_path, monkeypatch, "fw")
    depths = []
    for t, clock in made:
        tracker_mod._now = clock

        class Net:  # stands for DistributedDataParallel: its forward is wrapped on the class
            def forward(self, x, fail=False, inner=None):
                if inner is not None:
                    return inner.forward(x)
                if fail:
                    raise ValueError("bad input")
                return x + 1

        fwd = instrument.OutermostForward(t, None)
        fwd._wrap_ddp_forward(Net)
        assert Net.forward.__rankwatch_wrapped__ is not None
        a, b = Net(), Net()
        assert a.forward(1) == 2
        assert a.forward(1, inner=b) == 2  # b's call is nested: one forward phase
        with pytest.raises(ValueError):
            a.forward(1, fail=True)
        depths.append(fwd.depth)
        t.exit_step(3)
    same(*made, "the forward calls")
    assert depths == [0, 0]
    assert made[0][0]._ev_n == 2 * 3 + 1
    for t, _ in made:
        t._release()


class _Model:
    """Stands for a DistributedDataParallel model: the hook reads its ``require_forward_param_sync``."""

    def __init__(self, sync) -> None:
        self.sync = sync

    @property
    def require_forward_param_sync(self):
        if isinstance(self.sync, BaseException):
            raise self.sync
        return self.sync


@pytest.mark.parametrize("waiting", [True, False])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("model", ["sync", "no-sync", "gone", "raises", "queue-raises"])
def test_the_c_grad_hook_queues_as_the_python_one(waiting, depth, model):
    """DDP timing's post-accumulate-grad hook (``_fastpath.GradReady`` / ``ddp_timing._py_grad_ready``):
    the stamp is queued once, only in the outermost backward that will all-reduce; a failure is kept for
    ``end()`` to report, never raised into the autograd engine."""
    import gc
    import weakref

    from rankwatch.hooks import ddp_timing

    seen = []
    for state, make in ((fast.PhaseState(), fast.GradReady), (tracker_mod.PyPhaseState(), ddp_timing._py_grad_ready)):
        state.waiting, state.depth, state.ready_ns, state._error = waiting, depth, 0, None
        ddp = _Model(RuntimeError("attribute failed") if model == "raises" else model != "no-sync")
        ref = weakref.ref(ddp)
        if model == "gone":
            del ddp
            gc.collect()
        queued = []

        def queue(cb, queued=queued):
            if model == "queue-raises":
                raise RuntimeError("engine refused the callback")
            queued.append(cb)

        hook = make(state, ref, queue)
        assert hook(object()) is None
        assert hook(object()) is None  # a second parameter's call in the same backward: nothing more
        for cb in queued:
            cb()
        seen.append((len(queued), state.waiting, state.ready_ns > 0, type(state._error).__name__))
    assert seen[0] == seen[1]
    armed = waiting and depth == 1
    assert seen[0][0] == (1 if armed and model == "sync" else 0)
    assert (seen[0][3] == "RuntimeError") == (armed and model in ("raises", "queue-raises"))


def test_the_c_cores_state_reads_and_writes_as_python_attributes(tmp_path, monkeypatch):
    """The C core keeps the open phases, the last collective and the budgets' presence in C fields; the
    tracker's Python slow paths read and assign them as PyCore's plain attributes."""
    (tc, clock), _ = pair(tmp_path, monkeypatch, "attrs")
    try:
        tracker_mod._now = clock
        assert (tc._stack, tc._last_op, tc._budgets) == ([], -1, [])
        tc.enter(1)
        tc.enter(2)
        copy = tc._stack
        copy.pop()  # a copy: the core's stack is unchanged until assigned
        assert len(tc._stack) == 2
        tc._stack = copy
        assert tc._stack == copy
        tc.exit(1)  # the plain close of the innermost phase, after the assignment
        assert tc._stack == [] and tc._ev_n == 3
        with pytest.raises(TypeError):
            tc._stack = (1, 2)
        tc.collective_enter("all_reduce")
        assert tc._last_op >= 0
        tc._last_op = -1
        assert tc._last_op == -1
        tc.collective_exit()
        tc._budgets = [(0, 1.0, 0)]  # a pending budget sends every exit down the slow path
        tc.enter(3)
        tc.exit(3)
        assert tc._stack == [] and tc._budgets == []
    finally:
        tc._release()

