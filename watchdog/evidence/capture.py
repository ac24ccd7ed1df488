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
import shutil
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
from rankwatch.hooks.responder import ctl_path

from ..core.policy import CapturePolicy
from ..core.stacks import Frame

log = structlog.get_logger("rankwatch.capture")

@dataclass
class RankCapture:
    rank: int
    pid: int
    pyspy_threads: list[dict[str, Any]] | None = None
    pyspy_error: str | None = None
    responder_stacks: dict[str, Any] | None = None
    responder_error: str | None = None
    fr_json: bytes | None = None
    notes: list[str] = field(default_factory=list)

    def main_frames(self) -> list[Frame]:
        """The training thread's frames, innermost first, from py-spy if it worked, else the responder."""
        if self.pyspy_threads:
            main = next(
                (t for t in self.pyspy_threads if t.get("os_thread_id") == self.pid),
                next((t for t in self.pyspy_threads if t.get("thread_name") == "MainThread"), None),
            )
            if main is not None:
                return [
                    Frame(str(f.get("name")), str(f.get("filename")), int(f.get("line") or 0)) for f in main["frames"]
                ]
        if self.responder_stacks:
            for t in self.responder_stacks.get("threads", []):
                if t.get("thread_name") == "MainThread":
                    return [Frame(str(f["name"]), str(f["filename"]), int(f["line"])) for f in t["frames"]]
        return []


def pyspy_available() -> str | None:
    return shutil.which("py-spy")


def pyspy_dump(pid: int, timeout_s: float, nonblocking: bool, include_locals: bool) -> tuple[Any, str | None]:
    exe = pyspy_available()
    if exe is None:
        return None, "py-spy not installed"
    cmd = [exe, "dump", "--pid", str(pid), "--json"]
    if nonblocking:
        cmd.append("--nonblocking")
    if include_locals:
        cmd.append("--locals")
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, f"py-spy timed out after {timeout_s:.1f}s"
    except OSError as exc:
        return None, f"py-spy failed to start: {exc}"
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        first = err[0] if err else f"exit code {proc.returncode}"
        if "Permission" in first or "ptrace" in first.lower():
            first += " (py-spy needs CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0)"
        return None, first
    try:
        return json.loads(proc.stdout), None
    except ValueError:
        return None, "py-spy printed invalid JSON"


def request_dump(job_dir: str, rank: int, token: str) -> str | None:
    """Ask the rank's responder for a dump; returns an error string when it cannot be asked."""
    path = ctl_path(job_dir, rank)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return "dump responder not listening"
        return f"dump responder unreachable: {exc.strerror}"
    try:
        os.write(fd, f"dump {token}\n".encode())
    except OSError as exc:
        return f"dump request failed: {exc.strerror}"
    finally:
        os.close(fd)
    return None


def collect_dump(job_dir: str, rank: int, token: str, deadline: float, cap: RankCapture) -> None:
    base = os.path.join(job_dir, "dumps", token, f"rank-{rank}")
    while time.monotonic() < deadline and not os.path.exists(base + ".done"):
        time.sleep(0.05)
    if not os.path.exists(base + ".done"):
        cap.responder_error = "dump responder did not answer in time"
        return
    with contextlib.suppress(OSError, ValueError), open(base + ".stacks.json", "rb") as f:
        cap.responder_stacks = json.loads(f.read(8 << 20))
    with contextlib.suppress(OSError), open(base + ".fr.json", "rb") as f:
        cap.fr_json = f.read(64 << 20)
    if cap.fr_json is None:
        with contextlib.suppress(OSError), open(base + ".fr.err", "rb") as f:
            cap.notes.append("flight recorder: " + f.read(4096).decode("utf-8", "replace"))


def _capture_one(rank: int, pid: int, stopped: bool, job_dir: str, token: str, policy: CapturePolicy) -> RankCapture:
    cap = RankCapture(rank=rank, pid=pid)
    deadline = time.monotonic() + policy.responder_timeout_s
    asked = request_dump(job_dir, rank, token) if not stopped else "rank is stopped; responder cannot run"
    if asked is not None:
        cap.responder_error = asked
    threads, err = pyspy_dump(pid, policy.pyspy_timeout_s, nonblocking=stopped, include_locals=policy.include_locals)
    if threads is None and not stopped:
        # blocking dumps fail on processes that cannot be paused; the nonblocking read still works
        threads, err2 = pyspy_dump(pid, policy.pyspy_timeout_s, nonblocking=True, include_locals=policy.include_locals)
        if threads is None:
            err = f"{err}; nonblocking: {err2}"
    cap.pyspy_threads, cap.pyspy_error = threads, err
    if asked is None:
        collect_dump(job_dir, rank, token, deadline, cap)
    if cap.pyspy_error:
        log.warning("pyspy_failed", rank=rank, pid=pid, error=cap.pyspy_error)
    return cap


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
    with contextlib.suppress(OSError):
        shutil.rmtree(os.path.join(job_dir, "dumps", token))
    return results


def render_text(cap: RankCapture) -> str:
    lines = [f"rank {cap.rank} pid {cap.pid}"]
    if cap.pyspy_threads:
        for t in cap.pyspy_threads:
            lines.append(
                f"Thread {t.get('os_thread_id')} ({t.get('thread_name')}){' active' if t.get('active') else ''}"
            )
            lines.extend(f"    {f.get('name')} ({f.get('filename')}:{f.get('line')})" for f in t.get("frames", []))
    elif cap.responder_stacks:
        lines.append("(from the rank's dump responder; py-spy unavailable)")
        for t in cap.responder_stacks.get("threads", []):
            lines.append(f"Thread {t.get('thread_id')} ({t.get('thread_name')})")
            lines.extend(f"    {f['name']} ({f['filename']}:{f['line']})" for f in t.get("frames", []))
    else:
        lines.append("no stack captured")
    for label, err in (("py-spy", cap.pyspy_error), ("responder", cap.responder_error)):
        if err:
            lines.append(f"{label}: {err}")
    lines.extend(cap.notes)
    return "\n".join(lines) + "\n"
