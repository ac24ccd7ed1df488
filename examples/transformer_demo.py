"""A small DDP transformer language model with injectable faults (``fault_injection.py``), for the
localisation-accuracy suite (``benchmarks/accuracy/``). Not designed around rankwatch: a standard
``nn.TransformerEncoder`` (causal mask), token embeddings, AdamW, a ``DataLoader`` with worker processes
(so data-side faults happen in a worker, not in the rank's own process), one metrics all-reduce per step.

    torchrun --nproc-per-node 4 -m rankwatch.hooks examples/transformer_demo.py --scenario input-hang --fault-rank 2

Tiny dims (d_model 64, 2 layers, sequence 32, batch 8): ~10–50 ms per step on one CPU thread.
Scenarios: balanced, compute-straggler (``--straggler-rank``) and every fault of ``fault_injection.FAULTS``
at ``--fault-step`` on ``--fault-rank``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

try:
    import fault_injection
except ImportError:  # imported from elsewhere: the module lives beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fault_injection

SCENARIOS = (fault_injection.NO_FAULT, *fault_injection.STRAGGLERS, *fault_injection.FAULTS)


class Tokens(Dataset):
    """Batch ``i`` is item ``i`` (the loader has ``batch_size=None``): random token sequences with a
    learnable rule (each token is the previous one plus one, mod the vocabulary), per-rank seed."""

    def __init__(self, args: argparse.Namespace, rank: int, inj: fault_injection.Injector) -> None:
        self.args = args
        self.rank = rank
        self.inj = inj
        self.length = inj.data_len(1 << 30)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.inj.in_data(index)  # in a DataLoader worker when --workers > 0
        a = self.args
        gen = torch.Generator().manual_seed(self.rank * 1_000_003 + index)
        start = torch.randint(0, a.vocab, (a.batch_size, 1), generator=gen)
        seq = (start + torch.arange(a.seq_len + 1)) % a.vocab
        return seq[:, :-1], seq[:, 1:]


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) / math.sqrt(d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=SCENARIOS, default="balanced")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes per rank")
    p.add_argument("--straggler-rank", type=int, default=1)
    p.add_argument("--fault-rank", type=int, default=None, help="rank that faults (default: --straggler-rank)")
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--compute-extra-matmuls", type=int, default=40, help="compute-straggler's extra work per step")
    p.add_argument("--checkpoint-budget-s", type=float, default=1.0, help="checkpoint-hang's declared budget")
    p.add_argument("--pg-timeout-s", type=float, default=600.0, help="process group timeout")
    p.add_argument("--log-every", type=int, default=0)
    args = p.parse_args(argv)
    if args.fault_rank is None:
        args.fault_rank = args.straggler_rank
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank = dist.get_rank()
    torch.manual_seed(0)
    inj = fault_injection.Injector.from_args(args, rank)
    model = TinyLM(args.vocab, args.d_model, args.heads, args.layers, args.seq_len)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    inj.attach(model, opt)
    loader = DataLoader(
        Tokens(args, rank, inj),
        batch_size=None,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    batches = iter(loader)
    loss_sum = torch.zeros(1)
    ran_out = False
    for step in range(args.steps):
        inj.at_step_start(step)
        try:
            tokens, targets = next(batches)
        except StopIteration:  # uneven-data: this rank's loader ran out
            inj.data_exhausted(step)
            ran_out = True
            break
        logits = ddp(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        loss_sum.copy_(loss.detach())
        inj.metrics_all_reduce(step, loss_sum)
        inj.after_step(step)
        if args.log_every and rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss_sum.item() / dist.get_world_size():.4f}", flush=True)
    del batches  # DataLoader workers stop here
    if not ran_out:  # a rank whose data ran out leaves early and exits normally
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
