"""A torchtitan-style training job on CPU with shardckpt's checkpoint manager (run under torchrun).

torchtitan 0.3's ``Trainer`` imports triton (GPU-only), so the loop here is
the trainer's own ``train()`` / ``train_step()`` order written out, over
torchtitan's real containers: ``OptimizersContainer`` (AdamW),
``LRSchedulersContainer`` (warmup + linear decay), ``ParallelAwareDataloader``
(torchdata's ``StatefulDataLoader``) and the manager built from its config
with ``config.build(...)``, as ``Trainer.__init__`` does.

``train OUT CKPT``: 2 ranks, FSDP2. Steps 1..8, interval 3 (saves 3 and 6).
Writes the full parameters right after the save of step 3 returned (the
optimizer step of step 4 follows at once), and after step 8. Then, in the
same job, builds fresh objects, loads step 6 through a new manager and
trains 7..8 again: writes those parameters (must equal the uninterrupted
run's), and saves step 8 as the last step (full).

``resume OUT CKPT``: 1 rank, plain module. Loads the newest step (8) and writes
what it restored: parameters, optimizer state, LR, train step, whether the
dataloader position was restored.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import finish, flat_tensors, init  # noqa: E402

from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import default_adamw  # noqa: E402

from shardckpt.integrations.torchtitan import ShardckptCheckpointManager  # noqa: E402

STEPS = 8


class Tokens(IterableDataset):
    """Synthetic samples, a pure function of (dp rank, index); its position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.pos = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1000 * self.dp_rank + self.pos)
            self.pos += 1
            yield torch.randn(8, generator=g), torch.randint(0, 4, (), generator=g)

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def build(rank: int, world: int, ckpt: str, shard: bool, **extra):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers, training_steps=STEPS + 4)
    # Its own generator: iter(DataLoader) draws a seed from the global RNG otherwise, which the resumed run
    # (iter after load) would draw at another point than the uninterrupted one (dropout would differ).
    loader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=4,
                                     generator=torch.Generator().manual_seed(rank))
    train_state = TrainState()
    config = ShardckptCheckpointManager.Config(enable=True, folder=ckpt, interval=3, keep_latest_k=0,
                                               last_save_model_only=False, **extra)
    manager = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                           lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=None,
                           base_folder="")
    return model, optimizers, schedulers, loader, train_state, manager


def train_step(model, optimizers, schedulers, manager, batches, world):
    x, y = next(batches)
    optimizers.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    manager.maybe_wait_for_staging()  # as torchtitan's train_step does, before the optimizer step
    optimizers.step()
    schedulers.step()


def run(rank, world, ckpt, shard, out, stop, fence_at=None, tag=""):
    model, optimizers, schedulers, loader, train_state, manager = build(rank, world, ckpt, shard)
    manager.load(step=-1)
    start = train_state.step
    batches = iter(loader)
    while train_state.step < stop:
        train_state.step += 1
        train_step(model, optimizers, schedulers, manager, batches, world)
        train_state.ntokens_seen += 4
        manager.save(train_state.step, last_step=train_state.step == STEPS and tag == "resumed")
        if fence_at == train_state.step:
            params = flat_tensors(model.state_dict())
            if rank == 0:
                torch.save(params, os.path.join(out, f"params-at-save-{train_state.step}.pt"))
    params = flat_tensors(model.state_dict())
    optim = flat_tensors(dict(optimizers.optimizers[0].state_dict()["state"]))
    manager.close()
    if rank == 0:
        torch.save({"params": params, "optim": optim, "start": start, "step": train_state.step,
                    "ntokens_seen": train_state.ntokens_seen, "last_epoch": schedulers.schedulers[0].last_epoch,
                    "lr": optimizers.optimizers[0].param_groups[0]["lr"],
                    "dataloader_restored": manager.dataloader_state.restored},
                   os.path.join(out, f"final-{tag}.pt"))
    return manager


def main() -> None:
    mode, out, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, world = init()
    if mode == "train":
        run(rank, world, ckpt, True, out, STEPS, fence_at=3, tag="uninterrupted")
        # A fresh job's objects, the same process group: resume from step 6 (the newest: interval 3 and
        # no last-step save in the uninterrupted run) and train 7..8 again.
        dist.barrier()
        run(rank, world, ckpt, True, out, STEPS, tag="resumed")
    else:
        model, optimizers, schedulers, loader, train_state, manager = build(rank, world, ckpt, False)
        manager.load(step=-1)
        opt = optimizers.optimizers[0]
        torch.save({
            "step": train_state.step,
            "ntokens_seen": train_state.ntokens_seen,
            "params": flat_tensors(model.state_dict()),
            "optim": flat_tensors(dict(opt.state_dict()["state"])),
            "last_epoch": schedulers.schedulers[0].last_epoch,
            "lr": opt.param_groups[0]["lr"],
            "dataloader_restored": manager.dataloader_state.restored,
            "plan": repr(manager.last_plan),
        }, os.path.join(out, "resumed-1-rank.pt"))
        manager.close()
    finish()


if __name__ == "__main__":
    main()
