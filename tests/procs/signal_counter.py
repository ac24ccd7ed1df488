"""A bystander that records every catchable signal it receives (one name per line in the given file)."""

from __future__ import annotations

import signal
import sys
import time

out = open(sys.argv[1], "a", buffering=1)


def note(signum: int, _frame: object) -> None:
    out.write(signal.Signals(signum).name + "\n")


for sig in (signal.SIGTERM, signal.SIGCONT, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
            signal.SIGQUIT, signal.SIGABRT, signal.SIGTRAP):
    signal.signal(sig, note)
print("ready", flush=True)
while True:
    time.sleep(60)
