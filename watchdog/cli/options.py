"""Watchdog options shared by ``rankwatch run`` and ``rankwatch daemon``."""

from __future__ import annotations

import argparse
import math
import os

from rankwatch.hooks.jobinfo import DEFAULT_SHM_DIR

from ..core.policy import CapturePolicy, StallPolicy
from ..errors import UserError
from ..serve.alerts import Alerter, check_command, check_url


def stall_timeout(text: str) -> float | None:
    """SECONDS or 'auto' (None)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SECONDS or 'auto', got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"stall timeout must be a positive number of seconds, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def seconds_or_never(text: str) -> float | None:
    if text.strip().lower() == "never":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SECONDS or 'never', got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return value


def count_or_all(text: str) -> int | None:
    if text.strip().lower() == "all":
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive count or 'all', got {text!r}")
    return int(text)


def port(text: str) -> int:
    """A TCP port to listen on or connect to: 1–65535 (0 would pick a random one nobody can find)."""
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}")
    return int(text)


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def add_shm_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shm-dir",
        default=os.environ.get("RANKWATCH_SHM_DIR", DEFAULT_SHM_DIR),
        help="where the ranks' records live (default: $RANKWATCH_SHM_DIR or %(default)s)",
    )


def add_watch_options(p: argparse.ArgumentParser) -> None:
    """The options every watching command shares (run, daemon)."""
    _add_stall_options(p)
    _add_cluster_options(p)
    _add_evidence_options(p)
    _add_output_options(p)
    _add_alert_options(p)


def _add_stall_options(p: argparse.ArgumentParser) -> None:
    """When a job is stalled and what happens then."""
    p.add_argument(
        "--stall-timeout",
        type=stall_timeout,
        default=None,
        metavar="SECONDS|auto",
        help="no progress for this long is a stall; 'auto' learns it from step times (default: auto)",
    )
    p.add_argument(
        "--startup-timeout",
        type=positive_float,
        default=StallPolicy.startup_s,
        metavar="SECONDS",
        help="budget before the first step completes (default: %(default)s)",
    )
    p.add_argument(
        "--on-stall",
        choices=("report", "kill"),
        default="report",
        help="report only (default), or kill the job's ranks after capturing evidence",
    )
    p.add_argument(
        "--poll-interval",
        type=positive_float,
        default=0.5,
        metavar="SECONDS",
        help="how often rank records are read (default: %(default)s)",
    )


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """Cross-node correlation: the store and the secret that authenticates it."""
    p.add_argument(
        "--store",
        type=host_port,
        default=None,
        metavar="HOST:PORT",
        help="TCPStore for cross-node correlation (default: MASTER_ADDR and port 29431 on multi-node jobs)",
    )
    p.add_argument(
        "--store-secret-file",
        default=os.environ.get("RANKWATCH_STORE_SECRET_FILE") or None,
        metavar="PATH",
        help="shared secret (same file on every node, mode 0600/0400) that authenticates every store value "
        "(default: $RANKWATCH_STORE_SECRET_FILE; without one the store is unauthenticated and other nodes' "
        "claims never kill here)",
    )


def _add_evidence_options(p: argparse.ArgumentParser) -> None:
    """What is captured at an incident."""
    p.add_argument(
        "--pyspy-timeout",
        type=positive_float,
        default=CapturePolicy.pyspy_timeout_s,
        metavar="SECONDS",
        help="how long py-spy may take per rank at an incident (default: %(default)s)",
    )
    p.add_argument(
        "--include-locals", action="store_true", help="capture local variables in stacks (off: they may hold secrets)"
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Logs and the metrics server."""
    p.add_argument(
        "--json-logs", action="store_true", default=None, help="JSON log lines (default: when stderr is not a terminal)"
    )
    p.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: %(default)s)"
    )
    p.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics and /healthz on this port (default: off)",
    )
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address for the metrics server (default: %(default)s)")
    p.add_argument(
        "--metrics-histograms",
        action="store_true",
        help="also export a duration histogram per rank and phase (+21 series per rank and phase; default: the "
        "step histogram and per-phase medians only)",
    )


def _add_alert_options(p: argparse.ArgumentParser) -> None:
    """Who hears of an incident: webhooks and a command."""
    p.add_argument(
        "--notify",
        action="append",
        default=[],
        metavar="URL",
        help="POST each incident's verdict (JSON, with a one-line 'text' for Slack-style webhooks) to this "
        "http(s) URL when it fires and when it resolves; a URL ending in /api/v2/alerts gets Alertmanager's "
        "v2 format; repeatable",
    )
    p.add_argument(
        "--notify-stragglers",
        action="store_true",
        help="also notify when a live straggler starts and ends (default: incidents only)",
    )
    p.add_argument(
        "--on-incident",
        default=None,
        metavar="CMD",
        help="run this executable (no shell; words split like a shell would) with the incident bundle's path "
        "as its last argument and RANKWATCH_KIND, _INITIATING_RANKS, _PHASE, _CONFIDENCE, _REASON, ... in its "
        "environment; everything it starts is killed when it exits or times out",
    )


def alerter_from_args(args: argparse.Namespace) -> Alerter | None:
    """The alert sender the options ask for (None: none); bad URLs and commands are a UserError here,
    before anything starts."""
    urls = [check_url(u) for u in args.notify]
    command = check_command(args.on_incident) if args.on_incident is not None else None
    stragglers = bool(getattr(args, "notify_stragglers", False))
    if stragglers and not urls:
        raise UserError("--notify-stragglers needs a --notify URL")
    return Alerter(urls, command, stragglers=stragglers) if urls or command else None


def policies_from_args(args: argparse.Namespace) -> tuple[StallPolicy, CapturePolicy]:
    if args.stall_timeout is not None and args.stall_timeout < args.poll_interval:
        raise UserError("--stall-timeout must be longer than --poll-interval")
    stall = StallPolicy(timeout_s=args.stall_timeout, startup_s=args.startup_timeout)
    capture = CapturePolicy(pyspy_timeout_s=args.pyspy_timeout, include_locals=args.include_locals)
    return stall, capture
