"""The hook never raises into training and only the initialising process writes."""

from __future__ import annotations

import os
import subprocess
import sys

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


def run_hooked(tmp_path, script: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = dict(os.environ, **env_extra)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-m", "rankwatch.hooks", str(path)], env=env, capture_output=True, text=True, timeout=120
    )


def test_unusable_shm_dir_warns_once_and_training_runs(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    result = run_hooked(tmp_path, TRAIN, {"RANKWATCH_SHM_DIR": str(blocker / "sub"), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    assert "trained 8" in result.stdout
    assert result.stderr.count("rankwatch: cannot create the shm record") == 1


def test_record_deleted_mid_run_does_not_disturb_training(tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(tmp_path, TRAIN, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j", "DELETE_RECORD": "1"})
    assert result.returncode == 0, result.stderr
    assert "trained 8" in result.stdout
    assert "Traceback" not in result.stderr


def test_zero_code_instrumentation_of_a_plain_loop_records_every_step(tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(tmp_path, TRAIN, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.steps_done == 8 and rec.exited_normally and not rec.crashed
    for s in rec.recent_steps:
        assert {"dataloader", "forward", "backward", "optimizer"} <= set(s.phases_ms)


def test_script_exception_marks_the_rank_crashed_and_still_propagates(tmp_path):
    shm = tmp_path / "shm"
    script = "import torch\nraise RuntimeError('boom')\n"
    result = run_hooked(tmp_path, script, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 1 and "RuntimeError: boom" in result.stderr
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.crashed


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


def test_forward_hooks_move_from_every_module_to_the_model_after_the_first_step(tmp_path):
    shm = tmp_path / "shm"
    result = run_hooked(tmp_path, PROMOTE, {"RANKWATCH_SHM_DIR": str(shm), "RANKWATCH_JOB_ID": "j"})
    assert result.returncode == 0, result.stderr
    # one global pre-hook during the first step, none afterwards (inner modules then cost nothing)
    assert "GLOBAL [1, 0, 0, 0, 0]" in result.stdout, result.stdout
    rec = read_record(str(shm / "j" / "rank-0.hb"))
    assert rec.steps_done == 4
    for s in rec.recent_steps:  # the model's forward is still timed after the switch
        assert s.phases_ms.get("forward", 0) > 0
