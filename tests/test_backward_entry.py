"""Where the backward phase is timed: torch's engine entry, gated on ``accumulate_grad`` (instrument.backward_entry).

A real process with torch: ``loss.backward()``, ``torch.autograd.backward``, a ``backward`` the script bound
before the hook was installed are each one backward phase; ``torch.autograd.grad`` (the same engine entry,
``accumulate_grad=False``) is none, and gradients come out as without the hook. Slow: imports torch.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
import torch
from torch.autograd import backward as bound_early  # before the hook is installed
from rankwatch.hooks import api, instrument
from rankwatch.hooks.instrument import backward_entry

assert instrument()
t = api.current()
x = torch.ones(3, requires_grad=True)
seen = {"entry": backward_entry(torch.autograd), "core": type(t).__mro__[1].__name__}
for name, run in (
    ("tensor", lambda: (x * 2).sum().backward()),
    ("autograd", lambda: torch.autograd.backward((x * 3).sum())),
    ("bound_early", lambda: bound_early((x * 4).sum())),
    ("grad", lambda: seen.__setitem__("g", torch.autograd.grad((x * 5).sum(), x)[0].tolist())),
):
    n = t._ev_n
    run()
    seen[name] = t._ev_n - n
seen["x_grad"] = x.grad.tolist()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("impl", ["c", "python"])
def test_each_backward_is_one_phase_and_grad_none(procs, shm_dir, impl):
    env = dict(os.environ, RANKWATCH_SHM_DIR=str(shm_dir), RANKWATCH_JOB_ID="bwentry", RANKWATCH_HOOK_IMPL=impl)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RANKWATCH_DISABLE"):
        env.pop(key, None)
    res = procs.run([sys.executable, "-c", SCRIPT], timeout=120, env=env, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["entry"] == ["_engine_run_backward", True]  # torch 2.13 (the pinned wheel): the engine entry
    assert (seen["tensor"], seen["autograd"], seen["bound_early"]) == (2, 2, 2)  # an enter and an exit each
    assert seen["grad"] == 0
    assert seen["g"] == [5.0, 5.0, 5.0] and seen["x_grad"] == [9.0, 9.0, 9.0]  # 2 + 3 + 4, as without the hook


def test_a_backward_that_cannot_be_proven_to_call_the_entry_is_wrapped_itself():
    """An older torch (``backward`` calling the engine directly), no entry, or a ``backward`` someone else
    replaced (its globals are not the module's): the hook wraps ``backward``, ungated."""
    from rankwatch.hooks.instrument import backward_entry

    def module(body: str, entry: bool = True) -> types.ModuleType:
        mod = types.ModuleType("fake_autograd")
        if entry:
            exec("def _engine_run_backward(t, *a, **k):\n    return t\n", vars(mod))
        exec(f"def backward(t):\n    {body}\n", vars(mod))
        return mod

    assert backward_entry(module("_engine_run_backward(t, accumulate_grad=True)")) == ("_engine_run_backward", True)
    assert backward_entry(module("run_backward(t)")) == ("backward", False)  # older torch
    assert backward_entry(module("_engine_run_backward(t)")) == ("backward", False)  # no accumulate_grad
    assert backward_entry(module("_engine_run_backward(t, accumulate_grad=True)", entry=False)) == ("backward", False)
    replaced = module("_engine_run_backward(t, accumulate_grad=True)")
    ns: dict = {}
    exec("def backward(t):\n    _engine_run_backward(t, accumulate_grad=True)\n", ns)
    replaced.backward = ns["backward"]  # a profiler's or a user's own backward
    assert backward_entry(replaced) == ("backward", False)
