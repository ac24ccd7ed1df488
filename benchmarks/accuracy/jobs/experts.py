"""Expert parallel (MoE): one expert per rank; tokens go to their experts and come back by two
``all_to_all_single`` calls per step (dispatch, combine), a dense layer under DDP around them, a logging
``all_reduce`` at the end. Fault ``expert-spin``: ``--fault-rank``'s expert spins in its computation at
``--fault-step``, between dispatch and combine: every other rank waits for it in the combine all_to_all.
"""

from __future__ import annotations

import _common
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

HIDDEN = 32
TOKENS_PER_PEER = 4


class MoE(nn.Module):
    def __init__(self, args, rank: int, world: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.expert = nn.Linear(HIDDEN, HIDDEN)  # this rank's expert (not averaged across ranks)
        self.args, self.rank, self.world, self.step = args, rank, world, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        routed = torch.empty_like(h)
        dist.all_to_all_single(routed, h.detach().contiguous())  # dispatch: rows i*k.. go to rank i
        a = self.args
        if a.scenario == "expert-spin" and self.rank == a.fault_rank and self.step == a.fault_step:
            _common.mark("expert-spin", self.rank, self.step)
            _common.spin_forever()
        out = self.expert(routed)
        back = torch.empty_like(out)
        dist.all_to_all_single(back, out.detach().contiguous())  # combine
        return h + back


def main() -> int:
    p = _common.parser(__doc__, ("expert-spin", "none"))
    args = p.parse_args()
    rank, world = _common.init(args)
    moe = MoE(args, rank, world)
    # the expert is local: only the dense layer is data parallel
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(moe, ["expert.weight", "expert.bias"])
    model = DistributedDataParallel(moe)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)

    def step(i: int) -> torch.Tensor:
        moe.step = i
        x = torch.randn(TOKENS_PER_PEER * world, HIDDEN, generator=gen)
        return _common.optimize(opt, model(x).pow(2).mean())

    return _common.run_steps(args, step)

if __name__ == "__main__":
    raise SystemExit(main())
