"""What one rank did, in one line from its own messages: the "other ranks" list of a diagnosis (the document
and the text both show it). Pure."""

from __future__ import annotations

from . import events as ev
from .facts import RankFacts


def activity(f: RankFacts) -> str:
    """One line: what this rank was doing / how it ended, from its own messages."""
    parts: list[str] = []
    for fam, what in (
        (ev.NCCL_TIMEOUT, "NCCL watchdog timeout"),
        (ev.GLOO_TIMEOUT, "gloo timeout"),
        (ev.PEER_LOST, "lost its peer"),
        (ev.TIMEOUT_REPORTED, "timed out"),
        (ev.DUMP_SIGNAL, "told to dump by another rank"),
        (ev.HEARTBEAT, "heartbeat monitor abort"),
        (ev.WATCHDOG_ABORT, "taken down by its NCCL watchdog"),
        (ev.SIZE_MISMATCH, "received a wrong-sized message"),
        (ev.OP_MISMATCH, "collective fingerprint mismatch"),
        (ev.COMM_ERROR, "communication error"),
        (ev.CUDA_ERROR, "CUDA error"),
        (ev.CUDA_OOM, "CUDA out of memory"),
        (ev.HW_FAULT, "GPU hardware fault"),
        (ev.HOST_OOM, "killed by the OOM killer"),
        (ev.PY_ERROR, "Python exception"),
        (ev.FINISHED, "finished"),
    ):
        e = f.first.get(fam)
        if e is None:
            continue
        extra = ""
        if fam == ev.DUMP_SIGNAL:
            if f.told is None:
                what = "its own watchdog signalled a flight-recorder dump"
            else:
                what = f"told that {f.told.detail} timed out (not its own timeout)"
        elif fam == ev.NCCL_TIMEOUT and e.seq is not None:
            extra = f" in {e.op} #{e.seq}"
        elif e.detail and fam != ev.FINISHED:
            extra = f" ({e.detail[:80]})"
        parts.append(what + extra)
    if f.status is not None and f.status.enqueued is not None:
        parts.append(f"last enqueued #{f.status.enqueued}, completed #{f.status.completed}")
    tb = f.traceback
    if tb is not None and (tb.op or tb.detail):
        where = tb.op or tb.phase or "?"
        parts.append(f"stack in {where}" + (f" at {tb.detail}" if tb.detail else ""))
    if f.exit is not None:
        how = f.exit.signal or f"exit code {f.exit.exitcode}"
        by = " from torchrun" if f.agent_terminated and f.exit.signal == "SIGTERM" else ""
        parts.append(f"ended by {how}{by}")
    return "; ".join(parts) if parts else "no messages from this rank"
