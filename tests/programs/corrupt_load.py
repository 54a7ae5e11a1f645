"""Load the newest step with a given ``on_corrupt``; each rank records what happened.

usage: corrupt_load.py MODE CKPT_DIR OUT_PREFIX ON_CORRUPT
Writes OUT_PREFIX.<rank>.json: {"restored": step} or {"error": type, "message": text}.
"""

import sys

import common
import torch
from roundtrip import build

import shardckpt


def main() -> None:
    mode, ckpt_dir, out, on_corrupt = sys.argv[1:5]
    rank, _world = common.init()
    model, optim = build(mode, seed=7)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, on_corrupt=on_corrupt, preemption_signals=())
    try:
        result = {"restored": ckpt.load({"model": model, "optimizer": optim, "scheduler": sched})}
    except shardckpt.ShardckptError as exc:
        result = {"error": type(exc).__name__, "message": str(exc)}
    ckpt.close()
    common.write_json(f"{out}.{rank}.json", result)
    common.finish()


if __name__ == "__main__":
    main()
