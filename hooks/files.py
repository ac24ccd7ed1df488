"""The one way rankwatch writes a file: owner-only, and whole or absent.

Shared by the hook (job.json) and the watchdog (bundles, summaries, HTML reports),
so every writer fsyncs, refuses symlinks and cleans up after a failure in the same way. Standard library
only: this module runs inside training processes.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid

OWNER_ONLY = 0o600


def write_new(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Create ``path`` (never an existing file or a symlink) and write ``data``; a failed write removes it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, OWNER_ONLY)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def atomic_write(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` atomically: readers see the old file or all of the new one, never a part; a failure
    (ENOSPC, EIO) leaves no temp file behind."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    write_new(tmp, data, fsync=fsync)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_in(directory: str, name: str, data: bytes, *, uid: int | None = None) -> None:
    """Replace ``directory/name`` atomically through a descriptor of ``directory`` opened without following
    a symlink: a directory someone else controls (a job dir in the shared shm dir) cannot be swapped for a
    link between the check and the write, and neither the temp file nor the rename follows one. ``uid``:
    hand the file to that user (a root watchdog writing state its job's owner reads), still mode 0600."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, OWNER_ONLY, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                if uid is not None and uid != os.geteuid():
                    # without CAP_CHOWN the file stays the writer's: still whole, only the owner differs
                    with contextlib.suppress(OSError):
                        os.fchown(f.fileno(), uid, -1)
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def read_in(directory: str, name: str, limit: int) -> bytes:
    """Up to ``limit`` + 1 bytes of ``directory/name`` (more than ``limit``: the caller rejects it),
    refusing symlinks at both levels and anything but a regular file (a FIFO planted there would block
    the reader forever)."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{name} is not a regular file")
        return f.read(limit + 1)
