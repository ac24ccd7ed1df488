"""torchrun's stderr copy: what a writer already wrote reaches the user's stderr before rankwatch's last line.

On a busy node the copy thread lags the writers; rankwatch prints its own last line right after close(),
so close() must not return while bytes already written are still on their way."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import termios
import threading

from rankwatch.watchdog.cli.tee import StderrTee

BYTES = 512 * 1024
F_SETPIPE_SZ = 1031  # linux/fcntl.h


def _queued(fd: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0])


def test_close_copies_what_was_already_written_even_past_its_timeout():
    out_r, out_w = os.pipe()
    tee = StderrTee(out_fd=out_w)
    fcntl.fcntl(tee.child_fd, F_SETPIPE_SZ, 1 << 20)  # the writer's bytes all fit: its write completes at once
    writer_fd = os.dup(tee.child_fd)  # a writer that lingers (an orphaned child): the stream never ends
    tee.started()
    os.write(writer_fd, b"x" * BYTES)  # written before close(); our stderr (64 KB) is full, the copy waits

    received = 0
    lock = threading.Lock()
    stop = threading.Event()

    def read() -> None:  # the user's slow terminal, draining only once close() was asked
        nonlocal received
        while not stop.is_set():
            if select.select([out_r], [], [], 0.05)[0]:
                with lock:
                    received += len(os.read(out_r, 65536))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    tee.close(timeout_s=0.0)
    with lock:
        copied = received + _queued(out_r)
    stop.set()
    reader.join(10)
    for fd in (writer_fd, out_r, out_w):
        os.close(fd)
    assert copied == BYTES, f"close() returned with {BYTES - copied} bytes of torchrun's output not yet copied"
