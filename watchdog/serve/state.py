"""What a job's watchdog publishes for ``rankwatch status``: open incident, stalled ranks, recent incidents,
the job's straggler diagnosis.

``status`` is a separate process (often another user, or root on call): it reads the ranks' records
itself, but only the watchdog knows whether an incident is open and what its verdict said (and it has
diagnosed the job's stragglers already: status shows that diagnosis rather than making its own). The watchdog
writes ``watchdog.json`` (``rankwatch.state/1``) beside the job's records — owner-only, replaced
atomically, handed to the job dir's owner when a root daemon writes it — and, for a daemon, a copy under
its own ``--out`` (``<out>/<job>/state.json``), which a root daemon without ``CAP_DAC_OVERRIDE`` can
always write. It is rewritten when its content changes, else every ``ServePolicy.state_refresh_s``, so
its age tells ``status`` whether the watchdog is alive.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from rankwatch.hooks.files import atomic_write_in, read_in

from ..core.schema import STATE_SCHEMA
from ..core.straggler import StragglerDiagnosis
from ..core.straggler_cause import CAUSES, cause_line
from ..core.text import NAME, PROSE, clean

log = structlog.get_logger("rankwatch.state")

STATE_FILE = "watchdog.json"  # in the job's shm dir
OUT_STATE_FILE = "state.json"  # in <daemon out>/<job>/
MAX_STATE_BYTES = 256 * 1024
MAX_VERDICT_BYTES = 64 << 20  # a verdict of 8,192 ranks is a few MiB
# other nodes' ranks a state file lists as compared by the live diagnosis: ``CorrelationPolicy.live_ranks_merged``
# (64) with room; ~30 bytes each, so the list stays far below MAX_STATE_BYTES
MAX_REMOTE_LISTED = 1024


def incident_ref(doc: Mapping[str, Any], *, bundle: object = None, decided: bool = True) -> dict[str, Any]:
    """The gist of an incident as status shows it: from a verdict when the watchdog writes it, from an
    undecided trigger while the pipeline works, and again when ``status`` reads it back from a state file
    that anyone able to write the job dir may have replaced (so every field is re-typed and cleaned)."""
    ranks, phase, conf = doc.get("initiating_ranks"), doc.get("phase"), doc.get("confidence")
    return {
        "incident_id": clean(doc.get("incident_id"), NAME),
        "kind": clean(doc.get("kind"), NAME),
        "initiating_ranks": [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else [],
        "phase": clean(phase, NAME) if isinstance(phase, str) else None,
        "confidence": clean(conf, NAME) if isinstance(conf, str) else None,
        "decided": decided,
        "reason": clean(doc.get("reason") or "", PROSE),
        "bundle": clean(bundle, PROSE) if isinstance(bundle, str) else None,
    }


def diagnosis_doc(diag: StragglerDiagnosis | None, remote: Mapping[int, str] | None = None) -> dict[str, Any] | None:
    """The gist of the watchdog's straggler diagnosis as status shows it (None before the first one): its label
    and ranks, its cause (the rank it names — a straggler's, or on a communication-bound job the rank whose path
    is slow — and the cause's line), and ``remote_ranks``: the other nodes' ranks it compared (rank -> node name;
    the leader's live diagnosis merges every node's shared ranks, ``cluster.live_share``)."""
    if diag is None:
        return None
    cause = diag.cause or {}
    return diagnosis_ref({"label": diag.label, "straggler_ranks": diag.straggler_ranks, "phase": diag.phase,
                          "why": diag.why, "steps": diag.steps, "cause": cause.get("cause"),
                          "cause_rank": cause.get("rank"), "cause_text": cause_line(cause),
                          "remote_ranks": {str(r): n for r, n in sorted((remote or {}).items())}})


def _rank(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31


def diagnosis_ref(doc: object) -> dict[str, Any] | None:
    """``diagnosis_doc``'s document, and again when ``status`` reads it back from a state file anyone able to
    write the job dir may have replaced: every field re-typed and cleaned; None when it is not one."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("label"), str) or not doc["label"]:
        return None
    ranks, phase, steps, cause = doc.get("straggler_ranks"), doc.get("phase"), doc.get("steps"), doc.get("cause")
    cause_ok = isinstance(cause, str) and cause in CAUSES
    remote = doc.get("remote_ranks")
    text = doc.get("cause_text")
    return {
        "label": clean(doc["label"], NAME),
        "straggler_ranks": [r for r in ranks if isinstance(r, int) and not isinstance(r, bool)]
        if isinstance(ranks, list) else [],
        "phase": clean(phase, NAME) if isinstance(phase, str) and phase else None,
        "why": clean(doc.get("why") or "", PROSE),
        "steps": steps if isinstance(steps, int) and not isinstance(steps, bool) else 0,
        "cause": clean(cause, NAME) if cause_ok else None,
        "cause_rank": doc["cause_rank"] if cause_ok and _rank(doc.get("cause_rank")) else None,
        "cause_text": clean(text, PROSE) if cause_ok and isinstance(text, str) else "",
        "remote_ranks": _node_names(remote),
    }


def _node_names(doc: object) -> dict[str, str]:
    """Rank -> node name, as a state file carries it: rank keys only, names cleaned, bounded as a node's ranks are
    (``cluster.store.MAX_RANKS_PER_NODE`` × a few nodes): a state file is 256 KiB."""
    if not isinstance(doc, Mapping):
        return {}
    return {k: clean(v, NAME) for k, v in list(doc.items())[:MAX_REMOTE_LISTED]
            if isinstance(k, str) and k.isdigit() and isinstance(v, str)}


def job_diagnosis_ref(doc: object) -> dict[str, Any] | None:
    """A follower's copy of the leader's job-wide diagnosis (``live_share.JobDiagnosis.doc``) as ``status`` reads
    it back from a state file anyone able to write the job dir may have replaced: ``diagnosis_ref``'s fields, the
    straggler's excess, each named rank's node, the leader's name and whether the value was sealed — every field
    re-typed and cleaned; None when it is not one."""
    base = diagnosis_ref(doc)
    if base is None or not isinstance(doc, Mapping):
        return None
    def ms(v: object) -> float:
        return round(float(v), 3) if isinstance(v, int | float) and not isinstance(v, bool) else 0.0

    return {
        **base,
        "excess_ms": ms(doc.get("excess_ms")),
        "time_lost_ms": ms(doc.get("time_lost_ms")),
        "nodes": _node_names(doc.get("nodes")),
        "from": "leader",
        "leader": clean(doc.get("leader") or "node 0", NAME),
        "authenticated": doc.get("authenticated") is True,
    }


def state_doc(
    *,
    job_id: str,
    generation_start_unix: float | None = None,
    mode: str,
    on_stall: str,
    stall_timeout_s: float,
    stalled: Sequence[int],
    open_incident: dict[str, Any] | None,
    incidents: Sequence[dict[str, Any]],
    stragglers: Sequence[dict[str, Any]] = (),
    owner_lag_s: float = 0.0,
    diagnosis: dict[str, Any] | None = None,
    job_diagnosis: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The state document, without the time it is written (so two polls' documents compare equal)."""
    return {
        "schema": STATE_SCHEMA,
        "job_id": job_id,
        "watchdog_pid": os.getpid(),
        "watchdog_host": clean(socket.gethostname(), NAME),
        "mode": mode,
        "on_stall": on_stall,
        "stall_timeout_s": round(stall_timeout_s, 3),
        "stalled_ranks": list(stalled),
        "open_incident": open_incident,
        "incidents": list(incidents),
        "stragglers": list(stragglers),
        # how late this job's owner's previous look came (0 while the owner's lane keeps up): a user's own
        # flood or stopped reader slows only their jobs, and status says so
        "owner_lag_s": round(owner_lag_s, 1),
        "diagnosis": diagnosis,  # ``diagnosis_doc``: the job's straggler diagnosis, null before the first
        # on a follower of a multi-node job, the leader's job-wide live diagnosis (``JobDiagnosis.doc``) beside this
        # node's own in ``diagnosis``; null on the leader, on one node, and while the leader shares none
        "job_diagnosis": job_diagnosis,
        # which run of the job the open incident belongs to (a daemon restarted later resumes it only for
        # the same run: a reused job id is a new run)
        "generation_start_unix": None if generation_start_unix is None else round(generation_start_unix, 3),
    }


@dataclass(frozen=True)
class Resumable:
    """An incident a previous daemon reported for a job and had not closed when it stopped: what a restarted
    daemon needs to carry it on (same id, same bundle; its alert already sent) instead of opening it again."""

    incident_id: str
    verdict: dict[str, Any]
    bundle: str
    notified: bool  # the webhooks heard of it: a resolved notice is owed when it ends
    opened_unix: float
    generation_start_unix: float | None


def read_resumable(out_dir: str, job_id: str, incidents_dir: str) -> Resumable | None:
    """The open incident in ``<out>/<job>/state.json`` (this daemon's own directory, never the job dir a user
    writes), if its bundle exists under ``incidents_dir`` and its verdict reads back; None otherwise. Every
    field is re-typed: a file is not trusted because the daemon once wrote it."""
    try:
        raw = read_in(os.path.join(out_dir, job_id), OUT_STATE_FILE, MAX_STATE_BYTES)
        doc = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != STATE_SCHEMA or doc.get("job_id") != job_id:
        return None
    inc = doc.get("open_incident")
    if not isinstance(inc, dict) or inc.get("decided") is not True:
        return None
    incident_id, path = inc.get("incident_id"), inc.get("bundle")
    if not isinstance(incident_id, str) or not isinstance(path, str):
        return None
    if os.path.normpath(path) != os.path.join(os.path.normpath(incidents_dir), incident_id):
        return None  # a bundle this daemon writes is <incidents dir>/<incident id>, nowhere else
    try:
        verdict = json.loads(read_in(path, "verdict.json", MAX_VERDICT_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(verdict, dict) or verdict.get("incident_id") != incident_id:
        return None
    gen, opened = doc.get("generation_start_unix"), inc.get("opened_unix")
    return Resumable(
        incident_id=incident_id,
        verdict=verdict,
        bundle=path,
        notified=inc.get("notified") is True,
        opened_unix=float(opened) if isinstance(opened, (int, float)) and not isinstance(opened, bool) else time.time(),
        generation_start_unix=float(gen) if isinstance(gen, (int, float)) and not isinstance(gen, bool) else None,
    )


class StatePublisher:
    """Writes each job's state when it changed or is due; a write that fails is logged once per job and
    retried at the next refresh (status then falls back to what the records show)."""

    def __init__(self, refresh_s: float, out_dir: str | None) -> None:
        self.refresh_s = refresh_s
        self.out_dir = out_dir  # daemon: also <out>/<job>/state.json
        self._last: dict[str, tuple[dict[str, Any], float]] = {}
        self._failed: set[tuple[str, str]] = set()

    def publish(self, job_id: str, job_dir: str, doc: dict[str, Any], *, force: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(job_id)
        if not force and last is not None and last[0] == doc and now - last[1] < self.refresh_s:
            return
        self._last[job_id] = (doc, now)
        data = json.dumps({**doc, "updated_unix": round(time.time(), 3)}, indent=1).encode()
        self._write(job_id, job_dir, STATE_FILE, data, owner_of=job_dir)
        if self.out_dir is not None:
            job_out = os.path.join(self.out_dir, job_id)
            try:
                os.makedirs(job_out, mode=0o700, exist_ok=True)
            except OSError:
                pass
            self._write(job_id, job_out, OUT_STATE_FILE, data, owner_of=None)

    def forget(self, job_id: str) -> None:
        self._last.pop(job_id, None)

    def _write(self, job_id: str, directory: str, name: str, data: bytes, owner_of: str | None) -> None:
        try:
            uid = os.stat(owner_of, follow_symlinks=False).st_uid if owner_of else None
            atomic_write_in(directory, name, data, uid=uid)
            self._failed.discard((job_id, directory))
        except OSError as exc:
            if (job_id, directory) not in self._failed:
                self._failed.add((job_id, directory))
                log.info("state_unwritable", job=job_id, dir=directory, error=exc.strerror or str(exc))
