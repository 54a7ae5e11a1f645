"""A small DDP training run that checkpoints every step and can resume.

Dropout, a shuffled sampler with a global position, AdamW and a warmup+cosine
schedule: everything that must be restored for a bit-exact resume.

usage: train.py CKPT_DIR OUT_DIR TOTAL_STEPS [--every N] [--step-sleep S]

Writes OUT_DIR/losses.rank<r>.json ({step: loss}) and, at the end,
OUT_DIR/final.pt (rank 0: model weights); OUT_DIR/preempted (the step) when
SIGTERM stopped it.
"""

import argparse
import json
import math
import os
import time

import common
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import shardckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out_dir")
    parser.add_argument("total_steps", type=int)
    parser.add_argument("--every", type=int, default=None, help="save every N steps (default: every step)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args()
    rank, world = common.init()

    torch.manual_seed(1234)  # same initial weights on every rank
    model = DistributedDataParallel(common.TinyNet(width=32, dropout=0.2))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup, total = 4, args.total_steps

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)
    data_gen = torch.Generator().manual_seed(7)
    xs = torch.randn(512, 8, generator=data_gen)
    ys = torch.randn(512, 2, generator=data_gen)
    sampler = shardckpt.ResumableSampler(len(xs), batch_size=8, shuffle=True, seed=3)
    torch.manual_seed(99 + rank)  # per-rank RNG differs (dropout masks)

    state = {"model": model, "optimizer": optim, "scheduler": sched, "sampler": sampler}
    ckpt = shardckpt.Checkpointer(local_dir=args.ckpt_dir, keep_last=3, every_steps=args.every)
    start = ckpt.load(state) or 0

    losses_path = os.path.join(args.out_dir, f"losses.rank{rank}.json")
    losses = {}
    if os.path.exists(losses_path) and start:
        losses = {k: v for k, v in json.load(open(losses_path)).items() if int(k) <= start}
    loader_gen = torch.Generator().manual_seed(0)  # DataLoader must not draw from the global RNG
    dataset = TensorDataset(xs, ys)
    step = start
    while step < total:
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=loader_gen)
        for x, y in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            losses[str(step)] = loss.item()
            with open(losses_path, "w") as f:
                json.dump(losses, f)
            ckpt.save(state, step)
            if ckpt.preempted:  # SIGTERM arrived: the step is committed, leave now
                if rank == 0:
                    with open(os.path.join(args.out_dir, "preempted"), "w") as f:
                        f.write(str(step))
                ckpt.close()
                common.finish()
                return
            time.sleep(args.step_sleep)
            if step >= total:
                break
    ckpt.close()
    if rank == 0:
        torch.save(model.module.state_dict(), os.path.join(args.out_dir, "final.pt"))
    common.finish()


if __name__ == "__main__":
    main()
