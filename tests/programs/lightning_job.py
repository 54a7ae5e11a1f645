"""A tiny Lightning fit with ShardckptCheckpoint (run under torchrun, CPU, gloo).

``lightning_job.py OUT JOB [+ JOB ...]``: the jobs run one after the other in
one launch (one process, a fresh Trainer, model and loader each, seeded alike).
A job is ``TAG key=value ...``:

- ``strategy=ddp|fsdp2``: DDP (``auto`` at one rank) or ``ModelParallelStrategy``
  (FSDP2, ``fully_shard`` over the data-parallel mesh);
- ``ckpt=DIR``, ``remote=URL`` (S3), ``every=N`` (``every_n_train_steps``, 3),
  ``steps=N`` (``max_steps``, 20), ``epochs=N`` (``max_epochs``),
  ``accum=N`` (``accumulate_grad_batches``);
- ``sampler=rank|dist|shared|auto``: the guide's two recipes — each rank
  shuffles its own part of the data with torchdata's ``RandomSampler`` and a
  generator of its own, seeded by rank (``use_distributed_sampler=False``), or
  a ``DistributedSampler`` of the user's (Lightning keeps it and calls
  ``set_epoch``) — and two traps: ``shuffle=True`` in a
  ``StatefulDataLoader`` with a ``generator`` (the sampler shares it), each rank
  its own part; the same without a part of its own, where Lightning replaces
  the sampler (its ``DistributedSamplerWrapper``);
- ``kill=N``: at step N rank 0 waits for the save in flight to commit, writes
  ``OUT/TAG-reached`` and sleeps (the test SIGKILLs the job);
- ``sigterm=N``: every rank sends itself SIGTERM at step N (a preemption
  notice; Lightning stops the fit, the callback saves that step).

Every job resumes with ``fit(ckpt_path="last")``. Each rank appends one JSON
line per trained step to ``OUT/TAG-rankR.jsonl`` (step, epoch, loss, learning
rate, the sample indices of its batch); rank 0 writes the full parameters at
the start of training and at the end (``OUT/TAG-params-start.pt``,
``OUT/TAG-params-end.pt``) and what was restored (``OUT/TAG-result.json``).
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
import lightning.pytorch as L  # noqa: E402
from common import flat_tensors, jobs  # noqa: E402
from plan_check import install as check_plans  # noqa: E402
from torch.utils.data import DistributedSampler, Subset, TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

from shardckpt.integrations.lightning import ShardckptCheckpoint  # noqa: E402

SAMPLES, BATCH = 64, 4  # 2 ranks: 8 steps per epoch


class Tiny(L.LightningModule):
    def __init__(self, fsdp: bool, sampler: str) -> None:
        super().__init__()
        self.fsdp, self.sampler = fsdp, sampler
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 4))
        self.saves = 0
        self.loaded_extra = None
        self.seen: dict = {}

    def configure_model(self) -> None:
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net[3], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.seen = {"loss": loss.item(), "lr": self.trainer.optimizers[0].param_groups[0]["lr"],
                     "batch": index.tolist()}
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=6, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        self.saves += 1
        checkpoint["tiny_extra"] = {"saves": self.saves, "step": self.global_step}

    def on_load_checkpoint(self, checkpoint):
        self.loaded_extra = checkpoint.get("tiny_extra")
        self.saves = self.loaded_extra["saves"]  # the count goes on where the saved run left it

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g),
                             torch.arange(SAMPLES))
        # The loader's own generator: iter() would otherwise draw a seed from the global RNG, at another point
        # of a resumed run than of an uninterrupted one (and dropout would differ).
        loader_rng = torch.Generator().manual_seed(1)
        if self.sampler == "auto":  # Lightning replaces the sampler by its DistributedSamplerWrapper
            return StatefulDataLoader(data, batch_size=BATCH, shuffle=True, generator=loader_rng)
        if self.sampler == "dist":  # a DistributedSampler of the user's: Lightning keeps it and calls set_epoch
            return StatefulDataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0),
                                      generator=loader_rng)
        # Each rank its own part (the Trainer is told use_distributed_sampler=False).
        data = Subset(data, range(self.global_rank, SAMPLES, self.trainer.world_size))
        if self.sampler == "shared":  # shuffle=True: the sampler draws from the loader's generator
            return StatefulDataLoader(data, batch_size=BATCH, shuffle=True, generator=loader_rng)
        # torchdata's stateful RandomSampler, with a generator of its own that differs by rank: its state is
        # part of the loader's, which is saved per rank.
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(100 + self.global_rank))
        return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, generator=loader_rng)


class Recorder(L.Callback):
    def __init__(self, out: str, tag: str, ckpt: ShardckptCheckpoint, kill_at: int | None,
                 sigterm_at: int | None) -> None:
        self.out, self.tag, self.ckpt, self.kill_at, self.sigterm_at = out, tag, ckpt, kill_at, sigterm_at
        self.lines = None
        self.last = None

    def on_train_start(self, trainer, pl_module):
        params = flat_tensors(pl_module.net.state_dict())  # collective with FSDP2: every rank
        if trainer.global_rank == 0:
            torch.save(params, os.path.join(self.out, f"{self.tag}-params-start.pt"))
        self.lines = open(os.path.join(self.out, f"{self.tag}-rank{trainer.global_rank}.jsonl"), "a")
        self.last = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self.last:
            return  # a batch whose gradients are accumulated: the step is recorded with its last batch
        self.last = step
        self.lines.write(json.dumps({"step": step, "epoch": trainer.current_epoch, **pl_module.seen}) + "\n")
        self.lines.flush()
        if step == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.kill_at and trainer.global_rank == 0:
            self.ckpt.checkpointer.wait()  # the step saved before is committed, then the job is killed here
            open(os.path.join(self.out, f"{self.tag}-reached"), "w").close()
            while True:
                time.sleep(1)

    def teardown(self, trainer, pl_module, stage):
        if self.lines is not None:
            self.lines.close()


def run(out: str, tag: str, opts: dict[str, str]) -> None:
    world = int(os.environ["WORLD_SIZE"])
    fsdp = opts.get("strategy", "ddp") == "fsdp2"
    if fsdp:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    else:
        strategy = "ddp" if world > 1 else "auto"
    sampler = opts.get("sampler", "rank")
    ckpt = ShardckptCheckpoint(opts["ckpt"], every_n_train_steps=int(opts.get("every", 3)), keep_last=None,
                               remote=opts.get("remote"))
    recorder = Recorder(out, tag, ckpt, int(opts["kill"]) if "kill" in opts else None,
                        int(opts["sigterm"]) if "sigterm" in opts else None)
    torch.manual_seed(0)
    model = Tiny(fsdp=fsdp, sampler=sampler)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=int(opts.get("steps", 20)),
        max_epochs=int(opts["epochs"]) if "epochs" in opts else None, accumulate_grad_batches=int(opts.get("accum", 1)),
        callbacks=[ckpt, recorder], logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=sampler in ("dist", "auto"),
    )
    try:
        trainer.fit(model, ckpt_path="last")  # Lightning's SIGTERMException is a SystemExit
    finally:
        params = flat_tensors(model.net.state_dict())
        if trainer.global_rank == 0:
            torch.save(params, os.path.join(out, f"{tag}-params-end.pt"))
            plan = ckpt.last_plan
            with open(os.path.join(out, f"{tag}-result.json"), "w") as f:
                json.dump({
                    "restored_step": ckpt.restored_step,
                    "loaded_extra": model.loaded_extra,
                    "global_step": trainer.global_step,
                    "epoch": trainer.current_epoch,
                    "accumulate_grad_batches": trainer.accumulate_grad_batches,
                    "plan": None if plan is None else plan.as_dict(),
                }, f)


def main() -> None:
    out = sys.argv[1]
    check_plans(out, "lightning")
    for job in jobs(sys.argv[2:]):
        tag, opts = job[0], dict(item.split("=", 1) for item in job[1:])
        run(out, tag, opts)


if __name__ == "__main__":
    main()
