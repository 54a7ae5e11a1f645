"""A DDP training job that checkpoints with shardckpt and survives interruption.

Run it under torchrun, directly or through deploy/torchrun/launch.sh:

    NPROC_PER_NODE=2 CKPT_DIR=run/ckpt deploy/torchrun/launch.sh examples/train_ddp.py --steps 60

Kill it any way you like (a worker SIGKILLed, Ctrl-C, the node preempted) and
start the same command again, or let torchrun restart the worker group: it
resumes from the newest committed step (locally, else from --remote) and ends
with the same weights as a run that was never interrupted. On SIGTERM (what a
spot reclaim or `kubectl delete` sends) the next save() saves at once, waits
for the commit, and the loop exits cleanly.

What bit-exact resume needs, all here: model, optimizer, LR scheduler and
sampler position in the checkpointed state; per-rank RNG (dropout masks),
which shardckpt captures itself; and a DataLoader with its own generator,
because iterating a DataLoader otherwise draws from the global torch RNG.

Checkpoint settings come from the arguments, which default to the variables
launch.sh and the deploy/ manifests set (SHARDCKPT_LOCAL_DIR,
SHARDCKPT_REMOTE, SHARDCKPT_UPLOADER); any other SHARDCKPT_* variable
(SHARDCKPT_DRAIN_TIMEOUT_S, SHARDCKPT_ENDPOINT_URL, ...) applies as well.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import shardckpt


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-dir", default=env("SHARDCKPT_LOCAL_DIR", "checkpoints/train_ddp"),
                   help="local checkpoint directory, node-local NVMe (default: $SHARDCKPT_LOCAL_DIR)")
    p.add_argument("--remote", default=env("SHARDCKPT_REMOTE") or None,
                   help="remote tier, e.g. s3://bucket/runs/run1 (default: $SHARDCKPT_REMOTE, else none)")
    p.add_argument("--uploader", default=env("SHARDCKPT_UPLOADER", "auto"), choices=["auto", "external", "off"],
                   help="who uploads to the remote: auto (started per node), external (a sidecar), off")
    p.add_argument("--steps", type=int, default=60, help="total optimizer steps")
    p.add_argument("--every", type=int, default=5, help="save every N steps")
    p.add_argument("--keep-last", type=int, default=3, help="committed steps kept locally")
    p.add_argument("--out", default=None, help="final weights (rank 0 writes them; default: CKPT_DIR/../final.pt)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to sleep per step (makes demos interruptible)")
    p.add_argument("--digests", default=env("TRAIN_DIGESTS") or None,
                   help="rank 0 appends '<event> <step> model=<sha256> optimizer=... scheduler=... data=...' "
                   "at resume, preemption and finish (to compare runs; default: $TRAIN_DIGESTS, else none)")
    return p.parse_args()


def record_digest(path: str | None, event: str, step: int, model, optimizer, scheduler, sampler) -> None:
    """One line: digests of model, optimizer, scheduler state and data position (what a resume must bring back)."""
    if not path:
        return

    def feed(h, value) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                feed(h, value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                feed(h, v)
        elif not callable(value):
            h.update(repr(value).encode())

    parts = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(),
             # the data position (world size and batch layout change with resharding; the position does not)
             "data": {k: sampler.state_dict()[k] for k in ("epoch", "consumed", "seed", "shuffle", "dataset_len")}}
    digests = []
    for name, value in parts.items():
        h = hashlib.sha256()
        feed(h, value)
        digests.append(f"{name}={h.hexdigest()[:16]}")
    with open(path, "a") as f:
        f.write(f"{event} {step} {' '.join(digests)}\n")


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # "nccl" on GPUs; checkpointing is the same
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    warmup = 10
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / args.steps)),
    )
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(4096, 16, generator=gen)
    ys = xs.sum(dim=1, keepdim=True).sin()
    sampler = shardckpt.ResumableSampler(len(xs), batch_size=32, seed=0)
    torch.manual_seed(100 + rank)  # per-rank RNG differs: different dropout masks

    ckpt = shardckpt.Checkpointer(shardckpt.CheckpointConfig.from_env(
        local_dir=args.ckpt_dir, remote=args.remote, uploader=args.uploader,
        every_steps=args.every, keep_last=args.keep_last, metadata={"job": "train_ddp"},
    ))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler}
    start = ckpt.load(state) or 0
    # At another world size the plan keeps the global batch: e.g. 2 ranks -> 1 accumulates 2 micro-batches.
    accum = ckpt.last_plan.accum_steps if start and ckpt.last_plan and ckpt.last_plan.accum_steps else 1
    if rank == 0:
        if start:
            record_digest(args.digests, "resumed", start, model, optimizer, scheduler, sampler)
        print(f"[train_ddp] {f'resuming from step {start}' if start else 'starting fresh'}"
              f" with {dist.get_world_size()} rank(s), {accum} micro-batch(es) per step", flush=True)

    step = start
    loader_gen = torch.Generator().manual_seed(2)  # keeps the DataLoader off the global RNG
    dataset = TensorDataset(xs, ys)
    micro = 0
    while step < args.steps:
        for x, y in DataLoader(dataset, batch_size=32, sampler=sampler, generator=loader_gen):
            sync = micro == accum - 1  # DDP all-reduces the gradients once per optimizer step
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = nn.functional.mse_loss(model(x), y) / accum
                loss.backward()
            micro += 1
            if not sync:
                continue
            micro = 0
            step += 1
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            if rank == 0 and step % 5 == 0:
                print(f"[train_ddp] step {step:4d}  loss {loss.item() * accum:.4f}  "
                      f"lr {scheduler.get_last_lr()[0]:.5f}",
                      flush=True)
            ckpt.save(state, step)
            if ckpt.preempted:
                if rank == 0:
                    record_digest(args.digests, "preempted", step, model, optimizer, scheduler, sampler)
                    print(f"[train_ddp] preempted: step {step} is committed, exiting", flush=True)
                finish(ckpt)
                return
            time.sleep(args.step_sleep)
            if step >= args.steps:
                break
    if step > start and step % args.every:
        ckpt.save(state, step, force=True)  # the last step, when the interval skipped it
    if rank == 0:
        record_digest(args.digests, "finished", step, model, optimizer, scheduler, sampler)
        out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.ckpt_dir)), "final.pt")
        torch.save(model.module.state_dict(), out + ".tmp")
        os.replace(out + ".tmp", out)
        print(f"[train_ddp] finished {args.steps} steps; weights in {out}", flush=True)
    finish(ckpt)


def finish(ckpt: shardckpt.Checkpointer) -> None:
    ckpt.close()  # waits for the write in flight and, with a remote, for this node's uploads
    dist.barrier()  # every rank closed before gloo is torn down (an early teardown can abort a rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
