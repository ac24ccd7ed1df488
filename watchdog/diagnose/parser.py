"""Lines of one log source → events. Pure apart from the state that multi-line messages need.

One ``SourceParser`` per file: it knows the rank its path implies, keeps one open Python traceback per
rank (ranks interleave in a combined torchrun/srun log) and the position inside torch elastic's
failure report. Anything it does not recognise yields nothing; it never raises on odd input.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..core.schema import HEADLINES
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
        """Single-line messages. Order matters: the most specific family wins per line."""
        out: list[ev.Event] = []
        if "rankwatch: " in s and (m := pt.RANKWATCH_HEADLINE.search(s)):
            kind = _KIND_OF_HEADLINE.get(m.group(1).strip(), "unknown")
            detail = f"{kind}|{m.group(4)}|{m.group(3) or ''}"
            named = [] if m.group(2) == "no single rank" else pt.rank_list(m.group(2), limit=4096)
            if not named:
                out.append(mk(ev.RANKWATCH, rank=None, local_rank=None, pid=None, detail=detail))
            out.extend(mk(ev.RANKWATCH, rank=r, local_rank=None, pid=None, detail=detail) for r in named)
            return out
        if ("collective #" in s or "lagging ranks" in s) and (m := pt.DESYNC.search(s)):
            lagging = pt.rank_list(m.group(1), limit=4096)
            seq = int(m.group(3) or m.group(5) or 0) or None
            how = ("finished collective #{0}, but didn't join the next" if m.group(2) else
                   "joined but didn't finish collective #{0}" if m.group(4) else "never joined any collective")
            detail = how.format(seq)
            out.extend(mk(ev.DESYNC, rank=r, local_rank=None, pid=None, host=None, seq=seq, detail=detail)
                       for r in lagging)
            return out
        if "opCount" in s and (m := pt.NCCL_OPCOUNT.search(s)):
            hp = pt.NCCL_HOST_PID.search(s)
            where = {"host": hp.group(1), "pid": int(hp.group(2))} if hp else {}
            out.append(mk(ev.NCCL_OP, seq=int(m.group(2), 16), op=m.group(1), numel=int(m.group(3)),
                          pg=f"nranks={m.group(4)}", **where))
            return out
        if "pirun noticed" in s and (m := pt.MPIRUN_NOTICED.search(s)):
            code = -int(m.group(4))
            pid = int(m.group(2)) if m.group(2).isdigit() and m.group(2) != "0" else None
            out.append(mk(ev.EXIT, rank=int(m.group(1)), local_rank=None, pid=pid, host=m.group(3).rstrip(".,"),
                          exitcode=code, signal=pt.signal_name(code), detail="mpirun noticed it exit"))
            return out
        if "sigkill_handler" in s:
            if m := pt.DS_EXIT.search(s):
                code = int(m.group(2))
                out.append(mk(ev.EXIT, rank=None, local_rank=int(m.group(1)), exitcode=code,
                              signal=pt.signal_name(code), detail="DeepSpeed's launcher saw it exit first"))
                return out
            if m := pt.DS_KILLING.search(s):
                out.append(mk(ev.AGENT_TERM, rank=None, local_rank=None, pid=int(m.group(1)), signal="SIGKILL"))
                return out
        if "exitcode" in s and (m := pt.REPORT_FLAT.search(s)):
            code = int(m.group(3))
            out.append(mk(ev.EXIT, rank=int(m.group(1)), local_rank=int(m.group(2)), pid=int(m.group(4)),
                          exitcode=code, signal=pt.signal_name(code), root_cause=self._section == "root",
                          detail="failure report (flattened)"))
            return out
        if "Watchdog caught" in s and (m := pt.NCCL_WATCHDOG.search(s)):
            out.append(
                mk(
                    ev.NCCL_TIMEOUT,
                    seq=int(m.group(1)),
                    op=m.group(2),
                    numel=int(m.group(3)) if m.group(3) else None,
                    **self._pg_rank(s, rank),
                )
            )
            return out
        if "last enqueued" in s or "Last enqueued" in s:
            if m := pt.NCCL_STATUS.search(s):
                seq, enq, done = int(m.group(1)), int(m.group(2)), int(m.group(3))
                out.append(mk(ev.NCCL_STATUS, seq=seq, enqueued=enq, completed=done, **self._pg_rank(s, rank)))
                return out
            if m := pt.NCCL_TIMEOUT_AT.search(s):
                seq, enq, done = int(m.group(1)), int(m.group(2)), int(m.group(3))
                out.append(mk(ev.NCCL_STATUS, seq=seq, enqueued=enq, completed=done, **self._pg_rank(s, rank)))
                return out
            if m := pt.NCCL_DUMP_SIGNAL.search(s):
                # the status is the printing rank's own; "from rank N" says N timed out, not this rank
                who = m.group(1)
                pg = self._pg_rank(s, rank)
                out.append(
                    mk(
                        ev.DUMP_SIGNAL,
                        enqueued=int(m.group(2)),
                        completed=int(m.group(3)),
                        detail="this rank" if who is None else f"rank {who}",
                        **pg,
                    )
                )
                if who is not None:
                    out.extend(self._reported(int(who), pg.get("rank", rank), mk))
                return out
            if m := pt.NCCL_DUMP_SIGNAL_OLD.search(s):
                own = m.group(1).startswith("dump signal")
                out.append(
                    mk(
                        ev.DUMP_SIGNAL,
                        enqueued=int(m.group(2)),
                        completed=int(m.group(3)),
                        detail="this rank" if own else "another rank",
                        **self._pg_rank(s, rank),
                    )
                )
                return out
        if pt.NCCL_OBSERVED_DUMP in s:
            # another rank timed out and set the store key: this rank was told, it did not time out
            out.append(mk(ev.DUMP_SIGNAL, detail="another rank", **self._pg_rank(s, rank)))
            return out
        if pt.NCCL_BROADCAST_DUMP in s:
            out.append(mk(ev.DUMP_SIGNAL, detail="this rank", **self._pg_rank(s, rank)))
            return out
        if "another rank" in s and (m := pt.NCCL_TOLD_BY.search(s)):
            pg = self._pg_rank(s, rank)
            out.append(mk(ev.DUMP_SIGNAL, detail=f"rank {m.group(1)}", **pg))
            out.extend(self._reported(int(m.group(1)), pg.get("rank", rank), mk))
            return out
        if ("eartbeat" in s or "got stuck" in s) and pt.NCCL_HEARTBEAT.search(s):
            out.append(mk(ev.HEARTBEAT, **self._pg_rank(s, rank)))
            return out
        if "dumping nccl trace" in s and (m := pt.NCCL_DUMP_TO.search(s)):
            out.append(mk(ev.DUMP_WRITTEN, detail=m.group(1)))
            return out
        if "Detected mismatch" in s and (m := pt.OP_MISMATCH.search(s)):
            a, b = int(m.group(1)), int(m.group(3))
            op_a = pt.FINGERPRINT_OP.search(m.group(2))
            op_b = pt.FINGERPRINT_OP.search(m.group(4))
            out.append(mk(ev.OP_MISMATCH, rank=a, op=op_a.group(1) if op_a else None, detail=f"vs rank {b}"))
            out.append(mk(ev.OP_MISMATCH, rank=b, op=op_b.group(1) if op_b else None, detail=f"vs rank {a}"))
            return out
        if "NCCL WARN" in s and (m := pt.NCCL_WARN.search(s)):
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
            out.append(mk(fam, host=m.group(1), pid=int(m.group(2)), detail=detail[:MAX_TEXT]))
            return out
        if "Timed out waiting" in s and (m := pt.GLOO_TIMEOUT.search(s)):
            out.append(mk(ev.GLOO_TIMEOUT, detail=f"{m.group(2)} timed out after {m.group(1)} ms"))
            return out
        if ("preamble" in s or "data size" in s) and (m := pt.GLOO_SIZE.search(s)):
            detail = f"received {m.group(1)} bytes, expected {m.group(2)}" if m.group(1) else ""
            out.append(mk(ev.SIZE_MISMATCH, detail=detail))
            return out
        if ("peer" in s or "Read error" in s) and (m := pt.PEER_LOST.search(s)):
            host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            out.append(mk(ev.PEER_LOST, detail=f"peer {host}:{port}" if host else "peer"))
            return out
        if ("emote" in s or "aborted" in s) and pt.NCCL_REMOTE.search(s):
            out.append(mk(ev.PEER_LOST, detail="NCCL remote error"))
            return out
        if "ECC" in s and pt.ECC.search(s):
            out.append(mk(ev.HW_FAULT, detail="ECC error"))
            return out
        if "Xid" in s and (m := pt.XID.search(s)):
            pid = int(m.group(3)) if m.group(3) else None
            out.append(mk(ev.HW_FAULT, pid=pid, detail=f"Xid {m.group(2)} on PCI {m.group(1)}: {m.group(5)}"))
            return out
        if ("emory" in s or "OfMemory" in s) and pt.CUDA_OOM.search(s):
            out.append(mk(ev.CUDA_OOM, detail="CUDA out of memory"))
            return out
        if ("CUDA error" in s or "uda failure" in s) and (m := pt.CUDA_ERROR.search(s)):
            out.append(mk(ev.CUDA_ERROR, detail=(m.group(1) or m.group(2) or "").strip()))
            return out
        if ("Killed process" in s or "oom" in s) and (m := pt.HOST_OOM.search(s)):
            if m.group(1):
                out.append(mk(ev.HOST_OOM, pid=int(m.group(1)), detail=f"OOM killer killed {m.group(2)}"))
            else:
                out.append(mk(ev.HOST_OOM, detail=f"{m.group(3)} oom_kill event(s) in the step"))
            return out
        if "srun: error" in s and (m := pt.SLURM_TASK.search(s)):
            tasks = pt.expand_tasks(m.group(2))
            why = m.group(3).strip()
            cm = re.search(r"exit code (\d+)", why)
            sig = "SIGKILL" if why.startswith("Killed") else None
            for t in tasks[:1] if len(tasks) > 64 else tasks:
                out.append(
                    mk(ev.SLURM, rank=t, host=m.group(1), detail=why[:120],
                       exitcode=int(cm.group(1)) if cm else None, signal=sig)
                )
            return out
        if "CANCELLED" in s and (m := pt.SLURM_CANCEL.search(s)):
            out.append(mk(ev.SLURM, rank=None, detail=f"step {m.group(1)} cancelled ({m.group(4) or 'by request'})"))
            return out
        if "exitcode" in s and (m := pt.ELASTIC_FAILED.search(s)):
            code = int(m.group(1))
            out.append(
                mk(ev.EXIT, rank=None, local_rank=int(m.group(2)), pid=int(m.group(3)),
                   exitcode=code, signal=pt.signal_name(code), detail=ev.FIRST_NOTICED)
            )
            return out
        if "closing signal" in s and (m := pt.ELASTIC_CLOSING.search(s)):
            out.append(mk(ev.AGENT_TERM, rank=None, local_rank=None, pid=int(m.group(1)), signal=m.group(2)))
            return out
        if pt.NCCL_ERROR.search(s):
            out.append(mk(ev.COMM_ERROR, detail=s[:120]))
            return out
        if ("rocess" in s or "NCCL" in s) and pt.WATCHDOG_ABORT.search(s):
            out.append(mk(ev.WATCHDOG_ABORT, **self._pg_rank(s, rank)))
            return out
        if any(k in s for k in pt.FINISHED_WORDS) and pt.FINISHED.search(s):
            out.append(mk(ev.FINISHED, detail=s[:120]))
        return out

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
        funcs = {f[2] for f in frames}
        if phase is None:
            if "_engine_run_backward" in funcs or "backward" in funcs:
                phase = "backward"
            elif "__next__" in funcs:
                phase = "dataloader"
            elif any(f[2] == "step" and "/optim/" in f[0] for f in frames):
                phase = "optimizer"
            elif "forward" in funcs or "_call_impl" in funcs:
                phase = "forward"
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
