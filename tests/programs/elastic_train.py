"""Elastic restore test program: FSDP2 / DDP / plain training of a tiny model.

usage: elastic_train.py OUT_DIR CKPT_DIR [options] [+ OUT_DIR CKPT_DIR [options] ...]

--kind fsdp|ddp|plain   how the model is wrapped (plain: one process, no process group)
--load-step N           restore step N with --policy, write OUT_DIR/<tag>.loaded.pt and
                        OUT_DIR/<tag>.plan.json, then go on training
--save-at N             save (sync) after step N and write OUT_DIR/<tag>.saved.pt
--total N               train up to step N (records per step in OUT_DIR/<tag>.records.json)
--micro-batch b --accum A   the training shape of a fresh run (a resumed run takes A from the plan)
--shape-in-config       record the shape through CheckpointConfig.micro_batch_size
                        (default: the ResumableSampler in the state records it)

Every step records, on rank 0: the sorted global sample ids, the global mean
loss and the learning rate used. Layers of 10 and 30 rows give uneven FSDP2
shards at 8 and 3 ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import shardckpt  # noqa: E402

DATASET = 200
TOTAL = 20


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(16, 10), nn.Tanh(), nn.Linear(10, 30), nn.Tanh(), nn.Linear(30, 4))


def lr_lambda(step: int) -> float:
    warmup = 3
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (TOTAL - warmup)))


def wrap(kind: str, model: nn.Module, world: int) -> nn.Module:
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    return model


def snapshot(model, optim, sched) -> dict:
    """Full tensors of the model and optimizer (a collective under FSDP2) plus the LR state."""
    return {
        "model": common.flat_tensors(get_model_state_dict(model)),
        "optim": common.flat_tensors(get_optimizer_state_dict(model, optim)),
        "group_lr": [g["lr"] for g in optim.param_groups],
        "group_initial_lr": [g.get("initial_lr") for g in optim.param_groups],
        "base_lrs": list(sched.base_lrs),
        "last_lr": list(sched.get_last_lr()),
        "last_epoch": sched.last_epoch,
    }


def gather(obj, distributed: bool) -> list:
    if not distributed:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("ckpt_dir")
    p.add_argument("--kind", default="fsdp", choices=["fsdp", "ddp", "plain"])
    p.add_argument("--tag", required=True)
    p.add_argument("--load-step", type=int, default=None)
    p.add_argument("--policy", default="keep", choices=["keep", "linear", "sqrt", "nearest"])
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--total", type=int, default=TOTAL)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--shape-in-config", action="store_true")
    return p.parse_args(argv)


def main() -> None:
    # Several jobs can run one after the other in the same launch, separated
    # by "+" (one process group: fewer 8-rank launches on a small machine).
    parsed = [parse(job) for job in common.jobs(sys.argv[1:])]
    distributed = parsed[0].kind != "plain"
    if distributed:
        common.init()
    for args in parsed:
        if not distributed or dist.get_rank() == 0:
            print(f"== job {args.tag}", flush=True)  # where this job's lines start in the launch's log
        run(args, distributed)
    if distributed:
        common.finish()


def run(args: argparse.Namespace, distributed: bool) -> None:
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    model = wrap(args.kind, make_model(), world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(DATASET, 16, generator=gen)
    ys = torch.randn(DATASET, 4, generator=gen)
    dataset = TensorDataset(torch.arange(DATASET), xs, ys)
    b = args.micro_batch
    sampler = shardckpt.ResumableSampler(DATASET, batch_size=b, shuffle=True, seed=3, accum_steps=args.accum)
    loader = DataLoader(dataset, batch_size=b, sampler=sampler, generator=torch.Generator().manual_seed(0))
    # Per-rank user state: which rank saved it and how many samples that rank read.
    per_rank = shardckpt.PerRank({"id": rank, "samples": 0}, fresh=lambda r: {"id": -1, "samples": 0})
    state = {"model": model, "optimizer": optim, "scheduler": sched, "sampler": sampler, "per_rank": per_rank}
    config = dict(local_dir=args.ckpt_dir, mode="sync", keep_last=None, preemption_signals=())
    if args.shape_in_config:
        config.update(micro_batch_size=b, grad_accum_steps=args.accum)
    ckpt = shardckpt.Checkpointer(**config)

    accum = args.accum
    start = 0
    if args.load_step is not None:
        policy = {
            "keep": shardckpt.ElasticPolicy(),
            "nearest": shardckpt.ElasticPolicy(on_inexact="nearest"),
            "linear": shardckpt.ElasticPolicy(batch="scale_lr", lr_rule="linear"),
            "sqrt": shardckpt.ElasticPolicy(batch="scale_lr", lr_rule="sqrt"),
        }[args.policy]
        start = ckpt.load(state, step=args.load_step, elastic=policy)
        plan = ckpt.last_plan
        accum = plan.accum_steps
        snap = snapshot(model, optim, sched)
        snap["per_rank"] = gather([per_rank.value, per_rank.restored], distributed)
        if rank == 0:
            torch.save(snap, os.path.join(args.out_dir, f"{args.tag}.loaded.pt"))
            common.write_json(os.path.join(args.out_dir, f"{args.tag}.plan.json"), plan.as_dict())

    records = {}
    it = iter(loader)

    def next_batch():
        nonlocal it
        for _ in range(2):
            try:
                return next(it)
            except StopIteration:
                it = iter(loader)  # the sampler moved to the next epoch
        raise RuntimeError("the loader yields nothing")

    for step in range(start + 1, args.total + 1):
        ids, loss_sum = [], 0.0
        lr_used = optim.param_groups[0]["lr"]
        for _ in range(accum):
            idx, x, y = next_batch()
            loss = ((model(x) - y) ** 2).mean(dim=1).sum()
            (loss / (b * accum)).backward()
            ids += idx.tolist()
            per_rank.value["samples"] += len(idx)
            loss_sum += loss.item()
        optim.step()
        sched.step()
        optim.zero_grad()
        all_ids = sorted(i for part in gather(ids, distributed) for i in part)
        total_loss = sum(gather(loss_sum, distributed))
        records[step] = {"ids": all_ids, "loss": total_loss / len(all_ids), "lr": lr_used,
                         "epoch": sampler.epoch, "consumed": sampler.consumed}
        if step == args.save_at:
            ckpt.save(state, step)
            snap = snapshot(model, optim, sched)
            snap["per_rank"] = gather([per_rank.value, True], distributed)
            if rank == 0:
                torch.save(snap, os.path.join(args.out_dir, f"{args.tag}.saved.pt"))
    ckpt.close()
    if rank == 0:
        common.write_json(os.path.join(args.out_dir, f"{args.tag}.records.json"), records)


if __name__ == "__main__":
    main()
