"""Evidence capture on an incident: py-spy stacks and the hook's dump responder, every rank in parallel.

py-spy reads a process from outside (works when the rank is wedged with the GIL held, or stopped with
``--nonblocking``); the responder answers from inside (flight-recorder trace, and stacks when py-spy
lacks ptrace permission). Both run for every rank at once, each under its own timeout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
from rankwatch.hooks.exit_dump import DUMPS_DIR, dump_name, exit_dir
from rankwatch.hooks.responder import ctl_path, peer_cred, socket_address

from ..core.fr_trace import FlightRecorderFormatError, RankTrace, parse_dump
from ..core.policy import CapturePolicy
from ..core.stacks import Frame
from ..core.text import FIELD, NAME, PROSE, clean
from ..observe.jobdir import close_quietly, open_dir, read_regular
from ..observe.process import read_stat, session_members
from ..privsep.frames import w_float, w_int, w_str
from ..privsep.readers import ReaderError, default_readers, pyspy_available
from ..privsep.registry import Worker, handler
from .fr_dump import fr_wire_doc

__all__ = ["pyspy_available"]  # where py-spy is looked up (``privsep``: a reader runs it as the owner)

log = structlog.get_logger("rankwatch.capture")

@dataclass
class RankCapture:
    rank: int
    pid: int
    pyspy_threads: list[dict[str, Any]] | None = None
    pyspy_error: str | None = None
    responder_stacks: dict[str, Any] | None = None
    responder_error: str | None = None
    # the responder's raw dump: only ever set on the owner's side (the reader that read it) or in-process
    fr_json: bytes | None = None
    # the dump as the owner's reader parsed, bounded and typed it, validated again here (what root uses)
    fr_trace: RankTrace | None = None
    notes: list[str] = field(default_factory=list)
    # gone (or a zombie) when py-spy failed, or read with no Python frame in its main thread (an interpreter
    # finalizing after an uncaught exception: a rank whose store wait timed out as it was captured): it is
    # dying during capture, and the incident waits for its exit to show before deciding
    vanished: bool = False

    def main_frames(self) -> list[Frame]:
        """The training thread's frames, innermost first, from py-spy if it worked, else the responder. Both
        come from the rank's memory: any shape is survived (a malformed thread is no thread)."""
        threads = _threads(self.pyspy_threads)
        if threads:
            main = next(
                (t for t in threads if t.get("os_thread_id") == self.pid),
                next((t for t in threads if t.get("thread_name") == "MainThread"), None),
            )
            if main is not None:
                return _frames(main)
        if isinstance(self.responder_stacks, dict):
            for t in _threads(self.responder_stacks.get("threads")):
                if t.get("thread_name") == "MainThread":
                    return _frames(t)
        return []


def _frames(thread: dict[str, Any]) -> list[Frame]:
    out = []
    for f in thread.get("frames") or []:
        if isinstance(f, dict):
            line = f.get("line")
            out.append(Frame(str(f.get("name"))[:256], str(f.get("filename"))[:1024],
                             line if isinstance(line, int) and not isinstance(line, bool) else 0))
    return out


MAX_THREADS = 4096
MAX_FRAMES = 1024


def shape_threads(value: object) -> list[dict[str, Any]] | None:
    """py-spy's JSON reduced to the shape the rest relies on (a list of threads, each with an int
    ``os_thread_id``, a str ``thread_name``, bool flags and a list of frames with str name/filename and int
    line); None when it is not that list at all. Whatever else it holds is dropped, never trusted."""
    if not isinstance(value, list):
        return None
    out: list[dict[str, Any]] = []
    for t in value[:MAX_THREADS]:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            continue
        frames = []
        for f in t["frames"][:MAX_FRAMES]:
            if not isinstance(f, dict):
                continue
            line = f.get("line")
            frames.append(
                {
                    "name": clean(f.get("name"), NAME),
                    "filename": clean(f.get("filename"), FIELD),
                    "line": line if isinstance(line, int) and not isinstance(line, bool) else 0,
                    **({"locals": f["locals"]} if isinstance(f.get("locals"), list) else {}),
                }
            )
        tid, name = t.get("os_thread_id"), t.get("thread_name")
        out.append(
            {
                "os_thread_id": tid if isinstance(tid, int) and not isinstance(tid, bool) else None,
                "thread_id": t.get("thread_id") if isinstance(t.get("thread_id"), int) else None,
                "thread_name": clean(name, NAME) if isinstance(name, str) else None,
                "active": t.get("active") is True,
                "owns_gil": t.get("owns_gil") is True,
                "frames": frames,
            }
        )
    return out if out or not value else None  # threads were there, none of them of the shape: not a dump


def run_pyspy(
    exe: str | None, pid: int, timeout_s: float, nonblocking: bool, include_locals: bool, max_bytes: int,
    native: bool = False,
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """One ``py-spy dump --json``, its output cut at ``max_bytes`` (then not parsed at all) and shape-checked.
    Runs as whoever calls it: in the daemon, the rank owner's reader."""
    if exe is None:
        return None, "py-spy not installed"
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if nonblocking:
        cmd.append("--nonblocking")
    elif native:  # native frames need the process paused
        cmd.append("--native")
    if include_locals:
        cmd.append("--locals")
    try:
        # a session of its own: everything py-spy starts (a wrapper script's children) is found and ended with it
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            pass_fds=_fd_of(exe),
        )
    except OSError as exc:
        return None, f"py-spy failed to start: {exc}"
    exited = _exit_fd(proc.pid)
    deadline = time.monotonic() + timeout_s
    out, err = bytearray(), bytearray()
    over = False
    rc: int | None = None
    assert proc.stdout is not None and proc.stderr is not None
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    gone = False  # py-spy exited: what it wrote is in the pipes, which a child it left may hold open
    try:
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, f"py-spy timed out after {timeout_s:.1f}s"
            watch = list(streams) + ([exited] if exited is not None and not gone else [])
            ready, _, _ = select.select(watch, [], [], 0 if gone else left)
            if gone and not ready:
                break  # drained: the rest of the wait would only be for its children
            if exited is not None and exited in ready:
                gone = True
                ready.remove(exited)
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    del streams[fd]
                    continue
                buf = streams[fd]
                if buf is err:
                    if len(err) < 4096:
                        err += chunk[: 4096 - len(err)]
                    continue
                buf += chunk
                if len(buf) > max_bytes:
                    over = True
                    streams.clear()
                    break
        if over:
            return None, f"py-spy printed over {max_bytes} bytes: cut, not parsed"
        if not _exited_by(proc, exited, deadline):
            return None, f"py-spy timed out after {timeout_s:.1f}s"
    finally:
        # py-spy itself and whatever it started, on every way out: a child that outlived it (or a py-spy
        # that timed out) is killed while py-spy is not yet reaped, so its pid, the id of its group and
        # session, cannot have been handed to anyone else
        end_session(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            rc = proc.wait(5)
        if exited is not None:
            os.close(exited)
        proc.stdout.close()
        proc.stderr.close()
    if rc != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        first = clean(lines[0], FIELD) if lines else f"exit code {rc}"
        if "Permission" in first or "ptrace" in first.lower():
            first += " (py-spy needs CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0)"
        return None, first
    try:
        doc = json.loads(bytes(out))
    except (ValueError, RecursionError) as exc:
        return None, f"py-spy printed invalid JSON ({clean(str(exc), FIELD)[:80]}; {len(out)} bytes)"
    threads = shape_threads(doc)
    if threads is None:
        return None, "py-spy printed JSON of an unexpected shape"
    return threads, None


def _exit_fd(pid: int) -> int | None:
    """A pidfd of the child, readable once it exited (still unreaped); None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _exited_by(proc: subprocess.Popen[bytes], exited: int | None, deadline: float) -> bool:
    """Whether ``proc`` exited before ``deadline``, leaving it unreaped (``end_session`` must come first)."""
    if exited is not None:
        return bool(select.select([exited], [], [], max(0.1, deadline - time.monotonic()))[0])
    try:  # no pidfd: reaped here, its session ended after (a pid reused in between is the rare leftover)
        proc.wait(max(0.1, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def end_session(sid: int) -> None:
    """SIGKILL the process group and the session a capture started as ``sid`` (``start_new_session``): py-spy,
    or a wrapper of it, and every descendant that stayed in either (one that left both, ``setsid``, is
    beyond them). Its own leader must not be reaped yet, so neither id can name someone else's processes."""
    with contextlib.suppress(OSError):
        os.killpg(sid, signal.SIGKILL)
    # a child moved to a group of its own is still in the session; a fork racing the kill is caught next pass
    for _ in range(3):
        members = [pid for pid in session_members(sid) if pid != sid]
        if not members:
            return
        for pid in members:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _fd_of(exe: str) -> tuple[int, ...]:
    """The fd behind a ``/proc/self/fd/N`` executable (the reader's py-spy), kept open across the exec."""
    prefix = "/proc/self/fd/"
    return (int(exe[len(prefix):]),) if exe.startswith(prefix) and exe[len(prefix):].isdigit() else ()


def pyspy_dump(pid: int, timeout_s: float, nonblocking: bool, include_locals: bool, native: bool = False,
               owner: tuple[int, int] | None = None) -> tuple[Any, str | None]:
    """py-spy for ``pid``. With ``owner`` (the daemon's captures: the job dir's uid and gid) it runs as that
    user in a reader of theirs (``privsep``), so the daemon neither ptraces with its own rights nor parses
    py-spy's output itself; without, in this process (``rankwatch inspect``: no job dir, no owner to trust)."""
    if owner is None:
        return run_pyspy(pyspy_available(), pid, timeout_s, nonblocking, include_locals, MAX_PYSPY_BYTES, native)
    if owner[0] < 0:
        return None, "the job dir is gone: no owner to run py-spy as"
    req = {"op": "pyspy", "pid": pid, "timeout_s": timeout_s, "nonblocking": nonblocking,
           "locals": include_locals, "native": native}
    try:
        out = default_readers().ask(owner[0], owner[1], req, timeout_s=timeout_s + 5.0)
    except ReaderError as exc:
        return None, str(exc)
    err = out.get("error")
    threads = shape_threads(out.get("threads")) if out.get("threads") is not None else None
    return threads, err if isinstance(err, str) else None


def _run_pyspy_as(w: Worker, pid: int, timeout_s: float, nonblocking: bool, include_locals: bool,
                  native: bool = False) -> tuple[Any, str | None]:
    return run_pyspy(w.pyspy_exe(), pid, timeout_s, nonblocking, include_locals, w.policy.pyspy_max_bytes,
                     native=native)


@handler("pyspy")
def _pyspy_request(w: Worker, req: dict[str, Any], _fds: list[int]) -> dict[str, Any]:
    """py-spy of one process, run as the reader's user (the kernel's ptrace check is theirs)."""
    threads, err = _run_pyspy_as(w, w_int(req.get("pid"), 1, 1 << 22), w_float(req.get("timeout_s", 5.0)),
                                 bool(req.get("nonblocking")), bool(req.get("locals")),
                                 native=bool(req.get("native")))
    return {"threads": threads, "error": err}


MAX_PYSPY_BYTES = 8 << 20  # a real dump of a rank is tens of KB; 100 MB would cost gigabytes to parse


# the largest answer parts read from a responder (a flight-recorder trace of a big job is tens of MB)
MAX_STACKS_BYTES = 8 << 20
MAX_FR_BYTES = 64 << 20
MAX_FR_ERR_BYTES = 4096
_FRAME_LIMITS = {"stacks": MAX_STACKS_BYTES, "fr": MAX_FR_BYTES, "fr_err": MAX_FR_ERR_BYTES, "done": 0}
CONNECT_TIMEOUT_S = 1.0
# after py-spy returns, a responder that was paused by it gets at least this long to finish its answer
COLLECT_GRACE_S = 0.5


class DumpRequest:
    """A request the rank's responder accepted: its answer is read from ``sock`` by ``collect_dump``."""

    def __init__(self, sock: socket.socket, deadline: float = 0.0) -> None:
        self.sock = sock
        self.deadline = deadline
        self.received = 0  # bytes of the answer read so far (0: the responder has not started answering)
        self._buf = bytearray()

    def extend(self, deadline: float) -> None:
        self.deadline = max(self.deadline, deadline)

    def shorten(self, deadline: float) -> None:
        self.deadline = min(self.deadline, deadline)

    def cancel(self) -> None:
        """Wake a reader blocked on the answer (it then fails with 'did not answer in time')."""
        self.deadline = 0.0
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def _fill(self) -> None:
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            # short waits, so a deadline extended meanwhile (py-spy still running) is seen
            self.sock.settimeout(min(left, 0.25))
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                raise EOFError
            self.received += len(chunk)
            self._buf += chunk
            return

    def read_line(self, limit: int) -> bytes:
        while b"\n" not in self._buf:
            if len(self._buf) > limit:
                raise ValueError("answer header too long")
            self._fill()
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return line

    def read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


def request_dump(job_dir: str, rank: int, token: str, pid: int | None = None) -> DumpRequest | str:
    """Ask the rank's responder for a dump: the open request, or an error string when it cannot be asked.

    Only the rank itself may answer: the socket must be a socket (not a symlink to some other service's),
    and the peer behind it must run as the socket's owner and, when ``pid`` is given, be that process."""
    path = ctl_path(job_dir, rank)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "dump responder not listening (no control socket)"
    except OSError as exc:
        return f"dump responder unreachable: {exc.strerror}"
    if not stat.S_ISSOCK(st.st_mode):
        return "dump responder unreachable: its control file is not a socket (a hook older than this watchdog?)"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        with socket_address(path) as address:
            sock.connect(address)
        peer_pid, peer_uid, _ = peer_cred(sock)
        if peer_uid != st.st_uid:
            sock.close()
            return f"dump responder refused: the peer runs as uid {peer_uid}, the socket belongs to uid {st.st_uid}"
        if pid is not None and peer_pid != pid:
            sock.close()
            return f"dump responder refused: answered by pid {peer_pid}, not by the rank (pid {pid})"
        sock.sendall(f"dump {token}\n".encode())
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return "dump responder not listening"
        return f"dump responder unreachable: {exc.strerror or exc}"
    return DumpRequest(sock)


def collect_dump(req: DumpRequest, deadline: float, cap: RankCapture) -> None:
    """Read the responder's answer into ``cap`` until ``deadline`` (``req.extend`` may push it back)."""
    req.extend(deadline)
    got: dict[str, bytes] = {}
    try:
        while True:
            header = req.read_line(64).decode("ascii", "replace").split()
            if len(header) != 2 or header[0] not in _FRAME_LIMITS or not header[1].isdigit():
                cap.responder_error = "dump responder sent a malformed answer"
                return
            kind, size = header[0], int(header[1])
            if size > _FRAME_LIMITS[kind]:
                cap.responder_error = f"dump responder answer too large ({kind}: {size} bytes)"
                return
            if kind == "done":
                break
            got[kind] = req.read_exact(size)
    except (TimeoutError, EOFError, OSError, ValueError):
        cap.responder_error = (
            "dump responder sent its stacks but not the flight recorder in time"
            if "stacks" in got
            else "dump responder did not answer in time"
        )
    finally:
        req.close()
    if "stacks" in got:
        try:
            stacks = json.loads(got["stacks"])
        except (ValueError, RecursionError):
            stacks = None
        cap.responder_stacks = stacks if isinstance(stacks, dict) else None
    if "fr" in got:
        cap.fr_json = got["fr"]
    elif "fr_err" in got:
        cap.notes.append("flight recorder: " + got["fr_err"].decode("utf-8", "replace"))


def gil_held_idle(threads: object) -> str | None:
    """The name of a thread that holds the GIL while not running (py-spy's ``owns_gil`` and not ``active``):
    it sits in a C call that did not release the GIL, so no other thread of the process — the dump
    responder included — can run until that call returns. A thread that holds the GIL while *running*
    (a Python loop) gives it up every switch interval, so the responder still answers there."""
    for t in _threads(threads):
        if t.get("owns_gil") is True and t.get("active") is False:
            return clean(t.get("thread_name") or t.get("os_thread_id"), NAME)
    return None


def capture_as_owner(
    rank: int, pid: int, stopped: bool, job_dir: str, token: str, policy: CapturePolicy,
    pyspy: Callable[[bool], tuple[Any, str | None]],
) -> dict[str, Any]:
    """One rank's capture, run by its owner's reader (the ``capture`` request: the owner's uid, or in-process in
    an unprivileged daemon): asks the responder, reads its answer while py-spy runs, parses the stacks and
    the flight-recorder dump, and returns them as a bounded, typed document (``capture_from_doc`` checks it
    again on the root side). ``pyspy(nonblocking)`` runs py-spy as this process."""
    cap = RankCapture(rank=rank, pid=pid)
    deadline = time.monotonic() + policy.responder_timeout_s
    asked = request_dump(job_dir, rank, token, pid) if not stopped else "rank is stopped; responder cannot run"
    reader = None
    if isinstance(asked, str):
        cap.responder_error = asked
    else:
        # the answer is read while py-spy runs: a flight-recorder trace is larger than a socket buffer
        reader = threading.Thread(target=collect_dump, args=(asked, deadline, cap), name="rankwatch-dump-reader")
        reader.start()
    threads, err = pyspy(stopped)
    if threads is None and not stopped:
        # blocking dumps fail on processes that cannot be paused; the nonblocking read still works
        threads, err2 = pyspy(True)
        if threads is None:
            err = f"{err}; nonblocking: {err2}"
    cap.pyspy_threads, cap.pyspy_error = threads, err
    if reader is not None and not isinstance(asked, str):
        # py-spy pauses the rank while it reads it: the responder gets a little time after that
        asked.extend(time.monotonic() + COLLECT_GRACE_S)
        holder = gil_held_idle(threads)
        if holder is not None and asked.received == 0:
            # the responder cannot run before that C call returns: waiting out its timeout only delays the
            # verdict, and py-spy already has the stacks
            asked.shorten(time.monotonic() + COLLECT_GRACE_S)
        reader.join(max(asked.deadline - time.monotonic(), 0.0) + 1.0)
        if reader.is_alive():
            asked.cancel()
            reader.join()
        if holder is not None and cap.responder_error is not None and cap.responder_stacks is None:
            cap.responder_error = (
                f"dump responder did not answer: thread {holder} holds the GIL in a C call, so it cannot run"
            )
    return capture_to_doc(cap)


MAX_NOTES = 16
# what one rank's capture may put on the wire (``privsep.frames.MAX_FRAME`` is 24 MiB): a trace beyond its
# share is cut to its newest entries per process group, stacks beyond theirs are dropped with a note
FR_WIRE_BYTES = 8 << 20
PARSE_MARGIN_S = 15.0  # a 64 MiB dump parses in about a second; ten times that on an overloaded host
CAPTURE_WIRE_BYTES = 20 << 20


def capture_to_doc(cap: RankCapture) -> dict[str, Any]:
    """A capture as the reader sends it: stacks shape-checked, the dump parsed and compacted (owner side)."""
    notes = list(cap.notes)
    fr_doc = None
    if cap.fr_json is not None:
        fr_doc, note = fr_wire_doc(cap.fr_json, FR_WIRE_BYTES)
        if note:
            notes.append(f"flight recorder: {note}")
    resp = cap.responder_stacks if isinstance(cap.responder_stacks, dict) else None
    doc: dict[str, Any] = {
        "pyspy_threads": shape_threads(cap.pyspy_threads) if cap.pyspy_threads is not None else None,
        "pyspy_error": cap.pyspy_error,
        "responder_threads": shape_threads(resp.get("threads")) if resp is not None else None,
        "responder_error": cap.responder_error,
        "fr": fr_doc,
        "notes": [str(n)[:300] for n in notes[:MAX_NOTES]],
    }
    for key, why in (("fr", "flight-recorder trace"), ("responder_threads", "responder's stacks"),
                     ("pyspy_threads", "py-spy's stacks")):
        if len(json.dumps(doc, separators=(",", ":"))) <= CAPTURE_WIRE_BYTES:
            break
        doc[key] = None
        doc["notes"].append(f"{why} dropped: the capture is over {CAPTURE_WIRE_BYTES} bytes")
    return doc


def capture_from_doc(doc: dict[str, Any], rank: int, pid: int) -> RankCapture:
    """The root side of ``capture_to_doc``: every field checked again (the reader is the owner's process, so
    the owner can make it answer anything); what does not fit its type is dropped, never trusted."""
    cap = RankCapture(rank=rank, pid=pid)

    def text(v: object) -> str | None:
        return clean(v, FIELD) if isinstance(v, str) else None

    cap.pyspy_threads = shape_threads(doc.get("pyspy_threads"))
    cap.pyspy_error = text(doc.get("pyspy_error"))
    if cap.pyspy_threads is None and cap.pyspy_error is None:
        cap.pyspy_error = "py-spy gave no stacks"
    threads = shape_threads(doc.get("responder_threads"))
    cap.responder_stacks = {"pid": pid, "rank": rank, "threads": threads} if threads is not None else None
    cap.responder_error = text(doc.get("responder_error"))
    raw_notes = doc.get("notes")
    notes: list[Any] = raw_notes if isinstance(raw_notes, list) else []
    cap.notes = [clean(n, PROSE)[:300] for n in notes[:MAX_NOTES] if isinstance(n, str)]
    fr = doc.get("fr")
    if fr is not None:
        cap.fr_trace, rejected = _reader_trace(fr, rank)
        if rejected:
            cap.notes.append(f"flight recorder: {rejected}")
    return cap


def _reader_trace(fr: Any, rank: int) -> tuple[RankTrace | None, str | None]:
    """A trace an owner's reader handed back, checked again as root: the trace, or why it was rejected."""
    try:
        return parse_dump(fr, rank), None
    except (FlightRecorderFormatError, ValueError, TypeError, RecursionError) as exc:
        return None, f"the reader's trace rejected: {clean(str(exc), FIELD)[:200]}"


def _ask_owner(job_dir: str, req: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``req`` answered by a one-shot reader of the job dir's owner, handed the dir as an fd (whatever its name
    points at by now is not followed). OSError: the dir could not be opened; ReaderError: no answer."""
    dfd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        return default_readers().ask(st.st_uid, st.st_gid, req, (dfd,), timeout_s)
    finally:
        os.close(dfd)


@handler("capture")
def _capture_request(w: Worker, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """One rank's whole capture as its owner: responder asked and its answer parsed, py-spy run; the job
    dir comes as an fd (the one root opened), its socket reached through it."""
    if len(fds) != 1:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise ValueError("capture needs exactly one dir fd")
    try:
        pid = w_int(req.get("pid"), 1, 1 << 22)
        policy = CapturePolicy(pyspy_timeout_s=w_float(req.get("pyspy_timeout_s")),
                               responder_timeout_s=w_float(req.get("responder_timeout_s")),
                               include_locals=req.get("locals") is True)
        stopped = req.get("stopped") is True
        return capture_as_owner(
            w_int(req.get("rank"), 0, 1 << 31), pid, stopped, f"/proc/self/fd/{fds[0]}",
            w_str(req.get("token"), 128), policy,
            lambda nonblocking: _run_pyspy_as(w, pid, policy.pyspy_timeout_s, nonblocking, policy.include_locals),
        )
    finally:
        with contextlib.suppress(OSError):
            os.close(fds[0])


def _capture_one(rank: int, pid: int, stopped: bool, job_dir: str, token: str, policy: CapturePolicy) -> RankCapture:
    """Root's part of one rank's capture: hand the job dir (an fd: whatever its name points at by now is not
    followed) to a one-shot reader of its owner, which does all the reading and parsing; check its answer."""
    req = {"op": "capture", "rank": rank, "pid": pid, "stopped": stopped, "token": token,
           "pyspy_timeout_s": policy.pyspy_timeout_s, "responder_timeout_s": policy.responder_timeout_s,
           "locals": policy.include_locals}
    # py-spy twice at most (blocking, then nonblocking), the responder's wait, and parsing a dump of up to
    # MAX_FR_BYTES on a loaded host
    limit = 2 * policy.pyspy_timeout_s + policy.responder_timeout_s + COLLECT_GRACE_S + PARSE_MARGIN_S
    try:
        out = _ask_owner(job_dir, req, limit)
    except OSError as exc:
        return RankCapture(rank=rank, pid=pid, pyspy_error=f"the job dir is gone: {exc.strerror}")
    except ReaderError as exc:
        return RankCapture(rank=rank, pid=pid, pyspy_error=clean(str(exc), FIELD),
                           responder_error="the owner's reader did not answer")
    if isinstance(out.get("error"), str) and "pyspy_threads" not in out:
        return RankCapture(rank=rank, pid=pid, pyspy_error=clean(out["error"], FIELD))
    cap = capture_from_doc(out, rank, pid)
    if cap.pyspy_threads is None:
        st_ = read_stat(pid)
        cap.vanished = st_ is None or st_.state in ("Z", "X")
    elif not stopped and not cap.main_frames():
        cap.vanished = True
    if cap.pyspy_error:
        log.warning("pyspy_failed", rank=rank, pid=pid, error=cap.pyspy_error)
    return cap


@handler("exit_dump")
def _exit_dump_request(w: Worker, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """The flight recorder a gone rank wrote as it ended (``hooks.exit_dump``), read as its owner through the job
    dir's fd (every level opened without following a symlink, a regular file of at most ``MAX_FR_BYTES``) and
    parsed, bounded and typed as a responder's dump is (``fr_wire_doc``)."""
    if len(fds) != 1:
        for fd in fds:
            close_quietly(fd)
        raise ValueError("exit_dump needs exactly one dir fd")
    opened: list[int] = []
    try:
        rank, pid = w_int(req.get("rank"), 0, 1 << 31), w_int(req.get("pid"), 1, 1 << 22)
        try:
            opened.append(open_dir(DUMPS_DIR, fds[0]))
            opened.append(open_dir(exit_dir(pid), opened[-1]))
            data = read_regular(opened[-1], dump_name(rank), MAX_FR_BYTES)
        except FileNotFoundError:
            return {"fr": None, "note": None}
        except (OSError, ValueError) as exc:
            return {"fr": None, "note": f"dump at exit unreadable: {exc}"[:300]}
        doc, note = fr_wire_doc(data, FR_WIRE_BYTES)
        return {"fr": doc, "note": note}
    finally:
        for fd in (*opened, fds[0]):
            close_quietly(fd)


AT_EXIT = "flight recorder: dumped by the rank as it ended (the responder was never asked)"


def _exit_dump_one(rank: int, pid: int, job_dir: str, timeout_s: float) -> tuple[RankTrace | None, str | None]:
    """Root's part: hand the job dir (an fd) to a one-shot reader of its owner, check its answer again."""
    try:
        out = _ask_owner(job_dir, {"op": "exit_dump", "rank": rank, "pid": pid}, timeout_s)
    except OSError:
        return None, None
    except ReaderError as exc:
        return None, f"flight recorder at exit: {clean(str(exc), FIELD)}"[:300]
    note = clean(out["note"], PROSE)[:300] if isinstance(out.get("note"), str) else None
    fr = out.get("fr")
    if fr is None:
        return None, note and f"flight recorder at exit: {note}"
    trace, rejected = _reader_trace(fr, rank)
    if rejected:
        return None, f"flight recorder at exit: {rejected}"
    return trace, AT_EXIT + (f"; {note}" if note else "")


def exit_dumps(gone: Sequence[tuple[int, int]], job_dir: str, policy: CapturePolicy) -> dict[int, RankCapture]:
    """(rank, pid) of local ranks that are gone with no flight recorder captured → a capture holding the trace
    each wrote as it ended, where it did (a note where the file was there but unusable; nothing where there
    is none: a rank killed by SIGKILL or gloo's abort writes none). All in parallel, never raising."""
    if not gone:
        return {}
    # reading and parsing a dump of up to MAX_FR_BYTES on a loaded host (as a capture's parse)
    timeout_s = PARSE_MARGIN_S + policy.responder_timeout_s
    # made here if not yet: a zygote forked from a pool thread would die with that thread (PR_SET_PDEATHSIG)
    default_readers()
    out: dict[int, RankCapture] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(gone)), thread_name_prefix="rankwatch-exit-dump") as pool:
        futures = {pool.submit(_exit_dump_one, rank, pid, job_dir, timeout_s): (rank, pid) for rank, pid in gone}
        for fut, (rank, pid) in futures.items():
            try:
                trace, note = fut.result()
            except Exception as exc:  # one unreadable dump never costs the others
                trace, note = None, f"flight recorder at exit: {exc!r}"[:300]
            if trace is not None or note:
                out[rank] = RankCapture(rank=rank, pid=pid, fr_trace=trace, notes=[note] if note else [])
    return out


def capture_all(
    targets: Sequence[tuple[int, int, bool]], job_dir: str, token: str, policy: CapturePolicy
) -> dict[int, RankCapture]:
    """(rank, pid, stopped) for every live local rank → captures, all in parallel."""
    if not targets:
        return {}
    results: dict[int, RankCapture] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(targets)), thread_name_prefix="rankwatch-capture") as pool:
        futures = {
            pool.submit(_capture_one, rank, pid, stopped, job_dir, token, policy): rank
            for rank, pid, stopped in targets
        }
        for fut, rank in futures.items():
            try:
                results[rank] = fut.result()
            except Exception as exc:  # one failing capture never costs the others
                results[rank] = RankCapture(rank=rank, pid=-1, pyspy_error=f"capture failed: {exc!r}")
    return results


def _frame_line(f: object) -> str:
    if not isinstance(f, dict):
        return f"    {clean(f, FIELD)}"
    return f"    {clean(f.get('name'), NAME)} ({clean(f.get('filename'), FIELD)}:{clean(f.get('line'), 12)})"


def _threads(value: object) -> list[dict[str, Any]]:
    return [t for t in value if isinstance(t, dict)] if isinstance(value, list) else []


def render_text(cap: RankCapture) -> str:
    """A rank's stacks as text. Function, file and thread names come from the training process (py-spy reads
    its memory; the responder is code running inside it): every one is cleaned and bounded (``core.text``)."""
    lines = [f"rank {cap.rank} pid {cap.pid}"]
    if cap.pyspy_threads:
        for t in _threads(cap.pyspy_threads):
            lines.append(
                f"Thread {clean(t.get('os_thread_id'), NAME)} ({clean(t.get('thread_name'), NAME)})"
                + (" active" if t.get("active") else "")
            )
            lines.extend(_frame_line(f) for f in t.get("frames") or [])
    elif cap.responder_stacks:
        lines.append("(from the rank's dump responder; py-spy unavailable)")
        for t in _threads(cap.responder_stacks.get("threads")):
            lines.append(f"Thread {clean(t.get('thread_id'), NAME)} ({clean(t.get('thread_name'), NAME)})")
            lines.extend(_frame_line(f) for f in t.get("frames") or [])
    else:
        lines.append("no stack captured")
    for label, err in (("py-spy", cap.pyspy_error), ("responder", cap.responder_error)):
        if err:
            lines.append(f"{label}: {clean(err, FIELD)}")
    lines.extend(clean(n, PROSE) for n in cap.notes)
    return "\n".join(lines) + "\n"
