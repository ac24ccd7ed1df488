"""Flight-recorder dumps from PyTorch's debug server (``torch.distributed.debug.start_debug_server``), read
without the job's store.

Every rank that started it runs a C++ ``_WorkerServer`` (threads named ``pt_workerserver``) on an ephemeral
port and registers it in the job's TCPStore; rankwatch does not touch that store. It finds the port from
the process itself instead: the listening TCP sockets whose inodes are among the rank's own fds
(``/proc/<pid>/fd`` → ``socket:[inode]``, matched against ``/proc/<pid>/net/tcp{,6}``), loopback or
any-address only, owned by the job's owner, in this process's network namespace. Each such port gets one
``POST /handler/fr_trace_json`` (the handler torch's frontend fetches) under one total deadline and a size
cap; the first HTTP 200 answer is the dump. A process without a ``pt_workerserver`` thread is never
contacted. This runs in the job owner's reader (``privsep``: its uid, never root's), which also
parses the answer (``flight_recorder.fr_wire_doc``, bounded, never unpickled); root gets a typed trace.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from .fr_dump import MAX_DUMP_BYTES

WORKER_THREAD = "pt_workerserver"  # torch/csrc/distributed/c10d/control_plane/WorkerServer.cpp names its threads
FR_HANDLER = "/handler/fr_trace_json"  # torch/distributed/debug/_debug_handlers.py fetches it with POST


@dataclass(frozen=True)
class DebugServerPolicy:
    total_timeout_s: float = 3.0
    """A worker server answers from its own threads in milliseconds even when the rank is hung; a listener
    that is not one (gloo's, NCCL's bootstrap) never answers, so the whole probe is bounded at once."""
    max_ports: int = 16
    """A rank listens on a handful of sockets (gloo pairs, the worker server); more than this is not a rank's."""
    max_bytes: int = MAX_DUMP_BYTES
    """The parser's own limit: a larger answer is not a dump."""


@dataclass(frozen=True)
class Listener:
    port: int
    uid: int
    inode: int
    host: str  # the address to connect to: 127.0.0.1 or ::1


def _listen_host(addr_hex: str) -> str | None:
    """Where to reach a listener bound to this /proc/net/tcp address from the same host, or None when it
    listens on another interface only. IPv4 is one host-order u32; IPv6 four of them."""
    a = addr_hex.upper()
    if len(a) == 8:
        return "127.0.0.1" if a == "00000000" or a[6:8] == "7F" else None
    if len(a) == 32:
        if a == "0" * 32:
            return "127.0.0.1"  # "::" is dual-stack unless IPV6_V6ONLY; 127.0.0.1 reaches it (torch binds "::")
        if a == "0" * 24 + "01000000":
            return "::1"
        if a[:20] == "0" * 16 + "FFFF" and a[30:32] == "7F":  # ::ffff:127.x.x.x
            return "127.0.0.1"
    return None


def parse_listeners(text: str) -> list[Listener]:
    """Listening sockets (state 0A) reachable on loopback, from a /proc/net/tcp or tcp6 table."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] != "0A" or ":" not in f[1]:
            continue
        addr, _, port_hex = f[1].rpartition(":")
        host = _listen_host(addr)
        try:
            port, uid, inode = int(port_hex, 16), int(f[7]), int(f[9])
        except ValueError:
            continue
        if host is not None and 0 < port < 65536 and inode > 0:
            out.append(Listener(port, uid, inode, host))
    return out


def socket_inodes(pid: int, proc_root: str = "/proc") -> set[int]:
    """The socket inodes among the process's open fds (reading them needs the caller's ptrace right)."""
    base = f"{proc_root}/{pid}/fd"
    out: set[int] = set()
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names[:65536]:
        try:
            link = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]") and link[8:-1].isdigit():
            out.add(int(link[8:-1]))
    return out


def runs_worker_server(pid: int, proc_root: str = "/proc") -> bool:
    """A thread of the process is torch's worker server."""
    try:
        tids = os.listdir(f"{proc_root}/{pid}/task")
    except OSError:
        return False
    for tid in tids[:4096]:
        try:
            with open(f"{proc_root}/{pid}/task/{tid}/comm", "rb") as f:
                if f.read(64).strip() == WORKER_THREAD.encode():
                    return True
        except OSError:
            continue
    return False


def same_netns(pid: int, proc_root: str = "/proc") -> bool:
    """127.0.0.1 here is the process's loopback only in the same network namespace."""
    try:
        return os.stat(f"{proc_root}/{pid}/ns/net").st_ino == os.stat(f"{proc_root}/self/ns/net").st_ino
    except OSError:
        return False


def listeners_of(pid: int, owner_uid: int, proc_root: str = "/proc") -> list[Listener]:
    """The loopback-reachable listening sockets the process itself holds open, owned by ``owner_uid``."""
    inodes = socket_inodes(pid, proc_root)
    if not inodes:
        return []
    found: dict[int, Listener] = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/{pid}/net/{table}", encoding="ascii", errors="replace") as f:
                text = f.read(8 << 20)
        except OSError:
            continue
        for lst in parse_listeners(text):
            if lst.inode in inodes and lst.uid == owner_uid:
                found.setdefault(lst.port, lst)
    return sorted(found.values(), key=lambda lst: lst.port)


def http_post(host: str, port: int, path: str, deadline: float, max_bytes: int) -> bytes | str:
    """The body of an HTTP 200 answer to ``POST path``, or why not; the whole exchange ends by ``deadline``
    (monotonic) and reads at most ``max_bytes`` of body."""
    left = deadline - time.monotonic()
    if left <= 0:
        return "no time left"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(left)
            s.connect((host, port))
            request = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            s.sendall(request.encode())
            buf = bytearray()
            limit = max_bytes + 64 * 1024  # headers
            while len(buf) <= limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "no complete answer in time"
                s.settimeout(left)
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0 and (n := _content_length(bytes(buf[:head_end]))) is not None:
                    if n > max_bytes:
                        return f"answer of {n} bytes, over the {max_bytes}-byte limit"
                    if len(buf) - head_end - 4 >= n:
                        break
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    head, sep, body = bytes(buf).partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1."):
        return "not an HTTP server"
    status = head.split(b"\r\n", 1)[0].split(b" ")
    if len(status) < 2 or status[1] != b"200":
        return f"HTTP status {status[1].decode('ascii', 'replace')[:3] if len(status) > 1 else '?'}"
    n = _content_length(head)
    if len(body) > max_bytes:
        return f"answer over the {max_bytes}-byte limit"
    return body[:n] if n is not None else body


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            v = value.strip()
            return int(v) if v.isdigit() and len(v) < 19 else None
    return None


@dataclass(frozen=True)
class DebugServerDump:
    body: bytes | None  # the JSON dump, or None
    source: str  # "127.0.0.1:PORT" it came from, or why there is none


def fr_from_debug_server(
    pid: int, owner_uid: int, policy: DebugServerPolicy = DebugServerPolicy(), proc_root: str = "/proc"
) -> DebugServerDump | None:
    """The rank's flight-recorder dump from its worker server; None when it runs none (nothing contacted)."""
    if not runs_worker_server(pid, proc_root):
        return None
    if not same_netns(pid, proc_root):
        return DebugServerDump(None, "in another network namespace: not contacted")
    listeners = listeners_of(pid, owner_uid, proc_root)[: policy.max_ports]
    if not listeners:
        return DebugServerDump(None, "no loopback listener of its own found")
    deadline = time.monotonic() + policy.total_timeout_s
    # the first answer ends the wait: the listeners that are not HTTP servers stay silent until the deadline,
    # and their (daemon) threads end by it on their own without holding up this process's exit
    answers: queue.Queue[tuple[Listener, bytes | str]] = queue.Queue()
    for lst in listeners:
        threading.Thread(
            target=lambda lst=lst: answers.put((lst, http_post(lst.host, lst.port, FR_HANDLER, deadline,
                                                               policy.max_bytes))),
            name="rankwatch-dbgsrv", daemon=True,
        ).start()
    whys = []
    for _ in listeners:
        try:
            lst, got = answers.get(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        except queue.Empty:
            break
        if isinstance(got, bytes) and got[:1] == b"{":
            return DebugServerDump(got, f"{lst.host}:{lst.port}")
        whys.append(f"{lst.port}: {got if isinstance(got, str) else 'not a JSON dump'}")
    return DebugServerDump(None, "no listener answered " + FR_HANDLER + " (" + "; ".join(sorted(whys))[:200] + ")")
