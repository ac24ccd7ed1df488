"""Tensor x data parallel with ``new_group`` subgroups, meant for two nodes of 4 ranks (world size 8).

``--tp 4``: TP groups {0-3} {4-7} (one per node), DP groups {0,4} {1,5} {2,6} {3,7} (across the nodes).
``--tp 2``: TP groups {0,1} {2,3} {4,5} {6,7}, DP groups {0,2,4,6} {1,3,5,7}.
A row-parallel linear layer: each rank multiplies its slice of the input and the TP group sums the partial
outputs with a differentiable ``all_reduce`` (forward and backward); DDP on the DP group averages the
gradients; a logging ``all_reduce`` over the world ends the step. Fault ``block-before-tp``:
``--fault-rank`` blocks (no CPU) just before its TP all_reduce at ``--fault-step``. Its TP peers then wait
in that all_reduce, the other TP groups finish forward and wait in DDP's gradient all_reduce for their DP
peers — which wait in the TP group. Only the faulty rank waits for nobody.
"""

from __future__ import annotations

import warnings

import _common
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HIDDEN = 64
# the autograd-aware all_reduce is deprecated in favour of functional collectives, which have no backward
warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)


class RowParallel(nn.Module):
    def __init__(self, tp: int, tp_group: dist.ProcessGroup, args, rank: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.part = nn.Linear(HIDDEN // tp, HIDDEN, bias=False)
        self.tp, self.group, self.args, self.rank = tp, tp_group, args, rank
        self.tp_index = rank % tp
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = HIDDEN // self.tp
        partial = self.part(x[:, self.tp_index * w : (self.tp_index + 1) * w])
        a = self.args
        if a.scenario == "block-before-tp" and self.rank == a.fault_rank and self.step == a.fault_step:
            _common.mark("block-before-tp", self.rank, self.step)
            _common.block_forever()
        return dfn.all_reduce(partial, group=self.group).tanh()


def main() -> int:
    p = _common.parser(__doc__, ("block-before-tp", "none"))
    p.add_argument("--tp", type=int, choices=(2, 4), default=4)
    args = p.parse_args()
    rank, world = _common.init(args)
    tp = args.tp
    tp_groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    dp_groups = [dist.new_group(list(range(i, world, tp))) for i in range(tp)]
    tp_group, dp_group = tp_groups[rank // tp], dp_groups[rank % tp]
    layer = RowParallel(tp, tp_group, args, rank)
    model = DistributedDataParallel(layer, process_group=dp_group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    # a TP group sees the same input; DP replicas see different data
    gen = torch.Generator().manual_seed(rank // tp)

    def step(i: int) -> torch.Tensor:
        layer.step = i
        x = torch.randn(16, HIDDEN, generator=gen)
        return _common.optimize(opt, model(x).pow(2).mean())

    return _common.run_steps(args, step)

if __name__ == "__main__":
    raise SystemExit(main())
