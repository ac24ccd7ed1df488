"""``rankwatch inspect`` reads the flight recorder from torch's debug server, found without the job's store.

Fast tier: the /proc/net/tcp reading, and a child process's own listening sockets (a silent one and one that
answers like the worker server) found through its fds; a process without a ``pt_workerserver`` thread is
never contacted. Slow tier: a plain torchrun job whose ranks run the real worker server, one rank hung.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rankwatch.watchdog.evidence.debug_server import (
    DebugServerPolicy,
    fr_from_debug_server,
    listeners_of,
    parse_listeners,
)
from rankwatch.watchdog.evidence.fr_dump import load_dump

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "jobs"))
import hung

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "fr" / "nccl_hang" / "rank-1.fr.json"
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def row(local: str, state: str, uid: int = 1000, inode: int = 77) -> str:
    return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  {uid}  0 {inode} 1 0 100 0\n"


def test_only_loopback_reachable_listeners_are_read_from_the_table():
    text = HEADER + "".join([
        row("0100007F:1F90", "0A", inode=1),  # 127.0.0.1:8080
        row("0100007E:1F91", "0A", inode=2),  # 126.0.0.1: not loopback
        row("0A00000A:1F92", "0A", inode=3),  # 10.0.0.10: another interface
        row("00000000:1F93", "0A", inode=4),  # 0.0.0.0
        row("0100007F:1F94", "01", inode=5),  # established, not listening
        row("00000000000000000000000000000000:1F95", "0A", inode=6),  # ::
        row("00000000000000000000000001000000:1F96", "0A", inode=7),  # ::1
        row("0000000000000000FFFF00000100007F:1F97", "0A", inode=8),  # ::ffff:127.0.0.1
        row("20010DB8000000000000000000000001:1F98", "0A", inode=9),  # 2001:db8::1
        "garbage line\n",
        row("0100007F:ZZZZ", "0A", inode=10),
    ])
    got = {(lst.port, lst.host, lst.inode) for lst in parse_listeners(text)}
    assert got == {(0x1F90, "127.0.0.1", 1), (0x1F93, "127.0.0.1", 4), (0x1F95, "127.0.0.1", 6),
                   (0x1F96, "::1", 7), (0x1F97, "127.0.0.1", 8)}


CHILD = r"""
import json, os, socket, sys, threading
body = open(sys.argv[1], "rb").read()
name_thread = sys.argv[2] == "1"
contacts = []

def listener():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8); return s

silent, server = listener(), listener()
gone = listener()  # connected sockets are no listeners: a pair whose listener is closed
peer = socket.create_connection(gone.getsockname()); accepted = gone.accept()[0]; gone.close()

def hold(s):
    while True:
        c, _ = s.accept(); contacts.append(c)

def serve(s):
    while True:
        c, _ = s.accept(); contacts.append(c)
        data = b""
        while b"\r\n\r\n" not in data:
            data += c.recv(4096)
        ok = data.startswith(b"POST /handler/fr_trace_json ")
        status = b"200 OK" if ok else b"404 Not Found"
        c.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        c.close()

named = threading.Event()  # the ports are told once the thread has its name: a probe may come at once

def worker():
    if name_thread:  # what torch's WorkerServer names its threads
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write("pt_workerserver")
    named.set()
    serve(server)

threading.Thread(target=hold, args=(silent,), daemon=True).start()
threading.Thread(target=worker, daemon=True).start()
named.wait()
print(json.dumps({"silent": silent.getsockname()[1], "server": server.getsockname()[1]}), flush=True)
for line in sys.stdin:
    print(len(contacts), flush=True)
"""


@pytest.fixture
def child():
    started: list[subprocess.Popen] = []

    def start(name_thread: bool) -> tuple[subprocess.Popen, dict]:
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(FIXTURE), "1" if name_thread else "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(p)
        assert p.stdout is not None
        return p, json.loads(p.stdout.readline())

    yield start
    for p in started:
        p.kill()
        p.wait()


def contacts(p: subprocess.Popen) -> int:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("?\n")
    p.stdin.flush()
    return int(p.stdout.readline())


def test_a_processes_own_listeners_are_found_through_its_fds(child):
    p, ports = child(name_thread=False)
    with socket.socket() as mine:  # this process's listener is not the child's
        mine.bind(("127.0.0.1", 0))
        mine.listen(1)
        found = {lst.port for lst in listeners_of(p.pid, os.geteuid())}
        assert found == {ports["silent"], ports["server"]}
        assert mine.getsockname()[1] not in found
    assert listeners_of(p.pid, os.geteuid() + 1) == []  # another owner's sockets are not the job's


def test_a_process_without_a_worker_server_is_not_contacted(child):
    p, _ = child(name_thread=False)
    assert fr_from_debug_server(p.pid, os.geteuid()) is None
    assert contacts(p) == 0


def test_the_dump_comes_from_the_listener_that_answers_and_parses(child):
    p, ports = child(name_thread=True)
    got = fr_from_debug_server(p.pid, os.geteuid(), DebugServerPolicy(total_timeout_s=5.0))
    assert got is not None and got.body == FIXTURE.read_bytes()
    assert got.source == f"127.0.0.1:{ports['server']}"
    assert load_dump(got.body, rank=1).rank == 1
    # a larger answer than allowed is not taken
    small = fr_from_debug_server(p.pid, os.geteuid(), DebugServerPolicy(total_timeout_s=5.0, max_bytes=100))
    assert small is not None and small.body is None and "limit" in small.source


def test_a_served_dump_is_kept_and_files_fill_in_the_rest(tmp_path):
    from rankwatch.watchdog.evidence.capture import RankCapture
    from rankwatch.watchdog.evidence.inspect_capture import attach_fr_dumps
    from rankwatch.watchdog.observe.discover import Job, Proc, RankProc

    prefix = str(tmp_path / "trace_rank_")
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": prefix}
    uid = os.geteuid()
    job = Job("j", 2, [RankProc(100 + r, r, r, 2, Proc(100 + r, 99, "S", 1, (uid,) * 4), env) for r in (0, 1)],
              owner_uid=uid)
    for r in (0, 1):
        Path(f"{prefix}{r}").write_bytes(FIXTURE.read_bytes())
    served = b'{"version": "2.10", "pg_config": {}, "pg_status": {}}'
    kept = load_dump(served, rank=0)
    captures = {0: RankCapture(rank=0, pid=100, fr_trace=kept)}
    sources: dict = {0: {"from": "debug_server", "address": "127.0.0.1:1"}}
    attach_fr_dumps(job, captures, sources=sources)
    assert captures[0].fr_trace is kept
    def seqs(t):  # the reader sends the trace compacted (``compact_dump``: no output sizes)
        return [(e.record_id, e.collective_seq_id, e.profiling_name, e.input_sizes, e.state) for e in t.entries]

    assert captures[1].fr_trace is not None and seqs(captures[1].fr_trace) == seqs(load_dump(FIXTURE, rank=1))
    assert sources == {0: {"from": "debug_server", "address": "127.0.0.1:1"}, 1: {"from": "file", "path": f"{prefix}1"}}


# -- a real worker server --------------------------------------------------------------------------------
JOB = str(Path(__file__).resolve().parents[2] / "jobs" / "debug_server_job.py")


@pytest.mark.slow
def test_inspect_reads_the_flight_recorder_from_the_debug_server(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{hung.free_port()}", "--rdzv-id", f"dbgsrv-{os.getpid()}",
           JOB, "--hang-rank", "1", "--mark-dir", str(marks)]
    # a buffer but no dump file anywhere: the debug server is the only flight-recorder source
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "200", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "never_")}
    agent = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        def ready() -> dict[int, tuple[int, int]] | None:
            if agent.poll() is not None:
                raise AssertionError(f"torchrun ended (exit {agent.returncode}) before the hang")
            got = {}
            for r in (0, 1):
                f = marks / f"rank-{r}.ready"
                parts = f.read_text().split() if f.exists() else []
                if len(parts) != 2:
                    return None
                got[r] = (int(parts[0]), int(parts[1]))
            return got

        ranks = hung.wait_until(ready, 240, "both ranks to reach the hang")
        assert isinstance(ranks, dict)
        res = subprocess.run([sys.executable, "-m", "rankwatch.watchdog.cli", "inspect", "--pid", str(agent.pid),
                              "--out", str(tmp_path / "out"), "--json"], capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stderr
        v = json.loads(res.stdout)
        assert (v["kind"], v["initiating_ranks"]) == ("hang", [1])
        # each rank's dump came from its own worker server, the port it registered in the job's store
        assert v["flight_recorder_sources"] == {
            str(r): {"from": "debug_server", "address": f"127.0.0.1:{port}"} for r, (_, port) in ranks.items()
        }
        assert "flight recorder: pg 0 (default_pg): behind (others entered seq 4): rank 1 at seq 3" in v["evidence"]
        assert not Path(f"{tmp_path}/never_0").exists()  # nothing triggered a dump
        fr = Path(v["bundle"]) / "fr"
        assert sorted(p.name for p in fr.iterdir()) == ["rank-0.json", "rank-1.json"]
        assert load_dump(fr.joinpath("rank-1.json").read_bytes(), rank=1).entries
    finally:
        hung.kill_job(agent)
