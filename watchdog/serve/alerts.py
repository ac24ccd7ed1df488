"""Telling people: the verdict POSTed to webhooks (``--notify URL``) and a command run on the bundle
(``--on-incident CMD``), once per incident, on a thread of their own.

An alert must never cost detection: a webhook that hangs or refuses, or a command that never returns,
only delays the next alert, never the poll loop or the incident pipeline (both just enqueue). Every
failure is logged and dropped after the policy's retries. The command runs without a shell: its words
come from the operator's command line, the bundle path and the ids are passed as an argument and in the
environment, so nothing from a verdict can become shell syntax.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ..core.policy import AlertPolicy
from ..core.text import NAME, clean
from ..errors import UserError
from ..report.text import headline

log = structlog.get_logger("rankwatch.alerts")

USER_AGENT = "rankwatch-alert/1"


def check_url(url: str) -> str:
    """An http(s) URL with a host, or a UserError naming what is wrong (for the option parser)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--notify wants an http:// or https:// URL, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError:
        raise UserError(f"--notify URL has a bad port: {url!r}") from None
    return url


def check_command(cmd: str) -> list[str]:
    """The words of ``--on-incident``, its program resolved to an existing executable."""
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise UserError(f"--on-incident is malformed: {exc}") from exc
    if not words:
        raise UserError("--on-incident is empty")
    program = shutil.which(words[0]) if os.sep not in words[0] else words[0]
    if program is None or not os.path.isfile(program) or not os.access(program, os.X_OK):
        raise UserError(f"--on-incident: {words[0]!r} is not an executable file")
    return [os.path.abspath(program), *words[1:]]


def payload(verdict: dict[str, Any], bundle: str | None) -> bytes:
    """The verdict document plus a one-line ``text`` (what Slack-style webhooks display) and the bundle."""
    text = f"rankwatch [{clean(verdict.get('job_id'), NAME)}]: {headline(verdict)}"
    return json.dumps({**verdict, "text": text, "bundle": bundle}, default=str).encode()


@dataclass(frozen=True)
class Alert:
    verdict: dict[str, Any]
    bundle: str | None
    notify: bool  # POST to the webhooks
    command: bool  # run --on-incident (once the bundle is written)


Poster = Callable[[str, bytes, float], int]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A webhook that redirects is misconfigured; following it would turn the POST into a GET elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect())


def http_post(url: str, body: bytes, timeout_s: float) -> int:
    check_url(url)  # http(s) only: never file:// or ftp://
    req = urllib.request.Request(  # noqa: S310 - scheme checked above
        url, data=body, method="POST", headers={"Content-Type": "application/json", "User-Agent": USER_AGENT}
    )
    with _OPENER.open(req, timeout=timeout_s) as resp:
        return int(resp.status)


class Alerter:
    """One sender thread; ``submit`` never blocks."""

    def __init__(
        self,
        urls: Sequence[str],
        command: Sequence[str] | None,
        policy: AlertPolicy | None = None,
        *,
        post: Poster = http_post,
    ) -> None:
        self.urls = list(urls)
        self.command = list(command) if command else None
        self.policy = policy or AlertPolicy()
        self._post = post
        self._queue: queue.Queue[Alert | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="rankwatch-alerts", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.command)

    def submit(self, verdict: dict[str, Any], bundle: str | None, *, notify: bool = True, command: bool = True) -> None:
        """Queue the alerts of one incident; the caller decides which (webhooks once per job, the command
        once the bundle exists)."""
        notify, command = notify and bool(self.urls), command and self.command is not None
        if not (notify or command):
            return
        while self._queue.qsize() >= self.policy.max_queued:
            try:
                lost = self._queue.get_nowait()
            except queue.Empty:
                break
            if lost is not None:
                log.error("alert_dropped", incident=lost.verdict.get("incident_id"), why="alert queue full")
        self._queue.put(Alert(verdict, bundle, notify, command))

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued (bounded by ``timeout_s``), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.error("alerts_unfinished", queued=self._queue.qsize())

    def _loop(self) -> None:
        while True:
            alert = self._queue.get()
            if alert is None:
                return
            for url in self.urls if alert.notify else []:
                try:
                    self._notify(url, alert)
                except Exception:  # never the end of the sender
                    log.exception("notify_failed", url=_redact(url))
            if alert.command:
                try:
                    self._run(alert)
                except Exception:
                    log.exception("on_incident_failed", incident=alert.verdict.get("incident_id"))

    def _notify(self, url: str, alert: Alert) -> None:
        body, p = payload(alert.verdict, alert.bundle), self.policy
        incident = alert.verdict.get("incident_id")
        for attempt in range(p.notify_attempts):
            try:
                status = self._post(url, body, p.notify_timeout_s)
                if 200 <= status < 300:
                    log.info("notified", url=_redact(url), incident=incident, status=status, attempt=attempt)
                    return
                error = f"HTTP {status}"
            except urllib.error.HTTPError as exc:
                error = f"HTTP {exc.code}"
                if 400 <= exc.code < 500 and exc.code not in (408, 429):
                    log.error("notify_failed", url=_redact(url), incident=incident, error=error, final=True)
                    return  # the receiver refuses this request: trying again cannot help
            except (OSError, ValueError) as exc:
                error = str(exc)[:200]
            last = attempt == p.notify_attempts - 1
            log.warning("notify_failed", url=_redact(url), incident=incident, error=error, attempt=attempt, final=last)
            if not last:
                time.sleep(p.notify_backoff_s * (2**attempt))

    def _run(self, alert: Alert) -> None:
        assert self.command is not None
        v = alert.verdict
        env = dict(
            os.environ,
            RANKWATCH_INCIDENT_ID=clean(v.get("incident_id"), NAME),
            RANKWATCH_JOB_ID=clean(v.get("job_id"), NAME),
            RANKWATCH_KIND=clean(v.get("kind"), NAME),
            RANKWATCH_INITIATING_RANKS=",".join(str(r) for r in v.get("initiating_ranks") or [] if isinstance(r, int)),
            RANKWATCH_BUNDLE=alert.bundle or "",
        )
        argv = [*self.command, alert.bundle or ""]
        # stderr to a file, not a pipe: a grandchild the command left behind cannot keep the sender waiting
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                    start_new_session=True,
                )
            except OSError as exc:
                log.error("on_incident_failed", command=argv[0], error=str(exc))
                return
            try:
                code = proc.wait(timeout=self.policy.command_timeout_s)
            except subprocess.TimeoutExpired:
                # the operator's own command, in a session of its own: its whole group goes
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                log.error("on_incident_timeout", command=argv[0], incident=v.get("incident_id"))
                return
            err.seek(0)
            tail = err.read()[-400:].decode(errors="replace")
        level = log.info if code == 0 else log.error
        level("on_incident_ran", command=argv[0], incident=v.get("incident_id"), exit_code=code, stderr=clean(tail))


def _redact(url: str) -> str:
    """A webhook URL's path is often its secret (Slack, Teams): log only scheme, host and port."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/…"
