"""Telling people: incidents (and, opted in, live stragglers) POSTed to webhooks (``--notify URL``) as they
fire and when they resolve, and a command run on each incident's bundle (``--on-incident CMD``).

An alert must never cost detection, nor one receiver another: every target (each URL, the command) has a
sender thread and a bounded queue of its own, so a webhook that hangs, trickles or refuses delays only
itself; each POST has a total deadline (``webhook``), each command a timeout and a subreaper that takes
everything it started down with it (``reaper``). The poll loop and the incident pipeline only enqueue.
A queue keeps every job and every job owner its share: when one job (or one user's many jobs) floods it,
that job's (that user's) oldest notices are dropped, never another's; and owners are sent in turn, so one
user's backlog never holds up another user's alert. A URL ending in ``/api/v2/alerts`` gets
Alertmanager's v2 format (re-sent while firing, so an alert whose daemon died expires by itself); any
other URL the JSON document (``alert_docs``).
The command runs without a shell: its words come from the operator's command line, the bundle path and
the verdict's gist come as an argument and in the environment, so nothing from a verdict becomes syntax.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog

from ..core.policy import AlertPolicy
from ..core.text import clean
from ..errors import UserError
from . import reaper
from .alert_docs import (
    FIRING,
    RESOLVED,
    Notice,
    alertmanager_alert,
    command_env,
    incident_notice,
    is_alertmanager,
    straggler_notice,
)
from .webhook import USER_AGENT, Post, check_url

__all__ = ["USER_AGENT", "Alerter", "check_command", "check_url"]

log = structlog.get_logger("rankwatch.alerts")


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


Poster = Callable[[str, bytes, float], int]


class FairQueue:
    """A bounded queue of notices where each job and each job owner keeps its share: a job over ``per_job``
    loses its own oldest notice, an owner over ``per_owner`` (across their jobs) their own oldest; a full
    queue loses the oldest notice of the biggest job of the owner holding the most. ``get`` takes owners in
    turn (each owner's notices in order), so one owner's backlog never delays another's notice."""

    def __init__(self, limit: int, per_job: int, per_owner: int | None = None) -> None:
        self.limit, self.per_job = max(1, limit), max(1, per_job)
        self.per_owner = max(1, per_owner if per_owner is not None else limit)
        self._items: collections.deque[Notice] = collections.deque()
        self._end = False
        self._turn = 0
        self._served: dict[int, int] = {}  # owner -> the turn they were last served on
        self._cond = threading.Condition()

    def put(self, n: Notice | None) -> Notice | None:
        """Queue ``n`` (None: the end, after what is queued); returns the notice dropped to make room, if any."""
        with self._cond:
            lost = None
            if n is None:
                self._end = True
            else:
                mine = [x for x in self._items if x.job_id == n.job_id]
                theirs = [x for x in self._items if x.owner == n.owner]
                if len(mine) >= self.per_job:
                    lost = mine[0]
                elif len(theirs) >= self.per_owner:
                    lost = theirs[0]
                elif len(self._items) >= self.limit:
                    owners = collections.Counter(x.owner for x in self._items)
                    big_owner = max(owners, key=lambda o: owners[o])
                    jobs = collections.Counter(x.job_id for x in self._items if x.owner == big_owner)
                    big = max(jobs, key=lambda j: jobs[j])
                    lost = next(x for x in self._items if x.job_id == big)
                if lost is not None:
                    self._items.remove(lost)
                self._items.append(n)
            self._cond.notify()
            return lost

    def get(self, timeout_s: float | None) -> tuple[bool, Notice | None]:
        """(True, notice or None for the end) or (False, None) when nothing came within ``timeout_s``."""
        with self._cond:
            if not self._items and not self._end and not self._cond.wait_for(
                lambda: bool(self._items) or self._end, timeout_s
            ):
                return False, None
            if not self._items:
                return True, None
            # the owner served longest ago (never: first), their oldest notice
            owner = min(dict.fromkeys(x.owner for x in self._items), key=lambda o: self._served.get(o, -1))
            n = next(x for x in self._items if x.owner == owner)
            self._items.remove(n)
            self._turn += 1
            self._served[owner] = self._turn
            if len(self._served) > 4 * self.limit:  # bounded: owners with nothing queued are forgotten
                queued = {x.owner for x in self._items}
                self._served = {o: t for o, t in self._served.items() if o in queued}
            return True, n

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class _Target:
    """One receiver: a thread draining its own queue."""

    name = "target"

    def __init__(self, policy: AlertPolicy) -> None:
        self.policy = policy
        self.queue = FairQueue(policy.max_queued, policy.max_queued_per_job, policy.max_queued_per_owner)
        self.stop = threading.Event()  # set when sending must end now (shutdown past its deadline)
        self.thread = threading.Thread(target=self._loop, name=f"rankwatch-alerts-{self.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, n: Notice) -> None:
        lost = self.queue.put(n)
        if lost is not None:
            log.error("alert_dropped", target=self.label, job=lost.job_id, alert=list(lost.key),
                      owner_uid=lost.owner, why="the job's or its owner's share of the alert queue is full")

    @property
    def label(self) -> str:
        return self.name

    def idle_timeout(self) -> float | None:
        return None

    def idle(self) -> None:
        """Called when nothing came within ``idle_timeout()``."""

    def handle(self, n: Notice) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        self.stop.set()

    def _loop(self) -> None:
        while True:
            got, n = self.queue.get(self.idle_timeout())
            if got and n is None:
                return
            try:
                if n is None:
                    self.idle()
                else:
                    self.handle(n)
            except Exception:  # never the end of the sender
                log.exception("alert_failed", target=self.label)
            if self.stop.is_set():
                return


class _Webhook(_Target):
    """A plain webhook: the JSON document, retried with backoff, every try under a total deadline."""

    name = "webhook"

    def __init__(self, url: str, policy: AlertPolicy, post: Poster | None) -> None:
        self.url = url
        self._post = post
        self._current: Post | None = None
        self._lock = threading.Lock()
        super().__init__(policy)

    @property
    def label(self) -> str:
        return _redact(self.url)

    def abort(self) -> None:
        super().abort()
        with self._lock:
            current = self._current
        if current is not None:
            current.abort()

    def _send(self, body: bytes) -> int:
        if self._post is not None:
            return self._post(self.url, body, self.policy.notify_timeout_s)
        post = Post(self.url, body, self.policy.notify_timeout_s)
        with self._lock:
            self._current = post
        try:
            return post.send()
        finally:
            with self._lock:
                self._current = None

    def deliver(self, body: bytes, what: Mapping[str, Any]) -> bool:
        p = self.policy
        for attempt in range(p.notify_attempts):
            if self.stop.is_set():
                return False
            try:
                status = self._send(body)
                if 200 <= status < 300:
                    log.info("notified", url=self.label, status=status, attempt=attempt, **what)
                    return True
                error = f"HTTP {status}"
                if 400 <= status < 500 and status not in (408, 429):
                    log.error("notify_failed", url=self.label, error=error, final=True, **what)
                    return False  # the receiver refuses this request: trying again cannot help
            except (OSError, ValueError) as exc:
                error = clean(str(exc), 200)
            last = attempt == p.notify_attempts - 1
            log.warning("notify_failed", url=self.label, error=error, attempt=attempt, final=last, **what)
            if not last and self.stop.wait(p.notify_backoff_s * (2**attempt)):
                return False
        return False

    def handle(self, n: Notice) -> None:
        self.deliver(n.body(), {"alert": n.key[0], "job": n.job_id, "alert_status": n.status})


class _Alertmanager(_Webhook):
    """Alertmanager's v2 API: firing alerts re-sent every ``am_resend_s`` (each ending ``am_hold_s`` later
    unless re-sent), a resolved one sent with ``endsAt`` now and then forgotten."""

    name = "alertmanager"

    def __init__(self, url: str, policy: AlertPolicy, post: Poster | None) -> None:
        self.firing: dict[tuple[str, ...], Notice] = {}
        self._next_resend = time.monotonic() + policy.am_resend_s
        super().__init__(url, policy, post)

    def _post_alerts(self, notices: Sequence[Notice]) -> bool:
        now = time.time()
        body = json.dumps([alertmanager_alert(n, now, self.policy.am_hold_s) for n in notices]).encode()
        first = notices[0]
        return self.deliver(body, {"alert": first.key[0], "job": first.job_id, "alert_status": first.status,
                                   "alerts": len(notices)})

    def handle(self, n: Notice) -> None:
        if n.status == FIRING:
            self.firing[n.key] = n
            if len(self.firing) > self.policy.max_queued:  # bounded: the oldest firing alert expires by itself
                self.firing.pop(next(iter(self.firing)))
        else:
            self.firing.pop(n.key, None)
        self._post_alerts([n])

    def idle_timeout(self) -> float | None:
        return max(0.0, self._next_resend - time.monotonic())

    def idle(self) -> None:
        self._next_resend = time.monotonic() + self.policy.am_resend_s
        if self.firing:
            self._post_alerts(list(self.firing.values()))


class _Command(_Target):
    """``--on-incident``: once per incident whose bundle exists, under the reaper, one at a time."""

    name = "command"

    def __init__(self, argv: Sequence[str], policy: AlertPolicy) -> None:
        self.argv = list(argv)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        super().__init__(policy)

    def abort(self) -> None:
        super().abort()
        with self._lock:
            proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.terminate()  # the reaper kills and reaps everything the command started

    def handle(self, n: Notice) -> None:
        incident = n.verdict.get("incident_id")
        argv = [*self.argv, n.bundle or ""]
        timeout_s = self.policy.command_timeout_s
        env = {**os.environ, **command_env(n), reaper.PARENT_ENV: str(os.getpid())}
        wrapped = [sys.executable, "-m", "rankwatch.watchdog.serve.reaper", f"{timeout_s:g}", "--", *argv]
        # stderr to a file, not a pipe: a pipe would keep this thread waiting on whoever holds it open
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(wrapped, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=err, start_new_session=True)
            except OSError as exc:
                log.error("on_incident_failed", command=argv[0], error=str(exc))
                return
            with self._lock:
                self._proc = proc
            try:
                code = proc.wait(timeout=timeout_s + reaper.SWEEP_S + 5)
            except subprocess.TimeoutExpired:  # the reaper itself is stuck: its group at least goes
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            finally:
                with self._lock:
                    self._proc = None
            err.seek(0)
            tail = err.read()[-400:].decode(errors="replace")
        if code == 124:
            log.error("on_incident_timeout", command=argv[0], incident=incident, stderr=clean(tail))
            return
        level = log.info if code == 0 else log.error
        level("on_incident_ran", command=argv[0], incident=incident, exit_code=code, stderr=clean(tail))


class Alerter:
    """Per-target sender threads; ``submit``, ``resolve`` and ``straggler`` never block."""

    def __init__(
        self,
        urls: Sequence[str],
        command: Sequence[str] | None,
        policy: AlertPolicy | None = None,
        *,
        post: Poster | None = None,
        stragglers: bool = False,
    ) -> None:
        self.urls = list(urls)
        self.command = list(command) if command else None
        self.policy = policy or AlertPolicy()
        self.stragglers = stragglers
        self._hooks: list[_Webhook] = [
            (_Alertmanager if is_alertmanager(u) else _Webhook)(u, self.policy, post) for u in self.urls
        ]
        self._command = _Command(self.command, self.policy) if self.command else None
        self._lock = threading.Lock()
        # incidents the webhooks were told of, with when they started: only these get a resolved notice
        self._notified: collections.OrderedDict[tuple[str, ...], Notice] = collections.OrderedDict()
        self._straggling: dict[tuple[str, ...], Notice] = {}
        self._owners: dict[str, int] = {}  # job id -> its owner's uid (from the incidents submitted)
        # job id -> its page window: (end, monotonic; the newest incident held; how many were held; its timer)
        self._pages: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        for t in self._targets:
            t.start()

    @property
    def _targets(self) -> list[_Target]:
        return [*self._hooks, *([self._command] if self._command else [])]

    @property
    def enabled(self) -> bool:
        return bool(self.urls or self.command)

    def submit(self, verdict: dict[str, Any], bundle: str | None, *, notify: bool = True, command: bool = True,
               owner: int = -1) -> None:
        """Queue the alerts of one incident; the caller decides which (webhooks once per job, the command
        once the bundle exists). ``owner``: the job owner's uid, whose share of each queue it uses."""
        n = dataclasses.replace(incident_notice(verdict, bundle, time.time()), owner=owner)
        with self._lock:
            self._owners[n.job_id] = owner
            while len(self._owners) > self.policy.max_remembered:
                self._owners.pop(next(iter(self._owners)))
        if notify and self._hooks and self._page_now(n):
            self._page(n)
        if command and self._command is not None:
            self._command.put(n)

    def _page(self, n: Notice) -> None:
        with self._lock:
            self._notified[n.key] = n
            while len(self._notified) > self.policy.max_remembered:
                self._notified.popitem(last=False)
        for t in self._hooks:
            t.put(n)

    def _page_now(self, n: Notice) -> bool:
        """Whether ``n`` pages now: the first of its job's window does; the rest are held, and the newest
        goes out as the window's summary when it ends (``AlertPolicy.job_page_every_s``)."""
        every = self.policy.job_page_every_s
        if every <= 0:
            return True
        now = time.monotonic()
        with self._lock:
            w = self._pages.get(n.job_id)
            if w is None or (now >= w[0] and w[1] is None):
                self._pages[n.job_id] = [now + every, None, 0, None]
                self._pages.move_to_end(n.job_id)
                while len(self._pages) > self.policy.max_remembered:
                    _, old = self._pages.popitem(last=False)
                    if old[3] is not None:
                        old[3].cancel()
                return True
            w[1], w[2] = n, w[2] + 1
            if w[3] is None:
                timer = threading.Timer(max(0.0, w[0] - now), self._flush, (n.job_id,))
                timer.daemon = True
                timer.start()
                w[3] = timer
        log.info("alert_held", job=n.job_id, incident=n.key[-1], held=w[2],
                 why=f"this job paged less than {every:.0f} s ago: summarised at the window's end")
        return False

    def _flush(self, job_id: str) -> None:
        """The window's summary: its newest held incident, saying how many it stands for."""
        with self._lock:
            w = self._pages.get(job_id)
            if w is None or w[1] is None:
                return
            n, held = w[1], w[2]
            w[:] = [time.monotonic() + self.policy.job_page_every_s, None, 0, None]
        more = f" (+{held - 1} more of this job since its last alert)" if held > 1 else ""
        doc = {**n.doc, "summarised": held, "text": f"{n.doc.get('text', '')}{more}"}
        self._page(dataclasses.replace(n, doc=doc, annotations={**n.annotations, "summarised": str(held)}))

    def adopt(self, verdict: dict[str, Any], bundle: str | None, starts_unix: float, owner: int = -1) -> None:
        """An incident a previous daemon already alerted on (read back at start): nothing is sent now, but its
        resolved notice is owed when it ends, with the start time of the alert that fired."""
        if not self._hooks:
            return
        n = dataclasses.replace(incident_notice(verdict, bundle, starts_unix), owner=owner)
        with self._lock:
            self._owners[n.job_id] = owner
            self._notified[n.key] = n
            while len(self._notified) > self.policy.max_remembered:
                self._notified.popitem(last=False)

    def resolve(self, job_id: str, incident_id: str, why: str) -> None:
        """The incident is over (the job recovered, was killed or ended): tell the webhooks that heard of it."""
        with self._lock:
            fired = self._notified.pop(("incident", job_id, incident_id), None)
        if fired is None:
            return
        n = dataclasses.replace(incident_notice(fired.verdict, fired.bundle, fired.starts_unix, RESOLVED, why),
                                owner=fired.owner)
        for t in self._hooks:
            t.put(n)

    def resolve_job(self, job_id: str, why: str) -> None:
        """Every incident of ``job_id`` still firing is over (the job ended)."""
        with self._lock:
            ids = [k[2] for k in self._notified if k[1] == job_id]
        for incident_id in ids:
            self.resolve(job_id, incident_id, why)

    def straggler(self, job_id: str, node: str, doc: Mapping[str, Any], started: bool) -> None:
        """A live straggler started (``started``) or ended; sent only with ``stragglers`` (opt-in)."""
        if not (self.stragglers and self._hooks):
            return
        with self._lock:
            owner = self._owners.get(job_id, -1)
        fresh = dataclasses.replace(straggler_notice(job_id, node, doc, time.time()), owner=owner)
        with self._lock:
            if started:
                self._straggling[fresh.key] = fresh
                n = fresh
            else:
                first = self._straggling.pop(fresh.key, None)
                if first is None:
                    return
                n = dataclasses.replace(straggler_notice(job_id, node, doc, first.starts_unix, RESOLVED), owner=owner)
        for t in self._hooks:
            t.put(n)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued within ``min(timeout_s, policy.close_timeout_s)``, then cut what is still
        in flight (a trickling webhook, a command still running: the reaper takes its descendants)."""
        end = time.monotonic() + min(timeout_s, self.policy.close_timeout_s)
        with self._lock:
            held = [job for job, w in self._pages.items() if w[1] is not None]
            for w in self._pages.values():
                if w[3] is not None:
                    w[3].cancel()
        for job in held:  # what the windows held goes out now, summarised
            self._flush(job)
        for t in self._targets:
            t.queue.put(None)
        for t in self._targets:
            t.thread.join(timeout=max(0.0, end - time.monotonic()))
        late = [t for t in self._targets if t.thread.is_alive()]
        for t in late:
            t.abort()
        for t in late:
            t.thread.join(timeout=reaper.SWEEP_S)
            log.error("alerts_unfinished", target=t.label, queued=len(t.queue))


def _redact(url: str) -> str:
    """A webhook URL's path is often its secret (Slack, Teams): log only scheme, host and port."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}/…"
