"""A TCPStore server that attacks its clients (a process listening where a job's store should be).

    python tests/procs/hostile_store.py MODE PORT [ANNOUNCE_BYTES]

Speaks torch's wire protocol far enough to look like a store (validation, ping, CHECK says every key
exists, WAIT answers at once), then per MODE:

* ``huge``: every GET / MULTI_GET value is announced as ANNOUNCE_BYTES long (default 2 GiB) and never sent:
  a client that allocates what the prefix says grows by that much;
* ``silent``: accepts connections and never answers anything (not even the validation's ping).

Prints "ready PORT" once listening, and "announced N" after each huge announcement (N: the count so far).
Every connection is a thread; it runs until killed.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

U64 = struct.Struct("<Q")
count = 0
lock = threading.Lock()


def recvn(c: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        d = c.recv(n - len(buf))
        if not d:
            raise EOFError
        buf += d
    return buf


def string(c: socket.socket) -> bytes:
    (n,) = U64.unpack(recvn(c, 8))
    return recvn(c, n)


def announce(c: socket.socket, size: int) -> None:
    global count
    c.sendall(U64.pack(size))
    with lock:
        count += 1
        print(f"announced {count}", flush=True)


def serve_huge(c: socket.socket, size: int) -> None:
    while True:
        q = recvn(c, 1)[0]
        if q == 0:  # VALIDATE
            recvn(c, 4)
        elif q == 13:  # PING: echo the nonce
            c.sendall(recvn(c, 4))
        elif q == 5:  # CHECK: everything exists
            for _ in range(U64.unpack(recvn(c, 8))[0]):
                string(c)
            c.sendall(b"\x00")
        elif q == 6:  # WAIT: here already
            for _ in range(U64.unpack(recvn(c, 8))[0]):
                string(c)
            c.sendall(b"\x00")
        elif q == 3:  # GET
            string(c)
            announce(c, size)
        elif q == 10:  # MULTI_GET
            for _ in range(U64.unpack(recvn(c, 8))[0]):
                string(c)
            announce(c, size)
        elif q == 1:  # SET
            string(c)
            string(c)
        elif q == 2:  # COMPARE_SET
            string(c)
            string(c)
            announce(c, size)
        elif q == 4:  # ADD
            string(c)
            recvn(c, 8)
            c.sendall(struct.pack("<q", 1))
        else:
            return


def handle(c: socket.socket, mode: str, size: int) -> None:
    with c:
        try:
            if mode == "silent":
                while c.recv(65536):
                    pass
            else:
                serve_huge(c, size)
        except (EOFError, OSError):
            pass


def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 2 << 30
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen(128)
    print(f"ready {srv.getsockname()[1]}", flush=True)
    while True:
        c, _ = srv.accept()
        threading.Thread(target=handle, args=(c, mode, size), daemon=True).start()


if __name__ == "__main__":
    main()
