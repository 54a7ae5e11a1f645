"""A small DDP training job that checkpoints with shardckpt and survives interruption.

Run it under torchrun (scripts/demo.sh does):

    torchrun --standalone --nproc-per-node=2 examples/train_demo.py --steps 60 --dir demo-run/ckpt

Interrupt it (Ctrl-C, SIGTERM, kill -9) and run the same command again: it
resumes from the newest committed step. On SIGTERM (what a spot reclaim or
`kubectl delete` sends) the next save() saves at once, waits for the commit,
and the loop exits cleanly.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import shardckpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="demo-run/ckpt", help="local checkpoint directory")
    parser.add_argument("--steps", type=int, default=60, help="total training steps")
    parser.add_argument("--every", type=int, default=5, help="save every N steps")
    parser.add_argument("--step-sleep", type=float, default=0.1, help="seconds per step (to make it interruptible)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warmup = 10
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / args.steps)),
    )
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(4096, 16, generator=gen)
    ys = xs.sum(dim=1, keepdim=True).sin()
    sampler = shardckpt.ResumableSampler(len(xs), batch_size=32, seed=0)
    torch.manual_seed(100 + rank)

    ckpt = shardckpt.Checkpointer(local_dir=args.dir, every_steps=args.every, keep_last=3,
                                  metadata={"job": "demo"})
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
             "extra": {"note": "shardckpt demo"}}
    start = ckpt.load(state) or 0
    if rank == 0:
        print(f"[demo] {'resuming from step ' + str(start) if start else 'starting fresh'}", flush=True)

    step = start
    loader_gen = torch.Generator().manual_seed(2)
    while step < args.steps:
        for x, y in DataLoader(TensorDataset(xs, ys), batch_size=32, sampler=sampler, generator=loader_gen):
            step += 1
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 5 == 0:
                print(f"[demo] step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
            ckpt.save(state, step)
            if ckpt.preempted:
                if rank == 0:
                    print(f"[demo] preempted: step {step} is committed, exiting", flush=True)
                ckpt.close()
                dist.barrier()
                dist.destroy_process_group()
                return
            time.sleep(args.step_sleep)
            if step >= args.steps:
                break
    if step > start and step % args.every:
        ckpt.save(state, step, force=True)  # the final step, when the interval skipped it
    ckpt.close()
    if rank == 0:
        print(f"[demo] finished {args.steps} steps", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
