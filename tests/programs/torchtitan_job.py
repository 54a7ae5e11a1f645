"""A torchtitan-style training job on CPU with shardckpt's checkpoint manager (run under torchrun).

torchtitan 0.3's ``Trainer`` imports triton (GPU-only), so the loop here is
the trainer's own ``train()`` / ``train_step()`` order written out, over
torchtitan's real containers: ``OptimizersContainer`` (AdamW),
``LRSchedulersContainer`` (warmup + linear decay), ``ParallelAwareDataloader``
(torchdata's ``StatefulDataLoader``) and the manager built from its config
with ``config.build(...)``, as ``Trainer.__init__`` does.

``torchtitan_job.py OUT JOB [+ JOB ...]``: the jobs run one after the other in
one launch (fresh objects each, one process group). A job is ``TAG key=value ...``:

- ``ckpt=DIR``; ``steps=N`` (training steps, 12; the last one is saved with
  ``last_step=True``); ``interval=N`` (3); ``model_only=1``
  (``last_save_model_only=True``: the last step saved without optimizer state);
- ``shard=0``: a plain module (default: FSDP2 over all ranks);
- ``kill=N``: at step N rank 0 waits for the save in flight to commit, writes
  ``OUT/TAG-reached`` and sleeps (the test SIGKILLs the job);
- ``fence=N``: rank 0 writes the full parameters right after ``save(N)``
  returned (``OUT/params-at-save-N.pt``; the optimizer step of N+1 follows at once).

Every job loads the newest step first (``load(step=-1)``). Each rank's data
part holds 8 samples, re-looped with a new order every epoch (as torchtitan's
HF datasets do), batches of 2 (``training.local_batch_size`` of torchtitan's job config, which the train state
holds as the ``Trainer`` does): 4 steps per epoch. Each rank appends one JSON
line per trained step to ``OUT/TAG-rankR.jsonl`` (step, loss, learning rate,
data epoch, sample indices); rank 0 writes what it loaded and what it ended
with to ``OUT/TAG-start.pt`` and ``OUT/TAG-final.pt`` (parameters, optimizer
state, train step, LR, whether the data position was restored, the elastic plan).
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from common import finish, flat_tensors, init, jobs  # noqa: E402
from plan_check import install as check_plans  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import default_adamw  # noqa: E402
from torchtitan.config.configs import TrainingConfig  # noqa: E402

from shardckpt.integrations.torchtitan import ShardckptCheckpointManager  # noqa: E402

PART = 8  # samples per data-parallel rank and epoch
BATCH = 2  # training.local_batch_size


class Tokens(IterableDataset):
    """Each rank's part of a finite data set, re-looped with a new order every epoch; its position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.sample_idx, self.epoch = 0, 0

    def __iter__(self):
        while True:
            order = torch.randperm(PART, generator=torch.Generator().manual_seed(42 + self.epoch))
            while self.sample_idx < PART:
                index = self.dp_rank * PART + int(order[self.sample_idx])
                self.sample_idx += 1
                g = torch.Generator().manual_seed(index)
                yield torch.randn(8, generator=g), torch.randint(0, 4, (), generator=g), index, self.epoch
            self.sample_idx, self.epoch = 0, self.epoch + 1

    def state_dict(self):
        return {"sample_idx": self.sample_idx, "epoch": self.epoch}

    def load_state_dict(self, state):
        self.sample_idx, self.epoch = state["sample_idx"], state["epoch"]


class TrainState:
    """What torchtitan's ``Trainer`` passes as ``states["train_state"]`` (itself): the step, the tokens seen, and
    the job config's training section with the accumulation steps the ``Trainer`` computes from it."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0
        self.config = types.SimpleNamespace(training=TrainingConfig(local_batch_size=BATCH, seq_len=8))
        self.gradient_accumulation_steps = 1  # global_batch_size -1: local_batch_size x data-parallel degree

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def build(rank: int, world: int, opts: dict[str, str]):
    steps = int(opts.get("steps", 12))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
    if opts.get("shard", "1") == "1":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-2).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                              min_lr_factor=0.0).build(optimizers=optimizers, training_steps=steps + 4)
    # Its own generator: iter(DataLoader) draws a seed from the global RNG otherwise, which the resumed run
    # (iter after load) would draw at another point than the uninterrupted one (dropout would differ).
    loader = ParallelAwareDataloader(Tokens(rank), dp_rank=rank, dp_world_size=world, batch_size=BATCH,
                                     generator=torch.Generator().manual_seed(rank))
    train_state = TrainState()
    fields = {"last_save_model_only": True} if opts.get("model_only") == "1" else {}
    config = ShardckptCheckpointManager.Config(enable=True, folder=opts["ckpt"], interval=int(opts.get("interval", 3)),
                                               keep_latest_k=0, **fields)
    manager = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                           lr_schedulers=schedulers, states={"train_state": train_state}, sd_adapter=None,
                           base_folder="")
    return model, optimizers, schedulers, loader, train_state, manager


def run(out: str, rank: int, world: int, tag: str, opts: dict[str, str]) -> None:
    model, optimizers, schedulers, loader, train_state, manager = build(rank, world, opts)
    steps = int(opts.get("steps", 12))
    kill_at = int(opts["kill"]) if "kill" in opts else None
    fence_at = int(opts["fence"]) if "fence" in opts else None
    manager.load(step=-1)
    snapshot(out, rank, f"{tag}-start", model, optimizers, schedulers, train_state, manager)
    batches = iter(loader)
    with open(os.path.join(out, f"{tag}-rank{rank}.jsonl"), "a") as lines:
        while train_state.step < steps:
            train_state.step += 1
            x, y, index, epoch = next(batches)
            lr = optimizers.optimizers[0].param_groups[0]["lr"]
            optimizers.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            manager.maybe_wait_for_staging()  # as torchtitan's train_step does, before the optimizer step
            optimizers.step()
            schedulers.step()
            train_state.ntokens_seen += len(y)
            lines.write(json.dumps({"step": train_state.step, "loss": loss.item(), "lr": lr,
                                    "epoch": epoch.tolist(), "batch": index.tolist()}) + "\n")
            lines.flush()
            manager.save(train_state.step, last_step=train_state.step == steps)
            if fence_at == train_state.step:
                params = flat_tensors(model.state_dict())
                if rank == 0:
                    torch.save(params, os.path.join(out, f"params-at-save-{fence_at}.pt"))
            if kill_at == train_state.step and rank == 0:
                manager.maybe_wait_for_saving()  # the step saved before is committed, then the job is killed here
                open(os.path.join(out, f"{tag}-reached"), "w").close()
                while True:
                    time.sleep(1)
    snapshot(out, rank, f"{tag}-final", model, optimizers, schedulers, train_state, manager)
    manager.close()


def snapshot(out, rank, name, model, optimizers, schedulers, train_state, manager) -> None:
    params = flat_tensors(model.state_dict())  # collective with FSDP2: every rank
    optim = flat_tensors(dict(optimizers.optimizers[0].state_dict()["state"]))
    if rank == 0:
        torch.save({"params": params, "optim": optim, "step": train_state.step,
                    "ntokens_seen": train_state.ntokens_seen,
                    "last_epoch": schedulers.schedulers[0].last_epoch,
                    "lr": optimizers.optimizers[0].param_groups[0]["lr"], "loaded_step": manager.loaded_step,
                    "dataloader_restored": manager.dataloader_state.restored, "plan": repr(manager.last_plan)},
                   os.path.join(out, f"{name}.pt"))


def main() -> None:
    out = sys.argv[1]
    rank, world = init()
    check_plans(out, "torchtitan")
    for job in jobs(sys.argv[2:]):
        run(out, rank, world, job[0], dict(item.split("=", 1) for item in job[1:]))
        torch.distributed.barrier()
    finish()


if __name__ == "__main__":
    main()
