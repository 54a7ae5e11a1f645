"""A custom training loop on accelerate, checkpointed with accelerator_state (run under torchrun, CPU/gloo).

The data comes from a torchdata StatefulDataLoader with a ResumableSampler
and ``--workers`` worker processes; the model, optimizer and scheduler are
prepared by accelerate; a counter is registered with
``register_for_checkpointing``. Each rank appends one line per micro-batch to
``--samples PREFIX.rank<r>.jsonl`` (step, sample ids, loss as float.hex) and
rank 0 writes the weights of step ``--weights-step`` (default: the last) to ``--weights``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torchdata.stateful_dataloader import StatefulDataLoader

import shardckpt
from shardckpt.integrations.hf import accelerator_state, apply_plan

SAMPLES = 96


class Points(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Counter:
    """A user object registered with accelerator.register_for_checkpointing."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--samples", required=True)
    p.add_argument("--weights", default=None)
    p.add_argument("--weights-step", type=int, default=None,
                   help="the step whose weights --weights gets (default: last)")
    a = p.parse_args()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accum)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    # The sampler gives each rank its part of one global order: the loader is not prepared (not re-sharded).
    sampler = shardckpt.ResumableSampler(SAMPLES, batch_size=a.micro, seed=0, accum_steps=a.accum)
    loader = StatefulDataLoader(Points(), batch_size=a.micro, sampler=sampler, num_workers=a.workers,
                                generator=torch.Generator().manual_seed(0))

    ckpt = shardckpt.Checkpointer(local_dir=a.ckpt, micro_batch_size=a.micro, grad_accum_steps=a.accum, keep_last=50)
    state = accelerator_state(accelerator, loader=loader)
    step = ckpt.load(state) or 0
    if step:
        apply_plan(ckpt.last_plan, accelerator=accelerator, samplers=[sampler])
        print(f"rank {rank}: resumed step {step} counter {counter.steps} exact loader {state['loader'].exact} "
              f"accum {accelerator.gradient_accumulation_steps}", flush=True)
    out = open(f"{a.samples}.rank{rank}.jsonl", "a")
    while step < a.steps:
        for x, y, idx in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            out.write(json.dumps({"step": step + 1, "idx": idx.tolist(), "loss": loss.item().hex()}) + "\n")
            out.flush()
            if not accelerator.sync_gradients:
                continue
            step += 1
            counter.steps += 1
            ckpt.save(state, step)
            if rank == 0 and a.weights and step == (a.weights_step or a.steps):
                torch.save({"counter": counter.steps, "weights": accelerator.unwrap_model(model).state_dict()},
                           a.weights)
            if a.step_sleep:
                time.sleep(a.step_sleep)
            if ckpt.preempted or step >= a.steps:
                break
        if ckpt.preempted:
            break
    ckpt.close()
    accelerator.wait_for_everyone()
    print(f"rank {rank}: done step {step} counter {counter.steps}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
