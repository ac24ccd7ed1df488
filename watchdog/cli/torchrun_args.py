"""Rewriting a torchrun command line so every rank starts through ``-m rankwatch.hooks``.

torchrun's own argument parser finds the training script; the hook module is inserted right before it,
so the user's torchrun options and script arguments pass through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


@dataclass(frozen=True)
class TorchrunCommand:
    args: list[str]  # arguments for `python -m torch.distributed.run`
    rdzv_id: str | None
    nnodes: str
    node_rank: int
    master_addr: str | None
    master_port: int | None
    nproc_per_node: str


def inject_hooks(torchrun_args: list[str]) -> TorchrunCommand:
    from torch.distributed.run import get_args_parser

    if not torchrun_args:
        raise UserError("no torchrun arguments after '--' (e.g. -- --nproc-per-node 4 train.py)")
    parser = get_args_parser()
    try:
        parsed = parser.parse_args(torchrun_args)
    except SystemExit as exc:
        raise UserError(f"torchrun rejected the arguments: {' '.join(torchrun_args)}") from exc
    if parsed.no_python:
        raise UserError("--no-python runs a non-Python program: rankwatch's hook cannot be injected")
    tail = [parsed.training_script, *parsed.training_script_args]
    cut = None
    for i in range(len(torchrun_args) - len(tail), -1, -1):
        if torchrun_args[i:] == tail:
            cut = i
            break
    if cut is None:  # pragma: no cover - argparse always leaves the script and its args at the end
        raise UserError("cannot find the training script in the torchrun arguments")
    head = torchrun_args[:cut]
    if parsed.module:
        head = [a for a in head if a not in ("-m", "--module")]
        new = [*head, "-m", "rankwatch.hooks", "-m", *tail]
    else:
        new = [*head, "-m", "rankwatch.hooks", *tail]
    try:
        node_rank = int(parsed.node_rank)
    except (TypeError, ValueError):
        node_rank = 0
    rdzv = parsed.rdzv_id if parsed.rdzv_id not in (None, "", "none") else None
    return TorchrunCommand(
        args=new,
        rdzv_id=rdzv,
        nnodes=str(parsed.nnodes),
        node_rank=node_rank,
        master_addr=parsed.master_addr,
        master_port=parsed.master_port,
        nproc_per_node=str(parsed.nproc_per_node),
    )
