"""The save plan on 2 ranks: DDP and FSDP2 (torchrun, gloo).

usage: save_plan_job.py ddp|fsdp2 DIR OUT

1. After training steps, the plan's capture equals DCP's own (the same FQNs, each tensor the same memory
   with the same values; the same param groups): ``OUT/equal.rank<r>.json``.
2. Memory saves every step build one plan; then (FSDP2) an ``unshard()`` / ``reshard()`` cycle (no new
   plan: the same sharded parameters stay registered), then a parameter's local shard moved to new memory
   (a new plan); the step saved after it is restored into a fresh model, bitwise
   (``OUT/result.rank<r>.json``).
"""

import json
import os
import sys

import common
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardckpt
from shardckpt.saving.plan import SavePlan
from shardckpt.state import capture as state_mod


def local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def build(mode: str):
    torch.manual_seed(0)
    model = common.TinyNet(width=16)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model.fc1, model.fc2, model.fc3):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optim, step: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def compare(state: dict) -> list[str]:
    """What differs between the plan's capture and DCP's (empty: nothing)."""
    plan = SavePlan(state, dist.get_rank(), True, light=False, trainable_only=False)
    plan.capture(state)
    problems = []
    for step in (1, 2):
        train(state["model"], state["optimizer"], 100 + step)
        if not plan.holds(state):
            problems.append(f"the plan does not hold after step {step}")
        got, kinds, _f = plan.capture(state)
        want, want_kinds, _f = state_mod.capture(state, dist.get_rank(), True)
        if kinds != want_kinds or list(got) != list(want) or list(got["model"]) != list(want["model"]):
            problems.append(f"keys differ: {list(got['model'])} vs {list(want['model'])}")
            continue
        for fqn, t in want["model"].items():
            mine = got["model"][fqn]
            if type(mine) is not type(t) or local(mine).data_ptr() != local(t).data_ptr() \
                    or not torch.equal(local(mine), local(t)):
                problems.append(f"model {fqn} differs")
            if isinstance(t, DTensor) and (mine.placements != t.placements or mine.shape != t.shape):
                problems.append(f"model {fqn} sharded differently")
        if got["optimizer"]["param_groups"] != want["optimizer"]["param_groups"]:
            problems.append("param groups differ")
        ws, gs = want["optimizer"]["state"], got["optimizer"]["state"]
        if list(ws) != list(gs) or any(gs[f][k] is not v for f in ws for k, v in ws[f].items()):
            problems.append("optimizer state differs")
    return problems


def flat(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
    return out


def main() -> None:
    mode, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, _world = common.init()
    model, optim = build(mode)
    state = {"model": model, "optimizer": optim, "meta": {"step": 0}}
    train(model, optim, 0)
    with open(os.path.join(out, f"equal.rank{rank}.json"), "w") as f:
        json.dump(compare(state), f)

    ckpt = shardckpt.Checkpointer(local_dir=root, every_steps=10**9, memory_every_steps=1, preemption_signals=())
    result = {"plans": []}
    for step in range(1, 4):
        train(model, optim, step)
        state["meta"]["step"] = step
        ckpt.save(state, step)
    result["plans"].append(ckpt._saver.plans_built)
    if mode == "fsdp2":
        model.unshard()  # the full parameters registered on the modules
        ckpt.save(state, 4)
        result["plans"].append(ckpt._saver.plans_built)
        model.reshard()  # sharded parameters registered again
        # A parameter's local shard moved to new memory, as FSDP2's reset_sharded_param() moves it (the same
        # DTensor parameter object): a plan that kept the old shard would save its old values.
        param = model.fc2.weight
        with torch.no_grad():
            param._local_tensor = param._local_tensor.clone() + 0.5
        ckpt.save(state, 5)
        result["plans"].append(ckpt._saver.plans_built)
    last = 5 if mode == "fsdp2" else 3
    saved = flat(model)
    ckpt.close()

    model2, optim2 = build(mode)
    state2 = {"model": model2, "optimizer": optim2, "meta": {}}
    restorer = shardckpt.Checkpointer(local_dir=root, preemption_signals=())
    result["loaded"] = restorer.load(state2)
    restorer.close()
    got = flat(model2)
    result["same"] = list(saved) == list(got) and all(torch.equal(saved[k], got[k]) for k in saved)
    result["meta"] = state2["meta"]
    result["last"] = last
    with open(os.path.join(out, f"result.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    common.finish()


if __name__ == "__main__":
    main()
