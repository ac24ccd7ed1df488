# The C core's interface (hooks/_fastpath.c); tracker.PyCore is the same in Python.
from typing import Any

class Core:
    _tid: int
    thread_id: int
    _ev_n: int
    _slow_at: int
    _seq: int
    _steps_done: int
    _step_start: int
    _seen_ns: int
    _seen_batches: int
    _origin: int
    _colls: int
    input_slots_used: int
    input_workers: int
    explicit_steps: bool
    _stack: list[int]
    _budgets: list[tuple[int, float, int]]
    _gpu: Any
    _ops: dict[str, int]
    _last_op: int
    _frozen: tuple[int, int] | None
    _clock: Any
    _after_step: Any
    _p2p_n: int
    def enter(self, slot: int, budget_s: float = 0.0) -> None: ...
    def exit(self, slot: int, split_ns: int = 0, tail_slot: int = -1, failing: bool = False) -> None: ...
    def exit_batch(self, slot: int, produced: bool) -> None: ...
    def exit_step(self, slot: int) -> None: ...
    def collective_enter(self, op: str) -> None: ...
    def collective_exit(self) -> None: ...
    def p2p_enter(self, peer: int, direction: int) -> None: ...
    def p2p_learn(self, peer: int) -> None: ...
    def opt_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None: ...
    def opt_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None: ...
    def _end_step(self, now: int) -> None: ...
    def _write_cp(self, base: int, n: int, at: int) -> None: ...
    def _bind(self, raw: memoryview, layout: dict[str, int]) -> None: ...
    def _release(self) -> None: ...

class Phase:
    """A training function wrapped as a phase (instrument.py's wrappers, in C)."""

    _fn: Any
    __rankwatch_wrapped__: Any
    def __init__(self, core: Core, fn: Any, kind: int, slot: int, arg: Any, gated: bool = False) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def __get__(self, obj: Any, objtype: Any = None) -> Any: ...

PHASE_PLAIN: int
PHASE_NEXT: int
PHASE_COLL: int
PHASE_BACKWARD: int
PHASE_OUTERMOST: int
PHASE_P2P: int

class PhaseState:
    """What a wrapper keeps between calls, as C fields (OutermostForward's and DDPTiming's base)."""

    depth: int
    split_count: int
    ready_ns: int
    grad_sync_slot: int
    waiting: bool
    enabled: bool
    _error: BaseException | None
    def _stamp(self) -> None: ...

class GradReady:
    """DDP timing's post-accumulate-grad hook (ddp_timing._py_grad_ready, in C)."""

    def __init__(self, state: PhaseState, ref: Any, queue: Any) -> None: ...
    def __call__(self, param: Any) -> None: ...
