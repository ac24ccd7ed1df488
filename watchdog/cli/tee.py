"""torchrun's stderr, passed through to ours while watching for what rankwatch has to answer.

torchrun prints its "Root Cause (first observed failure)" only when workers failed and it was not stopped
by a signal; rankwatch explains that block next to its own verdict only when torchrun really printed one,
so it must see torchrun's stderr. The ranks inherit the same stream: on a terminal it stays a terminal (a
pseudo-terminal whose output is copied through unchanged, so progress bars and colours behave as
before), elsewhere a pipe, as it was. The copy is byte for byte; only a bounded tail is kept to search.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import sys
import termios
import threading
import time

ROOT_CAUSE = b"Root Cause (first observed failure)"
TAIL_BYTES = 64 * 1024  # torchrun's failure report is a few KB; the marker is searched across reads
DRAIN_CAP_S = 30.0  # bytes already written are copied before rankwatch's last words, however busy the node


class StderrTee:
    def __init__(self, out_fd: int | None = None) -> None:
        self._out = sys.stderr.fileno() if out_fd is None else out_fd
        self.root_cause_seen = False
        self._tail = b""
        self._copying = False  # between a read that returned bytes and their write: not yet on our stderr
        if os.isatty(self._out):
            import pty

            master, slave = pty.openpty()
            attrs = termios.tcgetattr(slave)
            attrs[1] &= ~termios.OPOST  # no "\n" -> "\r\n": the bytes reach the real terminal as written
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
            with contextlib.suppress(OSError):  # the ranks see the real terminal's size
                size = fcntl.ioctl(self._out, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
                fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
            self._read_fd, self.child_fd = master, slave
        else:
            self._read_fd, self.child_fd = os.pipe()
        self._thread = threading.Thread(target=self._copy, name="rankwatch-stderr-tee", daemon=True)
        self._thread.start()

    def started(self) -> None:
        """The child has its copy: ours goes, so the end of the stream is the end of every writer."""
        os.close(self.child_fd)

    def _copy(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 65536)
            except OSError:  # EIO: the pty's last writer is gone
                break
            if not data:
                break
            self._copying = True
            with contextlib.suppress(OSError):
                os.write(self._out, data)
            self._tail = (self._tail + data)[-TAIL_BYTES:]
            if ROOT_CAUSE in self._tail:
                self.root_cause_seen = True
            self._copying = False

    def _unread(self) -> int:
        """Bytes written into the stream that the copy has not taken yet."""
        try:
            return int(struct.unpack("i", fcntl.ioctl(self._read_fd, termios.FIONREAD, b"\0" * 4))[0])
        except OSError:
            return 0

    def close(self, timeout_s: float) -> None:
        """Wait until every writer is gone (a rank's orphaned child may hold the stream: not forever).

        On a busy node the copy can lag the writers: what was already written (torchrun's dying words)
        is copied before the caller prints its own, even past the timeout; a writer that lingers and
        writes later is later."""
        self._thread.join(timeout_s)
        deadline = time.monotonic() + DRAIN_CAP_S
        while self._thread.is_alive() and (self._copying or self._unread()) and time.monotonic() < deadline:
            self._thread.join(0.05)
        if not self._thread.is_alive():
            with contextlib.suppress(OSError):
                os.close(self._read_fd)
