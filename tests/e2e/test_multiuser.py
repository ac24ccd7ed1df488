"""Many users, one node: the shared shm dir, private job dirs, and a root daemon with the unit's capabilities.

Two throwaway unprivileged users (``useradd``, removed with ``userdel -r`` however the test ends) run the
hook in a fresh shm dir the first one's hook creates. Then the daemon side — ``capture_all`` and the record
reader — runs as root under the bounding set of ``systemd/rankwatch.service`` (no CAP_DAC_OVERRIDE) and
must still read the non-root rank's record and get its stacks from its dump responder.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO, rankwatch_cmd

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creating users and dropping capabilities needs root"),
    pytest.mark.skipif(shutil.which("useradd") is None or shutil.which("userdel") is None,
                       reason="useradd/userdel not installed"),
]

RANK_SCRIPT = textwrap.dedent("""
    import sys, time
    import rankwatch.hooks as rw
    ok = rw.init()
    for _ in range(3):
        with rw.phase("work"):
            time.sleep(0.01)
        rw.step()
    print("init", ok, flush=True)
    sys.stdin.readline()   # stay alive (a live rank for status and capture) until the test is done
""")

# what systemd/rankwatch.service leaves the daemon (CapabilityBoundingSet=), as setpriv spells it
UNIT_CAPS = "-all,+sys_ptrace,+dac_read_search,+kill,+setuid,+setgid"


class User:
    def __init__(self, name: str) -> None:
        self.name = name
        entry = pwd.getpwnam(name)
        self.uid, self.gid = entry.pw_uid, entry.pw_gid

    def popen(self, cmd: list[str], env: dict[str, str], **kw) -> subprocess.Popen:
        # extra_groups=[]: drop root's supplementary groups, or the child could read files of group root
        return subprocess.Popen(cmd, user=self.uid, group=self.gid, extra_groups=[], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)

    def run(self, cmd: list[str], env: dict[str, str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        proc = self.popen(cmd, env, stdin=subprocess.DEVNULL, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _remove_user(name: str) -> None:
    subprocess.run(["userdel", "-r", name], capture_output=True, timeout=60)  # rc 12: no home, user still gone
    with contextlib.suppress(KeyError):
        pwd.getpwnam(name)
        subprocess.run(["userdel", "-f", name], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def users():
    names = [f"rwtest-{tag}-{os.getpid()}" for tag in ("a", "b")]
    made: list[str] = []
    try:
        for name in names:
            res = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
                                 capture_output=True, text=True, timeout=60)
            if res.returncode != 0:
                pytest.skip(f"useradd failed: {res.stderr.strip()}")
            made.append(name)
        yield [User(n) for n in names]
    finally:
        for name in made:
            _remove_user(name)
        for name in made:
            with contextlib.suppress(KeyError):
                grp.getgrnam(name)
                subprocess.run(["groupdel", name], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def world(users):
    """A world-traversable scratch dir, the hook package where other users can import it, and a Python they
    can run; skips, saying why, when this machine has none."""
    scratch = Path(tempfile.mkdtemp(prefix="rankwatch-mu-", dir="/tmp"))
    try:
        scratch.chmod(0o755)
        stage = scratch / "pkg"
        (stage / "rankwatch").mkdir(parents=True)
        # rankwatch is a namespace package: rankwatch.hooks is the repo's hooks/ dir, nothing is copied
        (stage / "rankwatch" / "hooks").symlink_to(REPO / "hooks")
        for p in (scratch, stage, stage / "rankwatch"):
            p.chmod(0o755)
        devshm = scratch / "devshm"  # plays /dev/shm: sticky and world-writable
        devshm.mkdir()
        devshm.chmod(0o1777)
        script = scratch / "rank.py"
        script.write_text(RANK_SCRIPT)
        script.chmod(0o644)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(stage), "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(scratch),
               "LC_ALL": "C.UTF-8"}
        # the test's own Python may live where other users cannot read it (pyenv under /root): find one
        candidates = [sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]
        reasons = []
        for exe in dict.fromkeys(c for c in candidates if c):
            try:
                res = users[0].run([exe, "-c", "import rankwatch.hooks, sys; print(sys.version_info >= (3, 10))"],
                                   env, cwd=str(scratch))
            except OSError as exc:  # exec refused: the interpreter is not readable by other users
                reasons.append(f"{exe}: {exc.strerror}")
                continue
            if res.returncode == 0 and res.stdout.strip() == "True":
                yield {"dir": scratch, "devshm": devshm, "python": exe, "env": env, "script": str(script)}
                return
            reasons.append(f"{exe}: {(res.stderr.strip().splitlines() or ['not Python 3.10+'])[-1]}")
        pytest.skip("no Python with rankwatch.hooks that an unprivileged user can run: " + "; ".join(reasons))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def start_rank(user: User, world: dict, shm: Path, job: str) -> subprocess.Popen:
    env = dict(world["env"], RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job)
    proc = user.popen([world["python"], world["script"]], env, stdin=subprocess.PIPE, cwd=str(world["dir"]))
    line = proc.stdout.readline()
    assert line.strip() == "init True", f"{user.name}: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def two_ranks(users, world):
    """User A's hook creates the shm dir; user A and user B each run one rank of their own job in it."""
    shm = world["devshm"] / f"rankwatch-{time.monotonic_ns()}"
    a, b = users
    ranks = []
    try:
        ranks.append(start_rank(a, world, shm, "job-a"))
        ranks.append(start_rank(b, world, shm, "job-b"))
        yield shm, ranks
    finally:
        for proc in ranks:
            stop(proc)
        shutil.rmtree(shm, ignore_errors=True)


def test_two_users_share_the_shm_dir_and_keep_their_job_dirs_private(users, world, two_ranks):
    a, b = users
    shm, _ranks = two_ranks
    st = os.lstat(shm)
    assert stat.S_IMODE(st.st_mode) == 0o1777 and st.st_uid == a.uid  # created by A's hook, shared like /tmp
    for user, job in ((a, "job-a"), (b, "job-b")):
        d = os.lstat(shm / job)
        assert stat.S_ISDIR(d.st_mode) and d.st_uid == user.uid and stat.S_IMODE(d.st_mode) == 0o700
        rec = os.lstat(shm / job / "rank-0.hb")
        assert rec.st_uid == user.uid and stat.S_IMODE(rec.st_mode) == 0o600
        assert stat.S_ISSOCK(os.lstat(shm / job / "rank-0.ctl").st_mode)

    # root sees both jobs
    out = subprocess.run(rankwatch_cmd("status", "--shm-dir", str(shm), "--json", "--all"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    jobs = {j["job_id"]: j for j in json.loads(out.stdout)["jobs"]}
    assert set(jobs) == {"job-a", "job-b"}
    assert all(j["ranks"][0]["step"] == 3 for j in jobs.values())

    # user B can neither read A's record nor reach A's dump responder
    probe = textwrap.dedent(f"""
        import socket
        try:
            open({str(shm / "job-a" / "rank-0.hb")!r}, "rb")
            print("read")
        except PermissionError:
            print("denied")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect({str(shm / "job-a" / "rank-0.ctl")!r})
            print("connected")
        except PermissionError:
            print("denied")
    """)
    res = b.run([world["python"], "-c", probe], world["env"], cwd=str(world["dir"]))
    assert res.stdout.split() == ["denied", "denied"], res.stdout + res.stderr


def test_a_job_dir_another_user_created_first_disables_the_hook(users, world):
    a, b = users
    shm = world["devshm"] / f"rankwatch-{time.monotonic_ns()}"
    try:
        # B prepares a trap for A's next job: the dir A's records would go into, world-writable
        res = b.run([world["python"], "-c",
                     f"import os, rankwatch.hooks.shmdir as s; s.ensure_base_dir({str(shm)!r}); "
                     f"os.mkdir({str(shm / 'job-x')!r}); os.chmod({str(shm / 'job-x')!r}, 0o777)"],
                    world["env"], cwd=str(world["dir"]))
        assert res.returncode == 0, res.stderr
        env = dict(world["env"], RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="job-x")
        res = a.run([world["python"], "-c", "import rankwatch.hooks as rw; print('init', rw.init())"], env,
                    cwd=str(world["dir"]))
        assert res.stdout.strip() == "init False", res.stdout + res.stderr
        assert "belongs to uid" in res.stderr and "training continues without rankwatch" in res.stderr
        assert os.listdir(shm / "job-x") == []  # nothing of A's was written into B's dir
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_an_unshared_base_dir_of_another_user_disables_the_hook(users, world):
    a, b = users
    shm = world["devshm"] / f"rankwatch-{time.monotonic_ns()}"
    try:
        shm.mkdir(mode=0o755)
        os.chown(shm, a.uid, a.gid)  # what an older rankwatch left: the first user's 0755 dir
        env = dict(world["env"], RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="job-b")
        res = b.run([world["python"], "-W", "always", "-c",
                     "import rankwatch.hooks as rw; print('init', rw.init(), rw.init())"], env, cwd=str(world["dir"]))
        assert res.stdout.strip() == "init False False", res.stdout + res.stderr
        assert f"chmod 1777 {shm}" in res.stderr
        # and A, its owner, still can
        res = a.run([world["python"], "-c", "import rankwatch.hooks as rw; print('init', rw.init())"],
                    dict(env, RANKWATCH_JOB_ID="job-a"), cwd=str(world["dir"]))
        assert res.stdout.strip() == "init True", res.stdout + res.stderr
    finally:
        shutil.rmtree(shm, ignore_errors=True)


CAPTURE = textwrap.dedent("""
    import json, os, sys
    from rankwatch.hooks.record import read_record
    from rankwatch.watchdog.core.policy import CapturePolicy
    from rankwatch.watchdog.evidence.capture import capture_all

    job_dir, pid = sys.argv[1], int(sys.argv[2])
    caps = open("/proc/self/status").read().split("CapEff:")[1].split()[0]
    rec = read_record(os.path.join(job_dir, "rank-0.hb"))          # CAP_DAC_READ_SEARCH
    try:                                                             # no CAP_DAC_OVERRIDE: cannot write there
        open(os.path.join(job_dir, "planted"), "wb")
        writable = True
    except PermissionError:
        writable = False
    cap = capture_all([(0, pid, False)], job_dir, "t1", CapturePolicy(pyspy_timeout_s=20, responder_timeout_s=10))[0]
    threads = (cap.responder_stacks or {}).get("threads", [])
    main = next((t for t in threads if t["thread_name"] == "MainThread"), None)
    print(json.dumps({"cap_eff": caps, "steps": rec.steps_done, "writable": writable,
                      "responder_error": cap.responder_error,
                      "main": [f["filename"] for f in main["frames"]] if main else None,
                      "fr_note": cap.notes, "pyspy": bool(cap.pyspy_threads), "pyspy_error": cap.pyspy_error}))
""")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_root_daemon_with_the_unit_capabilities_captures_a_non_root_rank(world, two_ranks, tmp_path):
    shm, ranks = two_ranks
    unit = (REPO / "systemd" / "rankwatch.service").read_text()
    bounding = next(line for line in unit.splitlines() if line.startswith("CapabilityBoundingSet="))
    assert set(bounding.split("=", 1)[1].split()) == {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_KILL",
                                                      "CAP_SETUID", "CAP_SETGID"}
    script = tmp_path / "capture.py"
    script.write_text(CAPTURE)
    res = subprocess.run(["setpriv", f"--bounding-set={UNIT_CAPS}", "--inh-caps=-all", "--",
                          sys.executable, str(script), str(shm / "job-a"), str(ranks[0].pid)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # sys_ptrace, dac_read_search, kill, setgid, setuid
    assert int(out["cap_eff"], 16) == (1 << 19) | (1 << 2) | (1 << 5) | (1 << 6) | (1 << 7)
    assert out["steps"] == 3 and out["writable"] is False
    assert out["responder_error"] is None, out
    assert out["main"] and out["main"][-1].endswith("rank.py"), out  # outermost frame: the rank's script
    if shutil.which("py-spy") or os.path.exists(os.path.join(os.path.dirname(sys.executable), "py-spy")):
        assert out["pyspy"], out["pyspy_error"]


def test_the_responder_answers_only_root_or_its_own_user(users, world):
    """SO_PEERCRED: a third user who can reach the socket (a traversable dir here) gets no answer."""
    from rankwatch.hooks.responder import DumpResponder

    _a, b = users
    job_dir = world["dir"] / f"resp-{time.monotonic_ns()}"
    job_dir.mkdir(mode=0o711)
    job_dir.chmod(0o711)
    responder = DumpResponder(str(job_dir), 0)  # this test process (root) is the rank
    responder.start()
    try:
        ask = textwrap.dedent(f"""
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect({str(job_dir / "rank-0.ctl")!r})
            try:
                s.sendall(b"dump t1\\n")
                print("answer", len(s.recv(100)))
            except (BrokenPipeError, ConnectionResetError):  # dropped before the request was even read
                print("answer 0")
        """)
        res = b.run([world["python"], "-c", ask], world["env"], cwd=str(world["dir"]))
        assert res.stdout.strip() == "answer 0", res.stdout + res.stderr  # connected, then dropped unanswered
        with socket.socket(socket.AF_UNIX) as s:  # root (uid 0) is answered
            s.settimeout(10)
            s.connect(str(job_dir / "rank-0.ctl"))
            s.sendall(b"dump t2\n")
            assert s.recv(100).startswith(b"stacks ")
    finally:
        responder.close()
        shutil.rmtree(job_dir, ignore_errors=True)
