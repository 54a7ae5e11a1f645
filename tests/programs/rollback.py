"""Roll back, train on, restart: the abandoned branch is neither resumed nor counted (2 ranks).

usage: rollback.py DIR REMOTE OUT

Saves steps 100, 200, 300; a new instance rolls back to 100 (load(step=100))
and saves 110, 120, 130 with keep_last=3 on both tiers. Then a restart on the
same directory and one with an empty directory (from the remote alone) each
load the default step into a scrambled state. OUT/result.<rank>.json records
what each saw, and whether the model then equals the one saved at step 130.
"""

import json
import os
import sys

import common
import torch
from torch.nn.parallel import DistributedDataParallel

import shardckpt


def main() -> None:
    ckpt_dir, remote, out = sys.argv[1:4]
    rank, world = common.init()
    torch.manual_seed(0)
    model = DistributedDataParallel(common.TinyNet(width=8))
    state = {"model": model, "extra": {"at": 0}}
    opts = dict(remote=remote, keep_last=3, remote_keep_last=3, drain_timeout_s=120, preemption_signals=())

    def same(expected):
        return all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))

    def save_steps(ckpt, steps):
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(float(step))
            state["extra"]["at"] = step
            ckpt.save(state, step).wait()

    first = shardckpt.Checkpointer(local_dir=ckpt_dir, **opts)
    save_steps(first, [100, 200, 300])
    first.close()

    again = shardckpt.Checkpointer(local_dir=ckpt_dir, **opts)
    rolled = again.load(state, step=100)
    at_rollback = state["extra"]["at"]
    save_steps(again, [110, 120, 130])
    again.close()

    at_130 = [p.detach().clone() for p in model.parameters()]

    def scramble():
        """Another state in the live objects, so that only a load can bring step 130 back."""
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0)
        state["extra"] = {"at": -1}

    scramble()
    restart = shardckpt.Checkpointer(local_dir=ckpt_dir, **opts)
    resumed = restart.load(state)
    restart.close()
    resumed_state = {"extra": state["extra"], "model_equal": same(at_130)}

    scramble()
    empty = os.path.join(os.path.dirname(ckpt_dir), f"new-instance-{os.environ.get('GROUP_RANK', '0')}")
    fresh = shardckpt.Checkpointer(local_dir=empty, **opts)
    from_remote = fresh.load(state)
    fresh.close()
    remote_state = {"extra": state["extra"], "model_equal": same(at_130)}
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump({"rolled": rolled, "at_rollback": at_rollback, "resumed": resumed, "from_remote": from_remote,
                   "resumed_state": resumed_state, "remote_state": remote_state}, f)
    common.finish()


if __name__ == "__main__":
    main()
