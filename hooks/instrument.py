"""Automatic phase points for an unmodified training script.

Global PyTorch hooks where they exist (module forward, optimizer step), thin wrappers otherwise
(DataLoader ``__next__``, the C engine's ``run_backward`` under ``torch.autograd.backward`` (``backward_entry``),
Python-level ``torch.distributed`` collectives, ``DistributedDataParallel`` construction for the
backward/grad_sync split of ``ddp_timing.py``; batch production in ``input_timing.py``).
Wrappers call the original first-class function and never alter arguments or results.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from . import ddp_timing
from .ddp_timing import DDPTiming
from .record import CANONICAL_PHASES, NO_PHASE
from .tracker import PhaseState, Tracker

try:
    from . import _fastpath
except ImportError:  # not built: the Python wrappers
    _fastpath = None  # type: ignore[assignment]

DATALOADER, FORWARD, BACKWARD, OPTIMIZER = (CANONICAL_PHASES.index(p) for p in CANONICAL_PHASES[:4])

# Python-level collectives wrapped in ``torch.distributed``. Internal calls between them go through
# ``distributed_c10d``'s own globals, which stay unwrapped, so nothing is counted twice.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
)
P2P_DIRECTION = {"send": 1, "recv": 2}  # record.P2P_SEND / P2P_RECV; the keyword naming the peer: dst / src
_PEER_KEY = {1: "dst", 2: "src"}
# ``batch_isend_irecv`` is wrapped for its ops' peers only (no phase, not counted: its works are waited on
# later, outside it). ``isend``/``irecv`` themselves are not wrapped: ``P2POp`` checks its op *is* torch's
# (``_check_op``, ``op.op is isend``), so a wrapper passed as ``dist.isend`` would break every batch.
BATCH_P2P = "batch_isend_irecv"

_installed = False
_exc_info = sys.exc_info


class OutermostForward(PhaseState):
    """Times the outermost module call as ``forward``.

    Global module hooks find the outermost modules, but they run on *every* module call (~1.8 µs each,
    milliseconds per step for models with thousands of module calls). After the first optimizer step the
    top-level modules that hold parameters (the model, its DDP wrapper; GAN pairs) are known: per-instance
    hooks on them replace the global hooks, so inner module calls cost nothing. Top-level modules first
    called later, and parameter-free ones (loss functions), are then no longer timed as ``forward``. A
    top-level DDP model gets no hooks: ``DistributedDataParallel.forward`` is wrapped (``_wrap_ddp_forward``).
    """

    def __init__(self, tracker: Tracker, module_mod: Any) -> None:
        self.tracker = tracker
        self.module_mod = module_mod
        self.depth = 0
        self.tops: dict[int, Any] = {}
        self.global_handles: list[Any] = []
        self.promoted = False
        self._enter, self._exit = tracker.enter, tracker.exit

    def _pre(self, module: Any, args: Any) -> None:
        self.depth = depth = self.depth + 1
        if depth == 1:
            self._enter(FORWARD)
            if not self.promoted and id(module) not in self.tops:
                self.tops[id(module)] = module

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = depth = self.depth - 1
        if depth <= 0:
            self.depth = 0
            # always_call: torch also calls this while an exception leaves forward (inside its except block)
            self._exit(FORWARD, 0, NO_PHASE, _exc_info()[0] is not None)

    def install(self) -> None:
        self.global_handles = [
            self.module_mod.register_module_forward_pre_hook(self._pre),
            self.module_mod.register_module_forward_hook(self._post, always_call=True),
        ]

    def promote(self) -> None:
        """Swap the global hooks for hooks on the top-level modules seen so far (once, never raises)."""
        if self.promoted:
            return
        self.promoted = True
        try:
            if _compiled_something():
                return  # removing the global hooks would recompile every compiled graph: keep them
            tops = [m for m in self.tops.values() if any(True for _ in m.parameters())]
            if not tops or self.depth != 0:
                return  # nothing safe to promote to: keep the global hooks
            ddp = _ddp_class()
            for module in tops:
                if ddp is not None and type(module).forward is ddp.forward:
                    self._wrap_ddp_forward(ddp)  # no module hooks on it: Module._call_impl's fast path
                    continue
                module.register_forward_pre_hook(self._pre)
                module.register_forward_hook(self._post, always_call=True)
            for handle in self.global_handles:
                handle.remove()
            self.global_handles = []
        except Exception:
            pass  # the global hooks stay: slower, still correct
        finally:
            self.tops.clear()


    def _wrap_ddp_forward(self, ddp: Any) -> None:
        """Time ``DistributedDataParallel.forward`` itself (the class attribute, once): a module with
        hooks makes every call take ``Module._call_impl``'s slow path (a closure, a set, the hook dict
        walks); one wrapper frame costs a fraction of it. On the class, not the instance: an instance
        attribute would be copied by ``copy.deepcopy`` (EMA) and pickled by ``torch.save(model)``."""
        fn = ddp.forward
        if getattr(fn, "__rankwatch_wrapped__", None) is not None:
            return
        fast = _c_wrapper(fn, self.tracker, "OUTERMOST", FORWARD, self)
        if fast is not None:
            ddp.forward = fast
            return
        enter, exit_ = self._enter, self._exit
        fwd = self

        @functools.wraps(fn)
        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            fwd.depth = depth = fwd.depth + 1
            if depth == 1:
                enter(FORWARD)
            try:
                out = fn(module, *args, **kwargs)
            except BaseException:
                fwd.depth = depth - 1
                if depth == 1:
                    exit_(FORWARD, 0, NO_PHASE, True)
                raise
            fwd.depth = depth - 1
            if depth == 1:
                exit_(FORWARD)
            return out

        forward.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
        ddp.forward = forward


def _ddp_class() -> Any:
    """``DistributedDataParallel`` when this torch has it (imported by the script already), else None."""
    mod = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(mod, "DistributedDataParallel", None)


def _compiled_something() -> bool:
    """torch.compile has produced a graph in this process. Dynamo guards compiled code on the number of
    global module hooks, so removing them after the first step makes every compiled function recompile
    (minutes on a large model, past the stall timeout, at step 1)."""
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    try:
        return bool(counters and counters["stats"]["unique_graphs"])
    except Exception:
        return False


# The wrappers below run on every step. On the C core they are ``_fastpath.Phase`` objects (the same rules
# in C, no Python frame of the hook's around the training call); the Python closures are the fallback and
# bind what they need once, when they are made, so a call does no attribute lookups beyond the tracker's.
def _c_wrapper(
    fn: Callable[..., Any], tracker: Tracker, kind: str, slot: int, arg: Any, gated: bool = False
) -> Callable[..., Any] | None:
    """``fn`` wrapped in C when the tracker runs on the C core (None: use the Python wrapper); ``kind`` names
    one of ``_fastpath``'s ``PHASE_*`` kinds; ``gated``: see ``_gated``."""
    if _fastpath is None or not isinstance(tracker, _fastpath.Core):
        return None
    wrapper = _fastpath.Phase(tracker, fn, getattr(_fastpath, f"PHASE_{kind}"), slot, arg, gated)
    functools.update_wrapper(wrapper, fn)
    wrapper.__rankwatch_wrapped__ = fn
    return wrapper


def _gated(fn: Callable[..., Any], timed: Callable[..., Any]) -> Callable[..., Any]:
    """``timed`` for torch's engine entry when it runs a backward (``accumulate_grad=True``), ``fn`` itself
    for ``torch.autograd.grad``'s calls (``accumulate_grad=False``): the Python wrappers' form of a gated
    ``_fastpath.Phase``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("accumulate_grad") is True:
            return timed(*args, **kwargs)
        return fn(*args, **kwargs)

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_phase(fn: Callable[..., Any], tracker: Tracker, slot: int, gated: bool = False) -> Callable[..., Any]:
    fast = _c_wrapper(fn, tracker, "PLAIN", slot, None, gated)
    if fast is not None:
        return fast
    if gated:
        return _gated(fn, _wrap_phase(fn, tracker, slot))
    enter, exit_ = tracker.enter, tracker.exit

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        enter(slot)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            exit_(slot, failing=True)
            raise
        exit_(slot)
        return out

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_next(fn: Callable[..., Any], tracker: Tracker, single: type | None) -> Callable[..., Any]:
    """``DataLoader`` iterators' ``__next__`` as the ``dataloader`` phase. An iterator of class ``single``
    (no workers: this thread fetches and collates) books the phase's time as the batch's production time
    too, from the same two clock reads (``input_timing.py``); ``None``: input timing is off."""
    fast = _c_wrapper(fn, tracker, "NEXT", DATALOADER, single)
    if fast is not None:
        return fast
    enter, exit_batch = tracker.enter, tracker.exit_batch

    @functools.wraps(fn)
    def wrapper(self: Any) -> Any:
        enter(DATALOADER)
        try:
            out = fn(self)
        except StopIteration:
            tracker.exit(DATALOADER)  # the end of an epoch: a normal end of the phase, not a failure
            raise
        except BaseException:
            tracker.exit(DATALOADER, failing=True)
            raise
        exit_batch(DATALOADER, self.__class__ is single)
        return out

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_collective(fn: Callable[..., Any], tracker: Tracker, op: str) -> Callable[..., Any]:
    if op in P2P_DIRECTION:
        return _wrap_p2p(fn, tracker, op, P2P_DIRECTION[op])
    fast = _c_wrapper(fn, tracker, "COLL", NO_PHASE, op)
    if fast is not None:
        return fast
    enter, exit_ = tracker.collective_enter, tracker.collective_exit

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        enter(op)
        try:
            return fn(*args, **kwargs)
        finally:
            exit_()

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_p2p(fn: Callable[..., Any], tracker: Tracker, op: str, direction: int) -> Callable[..., Any]:
    """A send or recv as a collective that also records its peer (the ``dst``/``src`` global rank, second
    positional or by keyword) before it enters, and learns it as a peer once it completes: whom a rank in
    it waits for, and whether it ever exchanged with that peer before (the wrong-peer rung)."""
    fast = _c_wrapper(fn, tracker, "P2P", direction, op)
    if fast is not None:
        return fast
    enter, exit_, p2p_enter, p2p_learn = (
        tracker.collective_enter, tracker.collective_exit, tracker.p2p_enter, tracker.p2p_learn)
    key = _PEER_KEY[direction]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        peer = args[1] if len(args) > 1 else kwargs.get(key)
        peer = peer if isinstance(peer, int) and 0 <= peer < 1 << 63 else -1  # the C core's rule (a long long)
        p2p_enter(peer, direction)
        enter(op)
        try:
            out = fn(*args, **kwargs)
        finally:
            exit_()
        p2p_learn(peer)
        return out

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_batch(fn: Callable[..., Any], tracker: Tracker) -> Callable[..., Any]:
    """``batch_isend_irecv``: each op's peer (``P2POp.peer``, a global rank) learned as posted; no phase and no
    count (its works complete later, in the caller's ``wait()``). A Python wrapper on either core: one call per
    batch, not per phase transition."""
    learn = tracker.p2p_learn

    @functools.wraps(fn)
    def wrapper(p2p_op_list: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            for p2p_op in p2p_op_list[:64]:  # a bounded look: the record keeps a few peers
                peer = getattr(p2p_op, "peer", None)
                if isinstance(peer, int):
                    learn(peer)
        except Exception:
            pass  # never raise into training: torch's own checks report a bad list
        return fn(p2p_op_list, *args, **kwargs)

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_backward(
    fn: Callable[..., Any], tracker: Tracker, timing: DDPTiming | None, gated: bool = False
) -> Callable[..., Any]:
    """``backward`` (or torch's engine entry, ``gated``: see ``backward_entry``); with DDP timing, the tail
    after this rank's backward graph was done (waiting for the gradient all-reduce, i.e. for the peers) is
    booked as ``grad_sync``. ``DDPTiming.begin``'s body and ``end``'s common path run inline here (two Python
    calls per step fewer); the methods stay the reference."""
    if timing is None:
        return _wrap_phase(fn, tracker, BACKWARD, gated)
    fast = _c_wrapper(fn, tracker, "BACKWARD", BACKWARD, timing, gated)
    if fast is not None:
        return fast
    if gated:
        return _gated(fn, _wrap_backward(fn, tracker, timing))
    enter, exit_ = tracker.enter, tracker.exit
    ident, thread = threading.get_ident, tracker.thread_id

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if ident() != thread:  # another thread's backward: neither a phase nor split
            return fn(*args, **kwargs)
        timing.depth = depth = timing.depth + 1  # DDPTiming.begin()
        if depth == 1:
            timing.ready_ns = 0
            timing.waiting = timing.enabled
        enter(BACKWARD)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            exit_(BACKWARD, timing.end(), timing.grad_sync_slot, failing=True)
            raise
        if depth != 1 or timing._error is not None:  # nested, or an error on an autograd thread: end()
            exit_(BACKWARD, timing.end(), timing.grad_sync_slot)
            return out
        # DDPTiming.end()'s common path: the outermost backward
        timing.depth = 0
        timing.waiting = False
        ready = timing.ready_ns
        if ready and timing.enabled:
            timing.ready_ns = 0
            timing.split_count += 1
            exit_(BACKWARD, ready, timing.grad_sync_slot)
        else:
            exit_(BACKWARD)
        return out

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


_BASETYPE = 1 << 10  # Py_TPFLAGS_BASETYPE


def _engine_holder(entry: Any) -> Any | None:
    """The class (``Variable``) whose ``_execution_engine`` torch's engine entry calls ``run_backward`` on,
    where a subclass instance of that engine can stand in for it: the entry names the three through its
    module's globals, the engine is a C object with no state of its own (its methods drive torch's one
    process-wide engine, so any instance is the same engine), its type can be subclassed, ``run_backward``
    is its C method. None: not provable (another torch, or someone else's engine object)."""
    code = getattr(entry, "__code__", None)
    holder = getattr(entry, "__globals__", {}).get("Variable")
    if code is None or holder is None or not {"Variable", "_execution_engine", "run_backward"} <= set(code.co_names):
        return None
    engine = vars(holder).get("_execution_engine") if isinstance(holder, type) else None
    if engine is None:
        return None
    cls = type(engine)
    if hasattr(getattr(cls, "run_backward", None), "__rankwatch_wrapped__"):
        return holder  # ours, installed (asked again by benchmarks and tests)
    if (
        cls.__basicsize__ != object.__basicsize__
        or not cls.__flags__ & _BASETYPE
        or type(vars(cls).get("run_backward")).__name__ != "method_descriptor"
    ):
        return None
    return holder


def _python_entry(autograd: Any) -> Any:
    """torch's Python engine entry, unwrapped (asked again once installed: benchmarks, tests); None: none."""
    entry = vars(autograd).get("_engine_run_backward")
    return getattr(entry, "__rankwatch_wrapped__", entry)


def backward_entry(autograd: Any) -> tuple[str, bool]:
    """Where the backward phase is wrapped, innermost first, each where it can be proven that
    ``torch.autograd.backward`` reaches it: ``("engine", True)``: the C engine's ``run_backward`` (on a
    subclass instance of torch's engine put in its place, ``_engine_holder``); ``("_engine_run_backward",
    True)``: torch's Python engine entry, which ``backward`` calls through its module's globals with
    ``accumulate_grad=True`` (torch >= 2.4; ``grad`` calls it with False: gated out); else
    ``("backward", False)``.

    Why innermost: a wrapper is the caller of what it wraps, so the wrapped Python function's frame
    set-up and teardown (its argument tuple and dict, the locals freed at its return) run under the
    wrapper, in the hook's samples, where unwrapped they are inline in the caller. Around the C method
    nothing Python is set up or torn down. Both entries also time a ``backward`` the script bound before
    the hook was installed (``from torch.autograd import backward``)."""
    backward = getattr(autograd, "backward", None)
    entry = _python_entry(autograd)
    code = getattr(backward, "__code__", None)
    if (
        code is not None
        and getattr(entry, "__code__", None) is not None
        and getattr(backward, "__globals__", None) is vars(autograd)
        and "_engine_run_backward" in code.co_names
        and any(isinstance(c, tuple) and "accumulate_grad" in c for c in code.co_consts)
    ):
        return ("engine", True) if _engine_holder(entry) is not None else ("_engine_run_backward", True)
    return "backward", False


def _holder_of(autograd: Any) -> Any:
    return _engine_holder(_python_entry(autograd))


def backward_point(autograd: Any) -> tuple[Any, str]:
    """The object and attribute that hold the backward wrapper (``backward_entry``'s place): for the
    engine, torch's engine class before ``install``, the subclass put in its place after."""
    name, _ = backward_entry(autograd)
    if name != "engine":
        return autograd, name
    return type(vars(_holder_of(autograd))["_execution_engine"]), "run_backward"


def _wrap_engine(autograd: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Put a subclass instance of torch's engine in ``Variable._execution_engine`` whose ``run_backward``
    is ``wrap`` of the engine's own (``backward_entry``'s ``engine``), a static method: the engine's
    methods never read their instance, and the C wrapper of a C method that takes a tuple and a dict
    passes them through as they came (no bound method made, no arguments rebuilt). The other methods
    (``queue_callback``, which DDP and FSDP call) are the engine's own, inherited."""
    holder = _holder_of(autograd)
    engine = vars(holder)["_execution_engine"]
    base = type(engine)
    timed = type(f"Timed{base.__name__}", (base,),
                 {"__slots__": (), "__module__": __name__, "run_backward": staticmethod(wrap(engine.run_backward))})
    holder._execution_engine = timed()


def install(tracker: Tracker) -> None:
    """Install every automatic point once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch
    import torch.nn.modules.module as module_mod
    import torch.utils.data.dataloader as dl

    # GPU time per phase on CUDA ranks (None on CPU-only builds and machines: nothing is recorded)
    if os.environ.get("RANKWATCH_CUDA_EVENTS", "1") != "0":
        from .cuda_timing import EventPool

        tracker.attach_gpu_timing(EventPool.create())

    # the input pipeline's own time per batch, in the workers or on this thread (input_timing.py)
    single: type | None = None
    if os.environ.get("RANKWATCH_INPUT_TIMING", "1") != "0":
        try:
            from . import input_timing

            input_timing.install(tracker, dl)
            single = dl._SingleProcessDataLoaderIter
        except Exception as exc:
            warnings.warn(f"rankwatch: input pipeline timing unavailable: {exc!r}", RuntimeWarning, stacklevel=2)
    # DataLoader: every iterator class inherits __next__ from the base iterator.
    base_iter = dl._BaseDataLoaderIter
    base_iter.__next__ = _wrap_next(base_iter.__next__, tracker, single)  # type: ignore[method-assign]

    # Forward: only the outermost module call counts (a DDP wrapper, or the bare model).
    forward = OutermostForward(tracker, module_mod)
    forward.install()

    # Backward: Tensor.backward delegates to torch.autograd.backward, which calls torch's engine entry,
    # which calls the C engine: wrapping the innermost that can be proven (backward_entry) covers all three.
    # DDP timing (ddp_timing.py) splits the wait for the gradient all-reduce off into grad_sync.
    try:
        timing = ddp_timing.install(tracker)
    except Exception as exc:
        timing = None
        warnings.warn(f"rankwatch: DDP backward timing unavailable: {exc!r}", RuntimeWarning, stacklevel=2)
    name, gated = backward_entry(torch.autograd)
    if name == "engine":
        _wrap_engine(torch.autograd, lambda fn: _wrap_backward(fn, tracker, timing, gated))
    else:
        setattr(torch.autograd, name, _wrap_backward(getattr(torch.autograd, name), tracker, timing, gated))

    # Optimizer: global pre/post step hooks; the post hook closes the step.
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    # The tracker's own methods are the hooks: on the C core no Python frame runs between torch and the
    # record. The post hook calls _after_step after each automatic step end until it clears it.
    def after_first_step() -> None:
        tracker._after_step = None
        forward.promote()

    tracker._after_step = after_first_step
    register_optimizer_step_pre_hook(tracker.opt_pre_hook)
    register_optimizer_step_post_hook(tracker.opt_post_hook)

    # Collectives called from Python.
    import torch.distributed as dist

    if dist.is_available():
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None and not hasattr(fn, "__rankwatch_wrapped__"):
                setattr(dist, name, _wrap_collective(fn, tracker, name))
        fn = getattr(dist, BATCH_P2P, None)
        if fn is not None and not hasattr(fn, "__rankwatch_wrapped__"):
            setattr(dist, BATCH_P2P, _wrap_batch(fn, tracker))
