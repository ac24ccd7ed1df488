# ruff: noqa: F811  (the users/world fixtures of test_multiuser are imported, then requested by name)
"""A good neighbour on a shared node (issue 42): one user's volume slows only that user's own jobs.

A real root ``rankwatch daemon`` watches two throwaway unprivileged users (``useradd``, removed after). User A
floods the shared shm dir — hundreds of job dirs renamed in at once, a thousand records in one job, records
held torn by a live writer, or A's own reader stopped with SIGSTOP — while user B's job hangs. B's hang is
still detected, and its bundle written and its ``--on-incident`` command run: nothing of B's is lost to A's
volume. (How much later than on a quiet node is a benchmark's question, ``benchmarks/bench_flood.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import bundle_dirs, new_tracker
from test_multiuser import User, users, world  # noqa: F401  (fixtures: throwaway users, a world for them)
from test_privsep import daemons, discovered, fresh_shm, move_in, ranks, staged  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="real users and a root daemon need root"),
]

FLOOD_DIRS = 400  # job dirs A renames in at once (4 records each, of a process that is gone)
FLOOD_RECORDS = 1000  # records in one job of A's

# A's process writes ``count`` records in its job dir and maps every one (so each verifies as a live rank of
# A's); "torn": each held mid-update (its seqlock odd), so every read of it is torn
FLOODER = """
import os, sys, time
from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, write_identity
job, count, torn = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "torn"
os.makedirs(job, mode=0o700, exist_ok=True)
writers = []
for r in range(count):
    w = RecordWriter(os.path.join(job, f"rank-{r}.hb"))
    write_identity(w, RankIdentity(pid=os.getpid(), global_rank=r, local_rank=r, world_size=count,
                               local_world_size=count, node_rank=0, device=-1, hostname="flood", job_id="torn",
                               start_ns=time.monotonic_ns()), list(CANONICAL_PHASES))
    if torn:
        w.begin()  # the seqlock held odd from now on: a writer stuck mid-update
    writers.append(w)
print("ready", flush=True)
sys.stdin.readline()
"""


def _records(job: Path, count: int) -> None:
    """``count`` valid records in ``job`` (of a process that is gone: read every poll, never verified)."""
    template = job / "rank-0.hb"
    t = new_tracker(template, pid=1 << 22, job_id=job.name)
    raw = template.read_bytes()
    del t
    from rankwatch.hooks.record import RecordLayout

    off = RecordLayout.global_rank.offset
    for r in range(1, count):
        data = bytearray(raw)
        data[off:off + 4] = r.to_bytes(4, "little")
        (job / f"rank-{r}.hb").write_bytes(bytes(data))


def _flood_dirs(world: dict, shm: Path, a: User) -> None:
    stage = staged(world)
    for i in range(FLOOD_DIRS):
        job = stage / f"flood-{i}"
        job.mkdir(mode=0o700)
        _records(job, 4)
    for i in range(FLOOD_DIRS):  # renamed in one after the other, as fast as rename goes
        move_in(stage / f"flood-{i}", shm, a)


@pytest.mark.parametrize("flood", ["dirs", "records", "torn", "stopped-reader"])
def test_another_users_flood_never_hides_a_hang_nor_loses_its_bundle(users, world, daemons, ranks, tmp_path, flood):
    a, b = users
    shm = fresh_shm(world)
    marks = tmp_path / "on-incident"
    marks.mkdir(mode=0o755)
    hook = tmp_path / "mark.sh"
    hook.write_text(f'#!/bin/sh\ntouch "{marks}/$(basename "$1")"\n')
    hook.chmod(0o755)
    d = daemons(tmp_path, shm, "--on-incident", str(hook), stall="2", on_stall="report", counted=True)
    held: list[subprocess.Popen] = []
    try:
        # A's job first: the daemon has taken it in (and A's reader runs) before the flood starts
        first = ranks(a, world, shm, "a-healthy")
        assert discovered(d, "a-healthy", verified=True, pid=first.pid)
        if flood == "dirs":
            _flood_dirs(world, shm, a)
        elif flood in ("records", "torn"):
            script = world["dir"] / f"flooder-{time.monotonic_ns()}.py"
            script.write_text(FLOODER)
            script.chmod(0o644)
            count = str(FLOOD_RECORDS if flood == "records" else 99)
            writer = a.popen([world["python"], str(script), str(shm / f"a-{flood}"), count, flood], world["env"],
                             stdin=subprocess.PIPE, cwd=str(world["dir"]), start_new_session=True)
            held.append(writer)
            assert writer.stdout.readline().strip() == "ready", writer.stderr.read()
        else:  # A stops their own reader (it is theirs): every request to it waits out its deadline
            started = d.wait(lambda e: e.get("event") == "reader_started" and e.get("uid") == a.uid)
            assert started, "A's reader never started"
            os.kill(started["pid"], signal.SIGSTOP)
        d.looked(2)  # the daemon is in the flood
        # B's job: steps, then hangs in forward; A's flood is still there
        victim = ranks(b, world, shm, "b-victim", "--stall-after", "10", "--step-s", "0.05")
        got = d.wait(lambda e: e.get("event") == "incident_detected" and e.get("job") == "b-victim", timeout=120)
        assert got, [e for e in d.events() if e.get("job") == "b-victim"][-10:]
        assert d.wait(lambda e: e.get("event") == "verdict" and e.get("job") == "b-victim" and e.get("bundle"),
                      timeout=120), [e.get("event") for e in d.events()][-30:]
        (bundle,) = bundle_dirs(d.out / "b-victim" / "incidents")
        assert (bundle / "verdict.json").exists()
        assert _wait_file(marks / bundle.name), "B's --on-incident command never ran"
        assert victim.poll() is None and d.proc.poll() is None
        # A's own volume: A's jobs are never declared dead for it, and the loop stayed healthy throughout
        dead = [e for e in d.events() if e.get("event") == "incident_detected" and str(e.get("job")).startswith("a-")
                and e.get("kind") == "dead"]
        assert not dead, dead
        # the flood was there while B hung: A's volume reached the daemon
        before = d.events()[: d.events().index(got)]
        if flood == "dirs":
            assert any(e.get("event") == "job_discovered" and str(e.get("job")).startswith("flood-") for e in before)
        elif flood == "records":
            assert sum(e.get("event") == "rank_discovered" and e.get("job") == "a-records" for e in before) >= 100
        elif flood == "torn":
            assert any(e.get("event") == "record_rejected" and e.get("job") == "a-torn" for e in before)
        else:  # A's healthy rank is unreadable (never dead) while its reader is stopped
            assert any(e.get("event") == "record_unreadable" and e.get("job") == "a-healthy" for e in before)
        code, health = _healthz(d.port)
        assert code == 200 and health["owners"] == 2, health  # /healthz is the loop's, whatever A does
    finally:
        if flood == "stopped-reader":
            started = next((e for e in d.events() if e.get("event") == "reader_started" and e.get("uid") == a.uid),
                           None)
            if started:
                _cont(started["pid"])
        for p in held:
            p.kill()
            p.wait()


def _healthz(port: int | None) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_file(path: Path, timeout: float = 60) -> bool:
    from conftest import wait_for

    return bool(wait_for(path.exists, timeout))


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
