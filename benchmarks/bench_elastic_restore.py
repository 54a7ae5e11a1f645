"""Restore time 8 -> 4 ranks: shardckpt ``load`` vs stock ``dcp.load`` of the same files.

usage: python benchmarks/bench_elastic_restore.py [--params-m 8] [--repeats 5] [--dir DIR] [--json FILE]

1. 8 ranks (torchrun, gloo on CPU) train an FSDP2 MLP one step and save it
   with shardckpt (sync mode).
2. 4 ranks build the same model and optimizer and restore that step,
   alternating, ``--repeats`` times each:
   * ``dcp.load``: stock ``torch.distributed.checkpoint.load`` into
     ``get_model_state_dict`` / ``get_optimizer_state_dict`` plus
     ``set_model_state_dict`` / ``set_optimizer_state_dict`` (no checksums);
   * ``shardckpt``: ``Checkpointer.load`` with the default checksum
     verification (``verify_on_load=True``) and the elastic plan;
   * ``shardckpt, no verify``: the same with ``verify_on_load=False``.
   Every measurement is a barrier-to-barrier wall time on rank 0; the
   table shows medians and minima and their ratios to ``dcp.load`` measured
   in the same run, and the "paired ratio": the median over rounds of the
   ratio to the ``dcp.load`` run of the same round (runs of one round are
   back to back, so load on a shared machine hits both alike).

``--json FILE`` writes the result as ``benchmarks/run.py`` collects it (case
``elastic``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def build(params_m: float, world: int):
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optim, width


def child(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "src"))
    import shardckpt

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim, width = build(args.params_m, world)
    sampler = shardckpt.ResumableSampler(4096, batch_size=2)
    state = {"model": model, "optimizer": optim, "sampler": sampler}
    if args.mode == "save":
        model(torch.randn(2, width)).sum().backward()
        optim.step()
        ckpt = shardckpt.Checkpointer(local_dir=args.dir, mode="sync", preemption_signals=())
        ckpt.save(state, 1)
        ckpt.close()
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        step_dir = os.path.join(args.dir, "step_0000000001")
        # Warm the page cache and every code path once.
        sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
        dcp.load(sd, checkpoint_id=step_dir)

        def stock() -> None:
            sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}
            dcp.load(sd, checkpoint_id=step_dir)
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, optim, sd["optimizer"])

        checkpointers = {
            "shardckpt": shardckpt.Checkpointer(local_dir=args.dir, preemption_signals=()),
            "shardckpt, no verify": shardckpt.Checkpointer(
                local_dir=args.dir, preemption_signals=(), verify_on_load=False
            ),
        }
        import logging

        logging.getLogger("shardckpt").setLevel(logging.WARNING)
        runs = {"dcp.load": stock}
        for name, ckpt in checkpointers.items():
            runs[name] = lambda ckpt=ckpt: ckpt.load(state, 1)
        for fn in runs.values():
            fn()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(args.repeats):
            names = list(runs) if i % 2 == 0 else list(reversed(list(runs)))
            for name in names:
                dist.barrier()
                t0 = time.perf_counter()
                runs[name]()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            import common

            size = sum(os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir))
            result = common.new_result("elastic", size, ratio_label="dcp.load", repeats=args.repeats,
                                       saved_world_size=8, world_size=world)
            for name, ts in times.items():
                paired = statistics.median(t / b for t, b in zip(ts, times["dcp.load"]))
                common.add_row(result, name, ts, floor=name == "dcp.load", paired_ratio=paired)
            result["notes"].append(f"restore 8 -> {world} ranks (gloo on CPU), FSDP2 MLP + AdamW + sampler, "
                                   f"{args.repeats} rounds, the paths back to back in each; paired ratio: median "
                                   "over rounds of the ratio to that round's dcp.load")
            common.emit(result, args.json)
        for ckpt in checkpointers.values():
            ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


def torchrun(nproc: int, *args: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--child", *args]
    subprocess.run(cmd, check=True, env=env)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params-m", type=float, default=8.0, help="model parameters, in millions")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode", default="save")
    args = p.parse_args()
    if args.child:
        child(args)
        return
    directory = args.dir or tempfile.mkdtemp(prefix="shardckpt-bench-elastic-")
    try:
        shared = ["--params-m", str(args.params_m), "--repeats", str(args.repeats), "--dir", directory]
        torchrun(8, *shared, "--mode", "save")
        torchrun(4, *shared, "--mode", "restore", *(["--json", os.path.abspath(args.json)] if args.json else []))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
