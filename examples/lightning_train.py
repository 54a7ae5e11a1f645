"""A Lightning fit that checkpoints with shardckpt and resumes where it stopped.

    torchrun --nproc-per-node 2 examples/lightning_train.py --strategy ddp --steps 40 --ckpt-dir run/ckpt
    torchrun --nproc-per-node 2 examples/lightning_train.py --strategy fsdp2 --steps 40 --ckpt-dir run/ckpt \\
        --remote s3://bucket/runs/lightning

Kill it any way you like and start the same command again (at any number of
processes): ``fit(ckpt_path="last")`` resumes from the newest committed step
(locally, else from --remote). On SIGTERM Lightning stops the fit and the
callback commits the current step first.

For a bit-exact resume the dataloader is resumable: a torchdata
``StatefulDataLoader`` (its position is saved per rank), a sampler whose order
a checkpoint restores (here a ``DistributedSampler``: a function of the epoch,
which the callback sets before the restored position is applied), and the
loader's own generator.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as L
import torch
import torch.nn as nn
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from shardckpt.integrations.lightning import ShardckptCheckpoint


class Net(L.LightningModule):
    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))

    def configure_model(self) -> None:
        if self.fsdp:  # ModelParallelStrategy: shard over the data-parallel mesh (FSDP2)
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net[3], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["note"] = {"saved_at": self.global_step}  # anything extra comes back in on_load_checkpoint

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(1024, 32, generator=g), torch.randint(0, 4, (1024,), generator=g))
        # A DistributedSampler of our own (Lightning keeps it and calls set_epoch): each rank its part, in an order
        # that is a function of the epoch. The loader's own generator keeps iter() off the global RNG.
        sampler = DistributedSampler(data, num_replicas=self.trainer.world_size, rank=self.global_rank, seed=0)
        return StatefulDataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator().manual_seed(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="save every N optimizer steps")
    parser.add_argument("--ckpt-dir", default="checkpoints/lightning")
    parser.add_argument("--remote", default=os.environ.get("SHARDCKPT_REMOTE"))
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp" if world > 1 else "auto"
    ckpt = ShardckptCheckpoint(args.ckpt_dir, every_n_train_steps=args.every, remote=args.remote, keep_last=3)
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu" if not torch.cuda.is_available() else "auto", devices=world,
                        strategy=strategy, max_steps=args.steps, callbacks=[ckpt], logger=False,
                        enable_progress_bar=False)
    trainer.fit(Net(fsdp=args.strategy == "fsdp2"), ckpt_path="last")
    if trainer.global_rank == 0:
        print(f"finished {trainer.global_step} steps (resumed from step {ckpt.restored_step}; plan {ckpt.last_plan})")


if __name__ == "__main__":
    main()
