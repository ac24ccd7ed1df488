"""The daemon's signal handlers never log: a handler runs on the main thread between two bytecodes,
possibly inside a log call that holds structlog's (non-reentrant) PrintLogger lock, and a handler that
logged would wait for itself forever — a daemon deaf to SIGTERM, or hung by logrotate's SIGHUP."""

from __future__ import annotations

import io
import json
import signal
import threading

import pytest
import structlog
from rankwatch.watchdog import logs
from rankwatch.watchdog.cli.daemon import SignalHandlers


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def stop(self) -> None:
        self.calls.append("stop")

    def ping(self) -> None:
        self.calls.append("ping")

    def stopping(self) -> None:
        self.calls.append("stopping")


@pytest.fixture(autouse=True)
def _structlog_as_it_was():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _handlers(stream: io.StringIO) -> tuple[SignalHandlers, _Recorder, list[int]]:
    relogs: list[int] = []

    def relog() -> None:
        relogs.append(1)
        logs.configure(json_output=True, stream=stream)

    logs.configure(json_output=True, stream=stream)
    rec = _Recorder()
    return SignalHandlers(rec, rec, relog), rec, relogs  # type: ignore[arg-type]


def _returns_while_the_log_lock_is_held(stream: io.StringIO, handler, signum: int) -> bool:
    lock = structlog.PrintLogger(stream)._lock  # the lock a log line to this stream takes
    with lock:  # the main thread was inside a log call when the signal landed
        t = threading.Thread(target=handler, args=(signum, None), daemon=True)
        t.start()
        t.join(10)
        return not t.is_alive()


def test_sighup_reopens_the_log_after_the_poll_not_inside_the_handler() -> None:
    stream = io.StringIO()
    handlers, rec, relogs = _handlers(stream)
    assert _returns_while_the_log_lock_is_held(stream, handlers.reload, signal.SIGHUP)
    assert relogs == [] and stream.getvalue() == ""  # nothing logged or reconfigured in the handler
    handlers.after_poll()
    events = [json.loads(ln)["event"] for ln in stream.getvalue().splitlines()]
    assert events == ["daemon_reloaded"] and relogs == [1] and rec.calls == ["ping"]
    handlers.after_poll()  # one SIGHUP, one reload
    assert relogs == [1] and len(stream.getvalue().splitlines()) == 1


def test_sigterm_stops_the_loop_and_is_logged_only_by_the_caller() -> None:
    stream = io.StringIO()
    handlers, rec, _ = _handlers(stream)
    assert _returns_while_the_log_lock_is_held(stream, handlers.stop, signal.SIGTERM)
    assert stream.getvalue() == "" and rec.calls == ["stopping", "stop"]
    assert handlers.stopped_by == ["SIGTERM"]
