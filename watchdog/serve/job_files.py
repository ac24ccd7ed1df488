"""What ``rankwatch run`` leaves in the shm dir: nothing, once its job is over.

Each rank's record (~92 KB), the job's ``job.json``, the state file, the responders' sockets/FIFOs,
faulthandler files and dump dirs live in RAM-backed ``/dev/shm``; a node running many jobs would fill it.
``rankwatch run`` owns its job dir (same user, one job id), so at exit it removes every entry named as
rankwatch names them — except the records of ranks still alive (a rank torchrun failed to stop keeps its
record, so it stays watchable). Anything else in the dir (a user's file, a symlink) is left, and the dir
goes only when empty.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat

from rankwatch.hooks.record import RecordFormatError, read_record

from ..observe.process import maps_file

_RECORD = re.compile(r"^rank-(\d{1,7})\.hb$")
_RANK_FILE = re.compile(r"^rank-(\d{1,7})\.(?:ctl|sock|faulthandler)$")
_JOB_FILES = ("job.json", "watchdog.json")
_DUMPS = "dumps"


def live_record_pid(path: str) -> int | None:
    """The pid of a live process that maps this record (the rank writing it), else None."""
    try:
        pid = read_record(path).pid
    except (RecordFormatError, OSError):
        return None
    return pid if pid > 0 and maps_file(pid, path) is not False else None  # cannot tell: kept


def remove_job_files(job_dir: str) -> tuple[int, dict[int, int]]:
    """Remove the job's rankwatch files; returns (entries removed, {rank: pid} of live ranks kept)."""
    try:
        names = os.listdir(job_dir)
    except OSError:
        return 0, {}
    live: dict[int, int] = {}
    for name in names:
        m = _RECORD.match(name)
        if m:
            pid = live_record_pid(os.path.join(job_dir, name))
            if pid is not None:
                live[int(m.group(1))] = pid
    removed = 0
    for name in names:
        path = os.path.join(job_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        m = _RECORD.match(name) or _RANK_FILE.match(name)
        if m and int(m.group(1)) in live:
            continue
        if name == _DUMPS and stat.S_ISDIR(st.st_mode):
            if not live:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
            continue
        ours = (m is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode) or stat.S_ISFIFO(st.st_mode)))
        if ours or (name in _JOB_FILES and not live and stat.S_ISREG(st.st_mode)):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
    with contextlib.suppress(OSError):
        os.rmdir(job_dir)
    return removed, live
