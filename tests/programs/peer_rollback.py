"""A rollback, then a node loss: the peer tier replicates the live branch, not the highest step number.

usage: peer_rollback.py save  DIR OUT     (2 nodes x 1 rank)
       peer_rollback.py alone DIR OUT     (node 0 alone, 1 rank)

save:  steps 10, 20, 30; ``load(step=10)`` (a rollback: 20 and 30 are abandoned);
       steps 11 and 12 of the new branch; ``close()``, which waits until the live head
       (12) is peer-durable. Each rank records status() in OUT/outcome.<rank>.json;
       rank 0 writes the full state of step 12 to OUT/saved.pt.
alone: load the newest live step on node 0 alone (node 1 and its disk are gone):
       rank 0 writes OUT/restored.pt and OUT/alone.json.
"""

import argparse
import os

import common
import torch
from multinode import build, full_state, train_step

import shardckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "alone"])
    parser.add_argument("dir")
    parser.add_argument("out")
    args = parser.parse_args()
    rank, world = common.init()
    local_dir = os.path.join(args.dir, f"node{os.environ['GROUP_RANK']}")
    model, optim = build()
    state = {"model": model, "optimizer": optim}
    gen = torch.Generator().manual_seed(100 + rank)
    ckpt = shardckpt.Checkpointer(local_dir=local_dir, keep_last=3, mode="sync", preemption_signals=())
    if args.mode == "save":
        for step in (10, 20, 30):
            train_step(model, optim, gen)
            ckpt.save(state, step)
        assert ckpt.load(state, step=10) == 10
        for step in (11, 12):
            train_step(model, optim, gen)
            if step == 12:
                tensors = full_state(model, optim)
                if rank == 0:
                    torch.save({"step": step, "tensors": tensors}, os.path.join(args.out, "saved.pt"))
            ckpt.save(state, step)
        ckpt.close()  # returns once the live head, step 12, is peer-durable
        status = ckpt.status()
        common.write_json(os.path.join(args.out, f"outcome.{rank}.json"), {"status": status})
    else:
        restored = ckpt.load(state)
        ckpt.close()
        tensors = full_state(model, optim)
        if rank == 0:
            torch.save({"step": restored, "tensors": tensors}, os.path.join(args.out, "restored.pt"))
            common.write_json(os.path.join(args.out, "alone.json"), {"restored": restored, "world": world})
    common.finish()


if __name__ == "__main__":
    main()
