"""Checkpointer life-cycle at 2 ranks: preemption on a full disk, and what a closed instance leaves.

usage: lifecycle.py preempt-disk-full DIR OUT    (DIR: a 2 MiB filesystem)
       lifecycle.py instances DIR OUT
       lifecycle.py preempt-disk-full DIR OUT + instances DIR2 OUT2   (both in one launch, in turn)

preempt-disk-full: rank 1 alone gets the preemption signal; the save it
triggers does not fit the disk (on_disk_full="skip"); the next save, which
fits, must be the preemption save on both ranks.
instances: three Checkpointers created, used and closed in turn; records the
open file descriptors before and after.
"""

import json
import os
import signal
import sys

import common
import torch
from torch.nn.parallel import DistributedDataParallel

import shardckpt


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> None:
    rank, world = common.init()
    for job in common.jobs(sys.argv[1:]):
        run(rank, *job)
    common.finish()


def run(rank: int, mode: str, ckpt_dir: str, out: str) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(common.TinyNet(width=8))
    state = {"model": model}
    result = {}
    if mode == "preempt-disk-full":
        ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, every_steps=1000, on_disk_full="skip",
                                      preemption_signals=(signal.SIGUSR1,))
        big = dict(state, blob=torch.zeros(1 << 20))  # 4 MiB per rank: does not fit 2 MiB
        saved, preempted = [], []
        for step in range(1, 5):
            handle = ckpt.save(big if step == 3 else state, step)
            saved.append(handle is not None)
            preempted.append(ckpt.preempted)
            if step == 1 and rank == 1:
                os.kill(os.getpid(), signal.SIGUSR1)
        ckpt.close()
        result = {"saved": saved, "preempted": preempted, "steps": ckpt.steps()}
    else:
        counts = []
        for i in range(3):
            before = fds()
            ckpt = shardckpt.Checkpointer(local_dir=os.path.join(ckpt_dir, f"phase{i}"), preemption_signals=())
            for step in (1, 2):
                ckpt.save(state, step)
            ckpt.load(state)
            ckpt.close()
            counts.append((before, fds()))
        result = {"fds": counts}
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
