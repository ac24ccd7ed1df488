"""Lines of one log source → events. Pure apart from the state that multi-line messages need.

One ``SourceParser`` per file: it knows the rank its path implies, keeps one open Python traceback per
rank (ranks interleave in a combined torchrun/srun log) and the position inside torch elastic's
failure report. Anything it does not recognise yields nothing; it never raises on odd input.
"""

from __future__ import annotations

import re
import signal as _signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.phases import COLLECTIVE, IDLE
from ..core.ranks import rank_list
from ..core.schema import HEADLINES
from ..core.stack_phase import phase_from_frames
from ..core.stacks import Frame
from ..core.straggler_cause import CAUSES
from . import events as ev
from . import patterns as pt

MAX_TEXT = 300  # characters of a line kept as evidence
MAX_FRAMES = 64  # innermost frames kept per open traceback
MAX_OPEN_TRACEBACKS = 4096
MAX_SEEN = 4096  # ranks / hosts remembered per source for grouping sources into jobs (diagnose/jobs.py)


@dataclass(frozen=True, slots=True)
class PathRank:
    """What a file's path says about the rank writing it (torchrun --log-dir, rank-N.log)."""

    rank: int | None = None
    local_rank: int | None = None


@dataclass(slots=True)
class _Traceback:
    start_line: int
    # (path, line in that file, function, line number in the log, log text)
    frames: deque[tuple[str, int, str, int, str]] = field(default_factory=lambda: deque(maxlen=MAX_FRAMES))


@dataclass(slots=True)
class _ReportEntry:
    root: bool
    ts: float | None = None
    host: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    exitcode: int | None = None
    pid: int | None = None
    signal: str | None = None


_KIND_OF_HEADLINE = {v: k for k, v in HEADLINES.items()}


class SourceParser:
    """Feed (line number, text) pairs of one source; collect the events."""

    def __init__(self, file: str, path_rank: PathRank | None = None) -> None:
        self.file = file
        self.path_rank = path_rank or PathRank()
        self._tracebacks: dict[tuple[int | None, int | None, int | None], _Traceback] = {}
        self._section: str | None = None  # "failures" | "root" inside an elastic failure report
        self._entry: _ReportEntry | None = None
        self._ompi_first = -1  # the line of Open MPI's "The first process to do so was:" (its next lines name it)
        # what this source says about the job it belongs to (diagnose/jobs.py groups sources by it):
        # global ranks that printed here (by prefix or path), hosts named, and the time span it covers
        self.ranks: set[int] = set()
        self.hosts: set[str] = set()
        self.t_min: float | None = None
        self.t_max: float | None = None
        if self.path_rank.rank is not None:
            self.ranks.add(self.path_rank.rank)

    # -- public --------------------------------------------------------------------------------
    def feed(self, lineno: int, line: str) -> list[ev.Event]:
        try:
            return self._feed(lineno, line.rstrip("\r\n").replace("\x00", ""))
        except (ValueError, IndexError, OverflowError):  # garbled numbers etc.: skip the line
            return []

    def rank_events(self) -> list[ev.Event]:
        """The rank a per-rank file belongs to exists even when its file is empty."""
        pr = self.path_rank
        if pr.rank is None and pr.local_rank is None:
            return []
        return [ev.Event(ev.RANK_SEEN, self.file, 0, "", rank=pr.rank, local_rank=pr.local_rank, detail="path")]

    # -- internals -----------------------------------------------------------------------------
    def _feed(self, lineno: int, raw: str) -> list[ev.Event]:
        if "\r" in raw:  # progress bars: the message is what follows the last carriage return,
            tail = raw.rsplit("\r", 1)[1]  # unless an error was glued onto the bar itself
            raw = tail if tail.strip() else raw.replace("\r", " ")
        prefix, body = pt.split_prefix(raw)
        rank = prefix.rank if prefix.rank is not None else self.path_rank.rank
        local = prefix.local_rank if prefix.local_rank is not None else self.path_rank.local_rank
        if prefix.rank is not None and len(self.ranks) < MAX_SEEN:
            self.ranks.add(prefix.rank)
        ts: float | None = prefix.ts
        g = pt.GLOG.match(body)
        if g:
            ts = pt.glog_time(g)  # the message's own header beats a wrapper's stamp
            body = body[g.end() :]
        self._saw_time(ts)
        text = raw.strip()[:MAX_TEXT]
        base: dict[str, Any] = {"file": self.file, "line": lineno, "text": text, "ts": ts}
        who: dict[str, Any] = {"rank": rank, "local_rank": local, "pid": prefix.pid, "host": prefix.host}

        def mk(family: str, **kw: Any) -> ev.Event:
            args = {**base, **who, **kw}
            if args["host"] and len(self.hosts) < MAX_SEEN:
                self.hosts.add(args["host"])
            return ev.Event(family, **args)

        out: list[ev.Event] = []
        stripped = body.strip()
        if self._report_line(stripped, base, out):
            return out

        # Python traceback assembly (per rank, since ranks interleave; per pid when only a pid says who)
        key = (rank, local, prefix.pid if rank is None and local is None else None)
        if pt.TB_START in stripped:
            if len(self._tracebacks) >= MAX_OPEN_TRACEBACKS:
                self._tracebacks.clear()
            self._tracebacks[key] = _Traceback(lineno)
            return out
        tb = self._tracebacks.get(key)
        if tb is not None:
            fm = pt.TB_FRAME.match(body)
            if fm:
                tb.frames.append((fm.group(1), int(fm.group(2)), fm.group(3), lineno, text))
                return out

        out.extend(self._classify(stripped, mk, rank))
        if tb is not None:
            em = pt.TB_EXCEPTION.match(stripped)
            if em:
                del self._tracebacks[key]
                out.extend(self._finish_traceback(tb, em, out, mk))
        elif prefix.rank is not None and (em := pt.HEADLESS_EXCEPTION.match(stripped)):
            # an exception line pasted without its traceback (only its last lines kept): still the rank's own
            # message, read as a traceback with no frames (no frames: no traceback event of its own)
            headless = self._finish_traceback(_Traceback(lineno), em, out, mk)
            out.extend(e for e in headless if e.family != ev.TRACEBACK)
        return out

    def _saw_time(self, ts: float | None) -> None:
        if ts is None:
            return
        if self.t_min is None or ts < self.t_min:
            self.t_min = ts
        if self.t_max is None or ts > self.t_max:
            self.t_max = ts

    def _report_line(self, s: str, base: dict[str, Any], out: list[ev.Event]) -> bool:
        """torch elastic's failure report: entries of time/host/rank/exitcode/…/traceback fields."""
        if s.startswith(pt.REPORT_FAILURES):
            self._section, self._entry = "failures", None
            return True
        if s.startswith(pt.REPORT_ROOT):
            self._section, self._entry = "root", None
            return True
        if self._section is None:
            return False
        m = pt.REPORT_TIME.match(s)
        if m:
            self._entry = _ReportEntry(root=self._section == "root", ts=pt.report_time(m))
            self._saw_time(self._entry.ts)
            return True
        e = self._entry
        if e is None:
            return False
        if m := pt.REPORT_HOST.match(s):
            e.host = m.group(1)
            if len(self.hosts) < MAX_SEEN:
                self.hosts.add(e.host)
        elif m := pt.REPORT_RANK.match(s):
            e.rank, e.local_rank = int(m.group(1)), int(m.group(2))
            if 0 <= e.rank <= pt.MAX_RANK and len(self.ranks) < MAX_SEEN:
                self.ranks.add(e.rank)  # the launcher's report speaks for its ranks
        elif m := pt.REPORT_EXIT.match(s):
            e.exitcode, e.pid = int(m.group(1)), int(m.group(2))
            e.signal = m.group(3) or pt.signal_name(e.exitcode)
        elif m := pt.REPORT_TRACEBACK.match(s):
            if e.rank is not None:
                out.append(
                    ev.Event(
                        ev.EXIT,
                        **{**base, "ts": e.ts},
                        rank=e.rank,
                        local_rank=e.local_rank,
                        host=e.host,
                        pid=e.pid,
                        exitcode=e.exitcode,
                        signal=e.signal,
                        root_cause=e.root,
                        detail=m.group(1).strip()[:MAX_TEXT],
                    )
                )
            self._entry = None
        else:
            return False
        return True

    def _classify(self, s: str, mk: Any, rank: int | None) -> list[ev.Event]:
        """Single-line messages, by the first row of ``PATTERNS`` that matches (most specific first)."""
        for gate, search, build in _ROWS:
            if gate:
                if type(gate) is str:
                    if gate not in s:
                        continue
                elif not any(g in s for g in gate):
                    continue
            m = None
            if search is not None:
                m = search(s)
                if m is None:
                    continue
            return build(self, s, m, mk, rank)
        return []

    @staticmethod
    def _reported(timed_out: int, teller: int | None, mk: Any) -> list[ev.Event]:
        """Rank ``timed_out`` detected a collective timeout, per another rank's line: evidence about it."""
        if timed_out < 0 or timed_out > pt.MAX_RANK or timed_out == teller:
            return []
        by = f"per rank {teller}" if teller is not None else "per another rank's log"
        return [mk(ev.TIMEOUT_REPORTED, rank=timed_out, local_rank=None, pid=None, host=None, detail=by)]

    @staticmethod
    def _pg_rank(s: str, known: int | None) -> dict[str, Any]:
        """ProcessGroupNCCL's "[PG ID 0 … Rank N]": the group its SeqNums count in (None for the old "[Rank N]"
        form, which every group printed alike), and a global rank only for the default group."""
        m = pt.PG_PREFIX.search(s)
        if not m:
            return {}
        pg_id, guid = m.group(1), m.group(2) or ""
        out: dict[str, Any] = {"pg": pg_id} if pg_id is not None else {}
        if known is None and (pg_id in (None, "0") or "default_pg" in guid):
            out["rank"] = int(m.group(3))
        return out

    def _finish_traceback(
        self, tb: _Traceback, em: re.Match[str], found: list[ev.Event], mk: Any
    ) -> list[ev.Event]:
        exc_type, message = em.group(1), (em.group(2) or "")
        frames = list(tb.frames)
        op: str | None = None
        phase: str | None = None
        at: dict[str, Any] = {}  # the event points at the frame that names the op, else the call site
        for path, _line, func, lno, txt in reversed(frames):
            if path.endswith(pt.C10D_FILE) and not func.startswith("_"):
                op, phase = func, "collective"
                at = {"line": lno, "text": txt}
                break
        if phase is None:
            # the innermost library boundary, as for a live stack (one reading of phases: core.stack_phase)
            inner = phase_from_frames([Frame(f[2], f[0], f[1]) for f in reversed(frames)]).phase
            phase = None if inner in (IDLE, COLLECTIVE) else inner
        site = ""
        for path, line, func, lno, txt in reversed(frames):
            if not pt.TORCH_PATH.search(path):
                site = f"{path.rsplit('/', 1)[-1]}:{line} in {func}"
                at = at or {"line": lno, "text": txt}
                break
        out = [mk(ev.TRACEBACK, op=op, phase=phase, detail=site, **at)]
        meaningful = ev.PRIMARY | ev.WAITING | ev.MISMATCH
        if not any(e.family in meaningful for e in found):
            quiet = exc_type.rsplit(".", 1)[-1] in ("KeyboardInterrupt", "SystemExit", "ChildFailedError")
            if not quiet and not pt.COMM_MESSAGE.search(message) and not pt.COMM_MESSAGE.search(exc_type):
                out.append(mk(ev.PY_ERROR, phase=phase, detail=f"{exc_type}: {message}"[:MAX_TEXT]))
            elif not quiet:
                out.append(mk(ev.COMM_ERROR, phase=phase, detail=f"{exc_type}: {message}"[:MAX_TEXT]))
        return out


# -- single-line messages: one row per format ---------------------------------------------------------------
# Each builder gets (parser, line, match, mk, rank) and returns the line's events; ``mk`` makes an event with
# the line's file, position, text and the rank/host its prefix names.
Build = Callable[[SourceParser, str, re.Match[str] | None, Any, int | None], list[ev.Event]]


@dataclass(frozen=True, slots=True)
class Pattern:
    """One log format: the line must hold one of ``gate`` (a cheap substring check before the regex; () for
    any line), then ``regex`` must match (None: the gate alone decides); ``build`` makes its events."""

    name: str
    gate: tuple[str, ...]
    regex: re.Pattern[str] | None
    build: Build


def _m(m: re.Match[str] | None) -> re.Match[str]:
    assert m is not None  # a row with a regex is only built on a match
    return m


def _rankwatch(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    kind = _KIND_OF_HEADLINE.get(m.group(1).strip(), "unknown")
    detail = f"{kind}|{m.group(4)}|{m.group(3) or ''}"
    named = [] if m.group(2) == "no single rank" else rank_list(m.group(2), limit=4096)
    if not named:
        return [mk(ev.RANKWATCH, rank=None, local_rank=None, pid=None, detail=detail)]
    return [mk(ev.RANKWATCH, rank=r, local_rank=None, pid=None, detail=detail) for r in named]


def _straggler(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.STRAGGLER, rank=None, local_rank=None, pid=None,
               detail=f"{m.group(1)}|{m.group(2)}|{m.group(3) or ''}")]


def _straggler_cause(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any,
                     rank: int | None) -> list[ev.Event]:
    m = _m(m)
    if m.group(1) not in CAUSES:
        return []
    return [mk(ev.STRAGGLER_CAUSE, rank=None, local_rank=None, pid=None, detail=f"{m.group(1)}|{m.group(2)}")]


def _desync(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    lagging = rank_list(m.group(1), limit=4096)
    seq = int(m.group(3) or m.group(5) or 0) or None
    how = ("finished collective #{0}, but didn't join the next" if m.group(2) else
           "joined but didn't finish collective #{0}" if m.group(4) else "never joined any collective")
    detail = how.format(seq)
    return [mk(ev.DESYNC, rank=r, local_rank=None, pid=None, host=None, seq=seq, detail=detail) for r in lagging]


def _opcount(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    hp = pt.NCCL_HOST_PID.search(s)
    where = {"host": hp.group(1), "pid": int(hp.group(2))} if hp else {}
    return [mk(ev.NCCL_OP, seq=int(m.group(2), 16), op=m.group(1), numel=int(m.group(3)),
               pg=f"nranks={m.group(4)}", **where)]


def _mpirun(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    code = -int(m.group(4))
    pid = int(m.group(2)) if m.group(2).isdigit() and m.group(2) != "0" else None
    return [mk(ev.EXIT, rank=int(m.group(1)), local_rank=None, pid=pid, host=m.group(3).rstrip(".,"),
               exitcode=code, signal=pt.signal_name(code), detail="mpirun noticed it exit")]


def _ds_exit(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    code = int(m.group(2))
    return [mk(ev.EXIT, rank=None, local_rank=int(m.group(1)), exitcode=code, signal=pt.signal_name(code),
               detail="DeepSpeed's launcher saw it exit first")]


def _ds_killing(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.AGENT_TERM, rank=None, local_rank=None, pid=int(_m(m).group(1)), signal="SIGKILL")]


def _mp_spawn_exit(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    sig = m.group(2)
    code = -_signal.Signals[sig].value if sig in _signal.Signals.__members__ else (-1 if sig else int(m.group(3)))
    return [mk(ev.EXIT, rank=None, local_rank=int(m.group(1)), exitcode=code, signal=sig or None,
               detail="torch.multiprocessing.spawn saw it exit first")]


def _ompi_first(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    line = mk(ev.RANK_SEEN).line
    if "first process to do so" in s:
        p._ompi_first = line
        return []
    m = pt.OMPI_PROCESS_NAME.search(s)
    if m is None or not 0 < line - p._ompi_first <= pt.OMPI_FIRST_LINES:
        return []
    return [mk(ev.EXIT, rank=int(m.group(1)), local_rank=None, root_cause=True,
               detail="mpirun: the first process to exit non-zero")]


def _report_flat(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    code = int(m.group(3))
    return [mk(ev.EXIT, rank=int(m.group(1)), local_rank=int(m.group(2)), pid=int(m.group(4)), exitcode=code,
               signal=pt.signal_name(code), root_cause=p._section == "root", detail="failure report (flattened)")]


def _watchdog(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.NCCL_TIMEOUT, seq=int(m.group(1)), op=m.group(2), numel=int(m.group(3)) if m.group(3) else None,
               **p._pg_rank(s, rank))]


def _status(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    seq, enq, done = int(m.group(1)), int(m.group(2)), int(m.group(3))
    return [mk(ev.NCCL_STATUS, seq=seq, enqueued=enq, completed=done, **p._pg_rank(s, rank))]


def _dump_signal(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    # the status is the printing rank's own; "from rank N" says N timed out, not this rank
    m = _m(m)
    who = m.group(1)
    pg = p._pg_rank(s, rank)
    out = [mk(ev.DUMP_SIGNAL, enqueued=int(m.group(2)), completed=int(m.group(3)),
              detail="this rank" if who is None else f"rank {who}", **pg)]
    if who is not None:
        out.extend(p._reported(int(who), pg.get("rank", rank), mk))
    return out


def _dump_signal_old(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    own = m.group(1).startswith("dump signal")
    return [mk(ev.DUMP_SIGNAL, enqueued=int(m.group(2)), completed=int(m.group(3)),
               detail="this rank" if own else "another rank", **p._pg_rank(s, rank))]


def _observed_dump(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    # another rank timed out and set the store key: this rank was told, it did not time out
    return [mk(ev.DUMP_SIGNAL, detail="another rank", **p._pg_rank(s, rank))]


def _broadcast_dump(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.DUMP_SIGNAL, detail="this rank", **p._pg_rank(s, rank))]


def _told_by(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    pg = p._pg_rank(s, rank)
    return [mk(ev.DUMP_SIGNAL, detail=f"rank {m.group(1)}", **pg),
            *p._reported(int(m.group(1)), pg.get("rank", rank), mk)]


def _heartbeat(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.HEARTBEAT, **p._pg_rank(s, rank))]


def _dump_to(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.DUMP_WRITTEN, detail=_m(m).group(1))]


def _fingerprint(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    a, b = int(m.group(1)), int(m.group(3))
    op_a, op_b = pt.FINGERPRINT_OP.search(m.group(2)), pt.FINGERPRINT_OP.search(m.group(4))
    return [mk(ev.OP_MISMATCH, rank=a, op=op_a.group(1) if op_a else None, detail=f"vs rank {b}"),
            mk(ev.OP_MISMATCH, rank=b, op=op_b.group(1) if op_b else None, detail=f"vs rank {a}")]


def _nccl_warn(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    msg = m.group(5)
    fam = ev.COMM_ERROR
    if pt.ECC.search(msg):
        fam = ev.HW_FAULT
    elif "Cuda failure" in msg or "CUDA failure" in msg:
        fam = ev.CUDA_OOM if "out of memory" in msg else ev.CUDA_ERROR
    elif re.search(r"remote|peer|closed|Connection", msg):
        fam = ev.PEER_LOST
    cm = pt.CUDA_ERROR.search(msg)
    detail = (cm.group(2) or cm.group(1)) if cm and fam != ev.COMM_ERROR else msg
    return [mk(fam, host=m.group(1), pid=int(m.group(2)), detail=detail[:MAX_TEXT])]


def _gloo_timeout(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.GLOO_TIMEOUT, detail=f"{m.group(2)} timed out after {m.group(1)} ms")]


def _gloo_size(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.SIZE_MISMATCH, detail=f"received {m.group(1)} bytes, expected {m.group(2)}" if m.group(1) else "")]


def _peer_lost(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return [mk(ev.PEER_LOST, detail=f"peer {host}:{port}" if host else "peer")]


def _fixed(family: str, detail: str) -> Build:
    def build(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
        return [mk(family, detail=detail)]
    return build


def _xid(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    pid = int(m.group(3)) if m.group(3) else None
    return [mk(ev.HW_FAULT, pid=pid, detail=f"Xid {m.group(2)} on PCI {m.group(1)}: {m.group(5)}")]


def _cuda_error(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.CUDA_ERROR, detail=(m.group(1) or m.group(2) or "").strip())]


def _host_oom(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    if m.group(1):
        return [mk(ev.HOST_OOM, pid=int(m.group(1)), detail=f"OOM killer killed {m.group(2)}")]
    return [mk(ev.HOST_OOM, detail=f"{m.group(3)} oom_kill event(s) in the step")]


def _slurm_task(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    tasks = rank_list(m.group(2), limit=4096)  # srun task lists: "5", "0-3", "1,4-5"
    why = m.group(3).strip()
    cm = re.search(r"exit code (\d+)", why)
    sig = "SIGKILL" if why.startswith("Killed") else None
    code = int(cm.group(1)) if cm else (-9 if sig else None)
    out: list[ev.Event] = []
    for t in tasks[:1] if len(tasks) > 64 else tasks:
        out.append(mk(ev.SLURM, rank=t, host=m.group(1), detail=why[:120], exitcode=code, signal=sig))
        # how the task ended, as a launcher's exit (``facts.Collector`` keeps it only where no other launcher
        # reported: under srun + torchrun a task is a node's agent, not a rank)
        if why.startswith("Out Of Memory"):
            out.append(mk(ev.HOST_OOM, rank=t, host=m.group(1), detail=f"{pt.SRUN_EXIT}: task {t} Out Of Memory"))
        elif code is not None:
            out.append(mk(ev.EXIT, rank=t, host=m.group(1), exitcode=code, signal=sig, detail=pt.SRUN_EXIT))
    return out


def _slurm_cancel(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.SLURM, rank=None, detail=f"step {m.group(1)} cancelled ({m.group(4) or 'by request'})")]


def _elastic_failed(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    code = int(m.group(1))
    return [mk(ev.EXIT, rank=None, local_rank=int(m.group(2)), pid=int(m.group(3)), exitcode=code,
               signal=pt.signal_name(code), detail=ev.FIRST_NOTICED)]


def _elastic_closing(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    m = _m(m)
    return [mk(ev.AGENT_TERM, rank=None, local_rank=None, pid=int(m.group(1)), signal=m.group(2))]


def _nccl_error(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.COMM_ERROR, detail=s[:120])]


def _watchdog_abort(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.WATCHDOG_ABORT, **p._pg_rank(s, rank))]


def _world(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    n = int(_m(m).group(1))
    return [mk(ev.WORLD, rank=None, local_rank=None, size=n)] if 0 < n <= pt.MAX_RANK + 1 else []


def _finished(p: SourceParser, s: str, m: re.Match[str] | None, mk: Any, rank: int | None) -> list[ev.Event]:
    return [mk(ev.FINISHED, detail=s[:120])]


_ENQUEUED = ("last enqueued", "Last enqueued")

PATTERNS: tuple[Pattern, ...] = (
    Pattern("rankwatch headline", ("rankwatch: ",), pt.RANKWATCH_HEADLINE, _rankwatch),
    Pattern("rankwatch straggler", ("STRAGGLER — ",), pt.RANKWATCH_STRAGGLER, _straggler),
    Pattern("rankwatch straggler cause", ("cause: ",), pt.RANKWATCH_CAUSE, _straggler_cause),
    Pattern("desync report", ("collective #", "lagging ranks"), pt.DESYNC, _desync),
    Pattern("NCCL INFO opCount", ("opCount",), pt.NCCL_OPCOUNT, _opcount),
    Pattern("mpirun noticed", ("pirun noticed",), pt.MPIRUN_NOTICED, _mpirun),
    Pattern("DeepSpeed launcher exit", ("sigkill_handler",), pt.DS_EXIT, _ds_exit),
    Pattern("DeepSpeed launcher killing", ("sigkill_handler",), pt.DS_KILLING, _ds_killing),
    Pattern("torch.multiprocessing.spawn exit", ("terminated with",), pt.MP_SPAWN_EXIT, _mp_spawn_exit),
    Pattern("Open MPI first non-zero exit", ("first process to do so", "Process name: [["), None, _ompi_first),
    Pattern("failure report, flattened", ("exitcode",), pt.REPORT_FLAT, _report_flat),
    Pattern("NCCL watchdog timeout", ("Watchdog caught",), pt.NCCL_WATCHDOG, _watchdog),
    Pattern("NCCL PG status", _ENQUEUED, pt.NCCL_STATUS, _status),
    Pattern("NCCL timeout at", _ENQUEUED, pt.NCCL_TIMEOUT_AT, _status),
    Pattern("NCCL dump signal", _ENQUEUED, pt.NCCL_DUMP_SIGNAL, _dump_signal),
    Pattern("NCCL dump signal (older torch)", _ENQUEUED, pt.NCCL_DUMP_SIGNAL_OLD, _dump_signal_old),
    Pattern("NCCL observed dump signal", (pt.NCCL_OBSERVED_DUMP,), None, _observed_dump),
    Pattern("NCCL broadcast dump signal", (pt.NCCL_BROADCAST_DUMP,), None, _broadcast_dump),
    Pattern("NCCL told by another rank", ("another rank",), pt.NCCL_TOLD_BY, _told_by),
    Pattern("NCCL heartbeat monitor", ("eartbeat", "got stuck"), pt.NCCL_HEARTBEAT, _heartbeat),
    Pattern("NCCL trace dumped", ("dumping nccl trace",), pt.NCCL_DUMP_TO, _dump_to),
    Pattern("c10d fingerprint mismatch", ("Detected mismatch",), pt.OP_MISMATCH, _fingerprint),
    Pattern("NCCL WARN", ("NCCL WARN",), pt.NCCL_WARN, _nccl_warn),
    Pattern("gloo timeout", ("Timed out waiting",), pt.GLOO_TIMEOUT, _gloo_timeout),
    Pattern("gloo size enforcement", ("preamble", "data size"), pt.GLOO_SIZE, _gloo_size),
    Pattern("peer lost", ("peer", "Read error"), pt.PEER_LOST, _peer_lost),
    Pattern("NCCL remote error", ("emote", "aborted"), pt.NCCL_REMOTE, _fixed(ev.PEER_LOST, "NCCL remote error")),
    Pattern("ECC error", ("ECC",), pt.ECC, _fixed(ev.HW_FAULT, "ECC error")),
    Pattern("Xid", ("Xid",), pt.XID, _xid),
    Pattern("CUDA out of memory", ("emory", "OfMemory"), pt.CUDA_OOM, _fixed(ev.CUDA_OOM, "CUDA out of memory")),
    Pattern("CUDA error", ("CUDA error", "uda failure"), pt.CUDA_ERROR, _cuda_error),
    Pattern("host OOM killer", ("Killed process", "oom"), pt.HOST_OOM, _host_oom),
    Pattern("srun task exit", ("srun: error",), pt.SLURM_TASK, _slurm_task),
    Pattern("Slurm cancel", ("CANCELLED",), pt.SLURM_CANCEL, _slurm_cancel),
    Pattern("torch elastic failed", ("exitcode",), pt.ELASTIC_FAILED, _elastic_failed),
    Pattern("torch elastic closing signal", ("closing signal",), pt.ELASTIC_CLOSING, _elastic_closing),
    Pattern("world size", ("world_size", "WORLD_SIZE", "world size", "nranks "), pt.WORLD_SIZE, _world),
    Pattern("NCCL error", (), pt.NCCL_ERROR, _nccl_error),
    Pattern("NCCL watchdog abort", ("rocess", "NCCL"), pt.WATCHDOG_ABORT, _watchdog_abort),
    Pattern("finished", tuple(pt.FINISHED_WORDS), pt.FINISHED, _finished),
)

# the table as the loop reads it: a one-string gate as the string itself (one ``in`` test), bound searches
_ROWS: tuple[tuple[str | tuple[str, ...], Callable[[str], re.Match[str] | None] | None, Build], ...] = tuple(
    (row.gate[0] if len(row.gate) == 1 else row.gate, row.regex.search if row.regex is not None else None, row.build)
    for row in PATTERNS
)
