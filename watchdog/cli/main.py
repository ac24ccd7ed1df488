"""``rankwatch`` command line: run, daemon, status, report, diagnose, inspect.

Each subcommand lives in its own module, which imports what it uses at its top; ``COMMANDS`` below is the one
place a module is loaded by name, and only the module of the command that runs, so ``rankwatch --help`` and
``rankwatch status`` do not pay for ``run``'s daemon (and nothing here pays for torch). Bad input is one line
on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module

from ..errors import UserError

# command -> (its module, one line for the usage): the dispatch table, read by ``main`` alone
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("rankwatch.watchdog.cli.run", "start this node's watchdog and run torchrun with the hooks injected"),
    "daemon": ("rankwatch.watchdog.cli.daemon", "the per-node sidecar (as systemd runs it)"),
    "status": ("rankwatch.watchdog.cli.status", "live per-rank table for the jobs on this node"),
    "report": ("rankwatch.watchdog.cli.report", "render an incident bundle or a run summary"),
    "diagnose": ("rankwatch.watchdog.cli.diagnose", "name the initiating rank from logs a job already wrote"),
    "inspect": ("rankwatch.watchdog.cli.inspect",
                "name the rank a job that is hung right now waits for (no hook, no restart)"),
}

USAGE = (
    "usage: rankwatch COMMAND [OPTIONS]\n\ncommands:\n"
    + "".join(f"  {name:<9} {line}\n" for name, (_, line) in COMMANDS.items())
    + "\n'rankwatch COMMAND --help' describes each command; 'rankwatch --version' prints the version."
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("rankwatch")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _entry(command: str) -> Callable[[list[str]], int]:
    """The command's ``main``: its module is imported here, by its name in ``COMMANDS``, and nowhere else."""
    module = import_module(COMMANDS[command][0])
    entry: Callable[[list[str]], int] = module.main
    return entry


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
        return _entry(command)(rest)
    except UserError as exc:
        sys.stderr.write(f"rankwatch {command}: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
