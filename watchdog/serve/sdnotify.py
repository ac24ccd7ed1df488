"""systemd's notify protocol: one datagram to $NOTIFY_SOCKET (no libsystemd dependency)."""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    """READY=1 once, WATCHDOG=1 at half of $WATCHDOG_USEC; a no-op outside systemd."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._last_ping = 0.0

    def send(self, message: str) -> bool:
        """Never waits: a receiver that stopped reading fills its queue (10 datagrams by default), and a
        blocking send then froze the poll loop — and the SIGTERM handler's STOPPING=1 with it, a daemon deaf
        to its stop. A notification that does not fit is dropped (the next ping says the same)."""
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
                sock.connect(self.address)
                sock.sendall(message.encode())
            return True
        except OSError:
            return False

    def ready(self, status: str = "watching") -> bool:
        return self.send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def ping(self) -> None:
        """Called every poll; sends WATCHDOG=1 only as often as systemd asked for."""
        if self.watchdog_interval_s is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")
