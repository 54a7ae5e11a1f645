"""Load the newest step with a given ``on_corrupt``; each rank records what happened.

usage: corrupt_load.py MODE CKPT_DIR OUT_PREFIX ON_CORRUPT [OUT_PREFIX ON_CORRUPT ...]
Writes OUT_PREFIX.<rank>.json: {"restored": step} or {"error": type, "message": text}.
Several (OUT_PREFIX, ON_CORRUPT) pairs load one after the other in the same
process group, each with fresh objects and a fresh Checkpointer.
"""

import sys

import common
import torch
from roundtrip import build

import shardckpt


def main() -> None:
    mode, ckpt_dir, *pairs = sys.argv[1:]
    rank, _world = common.init()
    for out, on_corrupt in zip(pairs[::2], pairs[1::2]):
        load(mode, ckpt_dir, out, on_corrupt, rank)
    common.finish()


def load(mode: str, ckpt_dir: str, out: str, on_corrupt: str, rank: int) -> None:
    model, optim = build(mode, seed=7)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, on_corrupt=on_corrupt, preemption_signals=())
    try:
        result = {"restored": ckpt.load({"model": model, "optimizer": optim, "scheduler": sched})}
    except shardckpt.ShardckptError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    ckpt.close()
    common.write_json(f"{out}.{rank}.json", result)


if __name__ == "__main__":
    main()
