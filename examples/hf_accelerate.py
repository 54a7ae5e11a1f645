"""A custom training loop on accelerate, checkpointed by shardckpt (runs on CPU).

    python examples/hf_accelerate.py --ckpt runs/acc
    torchrun --nproc-per-node 2 examples/hf_accelerate.py --ckpt runs/acc

The data comes from torchdata's StatefulDataLoader with 2 workers and a
shardckpt.ResumableSampler (one global order, split by rank): the loader is
not passed to accelerator.prepare (the sampler already splits it). Run it
again after a kill: it resumes; at another world size the global batch is
kept (accumulation adjusted) and the data continues at the same sample.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torchdata.stateful_dataloader import StatefulDataLoader

import shardckpt
from shardckpt.integrations.hf import accelerator_state, apply_plan


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default="runs/hf-accelerate")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro", type=int, default=8)
    a = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=1)
    torch.manual_seed(0)
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=a.steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    sampler = shardckpt.ResumableSampler(len(data), batch_size=a.micro, seed=0)
    loader = StatefulDataLoader(data, batch_size=a.micro, sampler=sampler, num_workers=2,
                                generator=torch.Generator().manual_seed(0))
    ckpt = shardckpt.Checkpointer(local_dir=a.ckpt, every_steps=10, keep_last=3, micro_batch_size=a.micro,
                                  grad_accum_steps=accelerator.gradient_accumulation_steps)
    state = accelerator_state(accelerator, loader=loader)   # model, optimizer, scheduler, registered objects, loader
    step = ckpt.load(state) or 0                             # newest live step; None when there is none
    if step:
        apply_plan(ckpt.last_plan, accelerator=accelerator, samplers=[sampler])   # accumulation at a new world size
    while step < a.steps and not ckpt.preempted:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            ckpt.save(state, step)                           # every_steps decides; SIGTERM saves at once
            if ckpt.preempted or step >= a.steps:
                break
    ckpt.close()
    accelerator.print(f"reached step {step}, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
