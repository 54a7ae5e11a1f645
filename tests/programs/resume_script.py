"""A training script of the usual shape for ``shardckpt check-resume``: it trains until it is stopped.

``resume_script.py CKPT_DIR [--remote URL] [--fault KIND] [--fsdp2]``: one process, or every
rank under torchrun (DDP; with ``--fsdp2`` a second model beside it, sharded by FSDP2). A tiny model with dropout,
AdamW, a LambdaLR schedule, a shuffled ResumableSampler (40 samples, 8 per
step over all ranks: an epoch of 5 steps), input noise from a generator of its
own, a per-rank ``torch.Generator`` kept as a plain value under the key ``rng``
(drawn from at every step, feeding nothing), a ``samples_seen`` counter, and
the loss and a ``val_loss`` placeholder (NaN: no evaluation yet) reported to
``save(..., metrics=)``. It loops until the checker stops it (or ``--steps
N``). ``--fault``, each a classic way for a resume to go wrong (``--fault-rank
R``: on rank R only):

* ``generator``: the noise generator is not in the state (it starts again from its seed);
* ``scheduler``: the LR scheduler is not in the state;
* ``data``: the loop's epoch counter is not in the state, and its ``set_epoch()`` at
  each epoch's start resets the sampler's saved position;
* ``nosave``: never calls ``save()`` (and ends after 30 steps);
* ``nondeterministic``: the noise generator is seeded from the process id;
* ``older``: resumes the oldest step it holds, not the newest;
* ``rng``: the user's generator under ``rng`` is seeded again after ``load()``;
* ``again`` / ``skip``: the loop numbers the restored step again / skips a step after it;
* ``lr``: the learning rate is set again after ``load()`` (a chainable ExponentialLR schedule);
* ``accum``: gradients accumulated over 2 steps, saved in between (pending at the save);
* ``counter``: ``samples_seen`` is set to 0 after ``load()``;
* ``late``: the first ``save()`` call comes 60 s after the start.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
from common import TinyNet  # noqa: E402

import shardckpt  # noqa: E402

SAMPLES, GLOBAL_BATCH = 40, 8


class GeneratorState:
    """A torch.Generator in the checkpointed state."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def state_dict(self) -> dict:
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["state"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--fault", choices=["generator", "scheduler", "data", "nosave", "nondeterministic", "older", "rng",
                                       "again", "skip", "lr", "accum", "counter", "late"])
    p.add_argument("--fault-rank", type=int, default=None, help="the fault on this rank only")
    p.add_argument("--fsdp2", action="store_true")
    p.add_argument("--remote", default=None)
    p.add_argument("--steps", type=int, default=None, help="end after this step (default: train until stopped)")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()

    torch.manual_seed(0)
    model = TinyNet(width=16, dropout=0.2)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded = None
    if a.fsdp2:  # a second model, sharded by FSDP2 over the ranks, trained beside the first
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = TinyNet(width=16, dropout=0.2)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(sharded.fc1, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        sharded_optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    if a.fault == "lr":
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.2 * s))
    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 2, generator=g))
    sampler = shardckpt.ResumableSampler(SAMPLES, batch_size=GLOBAL_BATCH // world, seed=3)
    noise = torch.Generator().manual_seed(os.getpid() if a.fault == "nondeterministic" else 11)
    torch.manual_seed(100 + rank)  # dropout masks differ by rank

    rng = torch.Generator().manual_seed(50 + rank)
    state = {"model": model, "optimizer": optimizer, "sampler": sampler, "rng": rng, "samples_seen": 0}
    if sharded is not None:
        state.update(sharded=sharded, sharded_optimizer=sharded_optimizer)
    if a.fault != "scheduler":
        state["scheduler"] = scheduler
    if a.fault != "generator":
        state["noise"] = GeneratorState(noise)
    ckpt = shardckpt.Checkpointer(local_dir=a.ckpt, remote=a.remote, keep_last=2)
    older = min(ckpt.steps()) if a.fault == "older" and ckpt.steps() else None
    if a.fault == "late":
        time.sleep(60)
    step = ckpt.load(state, older) or 0
    faulty = a.fault_rank is None or a.fault_rank == rank
    if step and faulty:  # resumed: the faults that strike after load()
        if a.fault == "rng":
            state["rng"].manual_seed(50 + rank)
        elif a.fault == "again":
            step -= 1
        elif a.fault == "skip":
            step += 1
        elif a.fault == "lr":
            for group in optimizer.param_groups:
                group["lr"] = 1e-2
        elif a.fault == "counter":
            state["samples_seen"] = 0
    for epoch in itertools.count():  # the sampler moves to its next epoch itself at the end of one
        if a.fault == "data":
            sampler.set_epoch(epoch)  # from a counter that starts at 0 again after the resume
        loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        for x, y in loader:
            step += 1
            x = x + 0.1 * torch.randn(x.shape, generator=noise)
            torch.rand(1, generator=state["rng"])
            state["samples_seen"] += GLOBAL_BATCH
            loss = torch.nn.functional.mse_loss(model(x), y)
            if a.fault != "accum" or step % 2 == 1:  # accum: the gradients of two steps, one optimizer step
                optimizer.zero_grad()
            if sharded is not None:
                loss = loss + torch.nn.functional.mse_loss(sharded(x), y)
                sharded_optimizer.zero_grad()
            loss.backward()
            if a.fault == "accum" and step % 2 == 1:
                ckpt.save(state, step, metrics={"loss": loss.item(), "val_loss": float("nan")})
                continue
            optimizer.step()
            scheduler.step()
            if sharded is not None:
                sharded_optimizer.step()
            if a.fault != "nosave":
                ckpt.save(state, step, metrics={"loss": loss.item(), "val_loss": float("nan")})
            if step == (30 if a.fault == "nosave" else a.steps):
                ckpt.close()
                return


if __name__ == "__main__":
    main()
