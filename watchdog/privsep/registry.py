"""The requests a worker answers: a registry of handlers, filled from above.

``privsep`` knows how to run code as a job's owner, not what that code reads: ``observe`` registers the
job-dir requests (list, records, job.json, clean-up, host counters, environments), ``evidence`` the
capture requests (py-spy, a rank's responder and flight recorder). Each handler is a plain function
``(worker, request, fds) -> answer`` registered under its op name at its module's import, so neither
folder imports the other and this package imports neither. A worker forked as an owner runs the
handlers its root process had registered when it asked for the worker (``readers``: the zygote imports
their modules, as root, before it forks).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

from ..core.policy import ReaderPolicy
from .frames import WireError

Handler = Callable[["Worker", dict[str, Any], list[int]], dict[str, Any]]
_HANDLERS: dict[str, Handler] = {}
H = TypeVar("H", bound=Handler)


def handler(op: str) -> Callable[[H], H]:
    """Register the decorated function as the worker's answer to ``op`` (one function per op, for good)."""

    def put(fn: H) -> H:
        old = _HANDLERS.get(op)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"privsep op {op!r} is already {old.__module__}.{old.__qualname__}")
        _HANDLERS[op] = fn
        return fn

    return put


def handler_modules() -> list[str]:
    """The modules whose handlers are registered (what a worker needs imported before it is forked)."""
    return sorted({fn.__module__ for fn in _HANDLERS.values()})


def registered_ops() -> frozenset[str]:
    return frozenset(_HANDLERS)


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class Worker:
    """What one worker (a reader of one owner, or the in-process stand-in of an unprivileged daemon) holds
    between requests: its policy, the py-spy it may run, and each registrant's own state (``slot``)."""

    def __init__(self, policy: ReaderPolicy, pyspy: str | None, *, fixed_pyspy: bool = True,
                 find_pyspy: Callable[[], str | None] | None = None) -> None:
        self.policy = policy
        self.pyspy = pyspy  # None and not fixed: looked up at each use (in-process: PATH may change)
        self.fixed_pyspy = fixed_pyspy
        self._find_pyspy = find_pyspy
        self._slots: dict[str, Any] = {}

    def pyspy_exe(self) -> str | None:
        if self.pyspy is not None or self.fixed_pyspy or self._find_pyspy is None:
            return self.pyspy
        return self._find_pyspy()

    def slot(self, key: str, factory: Callable[[], Any]) -> Any:
        """The state a registrant keeps in this worker under ``key`` (made on first use)."""
        got = self._slots.get(key)
        if got is None:
            got = self._slots[key] = factory()
        return got

    def handle(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """The answer to one request: the handler's, or ``{"error": ...}`` (an unknown op, a failed read).
        The handler owns the fds it is given; an unknown op's are closed here."""
        op = req.get("op")
        fn = _HANDLERS.get(op) if isinstance(op, str) else None
        if fn is None:
            for fd in fds:
                close_quietly(fd)
            return {"error": f"unknown request {str(op)[:40]!r}"}
        try:
            return fn(self, req, fds)
        except (OSError, ValueError, KeyError, TypeError, WireError) as exc:
            return {"error": str(exc)[:300]}
