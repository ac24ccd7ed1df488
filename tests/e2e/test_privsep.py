# ruff: noqa: F811  (the users/world fixtures of test_multiuser are imported, then requested by name)
"""A hostile local user against a root daemon: every case of issue #20's review, with real users, symlinks,
ptys, fd limits and a store that never answers. The daemon is a real ``rankwatch daemon`` running as root
(this test process); ranks are real processes of throwaway unprivileged users (``useradd``, removed after).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, bundle_dirs, free_port, new_tracker, rankwatch_cmd, stalled_record, wait_for, wait_polls
from test_multiuser import User, users, world  # noqa: F401  (fixtures: throwaway users, a world for them)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="real users, other uids' files and ptys need root"),
]

RANK = str(REPO / "tests" / "procs" / "rank.py")


class DaemonProc:
    """``rankwatch daemon`` as root, JSON logs into a file the test reads while it runs."""

    def __init__(self, tmp: Path, shm: Path, *extra: str, prefix: tuple[str, ...] = (), env: dict | None = None,
                 stall: str = "1", on_stall: str = "kill", counted: bool = False) -> None:
        self.out = tmp / f"out-{time.monotonic_ns()}"
        self.log = tmp / f"daemon-{time.monotonic_ns()}.log"
        # counted: /healthz says how many polls it made, so a test waits for "it looked again" (``looked``)
        self.port = free_port() if counted else None
        metrics = ("--metrics-port", str(self.port)) if self.port else ()
        cmd = [*prefix, *rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(self.out), "--stall-timeout",
                                       stall, "--poll-interval", "0.2", "--on-stall", on_stall, "--json-logs",
                                       *metrics, *extra)]
        self._err = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._err, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env)

    def events(self) -> list[dict]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict):
                    out.append(doc)
        return out

    def wait(self, pred, timeout: float = 60) -> dict | None:
        return wait_for(lambda: next((e for e in self.events() if pred(e)), None), timeout)

    def looked(self, polls: int) -> None:
        """Until ``polls`` more whole polls are done: a fixed sleep covers fewer of them on a loaded host."""
        assert self.port is not None, "start the daemon with counted=True"
        wait_polls(self.port, more=polls + 1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # readers and py-spy children
        self._err.close()


@pytest.fixture
def daemons():
    made: list[DaemonProc] = []

    def start(*a, **kw) -> DaemonProc:
        d = DaemonProc(*a, **kw)
        made.append(d)
        return d

    yield start
    for d in made:
        d.stop()


@pytest.fixture
def ranks():
    """Rank processes of the test users: killed (SIGKILL, every one) at teardown."""
    made: list[subprocess.Popen] = []

    def start(user: User, world: dict, shm: Path, job: str, *args: str, rank: int = 0, size: int = 1):
        env = dict(world["env"], RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))
        proc = user.popen([world["python"], RANK, *args], env, cwd=str(world["dir"]), start_new_session=True)
        made.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("ready"), line + (proc.stderr.read() if proc.poll() is not None else "")
        return proc

    yield start
    for proc in made:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def fresh_shm(world: dict) -> Path:
    """A shared base dir like /dev/shm/rankwatch: world-writable and sticky."""
    shm = world["devshm"] / f"rw-{time.monotonic_ns()}"
    shm.mkdir()
    shm.chmod(0o1777)
    return shm


def give(path: Path, user: User) -> None:
    """Everything at and below ``path`` becomes ``user``'s (as if they had made it), symlinks included."""
    for p in [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else [path]:
        os.lchown(p, user.uid, user.gid)


def staged(world: dict) -> Path:
    """A scratch dir on the shm dirs' filesystem, where a job dir is built before ``move_in``."""
    stage = world["devshm"] / f"stage-{time.monotonic_ns()}"
    stage.mkdir(mode=0o700)
    return stage


def move_in(job: Path, shm: Path, user: User) -> Path:
    """``job`` (built by this root test in a ``staged`` dir) becomes ``user``'s, then appears in ``shm`` in one
    rename, as a job dir its user made: a running daemon that saw it half-chowned would take root for its
    owner and reject the user's records (a test race, not an attack: only root can chown)."""
    give(job, user)
    os.rename(job, shm / job.name)
    return shm / job.name


def discovered(d: DaemonProc, job: str, **match):
    return d.wait(lambda e: e.get("event") == "rank_discovered" and e.get("job") == job
                  and all(e.get(k) == v for k, v in match.items()))


# -- 1. identity --------------------------------------------------------------------------------------
def test_a_record_naming_another_users_verified_rank_is_rejected(users, world, daemons, ranks, tmp_path):
    a, b = users
    shm = fresh_shm(world)
    victim = ranks(b, world, shm, "job-b")  # healthy, stepping
    d = daemons(tmp_path, shm, counted=True)
    assert discovered(d, "job-b", verified=True, pid=victim.pid)
    # A plants a record of their own naming B's verified rank, stalled: --on-stall kill would hit B
    stage = staged(world)
    tracker = stalled_record(stage, "job-a", pid=victim.pid)
    move_in(stage / "job-a", shm, a)
    seen = discovered(d, "job-a", pid=victim.pid)
    assert seen is not None and seen["verified"] is False, seen
    assert d.wait(lambda e: e.get("event") == "rank_unverified" and e.get("job") == "job-a", timeout=30)
    # twenty polls later (0.2 s apart: several 1 s stall timeouts): nothing of B's was signalled, no incident
    d.looked(20)
    assert victim.poll() is None, "B's healthy rank was killed through A's record"
    assert not [e for e in d.events() if e.get("event") in ("killing_job", "incident_detected")]
    del tracker


# -- 2. job.json symlinked to a root-only file or a pty --------------------------------------------------
def test_job_json_symlinked_to_a_root_only_file_is_never_read(users, world, daemons, tmp_path):
    a, _ = users
    shm = fresh_shm(world)
    secret = tmp_path / "root-only.json"
    secret.write_text(json.dumps({"schema": "rankwatch.job/1", "world_size": 2, "local_world_size": 1}))
    secret.chmod(0o600)
    os.utime(secret, (0, time.time()))  # atime far in the past: any read() moves it (relatime)
    job = shm / "job-s"
    job.mkdir(mode=0o700)
    (job / "job.json").symlink_to(secret)
    give(job, a)
    d = daemons(tmp_path, shm, counted=True)
    assert d.wait(lambda e: e.get("event") == "job_discovered" and e.get("job") == "job-s")
    d.looked(10)  # each poll would have read job.json again
    assert d.proc.poll() is None
    assert os.stat(secret).st_atime == 0, "the root daemon read a root-only file through the user's symlink"


def test_job_json_symlinked_to_a_pty_never_becomes_the_daemons_terminal(users, world, daemons, tmp_path):
    a, _ = users
    shm = fresh_shm(world)
    master, slave = os.openpty()
    tty = os.ttyname(slave)
    os.chown(tty, a.uid, a.gid)  # the attacker's own terminal
    os.close(slave)
    try:
        job = shm / "job-t"
        job.mkdir(mode=0o700)
        (job / "job.json").symlink_to(tty)
        give(job, a)
        d = daemons(tmp_path, shm, counted=True)
        assert d.wait(lambda e: e.get("event") == "job_discovered" and e.get("job") == "job-t")
        d.looked(10)
        os.write(master, b"\x1c\x03")  # ^\ (SIGQUIT) and ^C to whoever has this terminal as its own
        time.sleep(1)
        assert d.proc.poll() is None, f"the daemon died (rc {d.proc.returncode}) from ^\\ typed on a user's pty"
        tty_nr = int(Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[4])
        assert tty_nr == 0, "the daemon acquired a controlling terminal"
    finally:
        os.close(master)


# -- 3. job dir swapped for a symlink after discovery -----------------------------------------------------
def test_a_job_dir_swapped_for_a_symlink_after_discovery_is_not_followed(users, world, daemons, ranks, tmp_path):
    a, b = users
    # A's own base dir (not sticky): root would follow a symlink A puts there (no fs.protected_symlinks)
    shm_a = world["dir"] / f"shm-a-{time.monotonic_ns()}"
    shm_a.mkdir(mode=0o755)
    give(shm_a, a)
    shm_b = fresh_shm(world)
    own = ranks(a, world, shm_a, "job-a")
    victim = ranks(b, world, shm_b, "job-b", "--stall-after", "1")  # B's rank, stalled: an incident target
    d = daemons(tmp_path, shm_a, counted=True)
    assert discovered(d, "job-a", verified=True, pid=own.pid)
    os.rename(shm_a / "job-a", shm_a / "job-a.old")
    (shm_a / "job-a").symlink_to(shm_b / "job-b")
    os.lchown(shm_a / "job-a", a.uid, a.gid)
    d.looked(20)  # several stall timeouts
    mine = [e for e in d.events() if e.get("job") == "job-a" and e.get("pid") == victim.pid]
    assert not mine, f"B's rank was adopted into A's job through the swapped dir: {mine}"
    assert victim.poll() is None
    assert not bundle_dirs(d.out / "job-a" / "incidents") or all(
        str(victim.pid) not in (p / "ranks.json").read_text() for p in bundle_dirs(d.out / "job-a" / "incidents"))


# -- 4. leftover clean-up ----------------------------------------------------------------------------------
def test_leftover_cleanup_never_follows_a_symlinked_dumps_dir(users, world, daemons, tmp_path):
    a, b = users
    shm = fresh_shm(world)
    victim = world["dir"] / f"victim-{time.monotonic_ns()}"
    (victim / "tok").mkdir(parents=True)
    precious = victim / "tok" / "rank-0.stacks.json"
    precious.write_text("B's file")
    give(victim, b)
    job = shm / "job-d"
    job.mkdir(mode=0o700)
    (job / "dumps").symlink_to(victim)
    give(job, a)
    # and a real leftover of a job of A's, which the clean-up must still remove
    stale = shm / "job-e" / "dumps" / "tok"
    stale.mkdir(parents=True)
    (stale / "rank-0.fr.json").write_text("{}")
    give(shm / "job-e", a)
    for p in (victim / "tok", stale):
        os.utime(p, (0, 0))
    d = daemons(tmp_path, shm, "--once")
    d.proc.wait(timeout=120)
    assert precious.exists(), "the root daemon deleted another user's file through a symlinked dumps dir"
    assert not (stale / "rank-0.fr.json").exists(), "a real stale dump was left behind"


# -- 5. fd exhaustion --------------------------------------------------------------------------------------
MAPPER = """
import mmap, os, sys
job, count, pid_off, rank_off = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
raw = bytearray(open(os.path.join(job, "template"), "rb").read())
raw[pid_off:pid_off + 8] = os.getpid().to_bytes(8, "little")
maps = []
for r in range(count):
    if r == 10:  # a few first, then the flood: the daemon has adopted the job before its fds run out
        print("first", flush=True)
        sys.stdin.readline()
    raw[rank_off:rank_off + 4] = r.to_bytes(4, "little")
    path = os.path.join(job, f"rank-{r}.hb")
    with open(path + ".tmp", "wb") as f:
        f.write(raw)
    with open(path + ".tmp", "r+b") as f:
        maps.append(mmap.mmap(f.fileno(), len(raw)))   # this process maps every record: each one verifies
    os.rename(path + ".tmp", path)
print("mapped", flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(not os.path.exists("/usr/bin/prlimit"), reason="prlimit (util-linux) not installed")
def test_fd_exhaustion_makes_ranks_unreadable_never_dead(users, world, daemons, ranks, tmp_path):
    from rankwatch.hooks.record import RecordLayout

    a, b = users
    shm = fresh_shm(world)
    victim = ranks(b, world, shm, "job-b")  # healthy
    d = daemons(tmp_path, shm, prefix=("prlimit", "--nofile=1024:1024", "--"))
    assert discovered(d, "job-b", verified=True, pid=victim.pid)
    # A's flood: 1,100 valid records, all mapped by one live process of A's (so each is a verified rank)
    job = staged(world) / "job-flood"
    job.mkdir(mode=0o700)
    # a fresh record (no step yet: the start-up budget keeps this job from an incident of its own)
    t = new_tracker(job / "template")
    job = move_in(job, shm, a)
    script = world["dir"] / "mapper.py"
    script.write_text(MAPPER)
    script.chmod(0o644)
    mapper = a.popen([world["python"], str(script), str(job), "1100", str(RecordLayout.pid.offset),
                      str(RecordLayout.global_rank.offset)], world["env"], stdin=subprocess.PIPE,
                     cwd=str(world["dir"]), start_new_session=True)
    try:
        assert mapper.stdout.readline().strip() == "first", mapper.stderr.read()
        assert d.wait(lambda e: e.get("job") == "job-flood" and e.get("event") == "rank_discovered"
                      and e.get("verified") is True)
        time.sleep(1)
        mapper.stdin.write("more\n")
        mapper.stdin.flush()
        assert mapper.stdout.readline().strip() == "mapped", mapper.stderr.read()
        time.sleep(6)  # 30 polls of the flood
        assert victim.poll() is None, "B's healthy rank was killed"
        bad = [e for e in d.events() if e.get("job") == "job-b" and e.get("event") in
               ("incident_detected", "killing_job", "verdict")]
        assert not bad, bad
        assert d.proc.poll() is None
    finally:
        os.killpg(mapper.pid, signal.SIGKILL)
        mapper.wait()
        del t


# -- 6. a store that never answers -----------------------------------------------------------------------
STORE_SERVER = """
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=30), use_libuv=True)
print("ready", flush=True)
time.sleep(3600)
"""


def test_a_store_that_never_answers_does_not_stop_the_poll_loop(daemons, tmp_path, procs):
    """A store that took the connection and then never answers (here: a real TCPStore server, stopped):
    the kernel still accepts and buffers, nothing comes back."""
    from conftest import free_port
    from test_safety import start_rank

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    port = free_port()
    server = procs.start([sys.executable, "-c", STORE_SERVER, str(port)], text=True)
    assert server.stdout.readline().strip() == "ready", server.stderr.read()
    mn = shm / "job-mn"
    mn.mkdir(mode=0o700)
    (mn / "job.json").write_text(json.dumps({"schema": "rankwatch.job/1", "job_id": "job-mn", "world_size": 2,
                                             "local_world_size": 1, "node_rank": 1, "master_addr": "127.0.0.1"}))
    start_rank(procs, shm, "job-mn", 1, 2)  # healthy, node 1 of 2
    d = daemons(tmp_path, shm, "--store", f"127.0.0.1:{port}", stall="3", on_stall="report")
    assert d.wait(lambda e: e.get("event") == "store_connected" and e.get("job") == "job-mn")
    os.kill(server.pid, signal.SIGSTOP)  # from now on: accepted, never answered
    try:
        time.sleep(2)  # the correlator's calls are now waiting on it
        start_rank(procs, shm, "job-x", 0, 1, "--stall-after", "1")  # another job hangs
        got = d.wait(lambda e: e.get("event") == "incident_detected" and e.get("job") == "job-x", timeout=90)
        assert got, "another job's hang went undetected while the store did not answer"
        assert d.proc.poll() is None
    finally:
        os.kill(server.pid, signal.SIGCONT)


# -- 7. replayed claims ------------------------------------------------------------------------------------
def test_a_claim_from_before_the_job_restarted_is_rejected(tmp_path):
    from conftest import free_port
    from rankwatch.watchdog.cluster.correlate import Correlator

    port = free_port()
    secret = b"s" * 32
    leader = Correlator("job", 0, "127.0.0.1", port, nnodes=2, secret=secret)
    follower = None
    try:
        assert wait_for(lambda: leader.store is not None, timeout=60)
        old = leader.claim("20260101T000000Z-001-stall", {"kind": "stall", "ranks": [1], "reason": "old run"})
        assert old.gen == 1
        # the job was killed and restarted, and node 1's daemon restarted with it: the sealed claim of the old
        # run is still in the store
        follower = Correlator("job", 1, "127.0.0.1", port, nnodes=2, secret=secret)
        # the restarted job's ranks started after the claim (the kill's grace period, torchrun's restart)
        follower.fresh_after_unix = time.time() + 2.0
        assert wait_for(lambda: follower.store is not None, timeout=60)
        replayed = [follower.poll_incident() for _ in range(20) if time.sleep(0.1) is None]
        assert not any(replayed), "a claim of the previous run was replayed to the restarted job"
        # a claim of this run still gets through
        wait_for(lambda: time.time() > follower.fresh_after_unix, timeout=5)
        leader.handled_gen = 1
        new = leader.claim("20260101T000100Z-002-stall", {"kind": "stall", "ranks": [0], "reason": "this run"})
        got = wait_for(lambda: follower.poll_incident(), timeout=10)
        assert got is not None and got.incident_id == new.incident_id
    finally:
        leader.close()
        if follower is not None:
            follower.close()


def test_a_restarted_daemon_never_replays_the_stores_old_claim_evidence_or_verdict(tmp_path):
    """Node 1's daemon restarts while the job runs on (and node 0's daemon, hosting the store, stays): the old
    run's sealed claim, evidence and verdict are still in the store. None of them passes for a fresh one: not
    the claim (issued before this daemon started), not a node's evidence or the leader's verdict of an earlier
    incident under the same ``evidence/<gen>``/``verdict/<gen>`` keys (bound to their incident and time)."""
    from conftest import free_port, resolve_and_decide
    from rankwatch.watchdog.cluster.correlate import HEARD, Correlator, SharedIncident
    from rankwatch.watchdog.core.policy import CorrelationPolicy
    from rankwatch.watchdog.core.snapshot import RankView
    from rankwatch.watchdog.verdict import decide

    def view(rank: int, phase: str, since: float) -> RankView:
        return RankView(rank=rank, node=f"n{rank}", pid=1000 + rank, state="running", step=7, phase=phase,
                        in_phase_s=since, since_progress_s=since)

    def decide_fn(incident_id: str):
        def fn(views, notes, how, remote_fr):
            doc = decide(views, job_id="job", incident_id=incident_id, detected_after_s=1.0,
                         extra_evidence=list(notes)).document()
            return dataclasses.replace(doc, correlation=how)
        return fn

    port = free_port()
    secret = b"s" * 32
    policy = CorrelationPolicy(verdict_timeout_s=1.5, evidence_timeout_s=1.5)
    job_started = time.time() - 60  # the job's ranks started before all of this and are still running
    leader = Correlator("job", 0, "127.0.0.1", port, nnodes=2, secret=secret, policy=policy)
    old = new = None
    try:
        assert wait_for(lambda: leader.store is not None, timeout=60)
        old = Correlator("job", 1, "127.0.0.1", port, nnodes=2, secret=secret, policy=policy)
        old.fresh_after_unix = job_started
        assert wait_for(lambda: old.store is not None, timeout=60)
        # the old run's incident, exchanged in full: rank 1 (node 1) named, node 1's evidence and the verdict
        claim = leader.claim("20260101T000000Z-001-stall", {"kind": "stall", "ranks": [1], "reason": "old"})
        seen = wait_for(lambda: old.poll_incident(), timeout=10)
        assert seen is not None and seen.gen == claim.gen == 1
        out: dict = {}
        t = __import__("threading").Thread(target=lambda: out.setdefault("f", resolve_and_decide(
            old, seen, [view(1, "dataloader", 9.0)], "n1", 2, decide_fn(seen.incident_id))))
        t.start()
        verdict, _, _ = resolve_and_decide(leader, claim, [view(0, "backward", 9.0)], "n0", 2,
                                           decide_fn(claim.incident_id))
        t.join(30)
        assert verdict["initiating_ranks"] == [1] and out["f"][0]["initiating_ranks"] == [1]
        old.close()
        old = None
        time.sleep(1.5)  # past the allowed clock skew
        # node 1's daemon restarts; the job did not
        new = Correlator("job", 1, "127.0.0.1", port, nnodes=2, secret=secret, policy=policy)
        new.fresh_after_unix = job_started
        assert wait_for(lambda: new.store is not None, timeout=60)
        replayed = [new.poll_incident() for _ in range(10) if time.sleep(0.1) is None]
        assert not any(replayed), "the restarted daemon took the old run's claim for a new incident"
        # an incident of this daemon's life under the same gen (the leader's numbering restarted with it):
        # the old verdict/1 names rank 1 and is validly sealed, yet it answers another incident
        fresh = SharedIncident(gen=1, incident_id="20260101T000000Z-001-stall", by_node=0, trigger={},
                               issued=time.time())
        # the leader, gathering for it before node 1 answered, does not take node 1's old evidence
        # (a replayed value is tampering: node 1 is not heard, and its old evidence is not rank 1's state now)
        views, notes, _, held = leader._gather(leader.store, fresh, [view(0, "backward", 9.0)], 2, 0.5)
        assert held.get(1) != HEARD, (held, notes)
        assert not [v for v in views if v.rank == 1 and v.phase == "dataloader"], (views, notes)
        # nor does node 1 adopt the old verdict
        adopted, how, decided_here = resolve_and_decide(new, fresh, [view(1, "forward", 0.2)], "n1", 2,
                                                    decide_fn(fresh.incident_id))
        assert decided_here and how.startswith("local: no valid verdict"), how
        assert adopted["initiating_ranks"] != [1] or "old" not in adopted["reason"]
    finally:
        for c in (new, old, leader):
            if c is not None:
                c.close()


# -- 8. budgets per user -----------------------------------------------------------------------------------
def test_one_users_incidents_prune_only_that_users_bundles(users, world, daemons, ranks, tmp_path):
    a, b = users
    shm = fresh_shm(world)
    d = daemons(tmp_path, shm, "--keep-incidents", "1", on_stall="report")
    ranks(b, world, shm, "job-b", "--stall-after", "1")
    assert wait_for(lambda: bundle_dirs(d.out / "job-b" / "incidents"), timeout=90)
    theirs = bundle_dirs(d.out / "job-b" / "incidents")
    ranks(a, world, shm, "job-a", "--stall-after", "1")
    ranks(a, world, shm, "job-a2", "--stall-after", "1")
    assert wait_for(lambda: len(bundle_dirs(d.out / "job-a" / "incidents"))
                    + len(bundle_dirs(d.out / "job-a2" / "incidents")) >= 1
                    and d.wait(lambda e: e.get("event") == "verdict" and e.get("job") in ("job-a", "job-a2")
                               and e.get("bundle"), timeout=0), timeout=90)
    assert d.wait(lambda e: e.get("event") == "verdict" and e.get("job") == "job-a2" and e.get("bundle"), 90)
    assert d.wait(lambda e: e.get("event") == "verdict" and e.get("job") == "job-a" and e.get("bundle"), 90)
    time.sleep(1)
    assert bundle_dirs(d.out / "job-b" / "incidents") == theirs, "A's incidents pruned B's bundle"
    # and A's own are pruned to its own budget: one bundle kept of A's two
    assert len(bundle_dirs(d.out / "job-a" / "incidents")) + len(bundle_dirs(d.out / "job-a2" / "incidents")) == 1


# the patched ranks' common end: a hooked job that hangs in forward at step 2
HANG_AT_STEP_2 = """
import rankwatch.hooks as rw
assert rw.init()
print("ready", os.getpid(), flush=True)
for step in range(3):
    with rw.phase("forward"):
        if step == 2:
            while True:
                time.sleep(60)
        time.sleep(0.05)
    rw.step()
"""


PATCHED_RANK = """
import json, os, sys, time
import rankwatch.hooks.responder as resp
entries, delay = int(sys.argv[1]), float(sys.argv[2])
fr = json.loads(open(sys.argv[3], "rb").read())
one = fr["entries"][0]
fr["entries"] = [dict(one, record_id=i, collective_seq_id=i + 1) for i in range(entries)] if entries else fr["entries"]
body = json.dumps(fr).encode()
real_answer = resp.answer

def answer(rank):  # a responder that is slow (a rank busy in C code) and/or serves a big recorder dump
    time.sleep(delay)
    yield from real_answer(rank)

resp.answer = answer
resp.flight_recorder_json = lambda: (body, None)
""" + HANG_AT_STEP_2


def patched_ranks(user: User, world: dict, shm: Path, jobs: list[str], entries: int, delay: float):
    script = world["dir"] / f"patched-{time.monotonic_ns()}.py"
    script.write_text(PATCHED_RANK)
    fr = world["dir"] / f"fr-{time.monotonic_ns()}.json"
    fr.write_bytes(FR_FIXTURE.read_bytes())
    for p in (script, fr):
        p.chmod(0o644)
    out = []
    for job in jobs:
        env = dict(world["env"], RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, RANK="0", LOCAL_RANK="0",
                   WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        p = user.popen([world["python"], str(script), str(entries), str(delay), str(fr)], env,
                       cwd=str(world["dir"]), start_new_session=True)
        out.append(p)
        line = p.stdout.readline()
        assert line.startswith("ready"), line + (p.stderr.read() if p.poll() is not None else "")
    return out


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_one_users_big_bundles_are_pruned_to_that_users_byte_budget_only(users, world, daemons, ranks, tmp_path):
    a, b = users
    shm = fresh_shm(world)
    d = daemons(tmp_path, shm, "--keep-incident-mib", "1", on_stall="report")
    ranks(b, world, shm, "job-b", "--stall-after", "1")  # B's small bundle
    assert wait_for(lambda: bundle_dirs(d.out / "job-b" / "incidents"), timeout=90)
    theirs = bundle_dirs(d.out / "job-b" / "incidents")
    # A's three incidents, each with a flight-recorder trace of 4,000 entries: over 1 MiB of bundle apiece
    big = patched_ranks(a, world, shm, ["job-a1", "job-a2", "job-a3"], entries=4000, delay=0.0)
    try:
        for job in ("job-a1", "job-a2", "job-a3"):
            assert d.wait(lambda e, job=job: e.get("event") == "verdict" and e.get("job") == job and e.get("bundle"),
                          120), job
        mine = wait_for(lambda: (lambda got: got if len(got) == 1 else None)(
            [p for j in ("job-a1", "job-a2", "job-a3") for p in bundle_dirs(d.out / j / "incidents")]), timeout=30)
        assert mine, "A's bundles were not pruned to A's byte budget (the newest one kept)"
        assert sum(f.stat().st_size for f in mine[0].rglob("*") if f.is_file()) > 1 << 20  # it is a big one
        assert bundle_dirs(d.out / "job-b" / "incidents") == theirs, "A's bytes pruned B's bundle"
        assert [e for e in d.events() if e.get("event") == "bundle_pruned" and e.get("owner_uid") != a.uid] == []
    finally:
        kill_all(big)


def test_one_users_incident_flood_leaves_another_user_a_free_worker(users, world, daemons, ranks, tmp_path):
    """Four of A's jobs hang at once, each incident slow (a responder that takes 30 s: its capture waits out
    the responder timeout); B's job hangs just after. A never holds more than its two incidents in flight,
    so B's incident starts while A's are still being captured, and is written."""
    a, b = users
    shm = fresh_shm(world)
    d = daemons(tmp_path, shm, on_stall="report")
    slow = patched_ranks(a, world, shm, [f"job-a{i}" for i in range(4)], entries=0, delay=30.0)
    try:
        assert d.wait(lambda e: e.get("event") == "incident_deferred" and e.get("owner_uid") == a.uid, 90)
        ranks(b, world, shm, "job-b", "--stall-after", "1")
        assert wait_for(lambda: bundle_dirs(d.out / "job-b" / "incidents"), timeout=120), "B's incident lost"
        in_flight, most, b_started_with = 0, 0, None
        for e in d.events():
            job = str(e.get("job", ""))
            if e.get("event") == "incident_detected" and job.startswith("job-a"):
                in_flight += 1
            elif e.get("event") == "verdict" and job.startswith("job-a"):
                in_flight -= 1
            elif e.get("event") == "incident_detected" and job == "job-b" and b_started_with is None:
                b_started_with = in_flight
            most = max(most, in_flight)
        assert most <= 2, f"user A had {most} incidents in flight at once"
        assert b_started_with is not None and b_started_with >= 1, "B's incident did not start beside A's"
    finally:
        kill_all(slow)


# -- 9. SIGHUP, py-spy output -------------------------------------------------------------------------------
def test_sighup_loses_no_incident_in_flight(daemons, tmp_path, procs):
    from test_safety import start_rank

    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    d = daemons(tmp_path, shm, on_stall="report")
    start_rank(procs, shm, "job-h", 0, 1, "--stall-after", "1")
    assert d.wait(lambda e: e.get("event") == "incident_detected" and e.get("job") == "job-h")
    os.kill(d.proc.pid, signal.SIGHUP)
    assert wait_for(lambda: bundle_dirs(d.out / "job-h" / "incidents") or d.proc.poll() is not None, timeout=60)
    assert d.proc.poll() is None, "SIGHUP ended the daemon"
    assert bundle_dirs(d.out / "job-h" / "incidents"), "the incident in flight was lost"
    assert d.wait(lambda e: e.get("event") == "daemon_reloaded")


FAKE_PYSPY = """#!/bin/sh
# py-spy stand-in: rank {bad}'s dump is the wrong shape, rank {big}'s is 100 MB, the others are real
for a in "$@"; do case "$prev" in --pid) pid="$a";; esac; prev="$a"; done
if [ "$pid" = "{bad}" ]; then
  echo '[{{"thread_name": "MainThread", "os_thread_id": {bad}, "frames": 5}}, 7]'; exit 0
fi
if [ "$pid" = "{big}" ]; then head -c 100000000 /dev/zero | tr '\\0' '['; exit 0; fi
exec {real} "$@"
"""


def test_a_bad_pyspy_answer_costs_only_its_own_rank(daemons, tmp_path, procs):
    from rankwatch.watchdog.evidence.capture import pyspy_available
    from test_safety import start_rank

    real = pyspy_available()
    if real is None:
        pytest.skip("py-spy not installed")
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    rs = [start_rank(procs, shm, "job-p", r, 3, "--stall-after", "1") for r in range(3)]
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYSPY.format(bad=rs[0].pid, big=rs[1].pid, real=os.path.realpath(real)))
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    d = daemons(tmp_path, shm, on_stall="report", env=env, stall="2")
    got = wait_for(lambda: bundle_dirs(d.out / "job-p" / "incidents"), timeout=120)
    assert got
    stacks = got[0] / "stacks"
    text = {r: (stacks / f"rank-{r}.txt").read_text() for r in range(3)}
    assert "rank.py" in text[2], text[2]  # the healthy capture kept its stacks
    assert "unexpected shape" in text[0] or "no stack" in text[0] or "responder" in text[0], text[0]
    # py-spy never gives rank 1 a usable answer: its real frames can only be the responder's fallback
    assert "cut, not parsed" in text[1] or "rank.py" in text[1], text[1]


# -- a reader its own user kills ---------------------------------------------------------------------------
def test_a_reader_killed_by_its_user_makes_ranks_unreadable_then_it_is_respawned(users, world, daemons, ranks,
                                                                                  tmp_path):
    _, b = users
    shm = fresh_shm(world)
    rank = ranks(b, world, shm, "job-b")  # healthy
    d = daemons(tmp_path, shm)
    assert discovered(d, "job-b", verified=True, pid=rank.pid)
    started = d.wait(lambda e: e.get("event") == "reader_started" and e.get("uid") == b.uid)
    assert started
    reader = started["pid"]
    assert os.stat(f"/proc/{reader}").st_uid == b.uid  # the reader runs as the job's owner
    os.kill(reader, signal.SIGKILL)  # B may: it is B's process
    assert d.wait(lambda e: e.get("event") == "record_unreadable" and e.get("job") == "job-b", timeout=30)
    assert d.wait(lambda e: e.get("event") == "record_readable_again" and e.get("job") == "job-b", timeout=60)
    assert rank.poll() is None and d.proc.poll() is None
    assert not [e for e in d.events() if e.get("event") in ("incident_detected", "killing_job")]
    assert len([e for e in d.events() if e.get("event") == "reader_started" and e.get("uid") == b.uid]) == 2


# -- 10. what a job answers is read and parsed as its owner, never as root (items 1 and 10) -----------------
FR_FIXTURE = REPO / "tests" / "fixtures" / "fr" / "nccl_hang" / "rank-0.fr.json"

SPIED_RANK = """
import os, sys, time
import rankwatch.hooks.responder as resp
peers, fr = sys.argv[1], open(sys.argv[2], "rb").read()
real_peer_cred = resp.peer_cred

def spy(sock):  # every process that asks this rank's responder for a dump, by uid
    pid, uid, gid = real_peer_cred(sock)
    with open(peers, "a") as f:
        f.write(f"{uid}\\n")
    return pid, uid, gid

resp.peer_cred = spy
resp.flight_recorder_json = lambda: (fr, None)  # a real NCCL dump (the recorded fixture), 'from torch'
""" + HANG_AT_STEP_2


def owner_files(world: dict, user: User, name: str, text: str, log_name: str) -> tuple[Path, Path, Path]:
    """(script, flight-recorder fixture, empty log the user may write): what a user's process runs and reports to."""
    script = world["dir"] / f"{name}-{time.monotonic_ns()}.py"
    script.write_text(text)
    fr = world["dir"] / f"fr-{time.monotonic_ns()}.json"
    fr.write_bytes(FR_FIXTURE.read_bytes())
    log = world["dir"] / f"{log_name}-{time.monotonic_ns()}.log"
    log.write_text("")
    for p in (script, fr):
        p.chmod(0o644)
    os.chown(log, user.uid, user.gid)
    return script, fr, log


def test_the_responders_answer_is_read_and_parsed_by_the_owner_never_by_root(users, world, daemons, tmp_path):
    from rankwatch.watchdog.evidence.fr_dump import load_dump

    a, _ = users
    shm = fresh_shm(world)
    script, fr, peers = owner_files(world, a, "spied", SPIED_RANK, "peers")
    env = dict(world["env"], RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="job-fr", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    rank = a.popen([world["python"], str(script), str(peers), str(fr)], env, cwd=str(world["dir"]),
                   start_new_session=True)
    try:
        line = rank.stdout.readline()
        assert line.startswith("ready"), line + (rank.stderr.read() if rank.poll() is not None else "")
        d = daemons(tmp_path, shm, on_stall="report")
        got = wait_for(lambda: bundle_dirs(d.out / "job-fr" / "incidents"), timeout=120)
        assert got, "no incident bundle"
        asked_by = [int(u) for u in peers.read_text().split()]
        assert asked_by, "the responder was never asked"
        assert set(asked_by) == {a.uid}, f"the responder was asked by uid(s) {asked_by}, not only by its owner {a.uid}"
        # and what the owner's reader parsed arrived whole: the trace in the bundle, its analysis in the verdict
        trace = load_dump((got[0] / "fr" / "rank-0.json").read_bytes(), rank=0)
        assert trace.entries and [e.record_id for e in trace.entries] == [
            e.record_id for e in load_dump(FR_FIXTURE, rank=0).entries]
        verdict = json.loads((got[0] / "verdict.json").read_text())
        fr_lines = [ln for ln in verdict["evidence"] if ln.startswith("flight recorder:")]
        assert fr_lines and not any("no flight-recorder dump" in ln for ln in fr_lines), fr_lines
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)
        rank.wait()


OWNER_SIDE = r"""
import ctypes, os, socket, sys, threading, time
libc = ctypes.CDLL(None)
if sys.argv[1] == "nodump":  # a process its own user may not ptrace (as sudo, ssh-agent, a setgid program are)
    libc.prctl(4, 0, 0, 0, 0)
    print("ready", flush=True)
    time.sleep(3600)
body, log = open(sys.argv[2], "rb").read(), sys.argv[3]
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(8)

def client_uid(port):  # who connected: the uid of the socket whose local port is the peer's
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and int(f[2].rsplit(":", 1)[1], 16) == srv.getsockname()[1]:
                return int(f[7])
    return -1

def serve():  # torch's worker server, as far as rankwatch can tell: a thread of that name, HTTP on loopback
    libc.prctl(15, b"pt_workerserver", 0, 0, 0)
    while True:
        c, addr = srv.accept()
        with open(log, "a") as f:
            f.write(f"{client_uid(addr[1])}\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        c.close()

threading.Thread(target=serve, daemon=True).start()
print("ready", flush=True)
time.sleep(3600)
"""

ROOT_INSPECT = r"""
import json, sys
from rankwatch.watchdog.evidence.inspect_capture import attach_debug_server_dumps, capture_job
from rankwatch.watchdog.observe.discover import Job, RankProc, read_proc
uid, pids = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
job = Job("j", len(pids), [RankProc(p, r, r, len(pids), read_proc(p), {}) for r, p in enumerate(pids)], owner_uid=uid)
cap = capture_job(job, timeout_s=20)
sources = {}
notes = attach_debug_server_dumps(job, cap.ranks, sources)
from rankwatch.watchdog.observe.discover import read_environ
from rankwatch.watchdog.observe.discover import environs_as
from rankwatch.watchdog.privsep.readers import default_readers
by_owner = environs_as(default_readers(), uid, pids)  # what discovery as root uses
env = {r: {"owner": by_owner[p] is not None, "root": read_environ(p) is not None} for r, p in enumerate(pids)}
ranks = {r: {"stacks": c.pyspy_threads is not None, "error": c.pyspy_error,
             "fr": len(getattr(c, "fr_trace", None) and c.fr_trace.entries or ())} for r, c in cap.ranks.items()}
print(json.dumps({"env": env, "notes": notes, "ranks": ranks}))
"""


def test_inspect_as_root_reads_a_job_only_with_its_owners_authority(users, world, tmp_path):
    """``rankwatch inspect`` run as root: py-spy runs, environments are read, the debug server is asked and
    its dump parsed as the job's owner. So a process the owner may not ptrace stays unread, and the server sees
    the owner's uid."""
    from rankwatch.watchdog.evidence.capture import pyspy_available

    if pyspy_available() is None:
        pytest.skip("py-spy not installed")
    a, _ = users
    script, fr, log = owner_files(world, a, "owner-side", OWNER_SIDE, "clients")
    procs = [a.popen([world["python"], str(script), mode, str(fr), str(log)], world["env"], cwd=str(world["dir"]),
                     start_new_session=True) for mode in ("server", "nodump")]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else ""
        res = subprocess.run([sys.executable, "-c", ROOT_INSPECT, str(a.uid), *(str(p.pid) for p in procs)],
                             capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(res.stdout.strip().splitlines()[-1])
        server, nodump = out["ranks"]["0"], out["ranks"]["1"]
        # the debug server was asked by the owner alone, and its dump arrived parsed
        assert [int(u) for u in log.read_text().split()] == [a.uid], log.read_text()
        assert server["fr"] == len(json.loads(FR_FIXTURE.read_text())["entries"]), out
        assert server["stacks"], out  # py-spy as the owner reads the owner's ordinary process
        # root's ptrace right was not lent: the owner cannot read that process, so neither did inspect
        assert not nodump["stacks"] and nodump["error"], out
        # environments (job-written bytes) are read by the owner's reader too: what it may not read stays unread
        assert out["env"]["0"] == {"owner": True, "root": True}, out
        assert out["env"]["1"] == {"owner": False, "root": True}, out
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
