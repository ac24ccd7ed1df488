"""Evidence of a job that runs without the hook: py-spy stacks of every rank (and of its DataLoader workers),
CPU use over the capture, and the flight-recorder dumps the job itself wrote or its torch debug server
serves (``debug_server``) — all in parallel, each under
a timeout. There is no dump responder to ask, so py-spy (``capture.pyspy_dump``) is the only stack source.

py-spy pauses the process it reads (blocking mode) for a consistent stack; a stopped rank is read without
pausing (``--nonblocking``), since detaching could resume a process someone stopped on purpose. Nothing is
signalled.

A job is looked at more than once (``look_at``): its ranks' CPU times and stacks (and live flight
recorders) at two moments tell a running job from a stalled one (``core.inspect_facts.judge_progress``);
only a stalled one has its DataLoader workers and dump files read.

Run as root, nothing of a job is read or parsed with root's authority: py-spy runs, the debug server is
asked and the dump files are read — and everything they return parsed — by a one-shot reader running as
the job's owner (``privsep``, the daemon's); root only checks the typed answers. Run as a user,
the same code runs in-process (that user's authority is all it has).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..core.fr_trace import FlightRecorderFormatError, parse_dump
from ..core.inspect_facts import RankLook, fr_counter, python_frames
from ..core.policy import CapturePolicy
from ..core.stack_phase import phase_from_frames
from ..core.stacks import signature
from ..core.text import FIELD, clean
from ..observe.discover import Job, Proc, RankProc, read_proc
from ..privsep.frames import w_int, w_str
from ..privsep.readers import ReaderError, default_readers
from ..privsep.registry import Worker, handler
from .capture import FR_WIRE_BYTES, RankCapture, pyspy_dump
from .debug_server import DebugServerPolicy, fr_from_debug_server
from .fr_dump import fr_wire_doc

MAX_WORKERS_PER_RANK = 4
"""DataLoader workers read per rank: one stuck worker shows the cause, eight identical ones add nothing."""
MAX_FR_FILE_BYTES = 64 << 20
DEFAULT_FR_PREFIX = "/tmp/nccl_trace_rank_"  # torch's default TORCH_FR_DUMP_TEMP_FILE


@dataclass
class JobCapture:
    ranks: dict[int, RankCapture]
    workers: dict[int, list[RankCapture]]  # rank -> its workers' captures
    cpu_pct: dict[int, float]
    seconds: float
    notes: list[str] = field(default_factory=list)


def owner_of(uid: int) -> tuple[int, int]:
    """(uid, gid) to read a job as: its owner's (the reader looks the gid up from the user database)."""
    return uid, uid


def _one(pid: int, label: int, stopped: bool, timeout_s: float, native: bool, owner: tuple[int, int]) -> RankCapture:
    cap = RankCapture(rank=label, pid=pid)
    threads, err = pyspy_dump(pid, timeout_s, nonblocking=stopped, include_locals=False, native=native and not stopped,
                              owner=owner)
    if threads is None and not stopped:
        # a process that cannot be paused can still be read without pausing it
        threads, err2 = pyspy_dump(pid, timeout_s, nonblocking=True, include_locals=False, owner=owner)
        if threads is None:
            err = f"{err}; nonblocking: {err2}"
    cap.pyspy_threads = threads if isinstance(threads, list) else None
    cap.pyspy_error = err if cap.pyspy_threads is None else None
    return cap


def _parallel(
    todo: Sequence[tuple[int, int]], timeout_s: float, native: bool, owner: tuple[int, int]
) -> list[RankCapture]:
    """(label rank, pid) → captures, all at once; one failing capture never costs the others."""
    if not todo:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(todo)), thread_name_prefix="rankwatch-inspect") as pool:
        futs = []
        for rank, pid in todo:
            current = read_proc(pid)
            stopped = current is not None and current.state == "T"
            futs.append((rank, pid, pool.submit(_one, pid, rank, stopped, timeout_s, native, owner)))
        out = []
        for rank, pid, fut in futs:
            try:
                out.append(fut.result())
            except Exception as exc:
                out.append(RankCapture(rank=rank, pid=pid, pyspy_error=f"capture failed: {exc!r}"))
        return out


@dataclass
class Look:
    """Every live rank of a job (or ``only`` some) at one moment: its /proc entry and its stacks."""

    at: float  # monotonic seconds when the CPU times were read (just before the stacks)
    procs: dict[int, Proc | None]  # rank -> its /proc entry now (None: gone)
    ranks: dict[int, RankCapture]
    seconds: float  # how long the stacks took


def _live(job: Job, only: Collection[int] | None = None) -> list[RankProc]:
    return [r for r in job.ranks if r.proc.state not in ("Z", "X") and (only is None or r.rank in only)]


def look_at(job: Job, *, timeout_s: float, native: bool = False, only: Collection[int] | None = None) -> Look:
    """CPU times, then stacks of every live rank (of ``only``) at once."""
    default_readers()  # as root: the zygote forks its readers from this thread, before any pool starts
    live = _live(job, only)
    at = time.monotonic()
    procs = {r.rank: read_proc(r.pid) for r in live}
    ranks = {c.rank: c for c in _parallel([(r.rank, r.pid) for r in live], timeout_s, native,
                                           owner_of(job.owner_uid))}
    return Look(at, procs, ranks, time.monotonic() - at)


def rank_looks(job: Job, look: Look, *, signature_frames: int = CapturePolicy.signature_frames) -> dict[int, RankLook]:
    """The look as the progress judgement reads it: alive (the process discovery found), CPU ticks, the
    main thread's stack signature, a live flight recorder's counters (where the look holds one)."""
    out = {}
    for r in _live(job, look.procs):
        now = look.procs.get(r.rank)
        alive = now is not None and now.start_ticks == r.proc.start_ticks and now.state not in ("Z", "X")
        cap = look.ranks.get(r.rank)
        frames = python_frames(cap.main_frames()) if cap is not None else ()
        out[r.rank] = RankLook(
            rank=r.rank, at=look.at, alive=alive, state=now.state if now is not None and alive else "",
            cpu_ticks=now.utime_ticks if now is not None and alive else None,
            signature=signature(frames, signature_frames) if frames else None,
            fr_counter=fr_counter(cap.fr_trace) if cap is not None else None,
            wakeups=now.wakeups if now is not None and alive and now.wakeups >= 0 else None,
        )
    return out


def cpu_pct(first: Mapping[int, RankLook], last: Mapping[int, RankLook]) -> dict[int, float]:
    """Each rank's CPU use between its first and its last look (100 = one core)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for rank, b in last.items():
        a = first.get(rank)
        if a is not None and a.cpu_ticks is not None and b.cpu_ticks is not None and b.at > a.at:
            out[rank] = 100.0 * (b.cpu_ticks - a.cpu_ticks) / ticks / (b.at - a.at)
    return out


def capture_workers(job: Job, ranks: Mapping[int, RankCapture], timeout_s: float) -> dict[int, list[RankCapture]]:
    """Stacks of the DataLoader workers of the ranks that wait for a batch: only there does a worker's
    stack say more than its rank's."""
    feeding = [r for r in _live(job) if r.workers and r.rank in ranks
               and phase_from_frames(ranks[r.rank].main_frames()).phase == "dataloader"]
    workers: dict[int, list[RankCapture]] = {}
    for cap in _parallel([(r.rank, w) for r in feeding for w in r.workers[:MAX_WORKERS_PER_RANK]], timeout_s, False,
                         owner_of(job.owner_uid)):
        workers.setdefault(cap.rank, []).append(cap)
    return workers


def capture_job(job: Job, *, timeout_s: float, native: bool = False) -> JobCapture:
    """One look at every live rank (CPU use over the capture) and the workers of the ranks that wait for a
    batch."""
    look = look_at(job, timeout_s=timeout_s, native=native)
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    cpu: dict[int, float] = {}
    for r in _live(job):
        now, before = read_proc(r.pid), look.procs.get(r.rank)
        if now is not None and before is not None and now.start_ticks == r.proc.start_ticks and look.seconds > 0:
            cpu[r.rank] = 100.0 * (now.utime_ticks - before.utime_ticks) / ticks / look.seconds
    return JobCapture(look.ranks, capture_workers(job, look.ranks, timeout_s), cpu, look.seconds)


def fr_enabled(env: Mapping[str, str]) -> bool:
    """The job keeps a flight recorder (a positive trace buffer size)."""
    return any(
        env.get(k, "").isdigit() and int(env[k]) > 0 for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    )


def fr_dump_path(env: Mapping[str, str], rank: int) -> str:
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or DEFAULT_FR_PREFIX
    return f"{prefix}{rank}"


def read_owned_file(path: str, owner_uid: int, max_bytes: int) -> bytes | str:
    """The file's bytes, or why not: never through a symlink, only a regular file the job's owner owns,
    bounded. (A dump path comes from the job's environment: it may point anywhere.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "no dump written (the recorder dumps on a collective timeout, which has not come)"
    except OSError as exc:
        return f"cannot open: {exc.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_uid != owner_uid:
            return f"owned by uid {st.st_uid}, not by the job's owner (uid {owner_uid})"
        if st.st_size > max_bytes:
            return f"{st.st_size} bytes, over the {max_bytes}-byte limit"
        chunks, size = [], 0
        while size <= max_bytes and (chunk := os.read(fd, 1 << 20)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)[: max_bytes + 1]
    finally:
        os.close(fd)


def attach_debug_server_dumps(
    job: Job, captures: dict[int, RankCapture], sources: dict[int, dict[str, str]],
    only: Collection[int] | None = None,
) -> list[str]:
    """Put each live rank's flight-recorder dump from its torch debug server (where it runs one) into its
    capture, all ranks at once; ``sources`` gets where each came from. Returns notes on servers that did not
    answer; a rank without a debug server adds nothing."""
    live = _live(job, only)
    if not live:
        return []
    owner = owner_of(job.owner_uid)
    with ThreadPoolExecutor(max_workers=min(32, len(live)), thread_name_prefix="rankwatch-dbgsrv") as pool:
        got = [(r, pool.submit(_ask_fr, owner, {"op": "fr_debug_server", "pid": r.pid}, r.rank)) for r in live]
        notes = []
        for r, fut in got:
            try:
                answer = fut.result()
            except Exception as exc:  # one rank's probe never costs the others
                notes.append(f"rank {r.rank}: debug server: probe failed: {type(exc).__name__}"[:300])
                continue
            if answer is None:
                continue
            trace, why, source = answer
            if trace is None:
                notes.append(f"rank {r.rank}: debug server: {why}"[:300])
                continue
            cap = captures.setdefault(r.rank, RankCapture(rank=r.rank, pid=r.pid))
            cap.fr_trace = trace
            if why:
                cap.notes.append(f"flight recorder: {why}")
            sources[r.rank] = {"from": "debug_server", "address": source}
    return notes


def _ask_fr(owner: tuple[int, int], req: dict[str, object], rank: int) -> tuple[Any, str | None, str] | None:
    """A flight-recorder source read and parsed by the owner's reader: (trace checked here, note or why
    not, where from); None where there is no such source (no debug server: nothing contacted)."""
    timeout = DebugServerPolicy().total_timeout_s + 10.0
    try:
        out = default_readers().ask(owner[0], owner[1], dict(req), timeout_s=timeout)
    except ReaderError as exc:
        return None, clean(str(exc), FIELD), ""
    if out.get("none") is True:
        return None
    why = out.get("why") if isinstance(out.get("why"), str) else out.get("error")
    source = clean(out.get("source"), FIELD) if isinstance(out.get("source"), str) else ""
    note = clean(out.get("note"), FIELD) if isinstance(out.get("note"), str) else None
    if out.get("fr") is None:
        return None, clean(why if isinstance(why, str) else note or "no dump", FIELD), source
    try:
        return parse_dump(out["fr"], rank), note, source
    except (FlightRecorderFormatError, ValueError, TypeError, RecursionError) as exc:
        return None, f"the reader's trace rejected: {clean(str(exc), FIELD)[:200]}", source


def attach_fr_dumps(
    job: Job, captures: dict[int, RankCapture], extra_ranks: Sequence[int] = (),
    sources: dict[int, dict[str, str]] | None = None,
) -> list[str]:
    """Put each rank's flight-recorder dump, where the job enabled one and wrote it, into its capture (read
    what exists, never trigger a dump) unless it already holds one (from the debug server); ``sources``
    gets the file each came from. Returns notes on what was not there."""
    notes: list[str] = []
    envs: dict[int, Mapping[str, str]] = {r.rank: r.env for r in job.ranks}
    any_env = job.ranks[0].env if job.ranks else {}
    for rank in sorted({*envs, *extra_ranks}):
        env = envs.get(rank, any_env)
        if not fr_enabled(env) or (rank in captures and captures[rank].fr_trace is not None):
            continue
        path = fr_dump_path(env, rank)
        answer = _ask_fr(owner_of(job.owner_uid), {"op": "fr_file", "path": path}, rank)
        trace, why, _ = answer if answer is not None else (None, "no answer", "")
        if trace is None:
            notes.append(f"rank {rank}: flight recorder {path}: {why}")
            continue
        cap = captures.setdefault(rank, RankCapture(rank=rank, pid=-1))
        cap.fr_trace = trace
        if why:
            cap.notes.append(f"flight recorder: {why}")
        if sources is not None:
            sources[rank] = {"from": "file", "path": path}
    if not any(fr_enabled(r.env) for r in job.ranks) and not any(c.fr_trace is not None for c in captures.values()):
        notes.append("no flight recorder: the job did not set TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE)")
    return notes


def worker_lines(workers: Mapping[int, list[RankCapture]]) -> list[str]:
    """One evidence line per worker with a stack: where a rank's DataLoader worker is."""
    lines = []
    for rank, caps in sorted(workers.items()):
        for cap in caps:
            frames = cap.main_frames()
            if frames:
                top = " < ".join(f.short() for f in frames[:3])
                lines.append(f"rank {rank}'s worker pid {cap.pid}: {top}")
    return lines


# -- the requests a reader of the job's owner answers (``privsep``) -----------------------------------------
@handler("fr_debug_server")
def _fr_debug_server_request(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """The rank's flight recorder from its torch debug server, asked and parsed as its owner."""
    dump = fr_from_debug_server(w_int(req.get("pid"), 1, 1 << 22), os.geteuid())
    if dump is None:
        return {"none": True}
    if dump.body is None:
        return {"why": dump.source}
    doc, note = fr_wire_doc(dump.body, FR_WIRE_BYTES)
    return {"fr": doc, "note": note, "source": dump.source}


@handler("fr_file")
def _fr_file_request(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """A flight-recorder file the job's environment names, read and parsed as its owner."""
    got = read_owned_file(w_str(req.get("path"), 4096), os.geteuid(), MAX_FR_FILE_BYTES)
    if isinstance(got, str):
        return {"why": got}
    if got[:1] == b"\x80":
        return {"why": "pickled (not read: unpickling runs code); analyse it with torch's fr_trace"}
    doc, note = fr_wire_doc(got, FR_WIRE_BYTES)
    return {"fr": doc, "note": note}
