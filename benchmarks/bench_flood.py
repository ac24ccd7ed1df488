"""Detection latency of a real hang while another user floods the daemon (issues #20 and #42: at most 2x quiet).

A real ``rankwatch daemon`` (``--stall-timeout 2``, 0.2 s polls) watches a victim rank (``tests/procs/rank.py``)
that stalls after a few steps, and, beside it, another user's (``nobody``, when run as root; else this same
user, whose own volume then holds the victim back too — the figures mean something only as root):

* ``quiet``:   nothing else;
* ``dirs``:    5,000 job dirs of 10 records each renamed into the shared dir at once, just before the daemon
  starts: their first look is taken while the victim runs and hangs;
* ``records``: 1,100 valid records in another job, every one mapped by one live process (so each verifies);
* ``torn``:    99 records held mid-update (odd seqlock) by a live process: every read of them is torn;
* ``incidents``: 4 hung jobs, each rank's responder serving a 19 MB flight-recorder dump (40,000 entries):
  their incidents are being captured and parsed (in that user's readers) while the victim stalls;
* ``stopped``: that user's reader stopped with SIGSTOP (it is theirs) while their job is watched: every
  request to it waits out its deadline, then it is written off and respawned, stopped again, ...
* ``stop-cont``: that user, with 64 jobs, stops their reader for 0.9 s and lets it run for 0.05 s, over and
  over: requests answer just under their 1 s deadline, so the reader is never written off.

Latency is stall onset to detection: the ``incident_detected`` log line's time minus the victim's last
progress (on this host's clocks), the 2 s stall timeout included. Medians over ``--repeats``.

    python benchmarks/bench_flood.py --quick
    python benchmarks/bench_flood.py --repeats 5 --json flood.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RANK = str(REPO / "tests" / "procs" / "rank.py")
STALL_S = 2.0

# ``jobs`` job dirs (``base``, or ``base-0`` ... when several) of ``count`` records each, every record mapped by
# this live process (so each verifies as a rank of its user's); "torn": each held mid-update
FLOODER = """
import mmap, os, sys, time
from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, write_identity
base, count, torn, jobs = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "torn", int(sys.argv[4])
writers = []
for j, r in ((j, r) for j in range(jobs) for r in range(count)):
    job = base if jobs == 1 else f"{base}-{j}"
    os.makedirs(job, mode=0o700, exist_ok=True)
    w = RecordWriter(os.path.join(job, f"rank-{r}.hb"))
    write_identity(w, RankIdentity(pid=os.getpid(), global_rank=r, local_rank=r, world_size=count,
                               local_world_size=count, node_rank=0, device=-1, hostname="flood", job_id="flood",
                               start_ns=time.monotonic_ns()), list(CANONICAL_PHASES))
    if torn:
        w.begin()  # seq odd from now on: a writer stuck mid-update
    writers.append(w)
print("ready", flush=True)
sys.stdin.readline()
"""

# ``count`` job dirs of ``recs`` records each (hard links of one record of a process that is gone) built in a
# hidden staging dir, then renamed into the shared dir one after another, as fast as rename goes
DIR_FLOODER = """
import os, sys, time
from rankwatch.hooks.record import CANONICAL_PHASES, RankIdentity, RecordWriter, write_identity
shm, count, recs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
stage = os.path.join(shm, f".stage-{os.getpid()}")
os.makedirs(stage, mode=0o700)
template = os.path.join(stage, "template")
w = RecordWriter(template)
write_identity(w, RankIdentity(pid=(1 << 22) - 1, global_rank=0, local_rank=0, world_size=recs, local_world_size=recs,
                               node_rank=0, device=-1, hostname="flood", job_id="flood", start_ns=time.monotonic_ns()),
               list(CANONICAL_PHASES))
for j in range(count):
    d = os.path.join(stage, f"flood-{j}")
    os.mkdir(d, 0o700)
    for r in range(recs):
        os.link(template, os.path.join(d, f"rank-{r}.hb"))
for j in range(count):
    os.rename(os.path.join(stage, f"flood-{j}"), os.path.join(shm, f"flood-{j}"))
print("ready", flush=True)
sys.stdin.readline()
"""
FLOOD_DIRS, FLOOD_DIR_RECORDS = 5_000, 10


FR_FIXTURE = REPO / "tests" / "fixtures" / "fr" / "nccl_hang" / "rank-0.fr.json"
BIG_FR_RANK = """
import json, os, sys, time
import rankwatch.hooks.responder as resp
fr = json.loads(open(sys.argv[1], "rb").read())
one = fr["entries"][0]
fr["entries"] = [dict(one, record_id=i, collective_seq_id=i + 1) for i in range(int(sys.argv[2]))]
body = json.dumps(fr).encode()
resp.flight_recorder_json = lambda: (body, None)
import rankwatch.hooks as rw
assert rw.init()
with rw.phase("forward"):
    time.sleep(0.05)
rw.step()
print("ready", len(body), flush=True)
with rw.phase("forward"):
    time.sleep(3600)
"""
MODES = ("quiet", "dirs", "records", "torn", "incidents", "stopped", "stop-cont")
INCIDENT_JOBS = 4
FR_ENTRIES = 40_000


def _other_user(tmp: Path, env: dict[str, str]) -> tuple[str, dict, dict[str, str]]:
    """(python, Popen kwargs, env) to run a hook process as ``nobody`` (root only; else as this user): the
    hook package staged where that user can import it, and a system Python it can run."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        return sys.executable, {}, env
    import pwd

    nobody = pwd.getpwnam("nobody")
    stage = tmp / "pkg"
    (stage / "rankwatch").mkdir(parents=True, exist_ok=True)
    if not (stage / "rankwatch" / "hooks").exists():
        (stage / "rankwatch" / "hooks").symlink_to(REPO / "hooks")
    for p in (stage, stage / "rankwatch"):
        p.chmod(0o755)
    kw = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    return "/usr/bin/python3", kw, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(stage), "HOME": str(tmp),
                                    "PYTHONDONTWRITEBYTECODE": "1", "RANKWATCH_SHM_DIR": env["RANKWATCH_SHM_DIR"]}


def _stop_cont(pid: int, done: threading.Event) -> None:
    """Stopped 0.9 s, running 0.05 s, until ``done``: each request answered just before its deadline."""
    with contextlib.suppress(ProcessLookupError):
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(0.9)
            os.kill(pid, signal.SIGCONT)
            done.wait(0.05)


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wall(ts: str) -> float:
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def one_run(mode: str, tmp: Path, dirs: int = FLOOD_DIRS) -> float | None:
    from rankwatch.hooks.record import read_record

    shm, out, log = tmp / f"shm-{mode}", tmp / f"out-{mode}", tmp / f"daemon-{mode}.log"
    shm.mkdir(mode=0o700, parents=True)
    shm.chmod(0o1777)  # shared like /dev/shm (another user's jobs in ``incidents``)
    for p in (tmp, tmp.parent):  # the run's dir and the benchmark's own: ``nobody`` imports the hook from there
        p.chmod(0o755)
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm))
    python, as_user, other_env = _other_user(tmp, env)
    stopped_reader: int | None = None
    done = threading.Event()
    try:
        if mode == "incidents":
            hung_env = other_env
            for j in range(INCIDENT_JOBS):
                hung = subprocess.Popen([python, "-c", BIG_FR_RANK, str(FR_FIXTURE), str(FR_ENTRIES)],
                                        stdout=subprocess.PIPE, text=True, **as_user,
                                        env=dict(hung_env, RANKWATCH_JOB_ID=f"hung-{j}", RANK="0", WORLD_SIZE="1",
                                                 LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"))
                procs.append(hung)
                assert hung.stdout is not None and hung.stdout.readline().startswith("ready")
        elif mode == "dirs":
            flood = subprocess.Popen([python, "-c", DIR_FLOODER, str(shm), str(dirs), str(FLOOD_DIR_RECORDS)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=other_env,
                                     **as_user)
            procs.append(flood)
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
        elif mode != "quiet":
            count = {"records": 1100, "torn": 99, "stopped": 1, "stop-cont": 1}[mode]
            jobs = 64 if mode == "stop-cont" else 1
            flood = subprocess.Popen([python, "-c", FLOODER, str(shm / "flood"), str(count), mode, str(jobs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=other_env,
                                     **as_user)
            procs.append(flood)
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
        with open(log, "w") as err:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "rankwatch.watchdog.cli", "daemon", "--shm-dir", str(shm), "--out", str(out),
                 "--stall-timeout", str(STALL_S), "--poll-interval", "0.2", "--json-logs"],
                stdout=subprocess.DEVNULL, stderr=err, env=env)
        procs.append(daemon)
        if mode in ("stopped", "stop-cont"):  # the other user stops their own reader the moment it is there
            uid = as_user.get("user", os.geteuid())
            deadline = time.monotonic() + 60
            while stopped_reader is None and time.monotonic() < deadline:
                stopped_reader = next((e["pid"] for e in _events(log) if e.get("event") == "reader_started"
                                       and e.get("uid") == uid), None)
                time.sleep(0.05)
            if stopped_reader is not None and mode == "stop-cont":
                threading.Thread(target=_stop_cont, args=(stopped_reader, done), daemon=True).start()
            elif stopped_reader is not None:
                os.kill(stopped_reader, signal.SIGSTOP)
            else:
                print("stopped: no reader of the other user (not root?): nothing to stop", file=sys.stderr)
        time.sleep(3)  # the daemon has adopted the flood (the hung jobs' incidents open about now)
        victim = subprocess.Popen([sys.executable, RANK, "--stall-after", "20", "--step-s", "0.05"],
                                  stdout=subprocess.PIPE, text=True,
                                  env=dict(env, RANKWATCH_JOB_ID="victim", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                           LOCAL_WORLD_SIZE="1"))
        procs.append(victim)
        deadline = time.monotonic() + 120
        got = None
        while time.monotonic() < deadline and got is None:
            got = next((e for e in _events(log) if e.get("event") == "incident_detected"
                        and e.get("job") == "victim"), None)
            time.sleep(0.1)
        if got is None:
            return None
        if mode == "incidents":  # the measurement means something only if they were being handled meanwhile
            events = _events(log)
            upto = events[: events.index(got)]
            hung = [e.get("event") for e in upto if str(e.get("job")).startswith("hung")]
            busy = hung.count("incident_detected") - hung.count("verdict")
            print(f"incidents: {busy} of the hung jobs' incidents in flight at the victim's detection", file=sys.stderr)
        rec = read_record(str(shm / "victim" / "rank-0.hb"))
        offset = time.time() - time.monotonic()
        return _wall(got["timestamp"]) - (rec.last_progress_ns / 1e9 + offset)
    finally:
        done.set()
        if stopped_reader is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped_reader, signal.SIGCONT)
        for p in reversed(procs):
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repeat per mode, 200 dirs in ``dirs`` (a smoke run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="also write the raw numbers here")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="floods to measure (quiet is always measured: the ratios are to it)")
    args = p.parse_args()
    repeats = 1 if args.quick else args.repeats
    raw: dict[str, list[float | None]] = {}
    # as root another user runs jobs from here: under /tmp itself, never below a private dir (pytest's, $TMPDIR)
    base = "/tmp" if os.geteuid() == 0 and os.path.isdir("/tmp") else None
    with tempfile.TemporaryDirectory(prefix="rw-flood-", dir=base) as d:
        for i in range(repeats):
            for mode in ["quiet", *(m for m in args.modes if m != "quiet")]:  # interleaved: load drifts alike
                raw.setdefault(mode, []).append(one_run(mode, Path(d) / f"{mode}-{i}",
                                                        200 if args.quick else FLOOD_DIRS))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    quiet = statistics.median([x for x in raw["quiet"] if x is not None] or [float("nan")])
    print(f"| flood | stall onset → detection, timeout {STALL_S:.0f} s (median s) | x quiet | missed |")
    print("|---|---|---|---|")
    for mode, xs in raw.items():
        ok = [x for x in xs if x is not None]
        med = statistics.median(ok) if ok else float("nan")
        print(f"| {mode} | {med:.2f} | {med / quiet if quiet else float('nan'):.2f} | {len(xs) - len(ok)} |")


if __name__ == "__main__":
    main()
