"""A job of ``--ranks`` real rank processes (the real hook API, no torch) that meet at a barrier every
step, like a data-parallel job's all-reduce, for the alert tests.

    RANKWATCH_SHM_DIR=... RANKWATCH_JOB_ID=... python tests/procs/alert_job.py --ranks 2 [--stall-rank R]
        [--slow-rank R] [--step-s S]

``--stall-rank``: after 3 steps that rank stops in ``forward`` (the others wait in ``collective``) until
the job gets SIGUSR1, then all go on: a hang that recovers. ``--slow-rank``: that rank's dataloader takes
8x longer until SIGUSR2: a straggler that ends. SIGTERM ends the job. Prints "ready" once every record exists.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import signal
import sys
import time


def rank_main(rank: int, world: int, args: argparse.Namespace, barrier, stall, slow, ready) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import rankwatch.hooks as rw

    if not rw.init():
        sys.exit("rankwatch hook did not start")
    ready.release()
    step, quarter = 0, args.step_s / 4
    while True:
        with rw.phase("dataloader"):
            time.sleep(quarter * (8 if rank == args.slow_rank and slow.is_set() else 1))
        with rw.phase("forward"):
            if rank == args.stall_rank and step == 3:
                stall.wait()
            time.sleep(quarter)
        with rw.phase("backward"):
            time.sleep(quarter)
        with rw.phase("collective"):
            barrier.wait()
        with rw.phase("optimizer"):
            time.sleep(quarter)
        rw.step()
        step += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--step-s", type=float, default=0.04)
    args = p.parse_args()
    ctx = mp.get_context("fork")
    barrier, stall, slow, ready = ctx.Barrier(args.ranks), ctx.Event(), ctx.Event(), ctx.Semaphore(0)
    slow.set()
    kids = []
    for r in range(args.ranks):
        pid = os.fork()  # not multiprocessing.Process: the hook stays off in multiprocessing children
        if pid == 0:
            try:
                rank_main(r, args.ranks, args, barrier, stall, slow, ready)
            finally:
                os._exit(1)
        kids.append(pid)
    signal.signal(signal.SIGUSR1, lambda *_: stall.set())
    signal.signal(signal.SIGUSR2, lambda *_: slow.clear())

    def stop(*_: object) -> None:
        for pid in kids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    for _ in kids:
        if not ready.acquire(timeout=120):
            stop()
    print("ready", flush=True)
    while os.waitpid(-1, os.WNOHANG) == (0, 0):
        time.sleep(0.2)
    stop()


if __name__ == "__main__":
    main()
