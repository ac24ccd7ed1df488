"""The daemon acts only on what it verified: real processes, real signals, a real `rankwatch daemon`.

Every test runs the daemon with ``--on-stall kill``, the mode in which a wrong target costs the most.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import bundle_dirs, free_port, rankwatch_cmd, stalled_record, wait_for, wait_polls
from rankwatch.hooks.record import read_record
from rankwatch.watchdog.core.policy import StallPolicy
from rankwatch.watchdog.observe.process import ProcessTable
from rankwatch.watchdog.serve.daemon import Daemon, DaemonConfig

HERE = Path(__file__).resolve().parents[2]
RANK = str(HERE / "procs" / "rank.py")
COUNTER = str(HERE / "procs" / "signal_counter.py")


def start_rank(procs, shm: Path, job: str, rank: int, world: int, *args: str) -> subprocess.Popen:
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID=job, RANK=str(rank), LOCAL_RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    proc = procs.start([sys.executable, RANK, *args], env=env, text=True)
    assert proc.stdout.readline().startswith("ready"), proc.stderr.read()
    return proc


def start_counter(procs, tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.signals"
    proc = procs.start([sys.executable, COUNTER, str(log)], text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, log


def daemon_cmd(shm: Path, out: Path, *extra: str) -> list[str]:
    return rankwatch_cmd("daemon", "--shm-dir", str(shm), "--out", str(out), "--stall-timeout", "1",
                         "--poll-interval", "0.2", "--on-stall", "kill", "--json-logs", *extra)


def events(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed")
def test_records_naming_pid_1_or_an_unrelated_process_are_never_touched(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    bystander, signals = start_counter(procs, tmp_path, "bystander")
    keep = [stalled_record(shm, "planted", rank=0, world=2, pid=1, stall_slot=1),
            stalled_record(shm, "planted", rank=1, world=2, pid=bystander.pid, stall_slot=1)]
    time.sleep(1.5)  # the clock, not a race: both records are past the 1 s stall timeout when the daemon starts
    trace = tmp_path / "strace.log"
    port = free_port()
    daemon = procs.start(["strace", "-f", "-qq", "-o", str(trace),
                          "-e", "trace=kill,tkill,tgkill,pidfd_send_signal,pidfd_open,ptrace,process_vm_readv",
                          *daemon_cmd(shm, out, "--metrics-port", str(port))], text=True)
    wait_polls(port, more=5)  # the stalled records were seen, and looked at again, several times
    for child in psutil.Process(daemon.pid).children():  # the daemon itself, under strace
        child.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=60)
    # the planted records still claim what they were planted with: the daemon never rewrote a record
    assert [read_record(str(shm / "planted" / f"rank-{r}.hb")).pid for r in (0, 1)] == [1, bystander.pid]
    del keep  # the trackers mapped the records until here, as a live writer would
    assert bystander.poll() is None
    assert not (signals.exists() and signals.read_text()), signals.read_text()
    assert not bundle_dirs(out / "planted" / "incidents"), "a planted record opened an incident"
    unverified = {e.get("pid"): e.get("reason") for e in events(err) if e.get("event") == "rank_unverified"}
    assert set(unverified) == {1, bystander.pid}, err[-3000:]
    assert "init" in unverified[1]
    assert "does not map the record" in unverified[bystander.pid]
    # no syscall of the daemon or its children (py-spy) ever aimed at pid 1 or the bystander
    targets = {"1", str(bystander.pid)}
    for line in trace.read_text().splitlines():
        m = re.search(r"\b(kill|tkill|tgkill|ptrace|process_vm_readv)\((?:PTRACE_\w+, )?(\d+)", line)
        assert not (m and m.group(2) in targets), line


def logged(log: Path, pred, count: int = 1, timeout: float = 60) -> bool:
    """Whether ``count`` of the daemon's JSON log lines (written to ``log``) match ``pred`` within ``timeout``."""
    return bool(wait_for(lambda: sum(1 for e in events(log.read_text(errors="replace")) if pred(e)) >= count,
                         timeout))


def spawn_at_pid(pid: int, cmd: list[str], procs) -> subprocess.Popen | None:
    """A new process that gets ``pid`` (forced through ns_last_pid; retried when another fork wins)."""
    for _ in range(200):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = procs.start(cmd, text=True)
        if proc.pid == pid:
            return proc
        procs.kill(proc)
        proc.wait()
    return None


def test_a_dead_rank_whose_pid_is_reused_is_a_dead_rank_and_the_new_holder_is_untouched(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    port = free_port()
    log = tmp_path / "daemon.log"
    with open(log, "w") as err:
        procs.start(daemon_cmd(shm, out, "--stall-timeout", "60", "--metrics-port", str(port)), text=True, stderr=err)
    r0 = start_rank(procs, shm, "reuse", 0, 2)
    r1 = start_rank(procs, shm, "reuse", 1, 2)
    assert logged(log, lambda e: e.get("event") == "rank_discovered" and e.get("job") == "reuse"
                  and e.get("verified") is True, count=2), "the daemon did not verify both ranks"
    pid = r1.pid
    r1.send_signal(signal.SIGKILL)
    r1.wait()
    signals = tmp_path / "newholder.signals"
    holder = spawn_at_pid(pid, [sys.executable, COUNTER, str(signals)], procs)
    if holder is None:
        pytest.skip("cannot force pid reuse here (ns_last_pid not writable)")
    assert holder.stdout.readline().strip() == "ready"
    found = wait_for(lambda: bundle_dirs(out / "reuse" / "incidents"), timeout=60)
    assert found, log.read_text()[-4000:]
    verdict = json.loads((found[0] / "verdict.json").read_text())
    assert verdict["kind"] == "dead_rank" and verdict["initiating_ranks"] == [1], verdict
    assert wait_for(lambda: r0.poll() is not None, timeout=30), "the verified live rank was not killed"
    wait_polls(port)
    assert holder.poll() is None, "the new holder of the dead rank's pid was killed"
    assert not (signals.exists() and signals.read_text()), signals.read_text()


def test_a_rank_that_dies_between_its_verification_and_the_first_poll_is_this_runs_dead_rank(procs, tmp_path):
    """The job's first look drops records whose processes are gone (an earlier run's); a rank this daemon
    proved alive a moment before is not one of them. Found under load: SIGKILL landed between the
    verification and the first poll's drop, and the dead rank vanished without an incident."""
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    ranks = [start_rank(procs, shm, "early", r, 2) for r in range(2)]
    table = ProcessTable()
    daemon = Daemon(DaemonConfig(shm_dir=str(shm), out_dir=str(out), poll_interval_s=0.2,
                                 stall=StallPolicy(timeout_s=60.0)), procs=table)
    try:
        daemon.discover()
        watch = daemon.jobs["early"].watch
        watch.refresh()  # the first poll's discovery: both ranks verified alive
        assert len(watch.identities()) == 2
        (dying,) = [i for i in watch.identities() if i.pid == ranks[1].pid]
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].wait()
        assert wait_for(lambda: table.exit_ns(dying) is not None, timeout=30)
        assert wait_for(lambda: daemon.poll_once() or daemon.jobs["early"].incident is not None, timeout=30)
        assert daemon.drain(60)
        (bundle,) = bundle_dirs(out / "early" / "incidents")
        verdict = json.loads((bundle / "verdict.json").read_text())
        assert verdict["kind"] == "dead_rank" and verdict["initiating_ranks"] == [1], verdict
        assert ranks[0].poll() is None, "nothing is signalled without --on-stall kill"
    finally:
        daemon.close()


def test_random_bytes_over_a_live_record_do_not_kill_a_healthy_job(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    port = free_port()
    daemon = procs.start(daemon_cmd(shm, out, "--metrics-port", str(port)), text=True)
    ranks = [start_rank(procs, shm, "noisy", r, 2) for r in range(2)]
    wait_polls(port)  # both ranks verified
    path = shm / "noisy" / "rank-1.hb"
    with open(path, "r+b") as f:
        f.write(os.urandom(path.stat().st_size))
    wait_polls(port, more=25)  # five 1 s stall timeouts at the 0.2 s poll interval, however slow polls get
    assert all(r.poll() is None for r in ranks), "a corrupt record killed a healthy job"
    assert not bundle_dirs(out / "noisy" / "incidents")
    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=60)
    assert any(e.get("event") == "record_unreadable" and e.get("rank") == 1 for e in events(err)), err[-2000:]


def test_kill_ends_the_whole_job_including_descendants_that_ignore_sigterm(procs, tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "out"
    shm.mkdir(mode=0o700)
    daemon = procs.start(daemon_cmd(shm, out, "--stall-timeout", "2"), text=True)
    r0 = start_rank(procs, shm, "tree", 0, 2, "--children", "2")
    r1 = start_rank(procs, shm, "tree", 1, 2, "--stall-after", "20")
    workers = [c.pid for c in psutil.Process(r0.pid).children()]
    assert len(workers) == 2
    found = wait_for(lambda: bundle_dirs(out / "tree" / "incidents"), timeout=60)
    assert found, "no incident"
    verdict = json.loads((found[0] / "verdict.json").read_text())
    assert verdict["initiating_ranks"] == [1] and verdict["phase"] == "forward", verdict

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def all_gone() -> bool:
        return r0.poll() is not None and r1.poll() is not None and not any(alive(w) for w in workers)

    assert wait_for(all_gone, timeout=30), "ranks or their workers survived --on-stall kill"
    daemon.send_signal(signal.SIGTERM)
    _, err = daemon.communicate(timeout=60)
    killed = [e for e in events(err) if e.get("event") == "job_killed"]
    assert killed and sorted(killed[0]["sigkilled_descendants"]) == sorted(workers), err[-2000:]


def test_a_record_held_mid_update_is_unreadable_for_the_poll_not_retried_for_long(tmp_path):
    """Issue #20: 99 records left mid-update (odd seqlock) cut polls 10x (~62 ms of sleeps per record per
    poll). The reader now makes a bounded number of attempts without sleeping: the record is 'torn' for this
    poll (unreadable, never dead), and read normally again once its writer finishes the update."""
    from conftest import new_tracker
    from rankwatch.hooks.record import RecordFormatError
    from rankwatch.watchdog.observe import jobdir

    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    tracker = new_tracker(job / "rank-0.hb")
    dfd = jobdir.open_dir(str(job))
    reader = jobdir.AtRecordReader(dfd, "rank-0.hb", 32)
    try:
        assert reader.read() is not None
        tracker._writer.begin()  # a writer stopped mid-update: the sequence stays odd
        with pytest.raises(RecordFormatError, match="torn"):
            reader.read()
        tracker._writer.end()
        assert reader.read() is not None
    finally:
        reader.close()
        os.close(dfd)
