"""The hook on a torch.compile'd model: after the first optimizer step the hook normally swaps its global
module hooks for per-module ones (cheaper); dynamo guards compiled code on the number of global hooks, so
that swap recompiled every compiled graph at step 1 — minutes on a large model, past the stall timeout
(the accuracy suite's ``compile`` class was named a shared hang at step 1 before its fault fired). With
something compiled the global hooks stay, and the compiled forward runs again without a recompile."""

from __future__ import annotations

# torch and dynamo are imported in the test, not here: every xdist worker imports each test module to collect
# it, and these two are ~3 s of CPU that only the worker running the test needs


class _Tracker:
    def __init__(self) -> None:
        self.entered = 0

    def enter(self, *args: object) -> None:
        self.entered += 1

    def exit(self, *args: object) -> None:
        pass


def test_promotion_keeps_the_global_hooks_when_something_is_compiled() -> None:
    import torch
    import torch._dynamo
    import torch._dynamo.utils
    from rankwatch.hooks.instrument import OutermostForward
    from torch import nn

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    compiled = torch.compile(model, backend="eager")
    tracker = _Tracker()
    forward = OutermostForward(tracker, nn.modules.module)
    forward.install()
    try:
        x = torch.ones(2, 4)
        compiled(x)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs >= 1
        forward.promote()
        assert forward.global_handles, "the global hooks were removed under compiled code"
        before = tracker.entered
        compiled(x)
        assert tracker.entered > before  # forward is still timed
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile
    finally:
        for h in forward.global_handles:
            h.remove()
        torch._dynamo.reset()
