"""Hugging Face ``transformers.Trainer`` on CPU/gloo, a tiny GPT-2 built from a config (no download), under
rankwatch's zero-code hook:

    rankwatch run --stall-timeout 5 -- --nproc-per-node 2 examples/works_with/train_hf_trainer.py
    RW_FAULT=input-hang RW_FAULT_RANK=1 RW_FAULT_STEP=3 rankwatch run … (rank 1's dataset blocks at batch 3)

Nothing here knows about rankwatch: the Trainer's DataLoader, the model's forward, ``loss.backward()`` and
the optimizer step are seen by the hook's automatic points. Faults: ``faults.py``.
"""

from __future__ import annotations

import os
import tempfile

import torch
from faults import FaultyData, fault_in_forward, injector
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 64, 16


class Tokens(FaultyData):
    """Sequences of consecutive tokens (mod VOCAB): the model can learn them."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x, _ = super().__getitem__(index)
        ids = (int(x[0].abs() * 10) + torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    inj = injector()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM"))
    fault_in_forward(model, inj)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="rw-hf-"),
        per_device_train_batch_size=8,
        max_steps=int(os.environ.get("RW_STEPS", "40")),
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        eval_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Tokens(inj, batch_size=8)).train()


if __name__ == "__main__":
    main()
