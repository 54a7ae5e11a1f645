"""Time the training loop is blocked per checkpoint, shardckpt vs the alternatives.

Run under torchrun (2 ranks by default), e.g.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \
        benchmarks/bench_save_blocking.py --gib 1.0 --repeat 3

The state is an FSDP2-sharded model (the parameters split over the ranks;
``--gib`` of fp32 in total). For each method the time until the training loop
could continue is measured on every rank; the slowest rank counts, and the
median over ``--repeat`` runs is printed with its ratio to the floor: a copy
of the same local shards into host buffers that already exist.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import shardckpt  # noqa: E402


def build_model(total_bytes: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 2048
    layers = max(1, round(total_bytes / (width * width * 4)))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="total state size in GiB (default 1.0)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (median reported)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shardckpt_log = __import__("logging").getLogger("shardckpt")
    shardckpt_log.setLevel("WARNING")

    root = args.dir or (tempfile.mkdtemp(prefix="bench-save-") if rank == 0 else None)
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    model = build_model(int(args.gib * (1 << 30)), world)
    state = {"model": model}
    local_shards = [p.to_local() for p in model.parameters()]
    local_bytes = sum(t.numel() * t.element_size() for t in local_shards)
    side = dist.new_group(backend="gloo")
    results: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(slowest(seconds))

    # Floor: copy into host buffers allocated beforehand.
    buffers = [torch.empty_like(t) for t in local_shards]
    for i in range(args.repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(buffers, local_shards):
            b.copy_(t)
        if i:
            record("copy into preallocated host buffers (floor)", time.perf_counter() - t0)
    del buffers

    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, "shardckpt"), keep_last=1, capture_rng=True)
    ckpt.save(state, 0).wait()  # first save allocates the staging buffers
    for i in range(1, args.repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        handle = ckpt.save(state, i)
        record("shardckpt.save (async)", time.perf_counter() - t0)
        handle.wait()
    ckpt.close()

    for i in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=os.path.join(root, f"dcp_sync_{i}"))
        record("dcp.save (sync)", time.perf_counter() - t0)

    for i in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(root, f"dcp_async_{i}"), process_group=side)
        record("dcp.async_save (default)", time.perf_counter() - t0)
        result = future.result() if hasattr(future, "result") else future.upload_completion.result()
        del result

    for i in range(args.repeat):
        dist.barrier()
        t0 = time.perf_counter()
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(full, os.path.join(root, f"torch_save_{i}.pt"))
        del full
        dist.barrier()
        record("rank-0 torch.save of the full state", time.perf_counter() - t0)

    if rank == 0:
        floor = statistics.median(results["copy into preallocated host buffers (floor)"])
        print(f"\nstate: {args.gib:.2f} GiB fp32 over {world} ranks ({local_bytes / (1 << 20):.0f} MiB per rank), "
              f"median of {args.repeat}, slowest rank\n")
        print(f"| {'method':<42} | {'blocked (s)':>11} | {'x floor':>7} |")
        print(f"|{'-' * 44}|{'-' * 13}|{'-' * 9}|")
        for name, values in results.items():
            median = statistics.median(values)
            print(f"| {name:<42} | {median:>11.3f} | {median / floor:>7.2f} |")
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
