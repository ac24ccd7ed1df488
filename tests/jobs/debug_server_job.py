"""A plain torch job (no rankwatch imported) whose ranks run torch's debug-server worker, then hang: rank
``--hang-rank`` sleeps in ``compute`` while the others wait in an all_reduce it never joins.

Each rank starts the worker server exactly as ``torch.distributed.debug.start_debug_server`` does on a
non-zero rank (its rank-0 frontend needs tabulate/aiohttp/jinja2, which are not test dependencies): a
``_WorkerServer`` on an ephemeral port, registered in the job's store under ``debug_server/rank<N>``.
Marks: ``rank-<r>.ready`` ("PID PORT", PORT: its worker server's) once the rank's last collective was
enqueued or its hang begun.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.debug._handlers  # registers the Python handlers, as start_debug_server does
from torch._C._distributed_c10d import _WorkerServer
from torch.distributed.debug._store import tcpstore_client


def compute() -> None:
    while True:
        time.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hang-rank", type=int, default=1)
    ap.add_argument("--mark-dir", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    server = _WorkerServer("::", 0)
    tcpstore_client().set(f"rank{rank}", f"http://{socket.gethostname()}:{server.port}")
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    mark = Path(args.mark_dir) / f"rank-{rank}.ready"
    if rank == args.hang_rank:
        mark.write_text(f"{os.getpid()} {server.port}")
        compute()
    work = dist.all_reduce(t, async_op=True)  # recorded by the flight recorder once enqueued
    mark.write_text(f"{os.getpid()} {server.port}")
    work.wait()


if __name__ == "__main__":
    main()
