"""A rank that fails is reported in the phase it failed in, not "idle" after the exception unwound it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, sys
import torch
import rankwatch.hooks as rw
from rankwatch.hooks.record import read_record

assert rw.instrument()
path = os.path.join(os.environ["RANKWATCH_SHM_DIR"], "job", "rank-0.hb")

class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        raise RuntimeError("boom")

try:
    Boom()(torch.zeros(1, 2))
except RuntimeError:
    pass
print("forward:", read_record(path).phase)
try:
    with rw.phase("checkpoint"):
        raise OSError("disk gone")
except OSError:
    pass
print("declared:", read_record(path).phase)
with rw.phase("dataloader"):
    pass
print("after:", read_record(path).phase)
"""


def test_the_phase_an_exception_left_stays_on_record_until_the_next_phase(tmp_path):
    env = {"RANKWATCH_SHM_DIR": str(tmp_path), "RANKWATCH_JOB_ID": "job", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["forward: forward", "declared: checkpoint", "after: None"], out.stdout


EPOCH = r"""
import os
import torch
import rankwatch.hooks as rw
from rankwatch.hooks.record import read_record

assert rw.instrument()
path = os.path.join(os.environ["RANKWATCH_SHM_DIR"], "job", "rank-0.hb")
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
for _ in loader:
    pass
print("epoch end:", read_record(path).phase)
it = iter(loader)
next(it)
print("mid epoch:", read_record(path).phase)
"""


def test_the_end_of_an_epoch_is_a_normal_end_of_the_dataloader_phase(tmp_path):
    # StopIteration from the iterator ends every epoch: booked as a failure, the record would name
    # `dataloader` until the next phase began (a rank checkpointing after its epoch would look stuck there)
    env = {"RANKWATCH_SHM_DIR": str(tmp_path), "RANKWATCH_JOB_ID": "job", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", EPOCH], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["epoch end: None", "mid epoch: None"], out.stdout
