"""Save to a remote through per-node local dirs, or restore from it (under torchrun).

usage: remote_train.py save    BASE REMOTE OUT STEPS     local_dir = BASE/node<GROUP_RANK>
       remote_train.py restore BASE REMOTE OUT           restore the newest step, dump the state
       remote_train.py hang    BASE REMOTE OUT STEPS     save STEPS steps, then wait to be killed

OUT receives (rank 0) torch.save of the full model and optimizer tensors and
the step, for bitwise comparison by the test.
"""

import os
import sys
import time

import common
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardckpt


def build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = common.TinyNet(width=24)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (net.fc1, net.fc2, net.fc3):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def dump(model, optim, step, out, rank):
    flat = common.flat_tensors(get_model_state_dict(model))
    flat.update({"optim." + k: v for k, v in common.flat_tensors(get_optimizer_state_dict(model, optim)).items()})
    if rank == 0:
        torch.save({"step": step, "tensors": flat}, out)


def main() -> None:
    mode, base, remote, out = sys.argv[1:5]
    rank, world = common.init()
    node = os.environ.get("GROUP_RANK", "0")
    local_dir = os.path.join(base, f"node{node}")
    model, optim = build()
    ckpt = shardckpt.Checkpointer(
        local_dir=local_dir, remote=remote, keep_last=2, remote_keep_last=2, drain_timeout_s=120,
        preemption_signals=(),
    )
    state = {"model": model, "optimizer": optim}
    if mode == "restore":
        step = ckpt.load(state)
        dump(model, optim, step, out, rank)
        ckpt.close()
        common.finish()
        return
    steps = int(sys.argv[5])
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(1, steps + 1):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        ckpt.save(state, step).wait()
    dump(model, optim, steps, out, rank)
    if mode == "hang":
        if rank == 0:
            with open(out + ".ready", "w") as f:
                f.write(str(steps))
        while True:
            time.sleep(1)
    ckpt.close()
    common.finish()


if __name__ == "__main__":
    main()
