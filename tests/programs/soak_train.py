"""Deterministic training that checkpoints every step, for crash-consistency trials.

usage: soak_train.py CKPT_DIR DIGESTS_OUT TOTAL_STEPS [--no-save] [--sleep S]
                     [--remote URL [--remote-keep-last N]] [--node-local]

Runs single-process or under torchrun (data parallel, gradients averaged in rank order). After every
optimizer step rank 0 appends ``step digest`` to DIGESTS_OUT, where the digest covers the model,
the optimizer state and the sampler position. With --no-save it is the
reference run: the digests of an uninterrupted run. With --remote every
committed step is also uploaded (``uploader="auto"``: a per-node uploader
process) and committed there; remote retention keeps --remote-keep-last steps.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import shardckpt  # noqa: E402


def build():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = shardckpt.ResumableSampler(4096, batch_size=16, seed=1, rank=0, world_size=1)
    return model, optim, sampler


def digest(model: nn.Module, optim: torch.optim.Optimizer, sampler) -> str:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    h = hashlib.sha256()
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optim)
    for key in sorted(msd):
        h.update(key.encode())
        h.update(msd[key].detach().cpu().contiguous().numpy().tobytes())
    for fqn in sorted(osd["state"]):
        for name in sorted(osd["state"][fqn]):
            h.update(f"{fqn}.{name}".encode())
            h.update(torch.as_tensor(osd["state"][fqn][name]).cpu().contiguous().numpy().tobytes())
    # The global data position only: the layout fields (world size, batch) differ
    # between a 2-rank trainer and the single-process checker.
    position = sampler.state_dict()
    h.update(repr((position["epoch"], position["consumed"], position["seed"])).encode())
    return h.hexdigest()[:32]


def average_gradients(model: nn.Module, world: int) -> None:
    """Data-parallel gradient averaging that sums in rank order, identically after every restart.

    DDP all-reduces buckets it rebuilds after the first iteration; at three
    ranks or more the float sums then associate differently in a resumed
    process than in the run it resumes, and the trainings drift apart by a
    rounding error, which this bitwise soak would report as a wrong restore.
    """
    for p in model.parameters():
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(parts, p.grad)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        p.grad = total / world


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("digests")
    parser.add_argument("total", type=int)
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--remote", default=None, help="remote tier URL (file:///..., s3://...)")
    parser.add_argument("--remote-keep-last", type=int, default=2)
    parser.add_argument("--node-local", action="store_true",
                        help="each node (GROUP_RANK) its own directory CKPT_DIR/node<N>: the peer tier is on")
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    rank, world = 0, 1
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, _ = build()
    sampler = shardckpt.ResumableSampler(4096, batch_size=16, seed=1, rank=rank, world_size=world)
    wrapped = model
    data_gen = torch.Generator().manual_seed(9)
    xs, ys = torch.randn(4096, 16, generator=data_gen), torch.randn(4096, 4, generator=data_gen)
    torch.manual_seed(100 + rank)
    state = {"model": wrapped, "optimizer": optim, "sampler": sampler}
    remote = {} if args.remote is None else {
        "remote": args.remote, "uploader": "auto", "remote_keep_last": args.remote_keep_last,
    }
    local_dir = (os.path.join(args.ckpt_dir, f"node{os.environ.get('GROUP_RANK', '0')}") if args.node_local
                 else args.ckpt_dir)
    ckpt = None if args.no_save else shardckpt.Checkpointer(local_dir=local_dir, keep_last=3, **remote)
    step = (ckpt.load(state) if ckpt else None) or 0
    out = open(args.digests, "a") if rank == 0 else None
    it = iter(sampler)
    while step < args.total:
        idx = []
        for _ in range(sampler.batch_size):
            try:
                idx.append(next(it))
            except StopIteration:
                it = iter(sampler)
                idx.append(next(it))
        x, y = xs[idx], ys[idx]
        loss = nn.functional.mse_loss(wrapped(x), y)
        optim.zero_grad()
        loss.backward()
        if distributed:
            average_gradients(model, world)
        optim.step()
        step += 1
        if out is not None:
            out.write(f"{step} {digest(model, optim, sampler)}\n")
            out.flush()
        if ckpt is not None:
            ckpt.save(state, step)
        if args.sleep:
            time.sleep(args.sleep)
    if ckpt is not None:
        ckpt.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
