"""The hook never raises into training and only the initialising process writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rankwatch.hooks.record import read_record

TRAIN = r"""
import os, sys, time, torch
from torch import nn
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8)
for step, (x, y) in enumerate(data):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 2 and os.environ.get("DELETE_RECORD"):
        import shutil; shutil.rmtree(os.environ["RANKWATCH_SHM_DIR"])
print("trained", step + 1, flush=True)
"""


# One interpreter imports torch once and forks a fresh child per run: a run is then a real
# ``python -m rankwatch.hooks script`` exit (excepthook, atexit, exit code) without a 1 s torch import each.
ZYGOTE = r"""
import json, os, sys
import torch  # noqa: F401  (what every run would import first)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
            os.dup2(os.open(name, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["rankwatch.hooks", *req["args"]]
        break
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
else:
    sys.exit(0)
import runpy
runpy.run_module("rankwatch.hooks", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def zygote():
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    yield proc
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def run_hooked(zygote, tmp_path):
    def run(script: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
        path = tmp_path / "train.py"
        path.write_text(script)
        env = dict(os.environ, **env_extra)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        out, err = tmp_path / "stdout", tmp_path / "stderr"
        req = {"env": env, "cwd": str(tmp_path), "args": [str(path)], "stdout": str(out), "stderr": str(err)}
        zygote.stdin.write(json.dumps(req) + "\n")
        zygote.stdin.flush()
        code = int(zygote.stdout.readline())
        return subprocess.CompletedProcess(req["args"], code, out.read_text(), err.read_text())

    return run


def test_unusable_shm_dir_warns_once_and_training_runs(run_hooked, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    result = run_hooked(TRAIN, {"RANKWATCH_SHM_DIR": str(blocker / "sub"), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    assert "trained 8" in result.stdout
    assert result.stderr.count("rankwatch: cannot create the shm record") == 1


def test_record_deleted_mid_run_does_not_disturb_training(run_hooked, tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(TRAIN, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j", "DELETE_RECORD": "1"})
    assert result.returncode == 0, result.stderr
    assert "trained 8" in result.stdout
    assert "Traceback" not in result.stderr


def test_zero_code_instrumentation_of_a_plain_loop_records_every_step(run_hooked, tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(TRAIN, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.steps_done == 8 and rec.exited_normally and not rec.crashed
    for s in rec.recent_steps:
        assert {"dataloader", "forward", "backward", "optimizer"} <= set(s.phases_ms)


def test_script_exception_marks_the_rank_crashed_and_still_propagates(run_hooked, tmp_path):
    shm = tmp_path / "shm"
    script = "import torch\nraise RuntimeError('boom')\n"
    result = run_hooked(script, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.crashed



def test_a_helper_thread_dying_is_kept_in_the_record_and_training_goes_on(run_hooked, tmp_path):
    """The first exception that ends a thread other than the training thread reaches the record (the
    daemon's ``thread_died`` rung); the thread's own traceback is still printed and the script is untouched."""
    shm = tmp_path / "shm"
    script = ("import threading\n"
              "def produce():\n    raise ValueError('corrupt shard 7')\n"
              "t = threading.Thread(target=produce, name='prefetch'); t.start(); t.join()\n"
              "t = threading.Thread(target=produce, name='second'); t.start(); t.join()\n"
              "print('still training', flush=True)\n")
    result = run_hooked(script, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0 and "still training" in result.stdout
    assert "ValueError: corrupt shard 7" in result.stderr
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.thread_error == "thread prefetch: ValueError: corrupt shard 7"  # the first one, kept
    assert not rec.crashed and rec.exited_normally


FORK = r"""
import os, time
import multiprocessing as mp
import rankwatch.hooks as rw
from rankwatch.hooks.record import read_record

def worker(q):
    import rankwatch.hooks as rw2
    q.put(rw2.init())

if __name__ == "__main__":
    rw.init()
    path = os.path.join(os.environ["RANKWATCH_SHM_DIR"], "j", "rank-0.hb")
    before = read_record(path).transitions
    pid = os.fork()
    if pid == 0:
        with rw.phase("child-work"):
            pass
        rw.step()
        os._exit(0)
    os.waitpid(pid, 0)
    after = read_record(path)
    print("child-wrote" if after.transitions != before or after.steps_done else "child-silent", flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=worker, args=(q,))
    p.start()
    print("spawn-init", q.get(timeout=60))
    p.join()
    with rw.phase("parent-work", budget_s=5):
        pass
    print("parent-transitions", read_record(path).transitions - before)
"""


def test_forked_and_spawned_children_never_write(tmp_path):
    shm = tmp_path / "shm"
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm), RANKWATCH_JOB_ID="j")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "child-silent" in result.stdout
    assert "spawn-init False" in result.stdout
    assert "parent-transitions 2" in result.stdout


PROMOTE = r"""
import torch
import torch.nn.modules.module as mm
from torch import nn
model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)], nn.Linear(8, 1))
loss_fn = nn.MSELoss()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
calls = [len(mm._global_forward_pre_hooks)]
for step in range(4):
    loss = loss_fn(model(torch.randn(4, 8)), torch.randn(4, 1))
    opt.zero_grad(); loss.backward(); opt.step()
    calls.append(len(mm._global_forward_pre_hooks))
print("GLOBAL", calls, flush=True)
"""


def test_forward_hooks_move_from_every_module_to_the_model_after_the_first_step(run_hooked, tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(PROMOTE, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    # one global pre-hook during the first step, none afterwards (inner modules then cost nothing)
    assert "GLOBAL [1, 0, 0, 0, 0]" in result.stdout, result.stdout
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.steps_done == 4
    for s in rec.recent_steps:  # the model's forward is still timed after the switch
        assert s.phases_ms.get("forward", 0) > 0


DDP_FORWARD = r"""
import copy, io, os, tempfile, torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
ddp = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(4):
    loss = nn.functional.mse_loss(ddp(torch.randn(4, 8)), torch.randn(4, 1))
    opt.zero_grad(); loss.backward(); opt.step()
print("HOOKS", len(ddp._forward_pre_hooks) + len(ddp._forward_hooks), "forward" in vars(ddp), flush=True)
ema = copy.deepcopy(ddp.module)  # an EMA copy: a plain module, nothing of the hook in it
buf = io.BytesIO(); torch.save(ddp.module, buf); buf.seek(0)
print("COPIES", type(torch.load(buf, weights_only=False)).__name__, type(ema).__name__, flush=True)
try:
    ddp(torch.randn(4, 3))  # a shape error inside DDP's forward reaches the script unchanged
except RuntimeError:
    print("RAISED", flush=True)
loss = nn.functional.mse_loss(ddp(torch.randn(4, 8)), torch.randn(4, 1))
opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
"""


def test_ddp_forward_is_timed_without_module_hooks_after_the_first_step(run_hooked, tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(DDP_FORWARD, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    # no hooks and no instance attribute on the DDP model: Module._call_impl keeps its fast path
    assert "HOOKS 0 False" in result.stdout, result.stdout
    assert "COPIES Sequential Sequential" in result.stdout and "RAISED" in result.stdout, result.stdout
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.steps_done == 5 and rec.phase is None
    for s in rec.recent_steps:  # DDP's forward stays timed after the switch, the failed one included
        assert s.phases_ms.get("forward", 0) > 0, s
