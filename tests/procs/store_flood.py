"""A local user flooding a job store: big values, then idle connections.

    python tests/procs/store_flood.py HOST PORT VALUES MIB CONNECTIONS

Sets VALUES values of MIB MiB each (reconnecting when the store drops it, until it has refused three in a
row), then opens CONNECTIONS idle TCP
connections and keeps them; prints "done <values stored> <connections open>" and waits to be killed."""

from __future__ import annotations

import datetime
import resource
import socket
import sys
import time

import torch.distributed as dist


def client(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))


def main() -> None:
    host, port, values, mib, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, conns + 64)), hard))
    store = client(host, port)
    stored = 0
    blob = b"x" * (mib << 20)
    refused = 0
    for i in range(values):
        try:
            store.set(f"flood/{i}", blob)
            stored += 1
            refused = 0
        except Exception:
            refused += 1
            if refused >= 3:  # the store keeps dropping it: it holds all it will
                break
            try:
                store = client(host, port)
            except Exception:
                break
    held = []
    failed = 0
    for _ in range(conns):
        s = socket.socket()
        s.settimeout(0.5)
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            failed += 1
            if failed >= 10:  # the store accepts no more: all it will take is held
                break
            continue
        held.append(s)
    print(f"done {stored} {len(held)}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
