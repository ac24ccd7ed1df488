"""``rankwatch inspect`` on jobs that were never wrapped.

Fast tier: discovery over a constructed /proc tree (hostile environments, workers, root's rules, a copied
run id), the phase read from stacks, running or stalled from two looks, facts → verdict, bad input, a
planted symlink where the bundle goes. Slow tier: plain torchrun jobs (tests/jobs/plain_ddp.py, no
rankwatch imported anywhere) hung in a DataLoader worker, in forward, stopped, with a dead rank, over two
nodes whose two inspect runs agree through a TCPStore, a healthy job beside a hung one, and a job that
carries another job's run id.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rankwatch.watchdog.cli import inspect as inspect_cli
from rankwatch.watchdog.core.evidence_items import Line
from rankwatch.watchdog.core.inspect_facts import RankFact, RankLook, judge_progress, views_from_facts
from rankwatch.watchdog.core.policy import InspectPolicy
from rankwatch.watchdog.core.stack_phase import phase_from_frames
from rankwatch.watchdog.core.stacks import Frame
from rankwatch.watchdog.observe.discover import MAX_ENV_VALUE, discover, parse_environ, select
from rankwatch.watchdog.report.text import headline
from rankwatch.watchdog.verdict import decide

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "jobs"))
import hung

TORCH = "/usr/lib/python3/site-packages/torch"
AGENT_CMD = b"/usr/bin/python\0-m\0torch.distributed.run\0--nproc-per-node\x002\0train.py\0"


# -- a constructed /proc ------------------------------------------------------------------------------
def proc_entry(root: Path, pid: int, ppid: int, *, uid: int = 1000, state: str = "S", env: dict | bytes | None = None,
               cmdline: bytes = b"python\0train.py\0", exit_code: int = 0) -> None:
    d = root / str(pid)
    d.mkdir()
    rest = [state, str(ppid)] + ["0"] * 17 + ["12345"] + ["0"] * 29 + [str(exit_code)]
    (d / "stat").write_text(f"{pid} (py thon) " + " ".join(rest) + "\n")
    (d / "status").write_text(f"Name:\tpython\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    raw = env if isinstance(env, bytes) else b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items())
    (d / "environ").write_bytes(raw)
    (d / "cmdline").write_bytes(cmdline)


def rank_env(rank: int, local: int, world: int = 2, run_id: str = "job1", **extra: str) -> dict:
    return {"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": run_id, "PATH": "/bin", **extra}


def torchrun_tree(root: Path, *, agent_uid: int = 1000, rank_uid: int = 1000) -> None:
    proc_entry(root, 100, 1, uid=agent_uid, cmdline=AGENT_CMD)
    proc_entry(root, 101, 100, uid=rank_uid, env=rank_env(0, 0))
    proc_entry(root, 102, 100, uid=rank_uid, env=rank_env(1, 1))
    proc_entry(root, 103, 102, uid=rank_uid, env=rank_env(1, 1))  # rank 1's DataLoader worker


def test_discovery_groups_ranks_and_tells_workers_apart(tmp_path):
    torchrun_tree(tmp_path)
    found = discover(proc_root=str(tmp_path), caller_uid=1000)
    assert [j.job_id for j in found.jobs] == ["job1"]
    job = found.jobs[0]
    assert [(r.rank, r.pid) for r in job.ranks] == [(0, 101), (1, 102)]
    assert job.ranks[1].workers == (103,)
    assert list(job.agents) == [100]
    # --pid: a rank's, a worker's or the agent's pid selects every rank that agent runs
    for pid in (100, 101, 103):
        jobs, err = select(found, pids=[pid])
        assert err is None and [r.rank for r in jobs[0].ranks] == [0, 1]
    jobs, err = select(found, pids=[4242])
    assert not jobs and "4242" in (err or "")


def test_an_agent_without_ranks_is_named(tmp_path):
    proc_entry(tmp_path, 100, 1, cmdline=AGENT_CMD)
    proc_entry(tmp_path, 101, 100, state="Z", env=b"", exit_code=signal.SIGKILL)
    found = discover(proc_root=str(tmp_path), caller_uid=1000)
    assert found.jobs == [] and found.idle_agents == [100]


def test_an_unprivileged_caller_sees_only_its_own_processes(tmp_path):
    torchrun_tree(tmp_path, agent_uid=2000, rank_uid=2000)
    assert discover(proc_root=str(tmp_path), caller_uid=1000).jobs == []


def test_root_takes_a_rank_only_under_a_torchrun_agent_of_the_same_user(tmp_path):
    torchrun_tree(tmp_path, agent_uid=0, rank_uid=1000)
    found = discover(proc_root=str(tmp_path), caller_uid=0)
    assert found.jobs == []
    assert any("do not run as one and the same user" in n for n in found.notes)
    other = tmp_path / "b"
    other.mkdir()
    proc_entry(other, 200, 1, uid=1000, cmdline=b"bash\0")  # not an agent: a planted environment
    proc_entry(other, 201, 200, uid=1000, env=rank_env(0, 0))
    found = discover(proc_root=str(other), caller_uid=0)
    assert found.jobs == [] and "not a torchrun agent" in found.notes[0]


def test_as_root_a_users_environments_come_from_that_users_reader(tmp_path):
    """Root never parses a job's environment itself: each owner's pids go to ``env_reader`` (the owner's
    reader), only root's own are read directly; what the reader could not read is simply not a rank."""
    torchrun_tree(tmp_path)
    proc_entry(tmp_path, 300, 1, uid=0, env=rank_env(0, 0, world=1, run_id="rootjob"), cmdline=b"python\0x.py\0")
    asked: list[tuple[int, list[int]]] = []

    def reader(uid: int, pids: list[int]) -> dict[int, dict[str, str] | None]:
        asked.append((uid, sorted(pids)))
        return {pid: (None if pid == 102 else rank_env(0 if pid == 101 else 1, 0 if pid == 101 else 1))
                for pid in pids}

    found = discover(proc_root=str(tmp_path), caller_uid=0, env_reader=reader)
    assert asked == [(1000, [100, 101, 102, 103])]
    ranks = {(j.job_id, r.rank, r.pid) for j in found.jobs for r in j.ranks}
    assert ("job1", 0, 101) in ranks and not any(pid == 102 for _, _, pid in ranks)


def test_inconsistent_jobs_are_left_out(tmp_path):
    proc_entry(tmp_path, 100, 1, cmdline=AGENT_CMD)
    proc_entry(tmp_path, 101, 100, env=rank_env(0, 0))
    proc_entry(tmp_path, 102, 100, env=rank_env(0, 1))  # a second RANK=0
    found = discover(proc_root=str(tmp_path), caller_uid=1000)
    assert found.jobs == [] and "RANK=0 is claimed" in found.notes[0]


def test_hostile_environments_are_bounded_and_validated():
    env = parse_environ(
        b"RANK=1\0LOCAL_RANK=\xff\0WORLD_SIZE=" + b"9" * (MAX_ENV_VALUE + 1)
        + b"\0NOEQUALS\0TORCHELASTIC_RUN_ID=a\x1bb\0MASTER_PORT=29500\0SECRET_TOKEN=x\0"
    )
    assert env == {"RANK": "1", "MASTER_PORT": "29500"}


def test_hostile_rank_values_are_not_ranks(tmp_path):
    proc_entry(tmp_path, 100, 1, cmdline=AGENT_CMD)
    proc_entry(tmp_path, 101, 100, env=rank_env(5, 0))  # RANK >= WORLD_SIZE
    proc_entry(tmp_path, 102, 100, env={**rank_env(0, 0), "WORLD_SIZE": "-1"})
    proc_entry(tmp_path, 103, 100, env={**rank_env(0, 0), "TORCHELASTIC_RUN_ID": "../../etc"})
    found = discover(proc_root=str(tmp_path), caller_uid=1000)
    assert [(j.job_id, [r.pid for r in j.ranks]) for j in found.jobs] == [("_._.._etc", [103])]


@pytest.mark.parametrize("caller", [0, 1000])
def test_a_job_is_one_agents_ranks_of_one_user_not_its_run_id(tmp_path, caller):
    """A run id is in every rank's world-readable environment and command line: anyone can start a rank
    carrying another job's. That one-rank job (another user's as root sees it; the same user's, under another
    agent, as that user sees it) is a job of its own, and the job whose id it copied is still found whole."""
    torchrun_tree(tmp_path)  # agent 100 (uid 1000): ranks 101, 102 of job1, world 2
    intruder = 2000 if caller == 0 else 1000
    proc_entry(tmp_path, 200, 1, uid=intruder, cmdline=AGENT_CMD)
    proc_entry(tmp_path, 201, 200, uid=intruder, env=rank_env(0, 0, world=1))  # job1 again: RANK=0, WORLD_SIZE=1
    found = discover(proc_root=str(tmp_path), caller_uid=caller)
    assert [(j.job_id, j.launcher, j.owner_uid, [r.pid for r in j.ranks]) for j in found.jobs] == [
        ("job1", 100, 1000, [101, 102]), ("job1", 200, intruder, [201])]
    assert not found.notes
    jobs, err = select(found, job_id="job1")
    assert err is None and len(jobs) == 2
    jobs, err = select(found, pids=[101])
    assert err is None and [(j.launcher, [r.rank for r in j.ranks]) for j in jobs] == [(100, [0, 1])]


def test_missing_local_ranks_are_found(tmp_path):
    proc_entry(tmp_path, 100, 1, cmdline=AGENT_CMD)
    proc_entry(tmp_path, 101, 100, env=rank_env(0, 0, world=3) | {"LOCAL_WORLD_SIZE": "3"})
    proc_entry(tmp_path, 103, 100, env=rank_env(2, 2, world=3) | {"LOCAL_WORLD_SIZE": "3"})
    proc_entry(tmp_path, 102, 100, state="Z", env=b"", exit_code=signal.SIGKILL)
    job = discover(proc_root=str(tmp_path), caller_uid=1000).jobs[0]
    assert job.missing_ranks() == [(1, 0)]
    assert [z.pid for z in job.zombies] == [102] and job.zombies[0].exit_code == signal.SIGKILL


# -- the phase read from a stack ----------------------------------------------------------------------
def frames(*spec: tuple[str, str]) -> tuple[Frame, ...]:
    return tuple(Frame(name, path, 1) for name, path in spec)


USER = "/home/u/train.py"
CASES = {
    "dataloader": frames(("Data.__getitem__", USER), ("fetch", f"{TORCH}/utils/data/_utils/fetch.py"),
                         ("_BaseDataLoaderIter.__next__", f"{TORCH}/utils/data/dataloader.py"), ("main", USER)),
    "forward": frames(("Model.forward", USER), ("Module._call_impl", f"{TORCH}/nn/modules/module.py"),
                      ("main", USER)),
    "backward": frames(("spin", USER), ("_engine_run_backward", f"{TORCH}/autograd/graph.py"),
                       ("Tensor.backward", f"{TORCH}/_tensor.py"), ("main", USER)),
    "optimizer": frames(("pre", USER), ("Optimizer.profile_hook_step.wrapper", f"{TORCH}/optim/optimizer.py"),
                        ("main", USER)),
    "collective": frames(("all_reduce", f"{TORCH}/distributed/distributed_c10d.py"),
                         ("wrapper", f"{TORCH}/distributed/c10d_logger.py"), ("main", USER)),
    "idle": frames(("Event.wait", "/usr/lib/python3.11/threading.py"), ("main", USER)),
}


@pytest.mark.parametrize("phase", sorted(CASES))
def test_phase_from_frames(phase):
    got = phase_from_frames(CASES[phase])
    assert got.phase == phase
    assert got.op == ("all_reduce" if phase == "collective" else None)


# -- facts → the live verdict's engine ---------------------------------------------------------------
def fact(rank: int, phase: str, **kw) -> RankFact:
    base = {"rank": rank, "node": "n", "node_rank": 0, "pid": 100 + rank, "proc_state": "S", "frames": CASES[phase]}
    return RankFact(**{**base, **kw})


def verdict_of(facts: list[RankFact]) -> dict:
    views, lines = views_from_facts(facts)
    return decide(views, job_id="j", incident_id="i", detected_after_s=0.0,
                  extra_evidence=[Line(x) for x in lines]).to_json()


WAITING = ("backward", frames(("_engine_run_backward", f"{TORCH}/autograd/graph.py"), ("main", USER)))


def test_the_rank_not_waiting_is_named_with_its_phase():
    facts = [fact(r, "dataloader") if r == 2 else fact(r, "backward", frames=WAITING[1]) for r in range(4)]
    v = verdict_of(facts)
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [2], "dataloader")


def test_ranks_waiting_in_different_collectives_name_the_odd_side():
    # an extra barrier: rank 3 waits in a collective the others never call, they wait in DDP's all-reduce
    facts = [fact(r, "collective") if r == 3 else fact(r, "backward", frames=WAITING[1]) for r in range(4)]
    v = verdict_of(facts)
    assert v["initiating_ranks"] == [3]
    assert any(e.startswith("every live rank waits for peers, in different collectives: rank 3 in collective")
               for e in v["evidence"])


def test_a_rank_whose_stack_was_not_read_takes_no_side():
    facts = [fact(0, "backward", frames=WAITING[1]), fact(1, "dataloader"),
             fact(2, "idle", frames=(), stack_error="py-spy timed out after 5.0s")]
    v = verdict_of(facts)
    assert (v["initiating_ranks"], v["phase"]) == ([1], "dataloader")
    assert v["ranks"]["2"]["state"] == "unknown"


def test_native_frames_do_not_hide_a_wait():
    native = (Frame("0x7f00", "/usr/lib/x86_64-linux-gnu/libc.so.6", 0), Frame("PyThread_acquire_lock_timed",
              "/usr/lib/libpython3.11.so.1.0", 0))
    facts = [fact(0, "backward", frames=native + WAITING[1]), fact(1, "forward", frames=native + CASES["forward"])]
    v = verdict_of(facts)
    assert (v["initiating_ranks"], v["phase"], v["confidence"]) == ([1], "forward", "medium")
    finding = v["finding"]
    assert (finding["rule"], finding["ranks"], finding["data"]["waiters"]) == ("wait_for", [1], [0])


def test_a_stopped_rank_is_named():
    facts = [fact(r, "idle", proc_state="T") if r == 1 else fact(r, "collective") for r in range(3)]
    v = verdict_of(facts)
    assert (v["kind"], v["initiating_ranks"]) == ("stopped_rank", [1])


def test_without_a_record_the_reason_names_no_step():
    # inspect reads no record: every step counter is 0 and phase timers 0.0 s, which the reason leaves out
    for facts in ([fact(r, "idle", proc_state="T") if r == 1 else fact(r, "collective") for r in range(3)],
                  [fact(r, "dataloader") if r == 2 else fact(r, "backward", frames=WAITING[1]) for r in range(4)]):
        views, said = views_from_facts(facts)
        lines = [Line(x) for x in said]
        plain = decide(views, job_id="j", incident_id="i", detected_after_s=0.0, extra_evidence=lines)
        bare = decide(views, job_id="j", incident_id="i", detected_after_s=0.0, extra_evidence=lines,
                      steps_known=False)
        assert " at step 0" in plain.reason and " at step" not in bare.reason and " for 0.0s" not in bare.reason
        assert bare.reason == plain.reason.replace(" at step 0 for 0.0s", "").replace(" at step 0", "")
        assert (bare.initiating_ranks, bare.evidence) == (plain.initiating_ranks, plain.evidence)


def test_a_killed_rank_beats_the_peers_that_lost_it():
    # rank 1 killed by SIGKILL; 0 and 2 exited 1 (their connection closed) and 3 was torn down by SIGTERM
    facts = [
        fact(0, "idle", proc_state="Z", exit_status=1 << 8, frames=()),
        fact(1, "idle", proc_state="Z", exit_status=signal.SIGKILL, frames=()),
        fact(2, "idle", proc_state="Z", exit_status=1 << 8, frames=()),
        fact(3, "idle", proc_state="Z", exit_status=signal.SIGTERM, frames=()),
    ]
    v = verdict_of(facts)
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [1])


def test_a_rank_gone_altogether_is_named():
    facts = [fact(0, "dataloader"), fact(1, "idle", pid=-1, proc_state="", frames=()), fact(2, "dataloader")]
    v = verdict_of(facts)
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [1])


# -- running or stalled: two looks ------------------------------------------------------------------------
TICKS = 100.0  # clock ticks per second, as the kernel reports CPU time


def look(rank: int, at: float, cpu: int | None, sig: str | None = "a", *, state: str = "S", alive: bool = True,
         wakeups: int | None = 0, fr: tuple[int, int] | None = None) -> RankLook:
    return RankLook(rank, at, alive, state, cpu, sig, fr, wakeups)


def progress(first: list[RankLook], last: list[RankLook], **kw):
    return judge_progress({x.rank: x for x in first}, {x.rank: x for x in last}, ticks_per_s=TICKS, **kw)


@pytest.mark.parametrize(
    ("second", "running", "moved", "still", "again"),
    [
        # each rank's stack moved as its CPU time advanced: running
        ([look(0, 1.0, 60, "b"), look(1, 1.0, 55, "c")], True, (0, 1), (), ()),
        # rank 1 spun in one place (CPU advanced, same stack, never woken): look again
        ([look(0, 1.0, 60, "b"), look(1, 1.0, 99, "a")], False, (0,), (), (1,)),
        # the same stack at both looks, but woken from waits hundreds of times: a quick step landing there
        ([look(0, 1.0, 60, "a", wakeups=600), look(1, 1.0, 55, "c")], True, (0, 1), (), ()),
        # a rank whose CPU time stood still made no progress, whatever its stack: stalled at once
        ([look(0, 1.0, 60, "b"), look(1, 1.0, 0, "c", wakeups=600)], False, (0,), (1,), ()),
        # a stopped rank, and a rank replaced by another process (or gone) between the looks
        ([look(0, 1.0, 60, "b"), look(1, 1.0, 55, "c", state="T")], False, (0,), (1,), ()),
        ([look(0, 1.0, 60, "b"), look(1, 1.0, 55, "c", alive=False)], False, (0,), (1,), ()),
        # a live flight recorder that completed collectives is progress even where the CPU time says little
        ([look(0, 1.0, 60, "b", fr=(7, 7)), look(1, 1.0, 0, "a", fr=(9, 9))], True, (0, 1), (), ()),
    ],
)
def test_two_looks_tell_running_from_stalled(second, running, moved, still, again):
    first = [look(0, 0.0, 0, "a", fr=(7, 7)), look(1, 0.0, 0, "a", fr=(7, 7))]
    p = progress(first, second)
    assert (p.running, p.moved, p.still, p.again) == (running, moved, still, again), p.line
    assert p.line.startswith("two looks 1.0s apart: ")


def test_a_rank_without_a_stack_takes_no_side_and_a_gone_rank_stalls_the_job():
    first = [look(0, 0.0, 0, "a"), look(1, 0.0, 0, None)]
    second = [look(0, 1.0, 60, "b"), look(1, 1.0, 60, None)]
    assert progress(first, second).running and progress(first, second).unread == (1,)
    # no stack moved at all: nothing proves progress
    assert not progress(first[1:], second[1:]).running
    # a local rank the launcher started is gone: not running, whatever the others do
    gone = progress(first, second, gone=[2])
    assert not gone.running and gone.still == (2,)


def test_cpu_needed_scales_with_the_time_between_the_looks():
    policy = InspectPolicy(min_cpu_share=0.1)
    first = [look(0, 0.0, 0, "a")]
    # 10 % of a core over 5 s is 50 ticks: 40 is not enough, 50 is
    assert progress(first, [look(0, 5.0, 40, "b")], policy=policy).still == (0,)
    assert progress(first, [look(0, 5.0, 50, "b")], policy=policy).running


# -- bad input ------------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch.watchdog.cli", "inspect", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--pid", "abc"), "expected a process id"),
        (("--pid", "0"), "expected a process id"),
        (("--store", "nohost"), "expected HOST:PORT"),
        (("--pid", str(2**31 - 2)), "is not a torch distributed rank"),
        (("--job", "no-such-job-xyz"), "no job 'no-such-job-xyz'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    res = run_cli(*args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_symlinked_out_dir_is_refused_before_anything_is_inspected(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "rankwatch-inspect").symlink_to(target)
    res = run_cli("--out", str(tmp_path / "rankwatch-inspect"))
    assert res.returncode == 2, res.stderr
    assert "is a symbolic link" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("level", ["job", "incidents"])
def test_a_symlink_below_the_out_dir_is_not_followed(tmp_path, level):
    """The job's and the incidents' dirs are opened as the daemon opens job dirs (O_NOFOLLOW): a link
    planted at either is refused (ELOOP), and nothing is written where it points."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    out = tmp_path / "out"
    (out / "job1").mkdir(parents=True, mode=0o700)
    planted = out / "job1" if level == "job" else out / "job1" / "incidents"
    if level == "job":
        planted.rmdir()
    planted.symlink_to(target)
    with pytest.raises(OSError) as exc:
        inspect_cli.open_incidents_dir(str(out), "job1")
    assert exc.value.errno == errno.ELOOP
    assert list(target.iterdir()) == []
    # a real dir of the caller's own is opened (and made where missing)
    fd = inspect_cli.open_incidents_dir(str(tmp_path / "fresh"), "job1")
    os.close(fd)
    assert (tmp_path / "fresh" / "job1" / "incidents").is_dir()


def test_a_job_dir_another_user_may_write_is_refused(tmp_path):
    out = tmp_path / "out"
    (out / "job1").mkdir(parents=True)
    os.chmod(out / "job1", 0o777)  # anyone could swap entries in it under the writer
    with pytest.raises(OSError, match="not this user's own directory"):
        inspect_cli.open_incidents_dir(str(out), "job1")


def test_no_ranks_found_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    real = inspect_cli.discover
    monkeypatch.setattr(inspect_cli, "discover", lambda **kw: real(proc_root=str(tmp_path), **kw))
    assert inspect_cli.main(["--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "no torch distributed ranks found" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# -- real plain torchrun jobs -----------------------------------------------------------------------------
HANG_TIMEOUT_S = 240.0


@pytest.fixture
def plain_job(tmp_path):
    """Start plain_ddp.py under plain torchrun; every job it started is killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(nproc: int, fault: str, fault_rank: int, *extra: str, monitor_interval: float = 0.2, nnodes: int = 1,
              node_rank: int = 0, master_port: int | None = None, marks: Path | None = None,
              run_id: str | None = None) -> tuple:
        marks = marks or tmp_path / "marks"
        marks.mkdir(exist_ok=True)
        cmd = hung.torchrun_cmd(nproc, run_id or f"insp-{os.getpid()}-{len(started)}", "--fault", fault, "--fault-rank",
                                str(fault_rank), "--fault-step", "3", "--mark-dir", str(marks), *extra,
                                nnodes=nnodes, node_rank=node_rank, master_port=master_port,
                                monitor_interval=monitor_interval)
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started.append(proc)
        return proc, marks

    yield start
    for proc in started:
        hung.kill_job(proc)
        if proc.stderr:
            proc.stderr.close()


def inspect_json(agent: subprocess.Popen, out: Path, *extra: str) -> dict:
    res = run_cli("--pid", str(agent.pid), "--out", str(out), "--json", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow
def test_input_hang_in_a_dataloader_worker(plain_job, tmp_path):
    # 2 ranks (a faulting rank and a peer waiting for it) throughout: the rank count is not the point, and
    # every rank is a torch process (~1.6 s of CPU to start)
    agent, marks = plain_job(2, "input-hang", 1, "--num-workers", "2")
    hung.wait_hung(marks, 2, "input-hang", 1, 3, HANG_TIMEOUT_S, agent)
    v = inspect_json(agent, tmp_path / "out")
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [1], "dataloader")
    # the workers share their rank's environment but are not ranks
    assert sorted(v["ranks"]) == ["0", "1"]
    assert any("rank 1's worker pid" in e for e in v["evidence"])
    bundle = Path(v["bundle"])
    assert json.loads((bundle / "verdict.json").read_text())["initiating_ranks"] == [1]
    assert sorted(p.name for p in (bundle / "stacks").iterdir()) == [
        "groups.txt", "rank-0.json", "rank-0.txt", "rank-1.json", "rank-1.txt"]
    assert oct((bundle / "verdict.json").stat().st_mode & 0o777) == "0o600"
    # the bundle is an incident's: rankwatch report renders it
    shown = subprocess.run([sys.executable, "-m", "rankwatch.watchdog.cli", "report", str(bundle)],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and headline(json.loads((bundle / "verdict.json").read_text())) in shown.stdout


@pytest.mark.slow
def test_compute_hang_in_forward(plain_job, tmp_path):
    agent, marks = plain_job(2, "compute-hang", 1)
    hung.wait_hung(marks, 2, "compute-hang", 1, 3, HANG_TIMEOUT_S, agent)
    v = inspect_json(agent, tmp_path / "out")
    assert (v["kind"], v["initiating_ranks"], v["phase"]) == ("hang", [1], "forward")
    assert " at step" not in v["reason"]  # no record was read: no step to name


@pytest.mark.slow
def test_stopped_rank_is_named_and_left_stopped(plain_job, tmp_path):
    agent, marks = plain_job(2, "stop", 0)
    pids = hung.wait_hung(marks, 2, "stop", 0, 3, HANG_TIMEOUT_S, agent)
    v = inspect_json(agent, tmp_path / "out")
    assert (v["kind"], v["initiating_ranks"]) == ("stopped_rank", [0])
    # inspect read it without resuming it
    assert Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_dead_rank_inside_the_launchers_monitor_window(plain_job, tmp_path):
    # torchrun reaps a dead rank and tears the group down at its next monitor tick (0.1 s by default, then
    # inspect finds no ranks: diagnose reads torchrun's report); until then the rank is an unreaped zombie
    agent, marks = plain_job(2, "dead", 1, monitor_interval=3600)
    hung.wait_hung(marks, 2, "dead", 1, 3, HANG_TIMEOUT_S, agent)
    v = inspect_json(agent, tmp_path / "out")
    assert (v["kind"], v["initiating_ranks"]) == ("dead_rank", [1])
    assert any("killed by SIGKILL" in e for e in v["evidence"])


@pytest.mark.slow
def test_two_nodes_agree_through_the_store(plain_job, tmp_path):
    port = hung.free_port()
    marks = tmp_path / "marks"
    run_id = f"insp-two-{os.getpid()}"
    # one rank per node: the exchange between the two nodes' inspects is the point, not the ranks
    a, _ = plain_job(1, "input-hang", 1, nnodes=2, node_rank=0, master_port=port, marks=marks, run_id=run_id)
    b, _ = plain_job(1, "input-hang", 1, nnodes=2, node_rank=1, master_port=port, marks=marks, run_id=run_id)
    hung.wait_hung(marks, 2, "input-hang", 1, 3, HANG_TIMEOUT_S, a)
    store = f"127.0.0.1:{hung.free_port()}"
    cmds = [[sys.executable, "-m", "rankwatch.watchdog.cli", "inspect", "--pid", str(p.pid), "--store", store,
             "--out", str(tmp_path / f"out-{i}"), "--json", "--store-timeout", "90"] for i, p in enumerate((b, a))]
    runs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    try:
        outs = [r.communicate(timeout=240) for r in runs]
    finally:
        for r in runs:
            if r.poll() is None:
                r.kill()
    assert [r.returncode for r in runs] == [0, 0], [o[1] for o in outs]
    docs = [json.loads(o[0]) for o in outs]
    for d in docs:
        assert (d["kind"], d["initiating_ranks"], d["phase"]) == ("hang", [1], "dataloader")
        assert sorted(d["ranks"]) == ["0", "1"]
        assert d["correlation"] == "decided by node 0 over 2 of 2 node(s)"
    assert docs[0]["reason"] == docs[1]["reason"] and docs[0]["evidence"] == docs[1]["evidence"]
    # a node that never answers: node 0 decides without it, and its ranks are the suspects
    alone = inspect_json(a, tmp_path / "out-alone", "--store", f"127.0.0.1:{hung.free_port()}", "--store-timeout", "3")
    assert alone["correlation"] == "decided by node 0 over 1 of 2 node(s)"
    assert alone["initiating_ranks"] == [1] and alone["ranks"]["1"]["state"] == "missing"


def wait_stepping(marks: Path, world: int, agent: subprocess.Popen, step: int = 5) -> None:
    """Until every rank of a healthy job has started ``step`` (each writes its mark as it starts a step)."""
    def stepping() -> bool:
        if agent.poll() is not None:
            raise AssertionError(f"torchrun ended (exit {agent.returncode}) before its ranks stepped")
        return all((marks / f"rank-{r}.step-{step}").exists() for r in range(world))

    hung.wait_until(stepping, HANG_TIMEOUT_S, f"{world} rank(s) to reach step {step}")


@pytest.mark.slow
def test_a_running_job_is_one_line_and_a_hung_one_beside_it_is_named(plain_job, tmp_path):
    """A healthy job (its ranks stepping, busy on the CPU, their stacks moving) is not a stall: one line, no
    bundle, exit 0. Beside a hung job it does not count against the answer: the hung one is named, exit 0."""
    healthy, healthy_marks = plain_job(2, "none", 0, marks=tmp_path / "healthy")
    stuck, stuck_marks = plain_job(2, "input-hang", 1, marks=tmp_path / "stuck")
    wait_stepping(healthy_marks, 2, healthy)
    res = run_cli("--pid", str(healthy.pid), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and ": running — two looks " in lines[0] and lines[0].endswith("no bundle"), res.stdout
    assert not (tmp_path / "out").exists()
    hung.wait_hung(stuck_marks, 2, "input-hang", 1, 3, HANG_TIMEOUT_S, stuck)
    res = run_cli("--pid", str(healthy.pid), "--pid", str(stuck.pid), "--out", str(tmp_path / "out"), "--json")
    assert res.returncode == 0, res.stderr
    docs = {d["agent_pid"] if d["kind"] == "running" else "stuck": d for d in json.loads(res.stdout)}
    assert sorted(docs, key=str) == sorted([healthy.pid, "stuck"], key=str), res.stdout
    running, verdict = docs[healthy.pid], docs["stuck"]
    assert running["schema"] == "rankwatch.running/1" and running["bundle"] is None
    assert sorted(running["looks"]["moved"]) == [0, 1]
    assert (verdict["kind"], verdict["initiating_ranks"], verdict["phase"]) == ("hang", [1], "dataloader")
    assert any(e.startswith("two looks ") and "CPU time flat" in e for e in verdict["evidence"])
    assert json.loads((Path(verdict["bundle"]) / "verdict.json").read_text())["initiating_ranks"] == [1]
    assert [p.parent.name for p in (tmp_path / "out").glob("*/incidents")] == [verdict["job_id"]]


@pytest.mark.slow
def test_a_job_carrying_another_jobs_run_id_does_not_hide_it(plain_job, tmp_path):
    """A one-rank job started under the hung job's run id (another user's, as root sees it; here the same
    user's in a separate process tree, which discovery tells apart the same way) is a job of its own: the
    hung job is still inspected by its run id and its rank named, the other is running."""
    run_id = f"insp-copied-{os.getpid()}"
    victim, marks = plain_job(2, "input-hang", 1, marks=tmp_path / "victim", run_id=run_id)
    copy, copy_marks = plain_job(1, "none", 0, marks=tmp_path / "copy", run_id=run_id)
    wait_stepping(copy_marks, 1, copy)
    hung.wait_hung(marks, 2, "input-hang", 1, 3, HANG_TIMEOUT_S, victim)
    res = run_cli("--job", run_id, "--out", str(tmp_path / "out"), "--json")
    assert res.returncode == 0, res.stderr
    docs = json.loads(res.stdout)
    kinds = sorted((d["kind"], d.get("agent_pid"), d["initiating_ranks"]) for d in docs)
    assert kinds == [("hang", None, [1]), ("running", copy.pid, [])], res.stdout
    hang = next(d for d in docs if d["kind"] == "hang")
    assert sorted(hang["ranks"]) == ["0", "1"] and hang["job_id"] == run_id


# -- flight-recorder dumps the job wrote ----------------------------------------------------------------
def test_flight_recorder_dumps_are_read_where_the_job_wrote_them(tmp_path):
    from rankwatch.watchdog.evidence.flight_recorder import fr_evidence
    from rankwatch.watchdog.evidence.inspect_capture import attach_fr_dumps
    from rankwatch.watchdog.observe.discover import Job, Proc, RankProc

    fixtures = Path(__file__).resolve().parents[2] / "fixtures" / "fr" / "nccl_hang"
    prefix = str(tmp_path / "trace_rank_")
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": prefix}
    uid = os.geteuid()
    ranks = [RankProc(100 + r, r, r, 4, Proc(100 + r, 99, "S", 1, (uid,) * 4), env) for r in range(4)]
    job = Job("j", 4, ranks, owner_uid=uid)
    for r in (0, 1):
        Path(f"{prefix}{r}").write_bytes((fixtures / f"rank-{r}.fr.json").read_bytes())
    os.symlink(fixtures / "rank-2.fr.json", f"{prefix}2")  # a symlink may point anywhere: not followed
    Path(f"{prefix}3").write_bytes(b"\x80\x04pickled")  # unpickling runs code: not read
    captures: dict = {}
    notes = attach_fr_dumps(job, captures)
    assert sorted(r for r, c in captures.items() if c.fr_trace is not None) == [0, 1]
    assert any("rank 2" in n and "cannot open" in n for n in notes)
    assert any("rank 3" in n and "pickled" in n for n in notes)
    assert fr_evidence(captures).facts is not None
