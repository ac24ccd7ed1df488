"""``rankwatch run [OPTIONS] -- TORCHRUN_ARGS…``: this node's watchdog around one torchrun job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
from rankwatch.hooks.jobinfo import sanitize_job_id
from rankwatch.hooks.record import RecordFormatError, StepTiming, read_record
from rankwatch.hooks.shmdir import ShmDirError, ensure_base_dir

from .. import logs
from ..cluster.auth import load_secret
from ..core.ranks import fmt_ranks
from ..core.straggler import diagnose_stragglers
from ..core.text import NAME, PROSE, clean
from ..errors import UserError
from ..report.bundle import atomic_json, atomic_text
from ..report.text import headline, int_ranks, summary_text, verdict_text
from ..serve.daemon import Daemon, DaemonConfig
from .options import add_shm_dir, add_watch_options, alerter_from_args, policies_from_args
from .parser import Parser
from .torchrun_args import TorchrunCommand, inject_hooks

log = structlog.get_logger("rankwatch.run")


def build_parser() -> Parser:
    p = Parser(
        prog="rankwatch run",
        description="Start this node's watchdog, run torchrun with rankwatch's hook injected into every rank, "
        "print incidents as they happen and a summary at the end; exit with torchrun's code.",
        usage="rankwatch run [OPTIONS] -- TORCHRUN_ARGS...",
    )
    p.add_argument("--out", default="rankwatch-out", help="output dir for summary and incidents (default: %(default)s)")
    p.add_argument("--run-name", default=None, help="job id (default: torchrun's --rdzv-id, else generated)")
    add_shm_dir(p)
    p.add_argument("--quiet", action="store_true", help="no log lines on stderr, only incidents and the summary")
    add_watch_options(p)
    return p


def check_script(cmd: TorchrunCommand, cwd: str | None = None) -> None:
    """The training script (or ``-m`` module) must exist before torchrun starts: otherwise every rank dies
    at once, which reads like a job failure (a DEAD RANK incident), not like a typo."""
    cwd = cwd or os.getcwd()
    if cmd.module:
        from importlib.machinery import PathFinder

        top = cmd.script.split(".")[0]
        if top in sys.builtin_module_names or PathFinder.find_spec(top, [cwd, *sys.path]) is not None:
            return
        raise UserError(f"no module named {top!r} for torchrun's -m (looked in {cwd} and sys.path)")
    if not os.path.isfile(os.path.join(cwd, cmd.script)):
        raise UserError(f"training script {cmd.script!r} not found (in {cwd})")


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        own, torchrun_args = argv[:cut], argv[cut + 1 :]
    else:
        own, torchrun_args = argv, []
    parser = build_parser()
    _, unknown = parser.parse_known_args(own)
    if unknown and not torchrun_args:
        raise UserError(
            f"unknown option {unknown[0]!r}: torchrun's arguments go after '--' "
            f"(rankwatch run [OPTIONS] -- --nproc-per-node N train.py ...)"
        )
    args = parser.parse_args(own)
    if not torchrun_args:
        raise UserError("missing torchrun arguments: rankwatch run [OPTIONS] -- --nproc-per-node N train.py ...")
    secret = load_secret(args.store_secret_file) if args.store_secret_file is not None else None
    alerts = alerter_from_args(args)
    cmd = inject_hooks(torchrun_args)
    check_script(cmd)
    logs.configure(json_output=args.json_logs, level="error" if args.quiet else args.log_level)
    job_id = sanitize_job_id(args.run_name or cmd.rdzv_id or _default_job_id(cmd))
    out = os.path.abspath(args.out)
    try:
        os.makedirs(out, mode=0o700, exist_ok=True)
        # shared by every user of the node like /tmp (01777); each job dir inside is its user's, 0700
        ensure_base_dir(args.shm_dir)
    except ShmDirError as exc:
        raise UserError(str(exc)) from exc
    except OSError as exc:
        raise UserError(f"cannot create {exc.filename}: {exc.strerror}") from exc
    _clear_stale_records(os.path.join(args.shm_dir, job_id))
    stall, capture = policies_from_args(args)
    config = DaemonConfig(
        shm_dir=args.shm_dir,
        out_dir=out,
        poll_interval_s=args.poll_interval,
        stall=stall,
        capture=capture,
        on_stall=args.on_stall,
        job_filter=job_id,
        incidents_dir=os.path.join(out, "incidents"),
    )
    printed: list[str] = []

    def on_incident(verdict: dict[str, Any], path: str | None) -> None:
        text = verdict_text(verdict)
        sys.stdout.write("\n" + text + (f"bundle: {path}\n" if path else "bundle: NOT WRITTEN (see log)\n"))
        sys.stdout.flush()
        printed.append(str(verdict.get("incident_id")))

    correlator = None
    if args.store is not None or cmd.nnodes not in ("1", "1:1"):
        from ..cluster.correlate import Correlator
        from ..cluster.store import DEFAULT_STORE_PORT

        host, port = args.store or (cmd.master_addr or "127.0.0.1", DEFAULT_STORE_PORT)
        correlator = Correlator(job_id, cmd.node_rank, host, port, nnodes=_max_nodes(cmd.nnodes), secret=secret)
    daemon = Daemon(
        config, on_incident=on_incident, correlators={job_id: correlator} if correlator else None, alerts=alerts
    )
    daemon.clean_leftovers()
    metrics = None
    if args.metrics_port is not None:
        from ..serve.metrics import serve_metrics

        metrics = serve_metrics(daemon, args.metrics_addr, args.metrics_port, histograms=args.metrics_histograms)
    env = dict(os.environ, RANKWATCH_SHM_DIR=args.shm_dir, RANKWATCH_JOB_ID=job_id)
    log.info("run_start", job=job_id, torchrun=cmd.args, out=out)
    watcher = threading.Thread(target=daemon.run, name="rankwatch-watchdog", daemon=True)
    watcher.start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *cmd.args], env=env)
    except OSError as exc:
        daemon.stop()
        raise UserError(f"cannot start torchrun: {exc}") from exc

    def forward(signum: int, _frame: Any) -> None:
        daemon.quiesce()  # the user stops the job: the ranks torchrun now stops are not dead ranks
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code = _wait(proc, on_interrupt=daemon.quiesce)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    # ranks can die in the last moments (torchrun tears the rest down within ~0.1 s): look once more
    daemon.stop()
    watcher.join(timeout=30)
    deadline = time.monotonic() + max(2.0, 3 * args.poll_interval)
    while time.monotonic() < deadline:
        daemon.poll_once()
        entry = daemon.jobs.get(job_id)
        if entry is None or entry.incident is not None or not entry.last_views:
            break
        if all(v.state in ("exited",) for v in entry.last_views):
            break
        time.sleep(args.poll_interval)
    # incidents run off the poll loop: their bundles and verdicts belong in the summary
    if not daemon.drain(config.serve.drain_timeout_s):
        log.error("incidents_unfinished", job=job_id)
    entry = daemon.jobs.get(job_id)
    history = {r: list(h) for r, h in entry.watch.history.items()} if entry else {}
    if correlator is not None:
        # every node shares its rings; the leader's summary covers every rank of the job
        correlator.publish_history(history)
        if correlator.leader:
            for rank, steps in correlator.gather_histories(wait_s=correlator.policy.summary_wait_s).items():
                history.setdefault(rank, steps)
        correlator.close()
    if metrics is not None:
        metrics.close()
    daemon.close()  # finishes incidents in flight and retries bundles the disk refused
    _write_summary(daemon, job_id, out, history, torchrun_code=code)
    return code


def _default_job_id(cmd: TorchrunCommand) -> str:
    """Multi-node runs need the same id on every node: derive it from the shared rendezvous address."""
    if cmd.nnodes not in ("1", "1:1") and cmd.master_addr:
        return f"job-{cmd.master_addr}-{cmd.master_port}"
    return f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _max_nodes(nnodes: str) -> int | None:
    """torchrun's --nnodes is N or MIN:MAX; the evidence wait needs the most nodes there can be."""
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        return None


def _clear_stale_records(job_dir: str) -> None:
    """Remove records an earlier run left under this job id; refuse if a live rank still owns one."""
    from ..observe.process import maps_file

    try:
        names = os.listdir(job_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(job_dir, name)
        if name.endswith(".hb"):
            try:
                pid = read_record(path).pid
            except (RecordFormatError, OSError):
                pid = 0
            if pid > 0 and maps_file(pid, path):
                raise UserError(
                    f"job id {os.path.basename(job_dir)!r} is in use by a running rank (pid {pid}); "
                    "pass another --run-name"
                )
        if name.endswith((".hb", ".ctl", ".faulthandler")) or name == "job.json":
            try:
                os.unlink(path)
            except OSError:
                pass


def _wait(proc: subprocess.Popen[bytes], on_interrupt: Callable[[], None]) -> int:
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            on_interrupt()
            # the terminal sent SIGINT to torchrun too; give it time to stop its ranks
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            except KeyboardInterrupt:
                proc.kill()


def torchrun_root_cause_note(verdicts: list[dict[str, Any]], torchrun_code: int, *, killed: bool = False) -> str:
    """When torchrun failed it prints its own "Root Cause (first observed failure)": the failed rank with
    the earliest exit it observed, in whole seconds, ties in rank order — usually a rank that failed
    *because of* the initiator (a lost peer, a collective timeout), and never a rank that hung and was
    stopped. Said next to rankwatch's answer, so the two are not read as a contradiction."""
    decided = [v for v in verdicts if int_ranks(v.get("initiating_ranks"))]
    if torchrun_code == 0 or not decided:
        return ""
    v = decided[0]
    which = (
        "and here rankwatch's --on-stall kill sent SIGTERM to the ranks still running, which torchrun counts "
        "as failures"
        if killed
        else "often one that failed because of the initiator"
    )
    return (
        "note: torchrun's 'Root Cause (first observed failure)' above is the first failed rank torchrun saw "
        f"exit (exit times in whole seconds, ties in rank order), {which}; rankwatch: "
        f"{fmt_ranks(int_ranks(v.get('initiating_ranks')))} initiated the failure — {clean(v.get('reason'), PROSE)}\n"
    )


def _write_summary(
    daemon: Daemon, job_id: str, out: str, history: dict[int, list[StepTiming]], *, torchrun_code: int = 0
) -> None:
    entry = daemon.jobs.get(job_id)
    incidents = entry.incidents if entry else []
    diag = diagnose_stragglers(history)
    doc = diag.summary_doc(job_id, incidents, history, entry.verdicts if entry else ())
    doc["details"] = diag.details
    text = summary_text(doc)
    summary_path: str | None = os.path.join(out, "summary.json")
    try:
        atomic_json(os.path.join(out, "summary.json"), doc)
        atomic_text(os.path.join(out, "summary.txt"), text)
    except OSError as exc:
        log.error("summary_write_failed", out=out, error=str(exc))
        summary_path = None
    bundles = entry.bundles if entry else {}
    recap = "".join(
        f"incident {clean(v.get('incident_id'), NAME)}: {headline(v)}\n    why: {clean(v.get('reason'), PROSE)}\n"
        "    bundle: "
        + (bundles.get(str(v.get("incident_id"))) or "NOT WRITTEN (the disk refused it; the verdict is in the log)")
        + "\n"
        for v in (entry.verdicts if entry else [])
    )
    where = f"summary: {summary_path}\n" if summary_path else "summary: NOT WRITTEN (see the log)\n"
    # the summary text starts with the incidents' headlines; the recap adds where each bundle is
    note = torchrun_root_cause_note(entry.verdicts if entry else [], torchrun_code, killed=daemon.killed(job_id))
    sys.stdout.write("\n" + text + where + recap + note)
    sys.stdout.flush()
