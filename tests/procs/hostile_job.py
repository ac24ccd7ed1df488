"""One rank (the real hook API, no torch) of a job whose every self-chosen string is hostile.

    RANKWATCH_SHM_DIR=... RANKWATCH_JOB_ID=... RANK=r WORLD_SIZE=2 LOCAL_RANK=r LOCAL_WORLD_SIZE=2 \
        RANKWATCH_HOSTILE='{"host": ..., "phase": ..., "op": ..., "exc": ..., "thread": ...}' \
        python tests/procs/hostile_job.py

The strings come as JSON in ``RANKWATCH_HOSTILE`` (JSON carries control characters escaped). The host
name the record holds is the job's (``socket.gethostname`` as the hook reads it: a container's hostname is
whatever its image says), and so are its phase name, its collective's op name, its main thread's name and
its exception's message. Rank 1 raises inside the hostile phase after 3 steps (the hook's crash mark keeps
the message); rank 0 then waits in a collective its peer never joins. Prints "ready" after its 3 steps.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

HOSTILE = json.loads(os.environ["RANKWATCH_HOSTILE"])


def main() -> None:
    socket.gethostname = lambda: HOSTILE["host"]  # what the hook writes into the record's identity
    threading.current_thread().name = HOSTILE["thread"]
    import rankwatch.hooks as rw
    from rankwatch.hooks import api

    if not rw.init():
        sys.exit("rankwatch hook did not start")
    for _ in range(3):
        with rw.phase(HOSTILE["phase"]):
            time.sleep(0.02)
        rw.step()
    print("ready", flush=True)
    if os.environ["RANK"] == "1":
        sys.stdin.readline()  # until the test says so: both ranks are known to the daemon by then
        with rw.phase(HOSTILE["phase"]):
            raise RuntimeError(HOSTILE["exc"])
    tracker = api._tracker
    assert tracker is not None
    tracker.collective_enter(HOSTILE["op"])  # as torch's all_reduce wrapper would, with the op's name
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
