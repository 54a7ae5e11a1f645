"""Train a TinyNet under FSDP2 for a few steps, save each step, dump the full state for comparison.

usage: export_job.py CKPT_DIR FULL_PT

Rank 0 writes FULL_PT: ``{"model": {fqn: full tensor}, "optimizer": {name: full tensor},
"param_groups": [...], "step": last step}``, the reference an export must equal bitwise.
"""

import sys

import common
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardckpt


def main() -> None:
    ckpt_dir, full_path = sys.argv[1:3]
    rank, world = common.init()
    torch.manual_seed(0)
    net = common.TinyNet(width=10)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (net.fc1, net.fc2, net.fc3):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    steps = 2
    with shardckpt.Checkpointer(local_dir=ckpt_dir, keep_last=None, preemption_signals=()) as ckpt:
        for step in range(1, steps + 1):
            model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
            ckpt.save({"model": model, "optimizer": optim, "extra": {"epoch": step}}, step)
    full = {
        "model": common.flat_tensors(get_model_state_dict(model)),
        "optimizer": common.flat_tensors(get_optimizer_state_dict(model, optim)["state"], "state."),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups],
        "step": steps,
    }
    if rank == 0:
        torch.save(full, full_path)
    common.finish()


if __name__ == "__main__":
    main()
