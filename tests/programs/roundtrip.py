"""Train a few steps (DDP or FSDP2), save, restore into fresh objects, compare bitwise.

Before that restore, a load into the model built on the meta device must be refused.

usage: roundtrip.py MODE CKPT_DIR OUT_JSON [+ MODE CKPT_DIR OUT_JSON ...]     (MODE: ddp | fsdp2)

Several round trips separated by "+" run one after the other in the same
launch (one process group: one torchrun start instead of several).
"""

import sys

import common
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardckpt


def build(mode: str, seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    with torch.device(device):
        net = common.TinyNet(width=10)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in (net.fc1, net.fc2, net.fc3):
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def meta_attempt(mode: str, ckpt_dir: str) -> dict:
    """load() into the model built on the meta device (torchtitan's way), before to_empty().

    FSDP2 shards the meta model as it is; DDP cannot wrap one (it broadcasts the
    parameters at construction), so its meta case is the module before wrapping.
    """
    if mode == "ddp":
        torch.manual_seed(0)
        with torch.device("meta"):
            model = common.TinyNet(width=10)
    else:
        model, _optim = build(mode, seed=0, device="meta")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir)
    try:
        ckpt.load({"model": model, "optimizer": optim})
        out = {"error": None}
    except shardckpt.ShardckptError as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    ckpt.close()
    out["params"] = [n for n, _p in model.named_parameters()]
    out["still_meta"] = all(p.is_meta for p in model.parameters())
    messages = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(messages, out.get("message"))
    out["other_ranks"] = messages[1:]  # what the other ranks print: the list once per job, on rank 0
    return out


def main() -> None:
    rank, _world = common.init()
    for job in common.jobs(sys.argv[1:]):
        roundtrip(rank, *job)
    common.finish()


def roundtrip(rank: int, mode: str, ckpt_dir: str, out: str) -> None:
    model, optim = build(mode, seed=0)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, keep_last=2)
    state = {"model": model, "optimizer": optim, "scheduler": sched, "extra": {"note": "rt", "epoch": 2}}
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, 4):
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        ckpt.save(state, step)
    ckpt.close()
    saved_model = common.flat_tensors(get_model_state_dict(model))
    saved_optim = common.flat_tensors(get_optimizer_state_dict(model, optim))
    saved_sched = sched.state_dict()

    meta = meta_attempt(mode, ckpt_dir)

    model2, optim2 = build(mode, seed=123)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=2, gamma=0.5)
    state2 = {"model": model2, "optimizer": optim2, "scheduler": sched2}
    ckpt2 = shardckpt.Checkpointer(local_dir=ckpt_dir)
    restored = ckpt2.load(state2)
    ckpt2.close()
    got_model = common.flat_tensors(get_model_state_dict(model2))
    got_optim = common.flat_tensors(get_optimizer_state_dict(model2, optim2))
    mismatched = [k for k in saved_model if not torch.equal(saved_model[k], got_model.get(k, torch.empty(0)))]
    mismatched += [k for k in saved_optim if not torch.equal(saved_optim[k], got_optim.get(k, torch.empty(0)))]
    result = {
        "restored_step": restored,
        "model_tensors": len(saved_model),
        "optim_tensors": len(saved_optim),
        "optim_state_keys": sorted(k for k in saved_optim if k.startswith("state.")),
        "mismatched": mismatched,
        "extra": state2.get("extra"),
        "scheduler_equal": sched2.state_dict() == saved_sched,
        "lr": [g["lr"] for g in optim2.param_groups],
        "meta": meta,
    }
    if rank == 0:
        common.write_json(out, result)


if __name__ == "__main__":
    main()
