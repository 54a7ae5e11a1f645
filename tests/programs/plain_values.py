"""Plain values under DDP at 2 ranks: values that differ by rank, dicts with int keys, the free-space estimate.

usage: plain_values.py OUT_DIR SMALL_DIR      (SMALL_DIR: a 3 MiB filesystem, or - when there is none)

Writes OUT_DIR/rank<r>.json with what each rank saw. OUT_DIR/own holds a step
with values that differ by rank at any size and per-rank state (a generator, a
sampler), which the test also restores at 1 rank.
"""

import functools
import os
import sys
import time

import common
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import shardckpt
from shardckpt import _failpoints
from shardckpt.format import shm


def warmup(step: int, n: int) -> float:
    return min(1.0, (step + 1) / n)


class RankSampler(torch.utils.data.Sampler):
    """A sampler of the user's own with a per-rank position and order (per rank by nature)."""

    def __init__(self, rank: int) -> None:
        self.pos = 0
        self.order = torch.randperm(300, generator=torch.Generator().manual_seed(rank))

    def __iter__(self):
        return iter(self.order[self.pos:].tolist())

    def state_dict(self) -> dict:
        return {"pos": self.pos, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.order = int(state["pos"]), state["order"]


class Meter:
    """A stateful object whose state differs by rank: rank 0's is kept, with a warning."""

    def __init__(self, value: float) -> None:
        self.sums = torch.full((200,), value)

    def state_dict(self) -> dict:
        return {"sums": self.sums, "count": 7}

    def load_state_dict(self, state: dict) -> None:
        self.sums = state["sums"]


def own_values(out_dir: str, rank: int, model) -> dict:
    """Values differing by rank at any size and per-rank state: saved at step 5, loaded into fresh objects."""
    big = torch.full((1000,), 3.65 if rank == 0 else 1e9)  # more than 64 elements
    text = ("a" if rank == 0 else "b") * 5000  # over 4 KiB pickled, the same length on every rank
    shuffle = torch.Generator().manual_seed(100 + rank)
    torch.randn(3, generator=shuffle)
    sampler = RankSampler(rank)
    sampler.pos = 10 * rank + 3
    state = {"model": model, "stats": {"big": big, "same": torch.arange(500.0)}, "notes": [text],
             "data": {"shuffle": shuffle, "epoch": 2}, "sampler": sampler, "meter": Meter(float(rank + 1))}
    ckpt_dir = os.path.join(out_dir, "own")
    with shardckpt.Checkpointer(local_dir=ckpt_dir, keep_last=None, preemption_signals=()) as ckpt:
        ckpt.save(state, 4).wait()
        ckpt.save(state, 5).wait()  # a second save: one warning per key in all
    expected = torch.randn(4, generator=shuffle).tolist()
    fresh = {"model": model, "stats": {}, "notes": [],
             "data": {"shuffle": torch.Generator().manual_seed(999), "epoch": 0}, "sampler": RankSampler(7),
             "meter": Meter(-1.0)}
    live_generator = fresh["data"]["shuffle"]
    with shardckpt.Checkpointer(local_dir=ckpt_dir, keep_last=None, preemption_signals=()) as ckpt:
        loaded = ckpt.load(fresh)
    stats = fresh["stats"]
    # The same state kept in the memory tier only (step 6), read back from memory by another instance: each
    # rank's copy holds the reference rank's values, received at the save.
    memory_dir = os.path.join(out_dir, "own-memory")
    saver = shardckpt.Checkpointer(local_dir=memory_dir, every_steps=100, memory_every_steps=1, preemption_signals=())
    tier = saver.save(state, 6).tier
    back = {"model": model, "stats": {}, "notes": [], "data": {"shuffle": torch.Generator(), "epoch": 0},
            "sampler": RankSampler(7), "meter": Meter(-1.0)}
    reader = shardckpt.Checkpointer(local_dir=memory_dir, memory_every_steps=1, preemption_signals=())
    memory = [tier, reader.load(back), reader.status()["restored_from"].split(" ")[0], float(back["stats"]["big"][-1]),
              back["notes"][0][:3], [float(back["meter"].sums[0]), float(back["meter"].sums[-1])]]
    reader.close()
    saver.close()
    # A save kept in memory and written to disk, rank 1 stamping its copy half a second after rank 0 (the disk's
    # manifest carries rank 0's time): the same save, so close() frees the memory.
    both_dir = os.path.join(out_dir, "own-memory-disk")
    if rank == 1:
        _failpoints.arm("save.staged", lambda: time.sleep(0.5))
    with shardckpt.Checkpointer(local_dir=both_dir, every_steps=1, memory_every_steps=1, preemption_signals=()) as both:
        both.save(state, 7).wait()
    memory.append(os.path.exists(shm.namespace(both_dir)))
    return {
        "memory": memory,
        "loaded": loaded,
        "big": [float(stats["big"][0]), float(stats["big"][-1]), list(stats["big"].shape)],
        "text": [fresh["notes"][0][:3], len(fresh["notes"][0])],
        "same": bool(torch.equal(stats["same"], torch.arange(500.0))),
        "shuffle_next": torch.randn(4, generator=fresh["data"]["shuffle"]).tolist(),
        "shuffle_expected": expected,
        "shuffle_same_object": fresh["data"]["shuffle"] is live_generator,
        "epoch": fresh["data"]["epoch"],
        "sampler": [fresh["sampler"].pos, fresh["sampler"].order[:5].tolist(), sampler.order[:5].tolist()],
        "meter": [float(fresh["meter"].sums[0]), float(fresh["meter"].sums[-1])],
    }


def main() -> None:
    out_dir, small_dir = sys.argv[1:3]
    rank, _world = common.init()
    result = {}

    # 1. A metric computed on rank 0 only (a 0-d tensor there, a float elsewhere), a value that
    #    differs by rank, and a vocabulary with int keys.
    torch.manual_seed(0)
    model = DistributedDataParallel(common.TinyNet(width=4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = {"best_val_loss": torch.tensor(3.65) if rank == 0 else 1e9, "lr": 0.5 * (rank + 1), "iter_num": 7,
            "extra": {}, "nested": {"empty": {}, "lists": [{}, []]}}
    vocab = {"itos": {0: "a", 1: "b", 10: "z"}, "stoi": {"a": 0, "#": 3}}
    # A LambdaLR over a functools.partial saves "lr_lambdas": [{}] (an empty dict in a list).
    sched = torch.optim.lr_scheduler.LambdaLR(optim, functools.partial(warmup, n=10))
    for _ in range(3):
        optim.step()
        sched.step()
    state = {"model": model, "optimizer": optim, "meta": meta, "vocab": vocab, "sched": sched}
    ckpt_dir = os.path.join(out_dir, "ckpt")
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, keep_last=None, preemption_signals=())
    for step in (1, 2):
        ckpt.save(state, step).wait()
    ckpt.close()

    live = {"itos": {0: "old", 1: "old"}}
    sched2 = torch.optim.lr_scheduler.LambdaLR(optim, functools.partial(warmup, n=10))
    state2 = {"model": model, "optimizer": optim, "meta": {}, "vocab": live, "sched": sched2}
    ckpt2 = shardckpt.Checkpointer(local_dir=ckpt_dir, keep_last=None, preemption_signals=())
    result["restored"] = ckpt2.load(state2)
    got = state2["meta"]
    result["best_val_loss"] = [type(got["best_val_loss"]).__name__, float(got["best_val_loss"])]
    result["lr"] = got["lr"]
    result["iter_num"] = got["iter_num"]
    result["empties"] = [got.get("extra", "missing"), got.get("nested", "missing")]
    result["sched"] = {"last_epoch": sched2.last_epoch, "keys": sorted(sched2.state_dict()),
                       "lr_lambdas": sched2.state_dict().get("lr_lambdas", "missing")}
    result["itos_keys"] = [repr(k) for k in live["itos"]]
    result["itos_same_object"] = state2["vocab"] is live
    result["itos"] = {repr(k): v for k, v in live["itos"].items()}
    result["stoi"] = live["stoi"]
    ckpt2.save(state2, 3).wait()  # the loaded dict saves again (no "duplicated flatten key")
    result["steps"] = ckpt2.steps()
    ckpt2.close()

    # 2. Values that differ by rank at any size; a generator and a sampler that belong to each rank.
    result["own"] = own_values(out_dir, rank, model)

    # 3. DDP replicas on a small disk: the step fits once, not once per rank.
    if small_dir != "-":
        torch.manual_seed(1)
        big = DistributedDataParallel(nn.Linear(1000, 400))  # 1.6 MB of parameters, no optimizer
        small = shardckpt.Checkpointer(local_dir=small_dir, preemption_signals=())
        try:
            small.save({"model": big}, 1).wait()
            result["small_steps"] = small.steps()
        except shardckpt.InsufficientSpaceError as exc:
            result["small_error"] = str(exc)
        small.close()

    common.write_json(os.path.join(out_dir, f"rank{rank}.json"), result)
    common.finish()


if __name__ == "__main__":
    main()
