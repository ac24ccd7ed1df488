"""A job dir read and cleaned only through the directory fd opened at discovery.

Everything under a job dir is the job owner's to plant: symlinks, FIFOs, ptys, a dir swapped for a
symlink after discovery. So the dir is opened once (``O_NOFOLLOW|O_DIRECTORY``), and every file in it is
opened relative to that fd with ``O_NOFOLLOW|O_NOCTTY|O_NONBLOCK`` (never a symlink, never a controlling
tty, never a blocking open), checked to be a regular file and read to a size cap; clean-up unlinks
through dir fds (``unlinkat``), so a symlinked ``dumps`` dir is never followed. These functions run in
the job owner's reader (``observe.reader``): whatever they open, the owner could open too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
from collections.abc import Iterable

from rankwatch.hooks.record import RecordFormatError, RecordReader, decode

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC

RANK_FILE = re.compile(r"^rank-(\d{1,7})\.hb$")
CTL_FILE = re.compile(r"^rank-\d{1,7}\.(?:ctl|sock)$")  # the responder's FIFO or socket
FAULT_FILE = re.compile(r"^rank-\d{1,7}\.faulthandler$")
DUMP_FILE = re.compile(r"^\.?rank-\d{1,7}\.(?:stacks\.json|fr\.json|fr\.err|done)(?:\.tmp-[0-9a-f]{8})?$")
# names a job dir may hold that the watchdog cares about; anything else is not even reported
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

MAX_JOB_JSON = 64 << 10
MAX_NAMES = 4096  # entries reported per listing: a dir of a million files costs one bounded answer
# job.json keys the watchdog reads, with their types; anything else in the file is ignored
JOB_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "job_id": str,
    "world_size": int,
    "node_rank": int,
    "local_world_size": int,
    "hostname": str,
    "master_addr": str,
    "master_port": (str, int),
}


def open_dir(name: str, dir_fd: int | None = None) -> int:
    """A job dir (or one below it) opened never through a symlink; OSError otherwise (ELOOP, ENOTDIR)."""
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def read_regular(dir_fd: int, name: str, cap: int) -> bytes:
    """The bytes of regular file ``name`` in ``dir_fd``, at most ``cap``; ValueError for anything else
    (a symlink, FIFO, device, socket, or a file over the cap)."""
    try:
        fd = os.open(name, OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{name} is a symlink, not read") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{name} is not a regular file, not read")
        if st.st_size > cap:
            raise ValueError(f"{name} is {st.st_size} bytes, over {cap}")
        data = b""
        while len(data) <= cap:
            chunk = os.read(fd, cap + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > cap:
            raise ValueError(f"{name} grew over {cap} bytes")
        return data
    finally:
        os.close(fd)


def job_info_from_bytes(raw: bytes) -> dict[str, object]:
    """The known, well-typed keys of a job.json; {} for a malformed or hostile document."""
    if len(raw) > MAX_JOB_JSON:
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, object] = {}
    for key, kind in JOB_KEYS.items():
        value = doc.get(key)
        if isinstance(value, kind) and not isinstance(value, bool):
            if isinstance(value, str):
                value = value[:256]
            elif isinstance(value, int) and not 0 <= value < 1 << 31:
                continue
            out[key] = value
    return out


def read_job_info(dir_fd: int) -> dict[str, object]:
    try:
        return job_info_from_bytes(read_regular(dir_fd, "job.json", MAX_JOB_JSON))
    except (OSError, ValueError):
        return {}


def list_names(dir_fd: int) -> list[str]:
    """The entries of the dir the fd holds (not of whatever its path names now), safe names only."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return []
    return [n for n in names if SAFE_NAME.match(n)][:MAX_NAMES]


class AtRecordReader(RecordReader):
    """A rank record opened relative to the job dir fd: never a symlink, a FIFO or a tty; replaced() asks
    the same dir, not the path, so a swapped dir is never followed."""

    def __init__(self, dir_fd: int, name: str, retries: int) -> None:
        super().__init__(name, retries, dir_fd=dir_fd)
        self._dir_fd = dir_fd

    def replaced(self) -> bool:
        try:
            return os.stat(self.path, dir_fd=self._dir_fd, follow_symlinks=False).st_ino != self.inode
        except OSError:
            return False

    def read(self, since_step: int = -1) -> object:  # type: ignore[override]
        """One bounded attempt budget per poll, without the base class's sleeps: a record held odd (torn)
        costs this poll a few microseconds, not tens of milliseconds."""
        for _ in range(self._retries):
            before = self._seq()
            if before & 1:
                os.sched_yield()
                continue
            buf = self._copy(since_step)
            if self._seq() == before:
                return decode(bytes(buf), self.path, since_step)
        raise RecordFormatError(f"{self.path}: record kept changing during {self._retries} reads (torn)")


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _unlink_at(dir_fd: int, name: str, *, is_dir: bool = False) -> bool:
    try:
        os.rmdir(name, dir_fd=dir_fd) if is_dir else os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def remove_dumps(job_fd: int, older_than_s: float = 0.0) -> int:
    """Dump answers the hook wrote under ``dumps/<token>/`` (by name, regular files only), then the empty
    dirs; each level opened with O_NOFOLLOW, each file unlinked relative to its dir fd."""
    removed = 0
    now = time.time()
    try:
        dumps = open_dir("dumps", job_fd)
    except OSError:
        return 0
    try:
        for token in list_names(dumps):
            st = lstat_at(dumps, token)
            if st is None or not stat.S_ISDIR(st.st_mode) or now - st.st_mtime < older_than_s:
                continue
            try:
                tdir = open_dir(token, dumps)
            except OSError:
                continue
            try:
                for name in list_names(tdir):
                    fst = lstat_at(tdir, name)
                    if fst is not None and DUMP_FILE.match(name) and stat.S_ISREG(fst.st_mode):
                        removed += _unlink_at(tdir, name)
            finally:
                os.close(tdir)
            _unlink_at(dumps, token, is_dir=True)
    finally:
        os.close(dumps)
    _unlink_at(job_fd, "dumps", is_dir=True)
    return removed


def remove_finished(job_fd: int, finished_inodes: Iterable[int]) -> tuple[int, bool]:
    """Records whose inode the watch saw finish; then, once no other record is left, the responder sockets,
    job.json, faulthandler files and dumps. Returns (entries removed, whether the dir is now empty of
    records). Everything through the dir fd: nothing outside the job's own dir is ever touched."""
    done = set(finished_inodes)
    removed = 0
    names = list_names(job_fd)
    others = False
    for name in names:
        if not RANK_FILE.match(name):
            continue
        st = lstat_at(job_fd, name)
        if st is None:
            continue
        if st.st_ino in done and stat.S_ISREG(st.st_mode):
            removed += _unlink_at(job_fd, name)
        else:
            others = True
    if others:
        return removed, False
    for name in names:
        st = lstat_at(job_fd, name)
        if st is None:
            continue
        fifo = CTL_FILE.match(name) and (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode))
        plain = (name in ("job.json", "watchdog.json") or FAULT_FILE.match(name)) and stat.S_ISREG(st.st_mode)
        if fifo or plain:
            removed += _unlink_at(job_fd, name)
        elif name == "dumps" and stat.S_ISDIR(st.st_mode):
            removed += remove_dumps(job_fd)
    return removed, True


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
