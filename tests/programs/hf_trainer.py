"""A Hugging Face Trainer job (tiny GPT-2 from a config, synthetic tokens) checkpointed by ShardckptTrainerMixin.

Run under torchrun (gloo, CPU). The Trainer is a subclass that overrides
``compute_loss`` through the mixin and records, per rank, the sample ids of
every micro-batch (``--samples``) so that tests can check the data position.
Writes on rank 0 at the end: ``--history`` (the Trainer's log history, which
a resumed run restores from the checkpoint) and ``--weights`` (``{step:
state_dict}``: every step with ``--every-step-weights``, else the last).
``--step-sleep`` slows each step so that a test can kill or preempt the job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from plan_check import install as check_plans  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import shardckpt
from shardckpt.integrations.hf import ShardckptTrainerMixin

VOCAB, SEQ, SAMPLES = 32, 8, 96


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i], "idx": torch.tensor(i)}


class RecordingTrainer(ShardckptTrainerMixin, Trainer):
    """A Trainer subclass of the usual kind: its own compute_loss (here it also records the samples)."""

    samples_path: str | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        idx = inputs.pop("idx")
        if self.samples_path:
            with open(self.samples_path, "a") as f:
                f.write(json.dumps({"step": self.state.global_step + 1, "idx": idx.tolist()}) + "\n")
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


class Weights(TrainerCallback):
    def __init__(self, every_step: bool, sleep: float) -> None:
        self.every_step, self.sleep, self.saved = every_step, sleep, {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_step:
            self.saved[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if self.sleep:
            time.sleep(self.sleep)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--remote", default=None)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--per-device", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--save-steps", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--lr-schedule", default="constant", help="lr_scheduler_type (one that does not depend on max_steps "
                   "when runs of different lengths are compared, e.g. constant_with_warmup)")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--samples", default=None, help="prefix; rank r appends to PREFIX.rank<r>.jsonl")
    p.add_argument("--history", default=None)
    p.add_argument("--weights", default=None)
    p.add_argument("--every-step-weights", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    check_plans(a.out, "hf")

    args = TrainingArguments(
        output_dir=a.out, max_steps=a.max_steps, per_device_train_batch_size=a.per_device,
        gradient_accumulation_steps=a.accum, learning_rate=3e-3, lr_scheduler_type=a.lr_schedule,
        warmup_steps=a.warmup_steps,
        save_strategy="steps", save_steps=a.save_steps, logging_steps=1, report_to="none", use_cpu=True,
        seed=0, remove_unused_columns=False, disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False, ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(a.out, "ckpt"), remote=a.remote, keep_last=50,
                                  remote_keep_last=50)
    weights = Weights(a.every_step_weights, a.step_sleep)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Tokens(), checkpointer=ckpt, callbacks=[weights])
    rank = int(os.environ.get("RANK", "0"))
    if a.samples:
        trainer.samples_path = f"{a.samples}.rank{rank}.jsonl"
    trainer.train(resume_from_checkpoint=True)
    print(f"rank {rank}: resumed {trainer.resumed_step} preempted {trainer.preempted} "
          f"global_step {trainer.state.global_step} accum {trainer.args.gradient_accumulation_steps} "
          f"model {type(trainer.model_wrapped).__name__}", flush=True)
    if rank == 0:
        if a.history:
            with open(a.history, "w") as f:
                json.dump(trainer.state.log_history, f)
        if a.weights:
            final = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            torch.save(weights.saved if a.every_step_weights else {trainer.state.global_step: final}, a.weights)
    ckpt.close()


if __name__ == "__main__":
    main()
