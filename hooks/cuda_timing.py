"""GPU-side phase timing with reusable CUDA events, harvested without ever blocking the training thread.

CPU timestamps of a phase say when Python *launched* the work; with asynchronous kernels the GPU may run
it much later. Recording a start/end ``torch.cuda.Event(enable_timing=True)`` pair on the current stream
around a phase, and reading ``start.elapsed_time(end)`` once both have fired, gives the phase's GPU time.
``poll()`` checks pairs with the non-blocking ``Event.query()`` only, never ``synchronize()``, so a
harvest costs microseconds and a stuck GPU never stalls the caller.

The pool is bounded: when every pair is in flight (the GPU is far behind, or ``poll()`` is not called),
``begin`` drops the measurement and counts it in ``dropped`` instead of allocating. Recording is skipped
while a CUDA graph is being captured (an event record inside capture would become part of the graph).
All methods swallow their own errors (counted in ``errors``): the hook must never raise into training.
Use from one thread (the training thread). torch is imported lazily so importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_CAPACITY = 64
"""Pairs in flight: a few phases per step × the steps the GPU may lag behind the CPU (usually 1–3)."""


class EventPool:
    """Reusable start/end event pairs keyed by a phase slot (int or name)."""

    def __init__(
        self,
        event_factory: Callable[[], Any],
        capacity: int = DEFAULT_CAPACITY,
        is_capturing: Callable[[], bool] | None = None,
    ) -> None:
        self._factory = event_factory
        self.capacity = max(1, capacity)
        self._is_capturing = is_capturing or (lambda: False)
        self._free: list[tuple[Any, Any]] = []
        self._created = 0
        self._open: dict[Any, tuple[Any, Any]] = {}
        self._pending: list[tuple[Any, Any, Any]] = []  # (slot, start, end), oldest first
        self.dropped = 0
        self.errors = 0
        self.harvested = 0

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, torch_module: Any = None) -> EventPool | None:
        """A pool on the current CUDA device, or None where torch has no usable CUDA (CPU-only builds)."""
        try:
            torch = torch_module
            if torch is None:
                import torch as torch_mod

                torch = torch_mod
            if not torch.cuda.is_available():
                return None
            cuda = torch.cuda

            def factory() -> Any:
                return cuda.Event(enable_timing=True)

            capturing = getattr(cuda, "is_current_stream_capturing", None)
            return cls(factory, capacity=capacity, is_capturing=capturing)
        except Exception:
            return None

    @property
    def in_flight(self) -> int:
        return len(self._open) + len(self._pending)

    def _take(self) -> tuple[Any, Any] | None:
        if self._free:
            return self._free.pop()
        if self._created < self.capacity:
            pair = (self._factory(), self._factory())
            self._created += 1
            return pair
        return None

    def begin(self, slot: Any) -> bool:
        """Record a start event for ``slot`` on the current stream; False when dropped."""
        try:
            if self._is_capturing():
                return False
            if slot in self._open:
                # unbalanced begin (an exception skipped end): recycle the old pair, start afresh
                self._free.append(self._open.pop(slot))
            pair = self._take()
        except Exception:
            self.errors += 1
            return False
        if pair is None:
            self.dropped += 1
            return False
        try:
            pair[0].record()
        except Exception:
            self.errors += 1
            self._free.append(pair)
            return False
        self._open[slot] = pair
        return True

    def end(self, slot: Any) -> bool:
        """Record the end event for ``slot``; False when ``slot`` had no recorded begin."""
        pair = self._open.pop(slot, None)
        if pair is None:
            return False
        try:
            if self._is_capturing():
                self._free.append(pair)
                return False
            pair[1].record()
            self._pending.append((slot, pair[0], pair[1]))
            return True
        except Exception:
            self.errors += 1
            self._free.append(pair)
            return False

    def poll(self) -> list[tuple[Any, float]]:
        """(slot, gpu_ms) of every pair whose events have both fired, oldest first. Never blocks."""
        done: list[tuple[Any, float]] = []
        still: list[tuple[Any, Any, Any]] = []
        for slot, start, end in self._pending:
            try:
                if not (end.query() and start.query()):
                    still.append((slot, start, end))
                    continue
                ms = float(start.elapsed_time(end))
                done.append((slot, ms))
                self.harvested += 1
            except Exception:
                self.errors += 1
            self._free.append((start, end))
        self._pending = still
        return done

    def stats(self) -> dict[str, int]:
        return {
            "capacity": self.capacity,
            "created": self._created,
            "in_flight": self.in_flight,
            "harvested": self.harvested,
            "dropped": self.dropped,
            "errors": self.errors,
        }
