"""One HTTP POST under a *total* deadline.

A socket timeout bounds each read, not the request: a receiver that trickles one byte every few seconds
never trips it and holds the sender for as long as it likes. Here a timer shuts the socket down when the
deadline passes, which ends whatever read or write is blocked on it, and ``abort`` does the same at once
(the alerter's shutdown). Redirects are never followed (a POST turned into a GET elsewhere); the caller
gets the status and decides.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse

from ..errors import UserError

USER_AGENT = "rankwatch-alert/1"
MAX_RESPONSE = 64 * 1024  # read (and ignore) at most this much of an answer


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


class Post:
    """One request; ``abort()`` from any thread ends it (OSError in ``send``)."""

    def __init__(self, url: str, body: bytes, deadline_s: float) -> None:
        check_url(url)  # http(s) only: never file:// or ftp://
        self.parts = urllib.parse.urlsplit(url)
        self.body = body
        self.deadline_s = deadline_s
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._aborted = False

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def send(self) -> int:
        """The answer's status code; OSError (TimeoutError past the deadline) when there is none."""
        p = self.parts
        end = time.monotonic() + self.deadline_s
        cls = http.client.HTTPSConnection if p.scheme == "https" else http.client.HTTPConnection
        conn = cls(p.hostname or "", p.port, timeout=self.deadline_s)
        timer = threading.Timer(self.deadline_s, self.abort)
        timer.daemon = True
        try:
            conn.connect()  # bounded by the socket timeout (= the whole deadline)
            with self._lock:
                self._conn = conn
                aborted = self._aborted
            if aborted:
                raise ConnectionAbortedError("alert sending stopped")
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {self.deadline_s:g}s")
            timer.interval = left
            timer.start()
            path = (p.path or "/") + (f"?{p.query}" if p.query else "")
            conn.request("POST", path, body=self.body,
                         headers={"Content-Type": "application/json", "User-Agent": USER_AGENT})
            resp = conn.getresponse()
            resp.read(MAX_RESPONSE)
            return int(resp.status)
        except (OSError, http.client.HTTPException) as exc:
            if self._aborted and time.monotonic() >= end - 0.05:
                raise TimeoutError(f"no complete answer within {self.deadline_s:g}s (total deadline)") from exc
            if self._aborted:
                raise ConnectionAbortedError("alert sending stopped") from exc
            if isinstance(exc, OSError):
                raise
            raise OSError(f"bad HTTP answer: {type(exc).__name__}") from exc
        finally:
            timer.cancel()
            conn.close()


def http_post(url: str, body: bytes, deadline_s: float) -> int:
    return Post(url, body, deadline_s).send()
