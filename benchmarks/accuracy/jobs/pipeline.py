"""Pipeline parallel (GPipe): one stage per rank, activations forward and gradients back by ``dist.send`` /
``dist.recv``, ``--micro-batches`` micro-batches per step, then a logging ``all_reduce`` of the loss.

By design the stages issue different numbers of p2p ops per step: the first stage only sends activations
and receives gradients, the last only receives activations and sends gradients, the middle ones do both —
so a per-group op counter says nothing about who is behind. Fault ``stage-spin``: ``--fault-rank``'s stage
spins in its forward of the first micro-batch at ``--fault-step`` and never sends; every other stage then
waits, directly (its recv from that stage) or through a chain of recvs, or in the logging all_reduce.
Fault ``wrong-peer`` (issue 44 item 5, a class outside the suite): at ``--fault-step`` stage ``--fault-rank``
(2 or more) posts the recv of its first micro-batch's activation from stage ``rank - 2`` instead of
``rank - 1``: that stage never sends to it, and the stages around it wait for one another in a ring.
"""

from __future__ import annotations

import _common
import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 64


def main() -> int:
    p = _common.parser(__doc__, ("stage-spin", "wrong-peer", "none"))
    p.add_argument("--micro-batches", type=int, default=4)
    args = p.parse_args()
    rank, world = _common.init(args)
    stage = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
    opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
    first, last = rank == 0, rank == world - 1
    gen = torch.Generator().manual_seed(1234)  # the same data on every stage: only the first reads it

    def step(i: int) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        inputs, outputs = [], []
        loss_sum = torch.zeros(1)
        for mb in range(args.micro_batches):  # forward of every micro-batch (GPipe fill)
            x = torch.randn(8, HIDDEN, generator=gen)
            if not first:
                x = torch.empty(8, HIDDEN)
                src = rank - 1
                if args.scenario == "wrong-peer" and rank == args.fault_rank and i == args.fault_step and mb == 0:
                    _common.mark("wrong-peer", rank, i)
                    src = rank - 2  # an off-by-one in the schedule: the stage before the previous one
                dist.recv(x, src=src)
            x.requires_grad_(not first)
            if args.scenario == "stage-spin" and rank == args.fault_rank and i == args.fault_step and mb == 0:
                _common.mark("stage-spin", rank, i)
                stage.register_forward_pre_hook(lambda _m, _a: _common.spin_forever())
            y = stage(x)
            inputs.append(x)
            outputs.append(y)
            if last:
                loss_sum += y.pow(2).mean().detach()
            else:
                dist.send(y.detach(), dst=rank + 1)
        for mb in reversed(range(args.micro_batches)):  # backward of every micro-batch (GPipe drain)
            if last:
                outputs[mb].pow(2).mean().backward()
            else:
                g = torch.empty(8, HIDDEN)
                dist.recv(g, src=rank + 1)
                outputs[mb].backward(g)
            if not first:
                dist.send(inputs[mb].grad, dst=rank - 1)
        opt.step()
        return loss_sum  # the last stage's; the shared loop all-reduces it for logging on every stage

    return _common.run_steps(args, step)

if __name__ == "__main__":
    raise SystemExit(main())
