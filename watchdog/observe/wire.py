"""Rank snapshots on the readers' wire: a record's snapshot as a document, and rebuilt from a reader's answer
field by field with types and ranges checked (``snapshot_from_doc``), never unpickled (frames:
``privsep.frames``)."""

from __future__ import annotations

from typing import Any

from rankwatch.hooks.record import RecordSnapshot

from ..core.snapshot import MAX_KNOWN_PEERS, P2P_DIRECTIONS
from ..core.steps import StepTiming
from ..privsep.frames import I64, MAX_STR, WireError, w_float, w_int, w_opt_str, w_str

__all__ = ["MAX_STR", "WireError", "snapshot_from_doc", "snapshot_to_doc"]

MAX_STEPS = 4096  # steps per snapshot (the ring holds 512)
MAX_PHASES = 64


def _phases(v: Any) -> dict[str, float]:
    if not isinstance(v, dict) or len(v) > MAX_PHASES:
        raise WireError("expected a small phase table")
    return {w_str(k, 64): w_float(x) for k, x in v.items()}



def snapshot_to_doc(s: RecordSnapshot) -> dict[str, Any]:
    return {
        "pid": s.pid, "global_rank": s.global_rank, "local_rank": s.local_rank, "world_size": s.world_size,
        "local_world_size": s.local_world_size, "node_rank": s.node_rank, "device": s.device,
        "hostname": s.hostname, "job_id": s.job_id, "start_ns": s.start_ns, "flags": s.flags,
        "phase_names": list(s.phase_names), "phase_budget_s": list(s.phase_budget_s), "step": s.step,
        "step_start_ns": s.step_start_ns, "phase": s.phase, "phase_start_ns": s.phase_start_ns,
        "last_progress_ns": s.last_progress_ns, "transitions": s.transitions,
        "coll_seq_entered": s.coll_seq_entered, "coll_seq_completed": s.coll_seq_completed,
        "coll_op": s.coll_op, "budget_s": s.budget_s, "budget_start_ns": s.budget_start_ns,
        "exit_ns": s.exit_ns, "steps_done": s.steps_done, "crash_info": s.crash_info,
        "thread_error": s.thread_error,
        "gpu_phase_ms": s.gpu_phase_ms,
        "p2p_dir": s.p2p_dir, "p2p_peer": s.p2p_peer, "p2p_known": list(s.p2p_known),
        "p2p_known_full": s.p2p_known_full,
        "steps": [
            [t.step, t.start_ns, t.end_ns, t.phases_ms, t.input_ms, t.input_batches, t.input_workers]
            for t in s.recent_steps
        ],
    }


def snapshot_from_doc(d: Any, path: str) -> RecordSnapshot:
    """A RecordSnapshot from a reader's answer, every field type- and range-checked (WireError)."""
    if not isinstance(d, dict):
        raise WireError("snapshot: expected an object")
    steps = d.get("steps")
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise WireError("snapshot: steps malformed")
    timings = []
    for t in steps:
        if not isinstance(t, list) or len(t) != 7:
            raise WireError("snapshot: step entry malformed")
        timings.append(
            StepTiming(
                step=w_int(t[0]), start_ns=w_int(t[1]), end_ns=w_int(t[2]), phases_ms=_phases(t[3]),
                input_ms=w_float(t[4]), input_batches=w_int(t[5], hi=1 << 32), input_workers=w_int(t[6], hi=1 << 16),
            )
        )
    names = d.get("phase_names")
    budgets = d.get("phase_budget_s")
    if not isinstance(names, list) or not isinstance(budgets, list) or len(names) > MAX_PHASES:
        raise WireError("snapshot: phase table malformed")
    i32 = (-(1 << 31), (1 << 31) - 1)
    return RecordSnapshot(
        path=path,
        pid=w_int(d.get("pid"), *I64),
        global_rank=w_int(d.get("global_rank"), 0, i32[1]),
        local_rank=w_int(d.get("local_rank"), *i32),
        world_size=w_int(d.get("world_size"), 1, i32[1]),
        local_world_size=w_int(d.get("local_world_size"), *i32),
        node_rank=w_int(d.get("node_rank"), *i32),
        device=w_int(d.get("device"), *i32),
        hostname=w_str(d.get("hostname"), 128),
        job_id=w_str(d.get("job_id"), 128),
        start_ns=w_int(d.get("start_ns")),
        flags=w_int(d.get("flags"), 0, (1 << 32) - 1),
        phase_names=tuple(w_str(n, 64) for n in names),
        phase_budget_s=tuple(w_float(b) for b in budgets),
        step=w_int(d.get("step")),
        step_start_ns=w_int(d.get("step_start_ns")),
        phase=w_opt_str(d.get("phase"), 64),
        phase_start_ns=w_int(d.get("phase_start_ns")),
        last_progress_ns=w_int(d.get("last_progress_ns")),
        transitions=w_int(d.get("transitions")),
        coll_seq_entered=w_int(d.get("coll_seq_entered")),
        coll_seq_completed=w_int(d.get("coll_seq_completed")),
        coll_op=w_opt_str(d.get("coll_op"), 64),
        budget_s=w_float(d.get("budget_s")),
        budget_start_ns=w_int(d.get("budget_start_ns")),
        exit_ns=w_int(d.get("exit_ns")),
        steps_done=w_int(d.get("steps_done")),
        crash_info=w_str(d.get("crash_info"), 1024),
        thread_error=w_str(d.get("thread_error", ""), 1024),
        gpu_phase_ms=_phases(d.get("gpu_phase_ms")),
        recent_steps=tuple(timings),
        **_p2p(d),
    )


def _p2p(d: dict[str, Any]) -> dict[str, Any]:
    """The send/recv fields (a reader of an older release sends none: nothing known)."""
    direction, peer, known = d.get("p2p_dir"), d.get("p2p_peer"), d.get("p2p_known", [])
    if direction is not None and direction not in P2P_DIRECTIONS:
        raise WireError("snapshot: p2p_dir malformed")
    if not isinstance(known, list) or len(known) > MAX_KNOWN_PEERS:
        raise WireError("snapshot: p2p_known malformed")
    return {"p2p_dir": direction, "p2p_peer": None if peer is None else w_int(peer, 0, (1 << 31) - 1),
            "p2p_known": tuple(w_int(p, 0, (1 << 31) - 1) for p in known),
            "p2p_known_full": d.get("p2p_known_full", False) is True}
