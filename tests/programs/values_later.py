"""A plain value that starts to differ on rank 1 at a later save, under 2 ranks (``values.agree`` sends only
the summaries that changed since the last save: the difference is still found, at the save it appears).

usage: values_later.py OUT_DIR

Saves steps 1-7, each kept in memory and every second one on disk; ``meta["lr"]`` is the same on both ranks
at steps 1-3, differs on rank 1 from step 4 (rank 1's then stays the same, so it has nothing new to send at
steps 5 and 6), and is the same again at step 7; ``progress["at"]`` changes on both at every save. Then each
rank restores steps 3, 5 and 7 from memory and 4 and 6 from disk, into fresh values, and writes
OUT_DIR/rank<r>.json.
"""

import os
import sys

import common
import torch

import shardckpt


def main() -> None:
    out_dir = sys.argv[1]
    rank, _world = common.init()
    root = os.path.join(out_dir, "ckpt")
    ckpt = shardckpt.Checkpointer(local_dir=root, every_steps=2, memory_every_steps=1, memory_keep=6,
                                  preemption_signals=())
    weights = torch.zeros(8)
    result = {"saved": {}, "memory": {}, "disk": {}}
    for step in range(1, 8):
        lr = 0.7 if rank == 1 and 4 <= step <= 6 else 0.5
        state = {"weights": weights, "meta": {"lr": lr}, "progress": {"at": step}}
        handle = ckpt.save(state, step)
        if handle is not None:
            handle.wait()
        result["saved"][step] = lr
    for step in (3, 5, 7):  # held only in memory: each rank reads its own copy
        fresh = {"weights": torch.zeros(8), "meta": {}, "progress": {}}
        result["memory"][step] = [ckpt.load(fresh, step=step), fresh["meta"], fresh["progress"]]
    ckpt.close()
    disk = shardckpt.Checkpointer(local_dir=root, every_steps=2, preemption_signals=())
    for step in (4, 6):
        fresh = {"weights": torch.zeros(8), "meta": {}, "progress": {}}
        result["disk"][step] = [disk.load(fresh, step=step), fresh["meta"], fresh["progress"]]
    disk.close()
    common.write_json(os.path.join(out_dir, f"rank{rank}.json"), result)
    common.finish()


if __name__ == "__main__":
    main()
