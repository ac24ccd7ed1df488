"""Dump responder: a daemon thread that writes this rank's flight-recorder trace and Python stacks on request.

The daemon asks by writing ``dump <token>\\n`` into the rank's FIFO ``rank-<g>.ctl``. The answer lands in
``dumps/<token>/``: ``rank-<g>.fr.json`` (flight recorder, when torch recorded anything),
``rank-<g>.stacks.json`` (every thread's Python stack, no local variables) and finally
``rank-<g>.done``; each file is written to a temp name and renamed, so a reader never sees half of one.
Blocking C++ calls (a gloo/NCCL wait) release the GIL and Python loops yield it every few ms, so the
thread answers while the training thread is stuck. ``faulthandler`` on SIGUSR2 is the fallback that
needs no GIL at all.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import traceback
from typing import Any

from .files import atomic_write

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_REQUEST = 256


def ctl_path(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"rank-{rank}.ctl")


def python_stacks() -> list[dict[str, Any]]:
    """Every thread's stack, innermost frame first (py-spy's order), without locals."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        frames = [
            {"name": fs.name, "filename": fs.filename, "line": fs.lineno}
            for fs in reversed(traceback.extract_stack(frame))
        ]
        out.append({"thread_id": ident, "thread_name": names.get(ident, "?"), "frames": frames})
    return out


def flight_recorder_json() -> tuple[bytes | None, str | None]:
    """(trace, why not): NCCL's dump where this build has one, else the generic flight recorder."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return None, "torch.distributed is not initialised in this process"
        from torch._C import _distributed_c10d as c10d
    except Exception as exc:
        return None, f"torch.distributed unavailable: {exc!r}"
    errors = []
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = fn(includeCollectives=True, onlyActive=False)
        except Exception as exc:
            errors.append(f"{name}: {exc!r}")
            continue
        if data:
            return bytes(data), None
        errors.append(f"{name}: empty trace (TORCH_FR_BUFFER_SIZE unset?)")
    return None, "; ".join(errors) or "this torch build has no flight recorder"


def answer(job_dir: str, rank: int, token: str) -> str:
    out_dir = os.path.join(job_dir, "dumps", token)
    os.makedirs(out_dir, mode=0o700, exist_ok=True)
    base = os.path.join(out_dir, f"rank-{rank}")
    stacks = {"pid": os.getpid(), "rank": rank, "threads": python_stacks()}
    atomic_write(base + ".stacks.json", json.dumps(stacks).encode())
    fr, why_not = flight_recorder_json()
    if fr is not None:
        atomic_write(base + ".fr.json", fr)
    else:
        atomic_write(base + ".fr.err", (why_not or "").encode())
    atomic_write(base + ".done", b"")
    return out_dir


class DumpResponder:
    def __init__(self, job_dir: str, rank: int) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.path = ctl_path(job_dir, rank)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.mkfifo(self.path, 0o600)
        # O_RDWR keeps a writer open ourselves, so reads block instead of seeing EOF between requests
        self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="rankwatch-dump-responder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._fd, MAX_REQUEST)
            except OSError:
                return
            if not chunk:
                return
            pending = (pending + chunk)[-MAX_REQUEST:]
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                parts = line.decode("ascii", "replace").split()
                if len(parts) == 2 and parts[0] == "dump" and _TOKEN.match(parts[1]):
                    with contextlib.suppress(Exception):
                        answer(self.job_dir, self.rank, parts[1])


def install_faulthandler(job_dir: str, rank: int) -> None:
    """SIGUSR2 dumps all threads to ``rank-<g>.faulthandler`` even when the GIL is held; only if unused."""
    try:
        if signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
            return
        path = os.path.join(job_dir, f"rank-{rank}.faulthandler")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        stream = os.fdopen(fd, "w")
        faulthandler.register(signal.SIGUSR2, file=stream, all_threads=True, chain=False)
        _keep.append(stream)
    except (OSError, ValueError, RuntimeError):
        pass


_keep: list[Any] = []
