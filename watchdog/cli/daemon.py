"""``rankwatch daemon``: the per-node sidecar, as systemd runs it (Type=notify, WatchdogSec=)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import structlog

from .. import logs
from ..cluster.auth import load_secret
from ..cluster.correlate import Correlator
from ..cluster.store import DEFAULT_STORE_PORT
from ..cluster.store_host import StoreHost
from ..core.policy import MetricsPolicy, ServePolicy
from ..errors import UserError
from ..observe.jobwatch import JobWatch
from ..serve.daemon import Daemon, DaemonConfig
from ..serve.metrics import Exposure, MetricsUnavailable, read_token, serve_metrics
from ..serve.sdnotify import Notifier
from .argparser import Parser
from .options import (
    add_shm_dir,
    add_watch_options,
    alerter_from_args,
    count_or_all,
    policies_from_args,
    port,
    seconds_or_never,
)

log = structlog.get_logger("rankwatch.daemon")


def build_parser() -> Parser:
    p = Parser(prog="rankwatch daemon", description="Watch every job under the shm dir on this node.")
    add_shm_dir(p)
    p.add_argument(
        "--out",
        default=os.environ.get("RANKWATCH_OUT", "/var/lib/rankwatch"),
        help="incident bundles go to OUT/<job-id>/incidents/ (default: %(default)s)",
    )
    p.add_argument(
        "--store-port",
        type=port,
        default=None,
        metavar="PORT",
        help="run a job store on this port, in a separate unprivileged process with its own limits, and "
        "correlate multi-node jobs through the store on their MASTER_ADDR at this port",
    )
    p.add_argument("--once", action="store_true", help="poll once and exit (for checks)")
    p.add_argument(
        "--retain-finished",
        type=seconds_or_never,
        default=ServePolicy.retain_finished_s,
        metavar="SECONDS|never",
        help="remove a finished job's records this long after it ended (default: %(default)s)",
    )
    p.add_argument(
        "--keep-incidents",
        type=count_or_all,
        default=ServePolicy.keep_incidents,
        metavar="N|all",
        help="keep only the N newest incident bundles under --out (default: %(default)s)",
    )
    p.add_argument(
        "--keep-incident-mib",
        type=count_or_all,
        default=(ServePolicy.keep_incident_bytes or 0) >> 20 or None,
        metavar="MIB|all",
        help="keep at most this many MiB of incident bundles per job owner (a user's incidents prune only "
        "that user's bundles; the newest is always kept) (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-detail",
        choices=("aggregate", "jobs"),
        default="aggregate",
        help="what every scraper of --metrics-port sees: node totals only (default: other users' job ids, "
        "ranks and pids stay private on a shared node), or every job's series (a single-tenant node)",
    )
    p.add_argument(
        "--metrics-token-file",
        default=None,
        metavar="PATH",
        help="a scrape presenting this file's token (Authorization: Bearer) gets every job's series whatever "
        "--metrics-detail says (file mode 0600/0400)",
    )
    add_watch_options(p)
    return p


def env_defaults(env: dict[str, str] | None = None) -> list[str]:
    """RANKWATCH_DAEMON_ARGS from the systemd EnvironmentFile, split like a shell would, never run by one."""
    import shlex

    env = dict(os.environ) if env is None else env
    raw = env.get("RANKWATCH_DAEMON_ARGS", "")
    try:
        return shlex.split(raw)
    except ValueError as exc:
        raise UserError(f"RANKWATCH_DAEMON_ARGS is malformed: {exc}") from exc


def correlator_factory(
    store: tuple[str, int] | None, store_port: int | None, secret: bytes | None = None
) -> Callable[[JobWatch], Correlator | None]:
    """Multi-node jobs (job.json: world size above the local one) get a correlator, a client of the store at
    MASTER_ADDR:store_port (or --store). The daemon never hosts a store in its own process, whatever a job's
    job.json says (it is the user's file): ``--store-port`` runs ``cluster.store_host`` beside it instead."""

    def build(watch: JobWatch) -> Correlator | None:
        info = watch.job_info
        world, local = info.get("world_size"), info.get("local_world_size")
        node_rank = info.get("node_rank")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (world, local, node_rank)):
            return None
        assert isinstance(world, int) and isinstance(local, int) and isinstance(node_rank, int)
        if world <= local:
            return None
        master = info.get("master_addr")
        host, port = store or (
            master if isinstance(master, str) and master else "127.0.0.1",
            store_port or DEFAULT_STORE_PORT,
        )
        log.info("correlating", job=watch.job_id, node_rank=node_rank, store=f"{host}:{port}")
        return Correlator(watch.job_id, node_rank, host, port, nnodes=-(-world // max(1, local)), secret=secret,
                          host_server=False)

    return build


def metrics_exposure(args: Any) -> Exposure:
    """Who sees per-job series on /metrics; a bad token file is a UserError here, before the daemon starts."""
    token = read_token(args.metrics_token_file) if args.metrics_token_file is not None else None
    return Exposure(args.metrics_detail, token)


class DaemonMetrics:
    """The daemon's /metrics and /healthz, and while its port is taken, the wait for it.

    Metrics are optional: a port another process holds (or an address this host cannot bind) is one warning
    in the log, and the daemon watches every job on without them (refusing to start would leave the node
    unwatched, and systemd restarting it would not free the port). The port is not moved: it is the node's
    fixed address (static scrape configs, Kubernetes' liveness probe), so it is tried again every
    ``retry_s`` off the poll loop, and metrics come back on it by themselves. Until then Prometheus sees
    the target down (``RankwatchWatchdogDown``), which says where to look."""

    def __init__(self, open_server: Callable[[], Any], retry_s: float) -> None:
        self._open = open_server
        self.server: Any = None
        self._stop = threading.Event()
        self._retry: threading.Thread | None = None
        if not self._try(first=True, retry_s=retry_s) and retry_s > 0:
            self._retry = threading.Thread(target=self._retry_loop, args=(retry_s,), name="rankwatch-metrics-retry",
                                           daemon=True)
            self._retry.start()

    def _try(self, *, first: bool, retry_s: float = 0.0) -> bool:
        try:
            self.server = self._open()
        except MetricsUnavailable as exc:
            if first:
                log.warning("metrics_unavailable", error=str(exc), retry_every_s=retry_s or None,
                            detail="watching on without /metrics and /healthz")
            return False
        if not first:
            log.info("metrics_available_again", url=self.server.url)
        return True

    def _retry_loop(self, retry_s: float) -> None:
        while not self._stop.wait(retry_s):
            if self._try(first=False):
                return

    def close(self) -> None:
        self._stop.set()
        if self._retry is not None:
            self._retry.join(timeout=30)
        if self.server is not None:
            self.server.close()


class SignalHandlers:
    """The daemon's signal handlers note the signal and return; whatever logs runs later, on the loop.

    A handler runs on the main thread between two bytecodes, possibly while that thread is inside a log
    call holding structlog's PrintLogger lock (not reentrant): a handler that logs, or configures the
    logging again, waits for itself forever (seen with SIGTERM: a daemon deaf to it)."""

    def __init__(self, daemon: Daemon, notifier: Notifier, relog: Callable[[], None]) -> None:
        self.daemon, self.notifier, self.relog = daemon, notifier, relog
        self.stopped_by: list[str] = []  # logged once the loop has returned
        self.reloads: list[str] = []  # SIGHUPs the loop has not acted on yet

    def stop(self, signum: int, _frame: Any) -> None:
        self.stopped_by.append(signal.Signals(signum).name)
        self.notifier.stopping()
        self.daemon.stop()

    def reload(self, signum: int, _frame: Any) -> None:
        # logrotate / journald restarts: the log stream is opened again after this poll; the loop, its
        # incidents in flight and the readers go on untouched (SIGHUP's default action would end the daemon)
        self.reloads.append(signal.Signals(signum).name)

    def after_poll(self) -> None:
        """The loop's heartbeat: systemd's watchdog ping, then a reload a SIGHUP asked for."""
        self.notifier.ping()
        if self.reloads:
            self.reloads.clear()
            self.relog()
            log.info("daemon_reloaded", signal="SIGHUP")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(env_defaults() + argv)

    def relog() -> None:  # at start, and again after SIGHUP
        logs.configure(json_output=True if args.json_logs is None else args.json_logs, level=args.log_level)

    relog()
    stall, capture = policies_from_args(args)
    secret = load_secret(args.store_secret_file) if args.store_secret_file is not None else None
    exposure = metrics_exposure(args)
    alerts = alerter_from_args(args)
    try:
        os.makedirs(args.out, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output dir {args.out}: {exc.strerror}") from exc
    if not os.access(args.out, os.W_OK):
        raise UserError(f"output dir {args.out} is not writable")
    config = DaemonConfig(
        shm_dir=args.shm_dir,
        out_dir=args.out,
        poll_interval_s=args.poll_interval,
        stall=stall,
        capture=capture,
        on_stall=args.on_stall,
        serve=ServePolicy(retain_finished_s=args.retain_finished, keep_incidents=args.keep_incidents,
                          keep_incident_bytes=None if args.keep_incident_mib is None else args.keep_incident_mib << 20),
    )
    factory = None
    if args.store_port is not None or args.store is not None:
        factory = correlator_factory(args.store, args.store_port, secret)
    daemon = Daemon(config, correlator_factory=factory, alerts=alerts)
    extras: list[Any] = []
    if args.store_port is not None and not args.once:  # this daemon's configuration decides, never a job
        host = StoreHost(args.store_port)
        host.start()
        extras.append(host)
    daemon.clean_leftovers()
    notifier = Notifier()
    if args.metrics_port is not None:
        def open_metrics() -> Any:
            return serve_metrics(daemon, args.metrics_addr, args.metrics_port, histograms=args.metrics_histograms,
                                 exposure=exposure, tries=MetricsPolicy().daemon_port_tries)

        extras.append(DaemonMetrics(open_metrics, retry_s=0 if args.once else MetricsPolicy().daemon_retry_s))

    handlers = SignalHandlers(daemon, notifier, relog)
    signal.signal(signal.SIGTERM, handlers.stop)
    signal.signal(signal.SIGINT, handlers.stop)
    signal.signal(signal.SIGHUP, handlers.reload)
    log.info(
        "daemon_start",
        shm_dir=args.shm_dir,
        out=args.out,
        poll_interval_s=args.poll_interval,
        stall_timeout=args.stall_timeout or "auto",
        on_stall=args.on_stall,
    )
    daemon.poll_once()
    notifier.ready(f"watching {len(daemon.jobs)} job(s) in {args.shm_dir}")
    try:
        if not args.once:
            daemon.run(heartbeat=handlers.after_poll)
        if handlers.stopped_by:
            log.info("daemon_stopping", signal=handlers.stopped_by[0])
    finally:
        for extra in extras:
            extra.close()
        daemon.close()
    log.info("daemon_stopped")
    return 0
