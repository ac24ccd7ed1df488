"""Where the backward phase is timed: torch's C engine (or its Python entry), gated on ``accumulate_grad``
(instrument.backward_entry).

A real process with torch: ``loss.backward()``, ``torch.autograd.backward``, a ``backward`` the script bound
before the hook was installed are each one backward phase; ``torch.autograd.grad`` (the same engine entry,
``accumulate_grad=False``) is none, gradients come out as without the hook, and an engine callback queued
during a backward (DDP's, FSDP's) still runs. Slow: imports torch.
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
from torch.autograd.variable import Variable

base = type(Variable._execution_engine)
assert instrument()
t = api.current()
x = torch.ones(3, requires_grad=True)
seen = {"entry": backward_entry(torch.autograd), "core": type(t).__mro__[1].__name__}
engine = Variable._execution_engine
seen["engine"] = [type(engine) is not base, isinstance(engine, base),
                  engine.run_backward.__rankwatch_wrapped__.__self__ is not engine]
# an engine callback queued from inside a backward (as DDP and FSDP queue theirs) still runs at its end
ran = []
y = torch.ones(2, requires_grad=True)


def with_callback():
    z = y * 2
    z.register_hook(lambda g: Variable._execution_engine.queue_callback(lambda: ran.append(1)))
    z.sum().backward()


for name, run in (
    ("tensor", lambda: (x * 2).sum().backward()),
    ("autograd", lambda: torch.autograd.backward((x * 3).sum())),
    ("bound_early", lambda: bound_early((x * 4).sum())),
    ("grad", lambda: seen.__setitem__("g", torch.autograd.grad((x * 5).sum(), x)[0].tolist())),
    ("callback", with_callback),
):
    n = t._ev_n
    run()
    seen[name] = t._ev_n - n
seen["x_grad"] = x.grad.tolist()
seen["ran"] = ran
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
    assert seen["entry"] == ["engine", True]  # torch 2.13 (the pinned wheel): the C engine
    assert seen["engine"] == [True, True, True]  # a subclass instance in its place, torch's own method inside
    assert (seen["tensor"], seen["autograd"], seen["bound_early"]) == (2, 2, 2)  # an enter and an exit each
    assert seen["callback"] == 2 and seen["ran"] == [1]
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


def test_the_c_engine_is_wrapped_only_where_a_stand_in_is_provably_the_same_engine():
    """The engine tier needs the entry to call ``Variable._execution_engine.run_backward`` through its
    globals and the engine to be torch's stateless C object (any instance drives the one engine); a Python
    engine object (someone else's), an entry that does not name it, no ``Variable``: the Python entry."""
    from rankwatch.hooks.instrument import backward_entry
    from torch.autograd.variable import Variable

    c_engine = type(Variable._execution_engine)  # torch's own type, also once the hook put a subclass in place
    while c_engine.__module__ != "torch._C":
        c_engine = c_engine.__base__

    def module(engine: object, body: str = "Variable._execution_engine.run_backward(t)", holder: bool = True):
        mod = types.ModuleType("fake_autograd")
        if holder:
            vars(mod)["Variable"] = type("Variable", (), {"_execution_engine": engine})
        exec(f"def _engine_run_backward(t, *a, **k):\n    return {body}\n", vars(mod))
        exec("def backward(t):\n    _engine_run_backward(t, accumulate_grad=True)\n", vars(mod))
        return mod

    class PyEngine:  # a Python object standing in for the engine: it has state of its own
        def run_backward(self, *a, **k):
            return a

    assert backward_entry(module(c_engine())) == ("engine", True)
    assert backward_entry(module(PyEngine())) == ("_engine_run_backward", True)
    assert backward_entry(module(c_engine(), body="t")) == ("_engine_run_backward", True)
    assert backward_entry(module(c_engine(), holder=False)) == ("_engine_run_backward", True)
