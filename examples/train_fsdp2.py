"""An FSDP2 training job that checkpoints with shardckpt and resumes at any world size.

    NPROC_PER_NODE=2 CKPT_DIR=run/ckpt deploy/torchrun/launch.sh examples/train_fsdp2.py --steps 40
    NPROC_PER_NODE=1 CKPT_DIR=run/ckpt deploy/torchrun/launch.sh examples/train_fsdp2.py --steps 60

Each rank saves only its own shards (DCP); a restore at another world size
reshards them, and the elastic plan keeps the global batch by changing the
number of accumulated micro-batches (here 2 ranks -> 1: accumulation 1 -> 2),
which the loop below applies. On GPUs use init_device_mesh("cuda", ...) and
the "nccl" backend; the checkpointing code does not change.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import shardckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", default=os.environ.get("SHARDCKPT_LOCAL_DIR", "checkpoints/train_fsdp2"))
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps")
    p.add_argument("--every", type=int, default=10, help="save every N steps")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    xs = torch.randn(2048, 16, generator=torch.Generator().manual_seed(1))
    ys = xs.sum(dim=1, keepdim=True).sin()
    sampler = shardckpt.ResumableSampler(len(xs), batch_size=16, seed=0)  # rank and world from the process group

    ckpt = shardckpt.Checkpointer(local_dir=args.ckpt_dir, every_steps=args.every, keep_last=2,
                                  micro_batch_size=16)
    state = {"model": model, "optimizer": optimizer, "sampler": sampler}
    start = ckpt.load(state) or 0
    accum = ckpt.last_plan.accum_steps if start and ckpt.last_plan and ckpt.last_plan.accum_steps else 1
    if rank == 0:
        print(f"[train_fsdp2] {f'resuming from step {start}' if start else 'starting fresh'} at world size "
              f"{world}, {accum} micro-batch(es) per step", flush=True)

    step, micro = start, 0
    loader = DataLoader(TensorDataset(xs, ys), batch_size=16, sampler=sampler,
                        generator=torch.Generator().manual_seed(2))
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y) / accum
            loss.backward()  # FSDP2 reduce-scatters the gradients of every micro-batch
            micro += 1
            if micro < accum:
                continue
            micro, step = 0, step + 1
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(state, step)
            if ckpt.preempted or step >= args.steps:
                break
        if ckpt.preempted:
            break
    if not ckpt.preempted and step > start and step % args.every:
        ckpt.save(state, step, force=True)  # the last step, when the interval skipped it
    ckpt.close()
    if rank == 0:
        print(f"[train_fsdp2] {'preempted' if ckpt.preempted else 'finished'} at step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
