"""A job dir held by its owner's reader: the requests that read it (registered with ``privsep``, run as the
owner) and the root side's checked calls (``JobDir``).

The job dir itself is opened by the daemon with ``O_NOFOLLOW|O_DIRECTORY`` at discovery and handed over as
an fd (``open_job``), so a dir swapped for a symlink later is never followed; inside, everything goes
through ``observe.jobdir``. How readers are spawned as the owner, and their deadlines: ``privsep.readers``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rankwatch.hooks.record import RecordFormatError, RecordSnapshot

from ..core.host_signals import RankCounters
from ..privsep.frames import WireError, w_int, w_str
from ..privsep.readers import Channel, ReaderError, Readers
from ..privsep.registry import Worker, handler
from . import jobdir
from .signals import counters_from_doc
from .wire import snapshot_from_doc, snapshot_to_doc


# -- the requests (run as the owner: in a reader child, or in-process) --------------------------------
@dataclass
class _Held:
    """What one reader holds open for the daemon: job dirs and records, by handle."""

    jobs: dict[int, int] = field(default_factory=dict)  # handle -> dir fd
    recs: dict[int, jobdir.AtRecordReader] = field(default_factory=dict)
    next: int = 1

    def new_id(self) -> int:
        self.next += 1
        return self.next


def _held(w: Worker) -> _Held:
    held: _Held = w.slot("observe.jobdirs", _Held)
    return held


def _dir(w: Worker, req: dict[str, Any]) -> int:
    return _held(w).jobs[w_int(req.get("h"))]


@handler("open_job")
def _open_job(w: Worker, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    if len(fds) != 1:
        for fd in fds:
            jobdir.close_quietly(fd)
        raise ValueError("open_job needs exactly one dir fd")
    held = _held(w)
    h = held.new_id()
    held.jobs[h] = fds[0]
    return {"h": h}


@handler("close_job")
def _close_job(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    fd = _held(w).jobs.pop(w_int(req.get("h")), None)
    if fd is not None:
        jobdir.close_quietly(fd)
    return {}


@handler("list")
def _list(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    return {"names": jobdir.list_names(_dir(w, req))}


@handler("stat")
def _stat(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    st = jobdir.lstat_at(_dir(w, req), w_str(req.get("name"), 128))
    if st is None:
        return {"missing": True}
    return {"ino": st.st_ino, "dev": st.st_dev, "uid": st.st_uid, "mode": st.st_mode, "mtime": st.st_mtime}


@handler("job_json")
def _job_json(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    return {"info": jobdir.read_job_info(_dir(w, req))}


@handler("rec_open")
def _rec_open(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    held = _held(w)
    dfd, name = _dir(w, req), w_str(req.get("name"), 128)
    st = jobdir.lstat_at(dfd, name)
    ident = {"ino": st.st_ino if st else 0}
    if len(held.recs) >= w.policy.max_records:
        return {**ident, "budget": True, "error": f"over {w.policy.max_records} records open for this user"}
    try:
        rec = jobdir.AtRecordReader(dfd, name, w.policy.torn_retries)
    except RecordFormatError as exc:
        return {**ident, "reject": str(exc)[:300]}
    try:
        snap = rec.read()
    except (RecordFormatError, OSError) as exc:
        rec.close()
        return {**ident, "reject": str(exc)[:300]}
    r = held.new_id()
    held.recs[r] = rec
    assert isinstance(snap, RecordSnapshot)
    return {"r": r, "ino": rec.inode, "dev": rec.dev, "uid": rec.uid, "snap": snapshot_to_doc(snap)}


@handler("rec_read")
def _rec_read(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    rec = _held(w).recs[w_int(req.get("r"))]
    since = req.get("since", -1)
    since = since if isinstance(since, int) and not isinstance(since, bool) else -1
    try:
        snap = rec.read(since)
    except RecordFormatError as exc:
        return {"unreadable": str(exc)[:300]}
    assert isinstance(snap, RecordSnapshot)
    return {"snap": snapshot_to_doc(snap)}


@handler("rec_read_many")
def _rec_read_many(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """Every record of a job in one exchange (a poll of 256 records is one round trip, not 256: on a loaded
    host each round trip waits for the reader to be scheduled)."""
    reads = req.get("reads")
    if not isinstance(reads, list):
        raise ValueError("reads must be a list")
    recs = _held(w).recs
    out: list[dict[str, Any]] = []
    for item in reads[: w.policy.max_records]:
        if not isinstance(item, list) or len(item) != 2:
            out.append({"error": "malformed read"})
            continue
        r, since = item
        rec = recs.get(r) if isinstance(r, int) else None
        if rec is None:
            out.append({"error": "no such record"})
            continue
        try:
            snap = rec.read(since if isinstance(since, int) and not isinstance(since, bool) else -1)
        except (RecordFormatError, OSError) as exc:
            out.append({"unreadable": str(exc)[:300]})
            continue
        assert isinstance(snap, RecordSnapshot)
        out.append({"snap": snapshot_to_doc(snap)})
    return {"snaps": out}


@handler("rec_replaced_many")
def _rec_replaced_many(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    rs = req.get("rs")
    if not isinstance(rs, list):
        raise ValueError("rs must be a list")
    recs = _held(w).recs
    return {"replaced": [isinstance(r, int) and r in recs and recs[r].replaced() for r in rs[: w.policy.max_records]]}


@handler("rec_replaced")
def _rec_replaced(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    return {"replaced": _held(w).recs[w_int(req.get("r"))].replaced()}


@handler("rec_close")
def _rec_close(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    rec = _held(w).recs.pop(w_int(req.get("r")), None)
    if rec is not None:
        rec.close()
    return {}


@handler("remove_dumps")
def _remove_dumps(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    age = req.get("older_than_s", 0.0)
    return {"removed": jobdir.remove_dumps(_dir(w, req), float(age) if isinstance(age, (int, float)) else 0.0)}


@handler("remove_finished")
def _remove_finished(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    inodes = req.get("inodes")
    if not isinstance(inodes, list):
        raise ValueError("inodes must be a list")
    removed, empty = jobdir.remove_finished(_dir(w, req), [w_int(i) for i in inodes[:100_000]])
    return {"removed": removed, "empty": empty}


# -- root side ---------------------------------------------------------------------------------------
def open_job(readers: Readers, base_fd: int, name: str) -> JobDir:
    """Open job dir ``name`` under the base dir fd (never through a symlink) and hand it to its owner's
    reader. OSError when it is not a dir (or a symlink); ReaderError when no reader can take it."""
    fd = jobdir.open_dir(name, base_fd)
    try:
        st = os.fstat(fd)
        job = JobDir(readers, fd, name, st.st_uid, st.st_gid)
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(ReaderError):
        job.attach()
    return job


@dataclass
class RecordInfo:
    """A record a reader opened: its handle, identity as the kernel gave it, and its first snapshot."""

    r: int
    ino: int
    dev: int
    uid: int
    snap: RecordSnapshot


class JobDir:
    """One job dir held by its owner's reader (root side). Every method raises ReaderError when the
    reader cannot answer; the watch then treats what it asked for as unreadable."""

    def __init__(self, readers: Readers, fd: int, name: str, uid: int, gid: int) -> None:
        self.readers = readers
        self.fd = fd  # held from discovery on: the dir, whatever its name points at later
        self.name = name
        self.uid = uid  # the dir's owner, from the kernel (fstat of the fd the daemon opened)
        self.gid = gid
        self.ch: Channel | None = None
        self.h = 0
        self.gen = 0  # bumped on every (re)attach: record handles of an older reader are void

    def attach(self) -> None:
        """Hand the dir to its owner's reader (again, after a respawn)."""
        ch = self.readers.channel(self.uid, self.gid)
        out = ch.call({"op": "open_job"}, (self.fd,))
        h = out.get("h")
        if not isinstance(h, int) or isinstance(h, bool):
            raise ReaderError(f"reader refused job dir {self.name}: {out.get('error')}")
        self.ch, self.h = ch, h
        self.gen += 1

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.ch is None or not self.ch.alive:
            self.ch = None
            self.attach()
        assert self.ch is not None
        return self.ch.call({**req, "h": self.h})

    def names(self) -> list[str]:
        out = self._call({"op": "list"}).get("names")
        if not isinstance(out, list):
            raise ReaderError("malformed listing")
        return [n for n in out if isinstance(n, str) and jobdir.SAFE_NAME.match(n)][: jobdir.MAX_NAMES]

    def job_info(self) -> dict[str, object]:
        info = self._call({"op": "job_json"}).get("info")
        if not isinstance(info, dict):
            return {}
        raw = {k: info.get(k) for k in jobdir.JOB_KEYS}
        # the same typing rule as the reader's: nothing else passes
        return jobdir.job_info_from_bytes(json.dumps({k: v for k, v in raw.items() if v is not None}).encode())

    def inode(self, name: str) -> int | None:
        out = self._call({"op": "stat", "name": name})
        ino = out.get("ino")
        return ino if isinstance(ino, int) and not isinstance(ino, bool) else None

    def open_record(self, name: str) -> RecordInfo | str:
        """The record, or why it was refused (a string)."""
        out = self._call({"op": "rec_open", "name": name})
        if "r" not in out:
            return str(out.get("reject") or out.get("error") or "refused")[:300]
        try:
            info = RecordInfo(
                r=w_int(out.get("r")), ino=w_int(out.get("ino")), dev=w_int(out.get("dev")),
                uid=w_int(out.get("uid"), 0, 1 << 32), snap=snapshot_from_doc(out.get("snap"), name),
            )
        except WireError as exc:
            raise ReaderError(f"malformed record answer: {exc}") from None
        if info.uid != self.uid:
            self.close_record(info.r)
            return f"owned by uid {info.uid}, not by the job dir's owner (uid {self.uid})"
        return info

    def read_record(self, r: int, since: int, path: str) -> RecordSnapshot:
        out = self._call({"op": "rec_read", "r": r, "since": since})
        if "unreadable" in out:
            raise RecordFormatError(str(out["unreadable"])[:300])
        if "snap" not in out:
            raise ReaderError(str(out.get("error"))[:300])
        try:
            return snapshot_from_doc(out["snap"], path)
        except WireError as exc:
            raise ReaderError(f"malformed snapshot: {exc}") from None

    def read_many(self, reads: list[tuple[int, int, str]]) -> list[RecordSnapshot | Exception]:
        """``read_record`` for many records in one exchange: per record its snapshot, or the error it would
        have raised (RecordFormatError: unreadable this poll; ReaderError: malformed). ReaderError when the
        reader cannot answer at all."""
        out = self._call({"op": "rec_read_many", "reads": [[r, since] for r, since, _ in reads]}).get("snaps")
        if not isinstance(out, list) or len(out) != len(reads):
            raise ReaderError("malformed batch answer")
        got: list[RecordSnapshot | Exception] = []
        for (_, _, path), item in zip(reads, out, strict=True):
            if not isinstance(item, dict):
                got.append(ReaderError("malformed answer"))
            elif "unreadable" in item:
                got.append(RecordFormatError(str(item["unreadable"])[:300]))
            elif "snap" not in item:
                got.append(ReaderError(str(item.get("error"))[:300]))
            else:
                try:
                    got.append(snapshot_from_doc(item["snap"], path))
                except WireError as exc:
                    got.append(ReaderError(f"malformed snapshot: {exc}"))
        return got

    def replaced_many(self, rs: list[int]) -> list[bool]:
        """``replaced`` for many records at once (all False when the reader cannot answer)."""
        try:
            out = self._call({"op": "rec_replaced_many", "rs": rs}).get("replaced")
        except ReaderError:
            return [False] * len(rs)
        if not isinstance(out, list) or len(out) != len(rs):
            return [False] * len(rs)
        return [x is True for x in out]

    def replaced(self, r: int) -> bool:
        try:
            return self._call({"op": "rec_replaced", "r": r}).get("replaced") is True
        except ReaderError:
            return False

    def close_record(self, r: int) -> None:
        with contextlib.suppress(ReaderError):
            self._call({"op": "rec_close", "r": r})

    def signals(self, pids: list[int]) -> dict[int, RankCounters]:
        """Each live rank process's host counters, read by the owner's reader and checked here; a pid it
        could not read is left out. ReaderError when the reader cannot answer."""
        out = self._call({"op": "signals", "pids": pids}).get("ranks")
        if not isinstance(out, dict):
            raise ReaderError("malformed signals answer")
        got: dict[int, RankCounters] = {}
        for pid in pids:
            doc = out.get(str(pid))
            if doc is None:
                continue
            try:
                got[pid] = counters_from_doc(doc)
            except WireError as exc:
                raise ReaderError(f"malformed signals answer: {exc}") from None
        return got

    def remove_dumps(self, older_than_s: float = 0.0) -> int:
        out = self._call({"op": "remove_dumps", "older_than_s": older_than_s}).get("removed")
        return out if isinstance(out, int) and not isinstance(out, bool) else 0

    def remove_finished(self, inodes: Iterable[int]) -> tuple[int, bool]:
        out = self._call({"op": "remove_finished", "inodes": list(inodes)})
        removed, empty = out.get("removed"), out.get("empty")
        return (removed if isinstance(removed, int) and not isinstance(removed, bool) else 0), empty is True

    def close(self) -> None:
        if self.ch is not None and self.ch.alive:
            with contextlib.suppress(ReaderError):
                self.ch.call({"op": "close_job", "h": self.h})
        jobdir.close_quietly(self.fd)
