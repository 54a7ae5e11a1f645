"""A tiny Lightning fit with ShardckptCheckpoint (run under torchrun, CPU, gloo).

``lightning_job.py OUT CKPT STRATEGY TAG [KILL_AT|-] [REMOTE|-] [MAX_STEPS] [SIGTERM_AT]``

STRATEGY ``ddp`` or ``fsdp2`` (ModelParallelStrategy, fully_shard over the
data-parallel mesh). Trains to global step 8 with ``fit(ckpt_path="last")``,
saving every 2 steps; writes the full parameters after every step
(``OUT/TAG-params-N.pt``, rank 0) and at the end (``OUT/TAG-params-end.pt``), and what was restored
(``OUT/TAG-result.json``). With KILL_AT, rank 0 waits for the save in flight
to commit at that step, writes ``OUT/TAG-reached`` and sleeps (the test
SIGKILLs the job). REMOTE: an s3:// URL for the remote tier. SIGTERM_AT:
every rank sends itself SIGTERM at that step (a preemption notice); Lightning
stops the loop and the callback saves that step before the process exits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from common import flat_tensors  # noqa: E402

import lightning.pytorch as L  # noqa: E402
from torch.utils.data import Sampler, Subset, TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from shardckpt.integrations.lightning import ShardckptCheckpoint  # noqa: E402

MAX_STEPS = 8


class Tiny(L.LightningModule):
    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
        self.saves = 0
        self.loaded_extra = None

    def configure_model(self) -> None:
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net[3], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        self.saves += 1
        checkpoint["tiny_extra"] = {"saves": self.saves, "step": self.global_step}

    def on_load_checkpoint(self, checkpoint):
        self.loaded_extra = checkpoint.get("tiny_extra")

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
        # Each rank its own shard, shuffled by a sampler of our own (the Trainer is told
        # use_distributed_sampler=False): its position is part of the loops' state that is saved.
        data = Subset(data, range(self.global_rank, 48, self.trainer.world_size))
        # The loader's own generator: iter() would otherwise draw a seed from the global RNG, at another point
        # of a resumed run than of an uninterrupted one (and dropout would differ).
        return StatefulDataLoader(data, batch_size=4, sampler=EpochShuffle(len(data)),
                                  generator=torch.Generator().manual_seed(1))


class EpochShuffle(Sampler):
    """A permutation that is a pure function of the epoch (Lightning calls set_epoch): a resumed run
    regenerates it, and the dataloader's saved position skips what was consumed."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class Recorder(L.Callback):
    def __init__(self, out: str, tag: str, kill_at: int | None, ckpt: ShardckptCheckpoint,
                 sigterm_at: int | None = None) -> None:
        self.out, self.tag, self.kill_at, self.ckpt = out, tag, kill_at, ckpt
        self.sigterm_at = sigterm_at

    def on_train_start(self, trainer, pl_module):
        params = flat_tensors(pl_module.net.state_dict())
        if trainer.global_rank == 0:
            torch.save(params, os.path.join(self.out, f"{self.tag}-params-start.pt"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = flat_tensors(pl_module.net.state_dict())  # collective with FSDP2: every rank
        step = trainer.global_step
        if trainer.global_rank == 0:
            torch.save(params, os.path.join(self.out, f"{self.tag}-params-{step}.pt"))
        if step == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.kill_at and trainer.global_rank == 0:
            self.ckpt.checkpointer.wait()  # the step saved before is committed, then the job is killed here
            open(os.path.join(self.out, f"{self.tag}-reached"), "w").close()
            while True:
                time.sleep(1)


def main() -> None:
    out, ckpt_dir, strategy_name, tag = sys.argv[1:5]
    def arg(i):
        return sys.argv[i] if len(sys.argv) > i and sys.argv[i] != "-" else None

    kill_at = None if arg(5) is None else int(arg(5))
    remote = arg(6)
    max_steps = MAX_STEPS if arg(7) is None else int(arg(7))
    sigterm_at = None if arg(8) is None else int(arg(8))
    world = int(os.environ["WORLD_SIZE"])
    if strategy_name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp" if world > 1 else "auto"
    ckpt = ShardckptCheckpoint(ckpt_dir, every_n_train_steps=2, keep_last=None, remote=remote)
    torch.manual_seed(0)
    model = Tiny(fsdp=strategy_name == "fsdp2")
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=max_steps,
        callbacks=[ckpt, Recorder(out, tag, kill_at, ckpt, sigterm_at)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    try:
        trainer.fit(model, ckpt_path="last")  # Lightning's SIGTERMException is a SystemExit
    finally:
        write_result(out, tag, trainer, ckpt, model)


def write_result(out, tag, trainer, ckpt, model) -> None:
    if trainer.global_rank == 0:
        plan = ckpt.last_plan
        with open(os.path.join(out, f"{tag}-result.json"), "w") as f:
            json.dump({
                "restored_step": ckpt.restored_step,
                "loaded_extra": model.loaded_extra,
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "plan": None if plan is None else [plan.saved_world_size, plan.world_size],
            }, f)


if __name__ == "__main__":
    main()
