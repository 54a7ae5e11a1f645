"""Host memory of a save of a sharded state: one copy of the staged bytes, no more.

usage: stage_memory.py DIR OUT  (1 or more ranks)

A state of 16 DTensors sharded by rows, 4 MiB per rank each, is saved; each rank
records the growth of its RSS high-water mark over the save (``VmHWM``
after ``5 > /proc/self/clear_refs``) and the bytes it staged, in
OUT/result.<rank>.json.
"""

import os
import sys

import common
import torch

import shardckpt


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root, out = sys.argv[1], sys.argv[2]
    rank, world = common.init()
    mesh = init_device_mesh("cpu", (world,))
    # Row shards of 4 MiB per rank, as FSDP2 holds its parameters.
    shards = {f"w{i}": distribute_tensor(torch.full((1024 * world, 1024), float(i)), mesh, [Shard(0)])
              for i in range(16)}
    staged = sum(t.to_local().numel() * t.to_local().element_size() for t in shards.values())
    ckpt = shardckpt.Checkpointer(local_dir=root, keep_last=1, preemption_signals=())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS:")
    ckpt.save({"shards": shards}, 1).wait()
    grown = _status("VmHWM:") - before
    ckpt.close()
    common.write_json(os.path.join(out, f"result.{rank}.json"), {"staged": staged, "hwm_growth": grown})
    common.finish()


if __name__ == "__main__":
    main()
