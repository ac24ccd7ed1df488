"""A hostile local user of the job's store: any process that reaches its port may delete and overwrite keys.

    python tests/procs/store_vandal.py HOST PORT KEY [KEY...]

Connects as a plain TCPStore client (retrying until the store is up), prints "ready", then until killed
alternately deletes each KEY and overwrites it with junk that is not a rankwatch value (counting both in
the file named by $VANDAL_COUNT, one line "deletes overwrites" rewritten every round)."""

from __future__ import annotations

import os
import sys
import time

from _store_connect import connect


def main() -> None:
    host, port, keys = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    store = connect(host, port)
    print("ready", flush=True)
    count = os.environ.get("VANDAL_COUNT")
    deletes = overwrites = 0
    while True:
        for key in keys:
            store.delete_key(key)
            deletes += 1
            time.sleep(0.005)
            store.set(key, b'{"schema": "rankwatch.node/1", "kind": "evidence", "junk": true}')
            overwrites += 1
            time.sleep(0.005)
        if count:
            with open(count + ".tmp", "w") as f:
                f.write(f"{deletes} {overwrites}\n")
            os.replace(count + ".tmp", count)


if __name__ == "__main__":
    main()
