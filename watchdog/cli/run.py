"""``rankwatch run [OPTIONS] -- TORCHRUN_ARGS…``: this node's watchdog around one torchrun job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
from rankwatch.hooks.jobinfo import sanitize_job_id
from rankwatch.hooks.shmdir import ShmDirError, ensure_base_dir

from .. import logs
from ..cluster.auth import load_secret
from ..cluster.correlate import Correlator, with_other_nodes
from ..cluster.store import DEFAULT_STORE_PORT
from ..core.host_signals import RankCounters
from ..core.policy import MetricsPolicy
from ..core.ranks import fmt_ranks
from ..core.steps import StepTiming
from ..core.straggler import diagnose_stragglers
from ..core.straggler_cause import explain
from ..errors import UserError
from ..report.bundle import atomic_json, atomic_text
from ..report.text import final_block, int_ranks, summary_text, verdict_text
from ..serve.daemon import Daemon, DaemonConfig
from ..serve.job_files import remove_job_files
from ..serve.metrics import MetricsUnavailable, file_sd_target, serve_metrics
from .argparser import Parser
from .launch import check_launch
from .options import add_shm_dir, add_watch_options, alerter_from_args, policies_from_args
from .tee import StderrTee
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
    # before parsing torchrun's line, so its parser's debug notes follow --log-level like every other line
    logs.configure(json_output=args.json_logs, level="error" if args.quiet else args.log_level)
    cmd = inject_hooks(torchrun_args)
    check_script(cmd)
    check_launch(cmd)
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
    job_dir = os.path.join(args.shm_dir, job_id)
    _clear_stale_records(job_dir)
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

    def on_incident(verdict: dict[str, Any], path: str | None) -> None:
        text = verdict_text(verdict, bundle=path)
        sys.stdout.write("\n" + text + (f"bundle: {path}\n" if path else "bundle: NOT WRITTEN (see log)\n"))
        sys.stdout.flush()

    correlator = None
    if args.store is not None or cmd.nnodes not in ("1", "1:1"):
        host, port = args.store or (cmd.master_addr or "127.0.0.1", DEFAULT_STORE_PORT)
        correlator = Correlator(job_id, cmd.node_rank, host, port, nnodes=_max_nodes(cmd.nnodes), secret=secret)
    daemon = Daemon(
        config, on_incident=on_incident, correlators={job_id: correlator} if correlator else None, alerts=alerts
    )
    try:
        return _run_job(args, cmd, job_id, out, daemon, correlator)
    finally:
        if correlator is not None:  # every way out (a launch that failed too): its connector stops quietly
            correlator.close()
        # the records, state file and sockets live in RAM (/dev/shm): none outlives the run, however it ends
        removed, live = remove_job_files(job_dir)
        if live:
            log.warning("records_kept_for_live_ranks", job=job_id, ranks=sorted(live), pids=sorted(live.values()))
        log.info("job_files_removed", job=job_id, entries=removed)


def _run_job(
    args: Any, cmd: TorchrunCommand, job_id: str, out: str, daemon: Daemon, correlator: Any
) -> int:
    daemon.clean_leftovers()
    metrics = _serve_metrics(args, daemon, job_id, out) if args.metrics_port is not None else None
    try:
        return _watch_job(args, cmd, job_id, out, daemon, correlator, metrics)
    finally:
        if metrics is not None:  # every way out: a listed target that no longer answers would page as down
            metrics.close()


def _watch_job(
    args: Any, cmd: TorchrunCommand, job_id: str, out: str, daemon: Daemon, correlator: Any,
    metrics: RunMetrics | None,
) -> int:
    config = daemon.config
    env = dict(os.environ, RANKWATCH_SHM_DIR=args.shm_dir, RANKWATCH_JOB_ID=job_id)
    log.info("run_start", job=job_id, torchrun=cmd.args, out=out)
    watcher = threading.Thread(target=daemon.run, name="rankwatch-watchdog", daemon=True)
    watcher.start()
    tee = StderrTee()
    try:
        torchrun = [sys.executable, "-m", "torch.distributed.run", *cmd.args]
        proc = subprocess.Popen(torchrun, env=env, stderr=tee.child_fd)
    except OSError as exc:
        daemon.stop()
        raise UserError(f"cannot start torchrun: {exc}") from exc
    finally:
        tee.started()
    startup_s = config.stall.startup_for()
    code, timed_out, interrupted, seen = _supervise(proc, daemon, job_id, startup_s)
    # ranks can die in the last moments (torchrun tears the rest down within ~0.1 s): look once more
    daemon.stop()
    watcher.join(timeout=30)
    log.info("watchdog_polls", job=job_id, **daemon.poll_stats())  # what watching cost the loop, per poll
    _last_look(daemon, job_id, args.poll_interval)
    entry = daemon.jobs.get(job_id)
    seen = seen or bool(entry is not None and (entry.last_views or entry.watch.history))
    history, samples = _histories(daemon, job_id, tee, correlator)
    if metrics is not None:
        metrics.close()
    daemon.close()  # finishes incidents in flight and retries bundles the disk refused
    if not seen:
        # no rank ever ran the hook: an empty summary ("0 ranks") would read like a run; say what failed
        sys.stdout.flush()
        sys.stderr.write(f"rankwatch run: {launch_failure(cmd, code, timed_out, startup_s, interrupted)}\n")
        sys.stderr.flush()
        return code if code != 0 else 1
    _write_summary(
        daemon, job_id, out, history, samples, torchrun_code=code, root_cause_printed=tee.root_cause_seen
    )
    return code


# Prometheus' file-based service discovery document of this run's /metrics, in --out while the run serves
METRICS_TARGET_FILE = "metrics-target.json"


class RunMetrics:
    """This run's metrics endpoint and the file_sd file naming it; ``close()`` stops both, once: a target
    still listed after the run would be scraped as down (and page as ``RankwatchWatchdogDown``)."""

    def __init__(self, server: Any, target_file: str | None) -> None:
        self.server, self.target_file = server, target_file
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.target_file is not None:
            try:
                os.unlink(self.target_file)
            except OSError:
                pass
        self.server.close()


def _warn(text: str) -> None:
    """One line on stderr, whatever --quiet says: what the user set up did not happen as asked."""
    sys.stderr.write(f"rankwatch run: warning: {text}\n")
    sys.stderr.flush()


def _serve_metrics(args: Any, daemon: Daemon, job_id: str, out: str) -> RunMetrics | None:
    """/metrics for this run, on the port asked for or the next free one (``MetricsPolicy``), written to
    ``out/metrics-target.json`` for Prometheus' file_sd; where no port can be bound, the job runs without
    metrics. Never a reason for the job not to start: a second job on the node holds the port as often as not."""
    try:
        server = serve_metrics(daemon, args.metrics_addr, args.metrics_port, histograms=args.metrics_histograms,
                               tries=MetricsPolicy().run_port_tries)
    except MetricsUnavailable as exc:
        _warn(f"{exc}; the job runs without metrics")
        return None
    path = os.path.join(out, METRICS_TARGET_FILE)
    target: str | None = path
    try:
        atomic_json(path, file_sd_target(server.addr, server.port, {"rankwatch_run": job_id}))
    except OSError as exc:
        log.warning("metrics_target_not_written", path=path, error=exc.strerror or str(exc))
        target = None
    if server.port != args.metrics_port and args.metrics_port != 0:
        where = f" (written to {target})" if target else ""
        _warn(f"metrics port {args.metrics_port} on {args.metrics_addr} is taken; serving {server.url} "
              f"instead{where}")
    return RunMetrics(server, target)


def _supervise(proc: subprocess.Popen, daemon: Daemon, job_id: str, startup_s: float) -> tuple[int, bool, bool, bool]:
    """Wait for torchrun, passing SIGTERM/SIGHUP on to it (the daemon quiesced first: the ranks the user
    stops are not dead ranks): (exit code, given up at startup, interrupted, a rank record was seen)."""
    interrupted: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        daemon.quiesce()  # the user stops the job: the ranks torchrun now stops are not dead ranks
        if proc.poll() is None:
            proc.send_signal(signum)

    def on_interrupt() -> None:
        interrupted.append(signal.SIGINT)
        daemon.quiesce()

    started = time.monotonic()
    seen: list[bool] = []

    def still_starting() -> bool:
        """False once the startup timeout passed without a single rank record (a stuck rendezvous)."""
        if not seen:
            entry = daemon.jobs.get(job_id)
            if entry is not None and (entry.last_views or entry.watch.ranks):
                seen.append(True)
        return bool(seen) or time.monotonic() - started < startup_s

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code, timed_out = _wait(proc, on_interrupt=on_interrupt, keep_waiting=still_starting)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return code, timed_out, bool(interrupted), bool(seen)


def _last_look(daemon: Daemon, job_id: str, poll_interval: float) -> None:
    """Poll until every rank is seen exited or an incident opened (at most a few polls): ranks can die
    in the job's last moments."""
    deadline = time.monotonic() + max(2.0, 3 * poll_interval)
    while time.monotonic() < deadline:
        daemon.poll_once()
        entry = daemon.jobs.get(job_id)
        if entry is None or entry.incident is not None or not entry.last_views:
            break
        if all(v.state in ("exited",) for v in entry.last_views):
            break
        time.sleep(poll_interval)


def _histories(
    daemon: Daemon, job_id: str, tee: StderrTee, correlator: Any
) -> tuple[dict[int, list[StepTiming]], list[tuple[int, Mapping[int, RankCounters]]]]:
    """The job's step rings once its incidents are finished (every node's, on the leader), and the host-signal
    samples the summary's cause reads: this node's, and on the leader the other nodes' ranks' beside them."""
    # incidents run off the poll loop: their bundles and verdicts belong in the summary
    if not daemon.drain(daemon.config.serve.drain_timeout_s):
        log.error("incidents_unfinished", job=job_id)
    tee.close(timeout_s=5.0)  # torchrun's last words come before rankwatch's
    entry = daemon.jobs.get(job_id)
    history = {r: list(h) for r, h in entry.watch.history.items()} if entry else {}
    samples: list[tuple[int, Mapping[int, RankCounters]]] = list(entry.watch.signals) if entry else []
    if correlator is not None:
        # every node shares its rings and its ranks' signals; the leader's summary covers every rank of the job
        correlator.publish_history(history, samples)
        if correlator.leader:
            remote: dict[int, list[tuple[int, RankCounters]]] = {}
            for rank, steps in correlator.gather_histories(correlator.policy.summary_wait_s, remote).items():
                history.setdefault(rank, steps)
            own = list(entry.watch.history) if entry else []
            samples = with_other_nodes(samples, history, own, remote, correlator.policy)
        correlator.close()
    return history, samples


def launch_failure(cmd: TorchrunCommand, code: int, timed_out: bool, startup_s: float, interrupted: bool) -> str:
    """One line for a launch in which no rank ever started rankwatch's hook."""
    if timed_out:
        nodes = f"all {cmd.nnodes.split(':')[-1]} nodes started, " if cmd.nnodes not in ("1", "1:1") else ""
        return (
            f"no rank started within the startup timeout ({startup_s:g} s): torchrun's rendezvous did not complete "
            f"(are {nodes}the rendezvous endpoint and its port reachable?); torchrun was stopped"
        )
    if interrupted:
        return "stopped before any rank started"
    return (
        f"torchrun exited with code {code} before any rank started rankwatch's hook: "
        "the cause is in torchrun's output above (nothing was watched, no summary written)"
    )


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
    """Remove what an earlier run left under this job id; refuse if a live rank still owns a record."""
    _, live = remove_job_files(job_dir)
    if live:
        raise UserError(
            f"job id {os.path.basename(job_dir)!r} is in use by a running rank (pid {min(live.values())}); "
            "pass another --run-name"
        )


def _wait(
    proc: subprocess.Popen[bytes], on_interrupt: Callable[[], None], keep_waiting: Callable[[], bool]
) -> tuple[int, bool]:
    """torchrun's exit code, and whether it was stopped because ``keep_waiting`` said so."""
    while True:
        try:
            while True:
                try:
                    return proc.wait(timeout=0.5), False
                except subprocess.TimeoutExpired:
                    if not keep_waiting():
                        return _stop(proc), True
        except KeyboardInterrupt:
            on_interrupt()
            # the terminal sent SIGINT to torchrun too; give it time to stop its ranks
            try:
                return proc.wait(timeout=30), False
            except subprocess.TimeoutExpired:
                proc.kill()
            except KeyboardInterrupt:
                proc.kill()


def _stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM (torchrun stops its workers), then SIGKILL if it does not exit."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return 1  # whatever torchrun answered, the job did not run


def torchrun_root_cause_note(
    verdicts: list[dict[str, Any]], *, root_cause_printed: bool, killed: bool = False
) -> str:
    """When torchrun's workers failed it prints its own "Root Cause (first observed failure)": the failed
    rank with the earliest exit it observed, in whole seconds, ties in rank order — usually a rank that
    failed *because of* the initiator, and never a rank that hung and was stopped. One line says so next
    to rankwatch's answer, and only when torchrun really printed that block (not after Ctrl-C)."""
    decided = [v for v in verdicts if int_ranks(v.get("initiating_ranks"))]
    if not root_cause_printed or not decided:
        return ""
    which = "here a rank --on-stall kill stopped" if killed else "often one that failed because of the initiator"
    return (
        "note: torchrun's 'Root Cause (first observed failure)' above is the first failed rank it saw exit "
        f"({which}); rankwatch names {fmt_ranks(int_ranks(decided[0].get('initiating_ranks')))} as the initiator\n"
    )


def _write_summary(
    daemon: Daemon,
    job_id: str,
    out: str,
    history: dict[int, list[StepTiming]],
    samples: Sequence[tuple[int, Mapping[int, RankCounters]]] = (),
    *,
    torchrun_code: int = 0,
    root_cause_printed: bool = False,
) -> None:
    """summary.json/txt, then on stdout the phase table and diagnosis, and last each incident's verdict
    (headline, why, where the initiating rank stands, bundle): what a person reads when the run ends."""
    entry = daemon.jobs.get(job_id)
    incidents = entry.incidents if entry else []
    verdicts = entry.verdicts if entry else []
    diag = diagnose_stragglers(history)
    if entry is not None:
        explain(diag, list(samples), entry.watch.host)
    doc = diag.summary_doc(job_id, incidents, history, verdicts)
    doc["details"] = diag.details
    summary_path: str | None = os.path.join(out, "summary.json")
    try:
        atomic_json(os.path.join(out, "summary.json"), doc)
        atomic_text(os.path.join(out, "summary.txt"), summary_text(doc))
    except OSError as exc:
        log.error("summary_write_failed", out=out, error=str(exc))
        summary_path = None
    bundles = entry.bundles if entry else {}
    where = f"summary: {summary_path}\n" if summary_path else "summary: NOT WRITTEN (see the log)\n"
    note = torchrun_root_cause_note(verdicts, root_cause_printed=root_cause_printed, killed=daemon.killed(job_id))
    blocks = "".join("\n" + final_block(v, bundles.get(str(v.get("incident_id")))) for v in verdicts)
    sys.stdout.write("\n" + summary_text(doc, incidents=False) + where + (f"\n{note}" if note else "") + blocks)
    sys.stdout.flush()
