"""The one way rankwatch writes a file: owner-only, and whole or absent.

Shared by the hook (job.json) and the watchdog (bundles, summaries, HTML reports),
so every writer fsyncs, refuses symlinks and cleans up after a failure in the same way. Standard library
only: this module runs inside training processes.
"""

from __future__ import annotations

import contextlib
import os
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
