"""shardckpt as torchtitan's checkpoint manager, in a job that runs on CPU.

In a torchtitan job (torchtitan 0.3) the manager is chosen by the config, nothing else changes::

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    def llama3_debugmodel_shardckpt() -> Trainer.Config:
        config = llama3_debugmodel()
        config.checkpoint = ShardckptCheckpointManager.Config(
            enable=True, interval=10, keep_latest_k=3, remote="s3://bucket/runs/llama3")
        return config

torchtitan's ``Trainer`` needs a GPU (it imports triton). This program runs
the same calls in the trainer's order — ``load`` before the loop,
``maybe_wait_for_staging`` before every optimizer step, ``save`` after every
step, ``close`` at the end — over torchtitan's own containers, on CPU:

    torchrun --nproc-per-node 2 examples/torchtitan_manager.py --steps 30 --ckpt-dir run/titan
    torchrun --nproc-per-node 1 examples/torchtitan_manager.py --steps 40 --ckpt-dir run/titan   # resumes 2 -> 1

The second command restores the 2-rank job's newest step into one rank (FSDP2
shards into one module); the dataloader position, saved per data-parallel
rank, is dropped with a warning because the data-parallel degree changed.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import default_adamw

from shardckpt.integrations.torchtitan import ShardckptCheckpointManager


class Samples(IterableDataset):
    """Synthetic data, a function of (data-parallel rank, position); the position is its state."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank, self.pos = dp_rank, 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(1_000_003 * self.dp_rank + self.pos)
            self.pos += 1
            yield torch.randn(32, generator=g), torch.randint(0, 4, (), generator=g)

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--ckpt-dir", default="checkpoints/torchtitan")
    parser.add_argument("--remote", default=os.environ.get("SHARDCKPT_REMOTE"))
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=5, decay_ratio=0.8, decay_type="linear").build(
        optimizers=optimizers, training_steps=args.steps)
    dataloader = ParallelAwareDataloader(Samples(rank), dp_rank=rank, dp_world_size=world, batch_size=16,
                                         generator=torch.Generator().manual_seed(rank))
    train_state = TrainState()

    config = ShardckptCheckpointManager.Config(enable=True, folder=args.ckpt_dir, interval=args.interval,
                                               keep_latest_k=3, remote=args.remote)
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder="")
    checkpointer.load(step=config.load_step)
    if rank == 0:
        print(f"training starts at step {train_state.step + 1}")
    batches = iter(dataloader)
    while train_state.step < args.steps:
        train_state.step += 1
        x, y = next(batches)
        optimizers.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
    checkpointer.close()
    if rank == 0:
        print(f"finished {train_state.step} steps")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
