"""``rankwatch inspect``: name the initiating rank of a job that is hung right now and was never wrapped.

find ranks (``observe.discover``) → stacks, CPU, /proc states, flight-recorder files (``evidence.
inspect_capture``) → views (``core.inspect_facts``) → the live verdict's ``decide`` → print and bundle
(``report``), with ``--store`` after every node's evidence is in (``cluster.inspect_exchange``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.fr_trace import RankTrace
from ..core.inspect_facts import RankFact, views_from_facts
from ..core.policy import CapturePolicy
from ..core.snapshot import RankView
from ..core.stacks import Frame
from ..core.text import NAME, clean, clean_doc
from ..errors import UserError
from ..observe.discover import Job, discover, read_proc, select
from ..observe.process import protected_pids
from ..report.verdict_words import decide
from .argparser import Parser
from .options import host_port, positive_float

DESCRIPTION = """Name the rank a hung job waits for, without the hook and without a restart: find this node's
torch distributed ranks in the process table (torchrun's RANK/LOCAL_RANK/WORLD_SIZE in their environment,
the torchrun agent as their parent; DataLoader workers told apart), read every rank's stack with py-spy in
parallel, its /proc state and exit, and the flight-recorder dumps the job wrote or its torch debug server
(start_debug_server) serves; decide with the live verdict's rules; print the verdict and write a bundle.
Multi-node: run it on every node with the same --store HOST:PORT (HOST: node 0's address; node 0's
inspect hosts it) and every node prints one verdict. Nothing is signalled. Exit code 0 when a rank is
named, 1 when no ranks are found or no rank can be named, 2 on bad input."""

# store exchange: every node's inspect starts within this of the others (srun/kubectl exec on each node)
STORE_TIMEOUT_S = 60.0


def build_parser() -> Parser:
    p = Parser(prog="rankwatch inspect", description=DESCRIPTION)
    p.add_argument("--out", default="rankwatch-inspect", metavar="DIR",
                   help="bundles go to DIR/<job-id>/incidents/<id>/ (default: ./%(default)s)")
    p.add_argument("--pid", type=_pid, nargs="+", action="extend", default=[], metavar="PID",
                   help="only the ranks of the torchrun agent that runs this rank or DataLoader worker (or of this "
                   "agent): this node's part of one job")
    p.add_argument("--job", default=None, metavar="ID", help="only this job (TORCHELASTIC_RUN_ID or slurm-<id>)")
    p.add_argument("--store", type=host_port, default=None, metavar="HOST:PORT",
                   help="agree on one verdict with the other nodes' inspect runs through a TCPStore at HOST:PORT")
    p.add_argument("--store-timeout", type=positive_float, default=STORE_TIMEOUT_S, metavar="SECONDS",
                   help="how long to wait for the other nodes (default: %(default)s)")
    p.add_argument("--store-secret-file", default=os.environ.get("RANKWATCH_STORE_SECRET_FILE") or None,
                   metavar="PATH", help="shared secret that authenticates every store value")
    p.add_argument("--native", action="store_true", help="native (C/C++) frames too (pauses each rank longer)")
    p.add_argument("--pyspy-timeout", type=positive_float, default=CapturePolicy.pyspy_timeout_s, metavar="SECONDS",
                   help="how long py-spy may take per rank (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the rankwatch.verdict/1 document")
    return p


def _pid(text: str) -> int:
    if not text.strip().isdigit() or not 0 < int(text) < 1 << 31:
        raise argparse.ArgumentTypeError(f"expected a process id, got {text!r}")
    return int(text)


def facts_of(job: Job, captures: Mapping[int, Any], cpu: Mapping[int, float], node: str) -> list[RankFact]:
    """A fact per rank of this node: the live ones as captured, the zombies of the agents, and the local
    ranks the launcher started that are gone."""
    facts = []
    for r in job.ranks:
        now = read_proc(r.pid)
        alive = now is not None and now.start_ticks == r.proc.start_ticks
        cap = captures.get(r.rank)
        frames: tuple[Frame, ...] = tuple(cap.main_frames()) if cap is not None else ()
        facts.append(
            RankFact(
                rank=r.rank, node=node, node_rank=r.node_rank, pid=r.pid,
                proc_state=now.state if alive and now is not None else "",
                exit_status=now.exit_code if alive and now is not None else None,
                frames=frames, cpu_pct=cpu.get(r.rank), stack_error=cap.pyspy_error if cap is not None else None,
            )
        )
    missing = job.missing_ranks()
    zombies = [z for z in job.zombies if z.exit_code is not None]
    # an unreaped child of the agent is the missing local rank only when that pairing is unambiguous
    if len(missing) == 1 and len(zombies) == 1:
        (rank, node_rank), z = missing[0], zombies[0]
        facts.append(RankFact(rank, node, node_rank, z.pid, "Z", z.exit_code))
    else:
        facts += [RankFact(rank, node, node_rank, -1, "") for rank, node_rank in missing]
    return sorted(facts, key=lambda f: f.rank)


def _decide(
    job: Job, incident_id: str, views: Sequence[RankView], captures: Mapping[int, Any],
    remote_fr: Mapping[int, RankTrace], notes: Sequence[str],
) -> tuple[dict[str, Any], Any]:
    from ..evidence.flight_recorder import fr_evidence, with_remote

    fr = with_remote(fr_evidence({r: c for r, c in captures.items() if c.fr_trace is not None}), remote_fr)
    verdict = decide(
        views, job_id=job.job_id, incident_id=incident_id, detected_after_s=0.0,
        extra_evidence=[*fr.lines, *notes], fr_hints=fr.hints,
        steps_known=False,  # no record: step counters and phase timers are unknown, the reason names none
    ).to_json()
    verdict["source"] = "inspect"
    # the job's strings cleaned before the verdict goes anywhere: with --store the leader publishes this one
    return clean_doc(verdict), fr


def inspect_job(job: Job, args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    from ..evidence.inspect_capture import attach_debug_server_dumps, attach_fr_dumps, capture_job, worker_lines

    node = clean(socket.gethostname(), NAME)
    incident_id = "inspect-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    cap = capture_job(job, timeout_s=args.pyspy_timeout, native=args.native)
    facts = facts_of(job, cap.ranks, cap.cpu_pct, node)
    views, lines = views_from_facts(facts)
    gone = [f.rank for f in facts if f.pid < 0]
    fr_sources: dict[int, dict[str, str]] = {}
    fr_notes = attach_debug_server_dumps(job, cap.ranks, fr_sources)
    fr_notes += attach_fr_dumps(job, cap.ranks, gone, fr_sources)
    notes = [*lines, *worker_lines(cap.workers), *fr_notes]
    notes.append(f"stacks of {len(cap.ranks)} rank(s) read in {cap.seconds:.2f}s")
    verdict, fr = _decide(job, incident_id, views, cap.ranks, {}, notes)
    if args.store is not None:
        verdict = _shared_verdict(job, args, node, views, cap.ranks, fr.traces, notes, incident_id)
    # where this node's flight-recorder dumps came from, by rank: {"from": "debug_server", "address": ...}
    # or {"from": "file", "path": ...}; only the ones that parsed
    verdict["flight_recorder_sources"] = {str(r): fr_sources[r] for r in sorted(fr.traces) if r in fr_sources}
    # once more over the whole: a leader's verdict read from the store (anyone reaching it could write one)
    # and the dump paths the job's environment named; the bundle and the terminal get the same safe text
    verdict = clean_doc(verdict)
    path = _write_bundle(args.out, job, verdict, views, cap.ranks)
    return verdict, path


def _shared_verdict(
    job: Job, args: argparse.Namespace, node: str, views: Sequence[RankView], captures: Mapping[int, Any],
    fr_traces: Mapping[int, RankTrace], notes: Sequence[str], incident_id: str,
) -> dict[str, Any]:
    from ..cluster.auth import load_secret
    from ..cluster.inspect_exchange import exchange
    from ..cluster.store import JobStore, StoreError

    node_ranks = {r.node_rank for r in job.ranks}
    if len(node_ranks) != 1 or -1 in node_ranks:
        raise UserError(
            "--store needs one node's ranks (GROUP_RANK): several torchrun agents run here, pick one with --pid AGENT"
        )
    node_rank = node_ranks.pop()
    env = job.ranks[0].env
    gws = env.get("GROUP_WORLD_SIZE", "")
    nnodes = int(gws) if gws.isdigit() and int(gws) > 0 else max(1, job.world_size // max(1, job.local_world_size))
    secret = load_secret(args.store_secret_file) if args.store_secret_file else None
    host, port = args.store
    try:
        store = JobStore(host, port, job.job_id, host_server=node_rank == 0, timeout_s=args.store_timeout,
                         secret=secret)
        shared = exchange(
            store, node_rank=node_rank, nnodes=nnodes, world_size=job.world_size, node=node, views=views,
            fr_traces=fr_traces,
            decide=lambda all_views, remote, more: _decide(
                job, incident_id, all_views, captures, remote, [*notes, *more]
            )[0],
            timeout_s=args.store_timeout,
        )
    except StoreError as exc:
        verdict, _ = _decide(job, incident_id, views, captures, {}, [*notes, f"store: {exc}; this node's ranks only"])
        verdict["correlation"] = f"local only ({exc})"
        return verdict
    return shared.verdict


def _write_bundle(
    out: str, job: Job, verdict: dict[str, Any], views: Sequence[RankView], captures: Mapping[int, Any]
) -> str | None:
    from ..report import bundle
    from ..serve.incident import ranks_doc

    incidents = os.path.join(out, job.job_id, "incidents")
    try:
        return bundle.write_bundle(
            incidents, str(verdict.get("incident_id") or "inspect"), verdict, _text(verdict),
            ranks_doc(job.job_id, verdict, views), views, captures,
        )
    except OSError as exc:
        sys.stderr.write(f"rankwatch inspect: bundle not written to {incidents}: {exc.strerror or exc}\n")
        return None


def _text(verdict: Mapping[str, Any]) -> str:
    from ..report.text import verdict_text

    # no detection delay for a job found already hung: leave the "detected after" line out
    return verdict_text({k: v for k, v in verdict.items() if k != "detected_after_s"})


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from ..evidence.capture import pyspy_available

    if pyspy_available() is None:
        raise UserError("py-spy not found (pip install py-spy): it reads the ranks' stacks")
    # as root, each user's environments are read and parsed by that user's reader, never by root
    env_reader = None
    if os.geteuid() == 0:
        from ..observe.reader import default_readers

        env_reader = default_readers().environs
    found = discover(protected=protected_pids(), env_reader=env_reader)
    jobs, err = select(found, pids=args.pid, job_id=args.job)
    if err is not None:
        raise UserError(err)
    if not jobs:
        why = f" ({found.notes[0]})" if found.notes else ""
        if found.idle_agents:
            why += (
                f"; torchrun agent(s) {', '.join(map(str, found.idle_agents[:5]))} run without live ranks: a group "
                "torn down after a rank failed (read the cause from its log: rankwatch diagnose LOG)"
            )
        sys.stderr.write(
            "rankwatch inspect: no torch distributed ranks found on this node that this user may inspect" + why + "\n"
        )
        return 1
    if args.store is not None and len(jobs) > 1:
        names = ", ".join(j.job_id for j in jobs)
        raise UserError(f"--store inspects one job: pick it with --job ID (jobs: {names})")
    docs, named = [], True
    for job in jobs:
        verdict, path = inspect_job(job, args)
        verdict["bundle"] = path
        docs.append(verdict)
        named = named and bool(verdict.get("initiating_ranks"))
        if not args.json:
            sys.stdout.write(_text(verdict) + (f"bundle: {path}\n" if path else "") + "\n")
    if args.json:
        sys.stdout.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
    return 0 if named else 1
