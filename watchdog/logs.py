"""structlog set-up: JSON lines for the daemon (journald, log shippers), readable text on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from .core.text import PROSE, clean


def _clean_strings(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """Console lines print string values as they are: clean them (a job named with an escape sequence
    must not drive the terminal). JSON lines need nothing: the encoder escapes control characters."""
    return {k: clean(v, PROSE) if isinstance(v, str) else v for k, v in event.items()}


def configure(json_output: bool | None = None, level: str = "info", stream: Any = None) -> None:
    """json_output None: JSON unless stderr is a terminal."""
    stream = stream or sys.stderr
    if json_output is None:
        json_output = not stream.isatty()
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json_output:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors += [_clean_strings, structlog.dev.ConsoleRenderer(colors=stream.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
