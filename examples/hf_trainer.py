"""A Hugging Face Trainer job checkpointed by shardckpt (runs on CPU; no download: the model is built from a config).

    python examples/hf_trainer.py --out runs/hf                      # one process
    torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/hf # 2 ranks (gloo on CPU)
    ... --remote s3://bucket/hf                                      # and a copy in S3 (AWS_ENDPOINT_URL etc.)

Kill it (SIGKILL, or SIGTERM to save first) and start it again with the same
command: it resumes from the newest committed step, at any world size. It
prints one line at the end with the step it resumed and the step it reached.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import shardckpt
from shardckpt.integrations.hf import ShardckptTrainer


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences (a stand-in for a tokenised corpus)."""

    def __init__(self, n: int = 512, seq: int = 32, vocab: int = 128) -> None:
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/hf-trainer")
    p.add_argument("--remote", default=os.environ.get("SHARDCKPT_REMOTE"))
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    a = p.parse_args()

    args = TrainingArguments(
        output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=8, learning_rate=1e-3,
        save_strategy="steps", save_steps=a.save_steps, save_total_limit=3, logging_steps=10,
        report_to="none", use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(a.out, "shardckpt"), remote=a.remote, keep_last=3,
                                  remote_keep_last=3)
    trainer = ShardckptTrainer(model=model, args=args, train_dataset=Tokens(), checkpointer=ckpt)
    trainer.train(resume_from_checkpoint=True)  # the newest live step, local or remote; fresh when none
    if trainer.is_world_process_zero():
        print(f"resumed step {trainer.resumed_step}, reached step {trainer.state.global_step}"
              f"{' (preempted: the step is committed)' if trainer.preempted else ''}", flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
