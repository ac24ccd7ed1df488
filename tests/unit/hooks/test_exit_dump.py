"""A rank writes its flight recorder as it ends (``hooks/exit_dump.py``): on an exception and on SIGTERM, also while
its training thread is blocked in C, and SIGTERM still ends it by that signal. Real ranks: ``python -m
rankwatch.hooks`` over a one-rank gloo group whose recorder holds one all_reduce."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rankwatch.hooks.record import read_record
from rankwatch.watchdog.evidence.fr_dump import load_dump

SCRIPT = r"""
import ctypes, os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.all_reduce(torch.ones(3))
mode = sys.argv[1]
if mode == "raise":
    raise RuntimeError("Connection reset by peer")
if mode == "fork":
    child = os.fork()
    if child == 0:
        print("child", os.getpid(), flush=True)
        time.sleep(60)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    print("child ended", os.waitstatus_to_exitcode(status), flush=True)
    sys.exit(0)
if mode == "gil":
    print("ready", flush=True)
    # the training thread inside one C call that never releases the GIL (a catastrophic regex): no Python runs
    import re
    re.match(r"(a+)+$", "a" * 64 + "b")
if mode == "own-handler":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
    print("ready", flush=True)
    time.sleep(60)
print("ready", flush=True)
# the training thread blocked in C with the GIL released, as in a gloo wait: it never runs a Python handler
mutex = ctypes.create_string_buffer(64)  # a zeroed pthread_mutex_t: PTHREAD_MUTEX_INITIALIZER
libc = ctypes.CDLL(None)
libc.pthread_mutex_lock(mutex)
libc.pthread_mutex_lock(mutex)
"""


def start(procs, tmp_path: Path, mode: str, **extra_env: str) -> subprocess.Popen:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(tmp_path / "shm"), RANKWATCH_JOB_ID="j", **extra_env)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "TORCH_FR_BUFFER_SIZE"):
        env.pop(key, None)
    return procs.start([sys.executable, "-m", "rankwatch.hooks", str(script), mode], env=env, text=True)


def dump_of(tmp_path: Path, pid: int) -> Path:
    return tmp_path / "shm" / "j" / "dumps" / f"exit-{pid}" / "rank-0.fr.json"


def recorded_sizes(path: Path) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    return [(e.op, e.input_sizes) for e in load_dump(path).entries]


def test_a_script_that_raises_leaves_its_flight_recorder_beside_its_crash_mark(procs, tmp_path):
    proc = start(procs, tmp_path, "raise")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Connection reset by peer" in err, err
    assert read_record(str(tmp_path / "shm" / "j" / "rank-0.hb")).crashed
    assert recorded_sizes(dump_of(tmp_path, proc.pid)) == [("all_reduce", ((3,),))]


def test_sigterm_to_a_rank_blocked_in_c_dumps_and_still_ends_it_by_sigterm(procs, tmp_path):
    proc = start(procs, tmp_path, "blocked")
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert recorded_sizes(dump_of(tmp_path, proc.pid)) == [("all_reduce", ((3,),))]


def test_a_jobs_own_sigterm_handler_is_left_to_decide(procs, tmp_path):
    # installed after the hook's: the job's handler runs and its exit code stands (its non-zero exit is a crash,
    # so the recorder is written on that path)
    proc = start(procs, tmp_path, "own-handler")
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 3


def test_a_forked_child_ends_by_its_own_sigterm_and_never_touches_the_rank(procs, tmp_path):
    proc = start(procs, tmp_path, "fork")
    line = proc.stdout.readline()
    assert line.startswith("child "), proc.stderr.read()
    child = int(line.split()[1])
    os.kill(child, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "child ended -15" in out and proc.returncode == 0, err
    assert not dump_of(tmp_path, child).exists() and not dump_of(tmp_path, proc.pid).exists()


def test_no_flight_recorder_no_file_and_the_exit_is_unchanged(procs, tmp_path):
    # without torch.distributed there is nothing to dump: SIGTERM ends the rank as before
    script = tmp_path / "plain.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(tmp_path / "shm"), RANKWATCH_JOB_ID="j")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    proc = procs.start([sys.executable, "-m", "rankwatch.hooks", str(script)], env=env, text=True)
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert not (tmp_path / "shm" / "j" / "dumps").exists()


def test_exception_only_mode_keeps_sigterms_default_action(procs, tmp_path):
    """``RANKWATCH_EXIT_DUMP=exception``: a rank whose training thread holds the GIL in C still dies at once on
    SIGTERM (with the handler it would wait for the launcher's SIGKILL), and a raising script still dumps."""
    proc = start(procs, tmp_path, "gil", RANKWATCH_EXIT_DUMP="exception")
    assert proc.stdout.readline() == "ready\n", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert not dump_of(tmp_path, proc.pid).exists()
    raised = start(procs, tmp_path, "raise", RANKWATCH_EXIT_DUMP="exception")
    raised.communicate(timeout=120)
    assert recorded_sizes(dump_of(tmp_path, raised.pid)) == [("all_reduce", ((3,),))]


def test_exit_dump_off_writes_nothing(procs, tmp_path):
    proc = start(procs, tmp_path, "raise", RANKWATCH_EXIT_DUMP="0")
    proc.communicate(timeout=120)
    assert proc.returncode == 1 and not (tmp_path / "shm" / "j" / "dumps").exists()
