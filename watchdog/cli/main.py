"""``rankwatch`` command line: run, daemon, status, report, diagnose, inspect.

Each subcommand lives in its own module and is imported only when used, so ``rankwatch status`` does
not pay for torch. Bad input is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..errors import UserError

USAGE = """usage: rankwatch COMMAND [OPTIONS]

commands:
  run       start this node's watchdog and run torchrun with the hooks injected
  daemon    the per-node sidecar (as systemd runs it)
  status    live per-rank table for the jobs on this node
  report    render an incident bundle or a run summary
  diagnose  name the initiating rank from logs a job already wrote
  inspect   name the rank a job that is hung right now waits for (no hook, no restart)

'rankwatch COMMAND --help' describes each command; 'rankwatch --version' prints the version."""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rankwatch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _load(name: str) -> Callable[[list[str]], int]:
    from importlib import import_module

    module = import_module(f"rankwatch.watchdog.cli.{name}")
    entry: Callable[[list[str]], int] = module.main
    return entry


COMMANDS = ("run", "daemon", "status", "report", "diagnose", "inspect")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["--version"], ["-V"]):
        sys.stdout.write(f"rankwatch {version()}\n")
        return 0
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE + "\n")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        sys.stderr.write(f"rankwatch: unknown command {command!r} (try: {', '.join(COMMANDS)})\n")
        return 2
    try:
        return _load(command)(rest)
    except UserError as exc:
        sys.stderr.write(f"rankwatch {command}: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
