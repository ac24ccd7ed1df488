"""``python -m rankwatch.hooks [-m module | script.py] [args…]``: run a training script instrumented.

torchrun starts this once per rank (``torchrun … -m rankwatch.hooks train.py``); the script then runs
as ``__main__`` with its own argv, exactly as it would without rankwatch.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m rankwatch.hooks [-m MODULE | SCRIPT] [ARGS...]"

# The flight recorder only records when given a buffer; it must be set before the process group exists.
DEFAULT_FR_BUFFER = "2000"


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write(USAGE + "\n")
        raise SystemExit(0 if argv else 2)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", DEFAULT_FR_BUFFER)

    from rankwatch.hooks import instrument
    from rankwatch.hooks.api import crash_text, mark_crashed

    instrument()
    try:
        _run(argv)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            mark_crashed(f"SystemExit: {exc.code}"[:200])
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        mark_crashed(crash_text(exc))
        raise


def _run(argv: list[str]) -> None:
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.stderr.write(USAGE + "\n")
            raise SystemExit(2)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.isfile(script):
            sys.stderr.write(f"rankwatch.hooks: no such script: {script}\n")
            raise SystemExit(2)
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
