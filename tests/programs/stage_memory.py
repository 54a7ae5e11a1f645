"""Host memory of a save of a sharded state: one copy of the staged bytes, no more.

usage: stage_memory.py DIR OUT  (1 or more ranks)

An FSDP2 model of 16 shards of 4 MiB per rank is saved; each rank
records the growth of its RSS high-water mark over the save (``VmHWM``
after ``5 > /proc/self/clear_refs``) and the bytes it staged, in
OUT/result.<rank>.json.
"""

import os
import sys

import common
import torch
import torch.nn as nn

import shardckpt


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root, out = sys.argv[1], sys.argv[2]
    rank, world = common.init()
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024 * world, bias=False) for _ in range(16)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    staged = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    ckpt = shardckpt.Checkpointer(local_dir=root, keep_last=1, preemption_signals=())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS:")
    ckpt.save({"model": model}, 1).wait()
    grown = _status("VmHWM:") - before
    ckpt.close()
    common.write_json(os.path.join(out, f"result.{rank}.json"), {"staged": staged, "hwm_growth": grown})
    common.finish()


if __name__ == "__main__":
    main()
