"""A hostile local user of the job's store writing values far over rankwatch's cap into the keys it reads.

    python tests/procs/store_bloater.py HOST PORT MIB KEY [KEY...]

Connects as a plain TCPStore client (retrying until the store is up), prints "ready", then until killed
rewrites each KEY with MIB MiB of junk (torch's libuv server takes 8 MiB per request, so the value is built
with appends), printing "round N" after each round."""

from __future__ import annotations

import sys
import time

from _store_connect import connect


def main() -> None:
    host, port, mib, keys = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    store = connect(host, port)
    print("ready", flush=True)
    chunk = b"J" * (4 << 20)
    rounds = 0
    while True:
        for key in keys:
            store.set(key, chunk)
            for _ in range(mib // 4 - 1):
                store.append(key, chunk)
        rounds += 1
        print(f"round {rounds}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
