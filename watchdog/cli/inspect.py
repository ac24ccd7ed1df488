"""``rankwatch inspect``: name the initiating rank of a job that is hung right now and was never wrapped.

find jobs (``observe.discover``: one torchrun agent's ranks of one user) → two looks at every rank a
moment apart (``evidence.inspect_capture.look_at``) → running or stalled (``core.inspect_facts.
judge_progress``): a running job is one line, no bundle → for a stalled one the workers' stacks, /proc
states, flight-recorder files → views (``core.inspect_facts``) → the live verdict's ``decide`` → print
and bundle (``report``, into a directory opened without following a symlink), with ``--store`` after
every node's evidence is in (``cluster.inspect_exchange``).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..cluster.auth import load_secret
from ..cluster.inspect_exchange import exchange
from ..cluster.store import JobStore, StoreError
from ..core.document import VerdictDocument
from ..core.evidence_items import Line
from ..core.fr_trace import RankTrace
from ..core.inspect_facts import Progress, RankFact, RankLook, judge_progress, views_from_facts
from ..core.policy import CapturePolicy, InspectPolicy
from ..core.schema import RUNNING_SCHEMA
from ..core.snapshot import RankView
from ..core.stacks import Frame
from ..core.text import NAME, clean
from ..errors import UserError
from ..evidence.capture import pyspy_available
from ..evidence.flight_recorder import fr_evidence, with_remote
from ..evidence.inspect_capture import (
    attach_debug_server_dumps,
    attach_fr_dumps,
    capture_workers,
    cpu_pct,
    look_at,
    rank_looks,
    worker_lines,
)
from ..observe.discover import Job, discover, env_reader_of, read_proc, select
from ..observe.jobdir import open_dir
from ..observe.process import protected_pids
from ..privsep.readers import default_readers
from ..report import bundle
from ..report.text import verdict_text
from ..serve.incident import ranks_doc
from ..verdict import decide
from .argparser import Parser
from .options import host_port, positive_float

DESCRIPTION = """Name the rank a hung job waits for, without the hook and without a restart: find this node's
torch distributed ranks in the process table (torchrun's RANK/LOCAL_RANK/WORLD_SIZE in their environment,
the torchrun agent as their parent; DataLoader workers told apart), read every rank's stack with py-spy in
parallel, twice a moment apart: a job whose ranks made progress in between (stacks moved as CPU time
advanced, or the flight recorder advanced) is running, one line and no bundle. For a stalled job read its
/proc states and exits and the flight-recorder dumps the job wrote or its torch debug server
(start_debug_server) serves; decide with the live verdict's rules; print the verdict and write a bundle.
A job is one torchrun agent's ranks of one user (not its run id, which anyone can copy).
Multi-node: run it on every node with the same --store HOST:PORT (HOST: node 0's address; node 0's
inspect hosts it) and every node prints one verdict. Nothing is signalled. Exit code 0 when every stalled
job found got a rank named (running jobs count as answered), 1 when no ranks are found or a stalled job got
no rank, 2 on bad input (an --out that is a symlink included)."""

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
    p.add_argument("--look-interval", type=positive_float, default=InspectPolicy.look_interval_s, metavar="SECONDS",
                   help="the two looks that tell a running job from a stalled one start at least this far apart; "
                   "raise it for a job whose steps take longer (default: %(default)s)")
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
) -> tuple[VerdictDocument, Any]:
    fr = with_remote(fr_evidence({r: c for r, c in captures.items() if c.fr_trace is not None}), remote_fr)
    verdict = decide(
        views, job_id=job.job_id, incident_id=incident_id, detected_after_s=0.0,
        extra_evidence=[Line(x) for x in (*fr.lines, *notes)], fr_facts=fr.facts,
        steps_known=False,  # no record: step counters and phase timers are unknown, the reason names none
    ).document()
    # the job's strings cleaned before the verdict goes anywhere: with --store the leader publishes this one
    return replace(verdict, source="inspect").cleaned(), fr


@dataclass
class Watched:
    """What the looks at a job saw: its first and latest look per rank, the latest stacks (with any live
    flight recorder) and where those recorders were read from."""

    progress: Progress
    first: dict[int, RankLook]
    latest: dict[int, RankLook]
    captures: dict[int, Any]
    fr_sources: dict[int, dict[str, str]]
    fr_notes: list[str]
    looks: int  # how many looks were taken (2, or more where a rank spun in one place)
    seconds: float  # from the first look to the end of the last


def _wait_until(deadline: float) -> None:
    """The look interval is a measurement window, not a guess: the second look is taken after it."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


def watch(job: Job, args: argparse.Namespace, policy: InspectPolicy) -> Watched:
    """Look at every rank, again ``look_interval_s`` later, and once more (``confirm_looks``) at the ranks
    whose CPU time advanced while their stack read the same, until the job is running or stalled."""
    ticks = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    gone = [rank for rank, _ in job.missing_ranks()]

    def one(only: Sequence[int] | None = None) -> tuple[Any, dict[int, dict[str, str]], list[str]]:
        look = look_at(job, timeout_s=args.pyspy_timeout, native=args.native, only=only)
        sources: dict[int, dict[str, str]] = {}
        notes = attach_debug_server_dumps(job, look.ranks, sources, only=only)
        return look, sources, notes

    look, _, _ = one()
    started, looks = look.at, 2
    first = rank_looks(job, look)
    _wait_until(look.at + policy.look_interval_s)
    look, sources, notes = one()
    latest, captures = rank_looks(job, look), dict(look.ranks)
    progress = judge_progress(first, latest, ticks_per_s=ticks, policy=policy, gone=gone)
    for _ in range(policy.confirm_looks):
        if progress.running or progress.still or not progress.again:
            break
        _wait_until(look.at + policy.look_interval_s)
        look, more_sources, more_notes = one(progress.again)
        looks += 1
        latest.update(rank_looks(job, look))
        captures.update(look.ranks)
        sources.update(more_sources)
        notes = [n for n in notes if not any(n.startswith(f"rank {r}:") for r in progress.again)] + more_notes
        progress = judge_progress(first, latest, ticks_per_s=ticks, policy=policy, gone=gone)
    if not progress.running and progress.again:
        # still the same stack after every look, though its CPU time moved: it spins in one place
        progress = Progress(False, progress.moved, tuple(sorted({*progress.still, *progress.again})), (),
                            progress.unread, progress.seconds, progress.line)
    return Watched(progress, first, latest, captures, sources, notes, looks, time.monotonic() - started)


def running_doc(job: Job, watched: Watched) -> dict[str, Any]:
    """What a running job gets instead of a verdict: the looks, one line, no bundle."""
    p = watched.progress
    cpu = cpu_pct(watched.first, watched.latest)
    spread = sorted(round(v) for v in cpu.values())
    use = "" if not spread else f"; {spread[0]}% CPU" if spread[0] == spread[-1] else f"; {spread[0]}-{spread[-1]}% CPU"
    line = f"{job.label}: running — {p.line}{use}; no bundle"
    return {
        "schema": RUNNING_SCHEMA, "source": "inspect", "job_id": job.job_id, "agent_pid": job.launcher,
        "owner_uid": job.owner_uid, "kind": "running", "initiating_ranks": [], "reason": line,
        "looks": {"seconds_apart": round(p.seconds, 2), "moved": list(p.moved), "unread": list(p.unread)},
        "ranks": {str(r): {"cpu_pct": round(v, 1)} for r, v in sorted(cpu.items())}, "bundle": None,
    }


def inspect_job(job: Job, args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """The verdict and bundle of a stalled job, or a running job's document (no bundle)."""
    node = clean(socket.gethostname(), NAME)
    agent = f"-a{job.launcher}" if job.launcher > 0 else ""
    incident_id = "inspect-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}{agent}"
    watched = watch(job, args, InspectPolicy(look_interval_s=args.look_interval))
    if watched.progress.running and args.store is None:
        return running_doc(job, watched), None
    captures = watched.captures
    workers = capture_workers(job, captures, args.pyspy_timeout)
    facts = facts_of(job, captures, cpu_pct(watched.first, watched.latest), node)
    views, lines = views_from_facts(facts)
    gone = [f.rank for f in facts if f.pid < 0]
    fr_sources = dict(watched.fr_sources)
    fr_notes = [*watched.fr_notes, *attach_fr_dumps(job, captures, gone, fr_sources)]
    notes = [watched.progress.line, *lines, *worker_lines(workers), *fr_notes]
    notes.append(f"stacks of {len(captures)} rank(s) read at {watched.looks} looks in {watched.seconds:.2f}s")
    verdict, fr = _decide(job, incident_id, views, captures, {}, notes)
    if args.store is not None:
        verdict = _shared_verdict(job, args, node, views, captures, fr.traces, notes, incident_id)
    # where this node's flight-recorder dumps came from, by rank: {"from": "debug_server", "address": ...}
    # or {"from": "file", "path": ...}; only the ones that parsed
    verdict = replace(
        verdict, flight_recorder_sources={str(r): fr_sources[r] for r in sorted(fr.traces) if r in fr_sources}
    )
    # once more over the whole: a leader's verdict read from the store (anyone reaching it could write one)
    # and the dump paths the job's environment named; the bundle and the terminal get the same safe text
    doc = verdict.cleaned().to_json()
    path = _write_bundle(args.out, job, doc, views, captures)
    return doc, path


def _shared_verdict(
    job: Job, args: argparse.Namespace, node: str, views: Sequence[RankView], captures: Mapping[int, Any],
    fr_traces: Mapping[int, RankTrace], notes: Sequence[str], incident_id: str,
) -> VerdictDocument:
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
        return replace(verdict, correlation=f"local only ({exc})")
    return shared.verdict


def check_out(out: str) -> None:
    """Refuse, before anything is inspected, an ``--out`` that is a symlink or not a directory: a bundle is
    never written through a link someone planted (a ``rankwatch-inspect`` in a shared directory)."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"--out {out}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise UserError(f"--out {out} is a symbolic link: a bundle is never written through one (remove it, or pass "
                        "--out DIR)")
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"--out {out} is not a directory")


def open_incidents_dir(out: str, job_dir: str) -> int:
    """``out/job_dir/incidents`` as a directory fd, every level made and opened as the daemon opens job dirs
    (``observe.jobdir.open_dir``: ``O_NOFOLLOW``), so a symlink at any of them is refused (ELOOP), never
    followed. The two levels inspect makes must be the caller's own and writable by no one else: entries
    in a directory another user may write can be swapped under the writer."""
    parent, leaf = os.path.split(os.path.abspath(out))
    os.makedirs(parent, mode=0o700, exist_ok=True)  # the path up to --out is the caller's to choose
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, own in ((leaf, False), (job_dir, True), ("incidents", True)):
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                sub = open_dir(name, fd)
            except OSError:
                # O_DIRECTORY|O_NOFOLLOW on a link fails with ENOTDIR: say what it is
                if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, f"{name} is a symbolic link, not followed") from None
                raise
            os.close(fd)
            fd = sub
            st = os.fstat(fd)
            if own and (st.st_uid != os.geteuid() or st.st_mode & 0o022):
                raise OSError(errno.EPERM, f"{name} is not this user's own directory (uid {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_bundle(
    out: str, job: Job, verdict: dict[str, Any], views: Sequence[RankView], captures: Mapping[int, Any]
) -> str | None:
    incidents = os.path.join(out, job.job_id, "incidents")
    try:
        fd = open_incidents_dir(out, job.job_id)
    except OSError as exc:
        sys.stderr.write(f"rankwatch inspect: bundle not written to {incidents}: {exc.strerror or exc}\n")
        return None
    try:
        # written through the fd's own /proc path: it names the directory that was opened, not a path that
        # could be swapped for a link after the check
        written = bundle.write_bundle(
            f"/proc/self/fd/{fd}", str(verdict.get("incident_id") or "inspect"), verdict, _text(verdict),
            ranks_doc(job.job_id, verdict, views), views, captures,
        )
        return os.path.join(incidents, os.path.basename(written))
    except OSError as exc:
        sys.stderr.write(f"rankwatch inspect: bundle not written to {incidents}: {exc.strerror or exc}\n")
        return None
    finally:
        os.close(fd)


def _text(verdict: Mapping[str, Any]) -> str:
    # no detection delay for a job found already hung: leave the "detected after" line out
    return verdict_text({k: v for k, v in verdict.items() if k != "detected_after_s"})


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_out(args.out)
    if pyspy_available() is None:
        raise UserError("py-spy not found (pip install py-spy): it reads the ranks' stacks")
    # as root, each user's environments are read and parsed by that user's reader, never by root
    env_reader = None
    if os.geteuid() == 0:
        env_reader = env_reader_of(default_readers())
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
        names = ", ".join(j.label for j in jobs)
        raise UserError(f"--store inspects one job: pick it with --job ID or --pid AGENT (jobs: {names})")
    docs, answered = [], True
    for job in jobs:
        verdict, path = inspect_job(job, args)
        if verdict.get("kind") == "running":
            if not args.json:
                sys.stdout.write(str(verdict["reason"]) + "\n")
            docs.append(verdict)
            continue
        verdict["bundle"] = path
        docs.append(verdict)
        # a stalled job is answered when a rank is named; a running job was never a question
        answered = answered and bool(verdict.get("initiating_ranks"))
        if not args.json:
            sys.stdout.write(_text(verdict) + (f"bundle: {path}\n" if path else "") + "\n")
    if args.json:
        sys.stdout.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
    return 0 if answered else 1
