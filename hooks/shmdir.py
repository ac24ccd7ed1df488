"""The shm dir, shared by every user of a node the way /tmp is, and each job's private dir inside it.

* The base dir (default ``/dev/shm/rankwatch``) is created ``01777``: world-writable and sticky, so every
  user's ranks can create their job dirs and nobody can remove or rename another user's. The mode is set
  with ``chmod`` after ``mkdir`` (the umask would clear the bits otherwise). An existing base dir is used
  when it is sticky and world-writable, or owned by this user; anything else (say a 0755 dir another user
  created first) is refused with a message saying how to fix it — the hook then warns once and disables
  itself, training goes on.
* A job dir is ``0700`` and must be this user's own: in a world-writable dir anyone can create
  ``<base>/<job-id>`` first (to read the records, stacks and dumps written into it, or plant files there).
  Before anything is written, the job dir is checked with ``lstat`` — a real directory, not a symlink,
  owned by ``geteuid()``, mode ``0700`` — and refused otherwise. A dir of ours with a looser mode that no
  one else could write into (no group/other write bit) is tightened to 0700; one that others could write
  into is refused, since they may have planted files in it already.

What this does not stop: the owner of the base dir (root once the daemon or an administrator created it;
otherwise the first user) can remove or rename entries in it, as root can in /tmp. Records stay 0600 in a
0700 dir, so even then nobody else can read them.

Standard library only: this module runs inside training processes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time

SHARED_MODE = 0o1777
PRIVATE_MODE = 0o700


class ShmDirError(OSError):
    """The shm dir or a job dir cannot be used safely; the message says why and what to do."""


def _shared_ok(st: os.stat_result) -> bool:
    mode = stat.S_IMODE(st.st_mode)
    return bool(mode & stat.S_ISVTX) and mode & 0o003 == 0o003


def ensure_base_dir(path: str) -> None:
    """Create the shared base dir ``01777`` if it is missing; raise ShmDirError if it is unusable."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_MODE)
    except FileExistsError:
        pass
    else:
        # created by us: open it to everyone like /tmp (explicit chmod: the umask cleared the bits)
        os.chmod(path, SHARED_MODE)
    st = os.lstat(path)
    if not stat.S_ISLNK(st.st_mode) and st.st_uid != os.geteuid() and not _shared_ok(st):
        # another user's rank may be between its mkdir and its chmod right now
        time.sleep(0.2)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ShmDirError(f"shm dir {path} is a symlink; refusing it (point RANKWATCH_SHM_DIR at the real dir)")
    if not stat.S_ISDIR(st.st_mode):
        raise ShmDirError(f"shm dir {path} is not a directory")
    if st.st_uid != os.geteuid() and not _shared_ok(st):
        raise ShmDirError(
            f"shm dir {path} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, so other "
            f"users cannot create their job dirs in it; its owner (or root) should run: chmod 1777 {path}"
        )


def ensure_job_dir(base: str, job: str) -> str:
    """This user's private ``<base>/<job>`` (created 0700, or an existing one of ours); returns its path.

    Raises ShmDirError for a job dir that is a symlink, not a directory, someone else's, or writable by
    others: the records must never be written where another user could read or replace them."""
    ensure_base_dir(base)
    path = os.path.join(base, job)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_MODE)
    check_private_dir(path)
    return path


def check_private_dir(path: str) -> None:
    """``path`` is a real directory owned by this user with mode 0700 (tightened if only we could write)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ShmDirError(f"{path} is a symlink or not a directory; refusing to write records into it") from exc
        raise ShmDirError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ShmDirError(
                f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): someone else "
                "created this job dir first; refusing to write records into it (use another job id)"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode != PRIVATE_MODE:
            if mode & 0o022:
                raise ShmDirError(
                    f"{path} has mode {mode:04o}: others could have written into it; refusing it "
                    "(remove it, or use another job id)"
                )
            os.fchmod(fd, PRIVATE_MODE)
    except OSError as exc:
        if isinstance(exc, ShmDirError):
            raise
        raise ShmDirError(f"cannot check {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
