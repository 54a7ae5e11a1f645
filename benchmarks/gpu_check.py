"""One prepared check for a machine with an NVIDIA GPU (a few minutes).

    python benchmarks/gpu_check.py [--gib 4] [--out results.json]

1. blocked: the time ``save()`` blocks against the floor, a copy of the
   same tensors into preallocated pinned buffers with a synchronize: by
   default (``save()`` returns with the copies done) target <= 1.1x; with
   ``overlap_copies=True`` (copies only enqueued on a side stream) <= 0.2x;
2. overlap (``overlap_copies=True``): a training step that runs while a
   save's copies are in flight against a normal step and against the copy
   alone; target <= 1.1x max(normal step, copy); the step is fenced, so
   every save must commit;
3. resume: bitwise equal parameters after a save/load mid-run with fp16
   autocast, GradScaler, dropout (CUDA RNG) and a LR schedule;
4. fsdp2: FSDP2 over NCCL at world size 1: round trip bitwise, and the step
   readable by stock ``dcp.load``;
5. torchtitan (when torchtitan >= 0.3 is installed): shardckpt's torchtitan
   manager over torchtitan's containers with ``overlap_copies=True`` (a save
   returns with the copies only enqueued): the optimizer step follows
   ``maybe_wait_for_staging()`` at once, and every committed step must hold
   the parameters as they were at its save, bitwise; the time a save blocks
   against a training step. (torchtitan's own ``Trainer`` loop with its
   llama3 debug model needs its tokenizer assets and ``datasets``; it is not
   run here.)

Prints one JSON object (and writes it to ``--out``) labelled with the GPU's
name; exits 1 when a correctness check fails. Needs torch with CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import shardckpt  # noqa: E402


def sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def big_model(gib: float) -> nn.Module:
    width = 8192
    layers = max(1, round(gib * 2**30 / (width * width * 4)))
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).cuda()


def check_blocked_and_overlap(gib: float, root: str, overlap: bool) -> dict:
    model = big_model(gib)
    optim = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(4096, 8192, device="cuda")
    state = {"model": model}
    pinned = [torch.empty_like(p, device="cpu").pin_memory() for p in model.parameters()]

    def floor() -> None:
        for buf, p in zip(pinned, model.parameters()):
            buf.copy_(p, non_blocking=True)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()

    copy_s = statistics.median(sync_time(floor) for _ in range(5))
    step_s = statistics.median(sync_time(step) for _ in range(5))
    ckpt = shardckpt.Checkpointer(
        local_dir=os.path.join(root, f"blocked-{overlap}"), keep_last=1, preemption_signals=(), overlap_copies=overlap
    )
    ckpt.save(state, 0).wait()  # allocates the pinned buffers
    blocked, overlapped = [], []
    for i in range(1, 6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = ckpt.save(state, i)
        blocked.append(time.perf_counter() - t0)
        overlapped.append(sync_time(step))  # the next step, beside the copies
        handle.wait()
    ckpt.close()
    b, o = statistics.median(blocked), statistics.median(overlapped)
    return {
        "state_gib": sum(p.numel() * 4 for p in model.parameters()) / 2**30,
        "pinned_copy_floor_s": copy_s, "save_blocked_s": b, "blocked_vs_floor": b / copy_s,
        "normal_step_s": step_s, "step_during_save_s": o, "overlap_vs_max": o / max(step_s, copy_s),
        "overlap_copies": overlap,
        "targets_met": (
            {"blocked <= 0.2x floor": b <= 0.2 * copy_s, "step <= 1.1x max": o <= 1.1 * max(step_s, copy_s)}
            if overlap else {"blocked <= 1.1x floor": b <= 1.1 * copy_s}
        ),
    }


def check_resume(root: str) -> dict:
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.2), nn.ReLU(), nn.Linear(256, 8)).cuda()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
        scaler = torch.amp.GradScaler("cuda")
        return {"model": model, "optimizer": optim, "scheduler": sched, "scaler": scaler}

    def train(state, steps, gen):
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = state["model"](torch.randn(64, 256, device="cuda", generator=gen)).float().pow(2).mean()
            state["scaler"].scale(loss).backward()
            state["scaler"].step(state["optimizer"])
            state["scaler"].update()
            state["optimizer"].zero_grad()
            state["scheduler"].step()

    straight = build()
    torch.cuda.manual_seed(7)
    gen = torch.Generator(device="cuda").manual_seed(1)
    train(straight, 10, gen)
    expected = [p.detach().clone() for p in straight["model"].parameters()]

    first = build()
    torch.cuda.manual_seed(7)
    gen = torch.Generator(device="cuda").manual_seed(1)
    train(first, 5, gen)
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, "resume"), preemption_signals=())
    ckpt.save({**first, "gen": gen.get_state()}, 5).wait()
    ckpt.close()
    torch.cuda.manual_seed(12345)  # another CUDA RNG state: the load must restore the saved one
    second = build()
    holder = {**second, "gen": torch.zeros(0, dtype=torch.uint8)}
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, "resume"), preemption_signals=())
    assert ckpt.load(holder) == 5
    ckpt.close()
    gen = torch.Generator(device="cuda")
    gen.set_state(holder["gen"].cpu())
    train(second, 5, gen)
    got = list(second["model"].parameters())
    equal = all(torch.equal(a, b) for a, b in zip(expected, got))
    return {"bitwise_after_resume": equal, "scaler_scale": float(second["scaler"].get_scale())}


def check_fsdp2(root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        def build(seed):
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16)).cuda()
            mesh = init_device_mesh("cuda", (1,))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        model, optim = build(0)
        model(torch.randn(8, 512, device="cuda")).sum().backward()
        optim.step()
        path = os.path.join(root, "fsdp2")
        ckpt = shardckpt.Checkpointer(local_dir=path, preemption_signals=())
        ckpt.save({"model": model, "optimizer": optim}, 1).wait()
        ckpt.close()
        fresh, fresh_optim = build(1)
        ckpt = shardckpt.Checkpointer(local_dir=path, preemption_signals=())
        ckpt.load({"model": fresh, "optimizer": fresh_optim})
        ckpt.close()
        a, b = get_model_state_dict(model), get_model_state_dict(fresh)
        equal = all(torch.equal(a[k].full_tensor(), b[k].full_tensor()) for k in a)
        stock = {"model": {k: torch.zeros_like(v.full_tensor()) for k, v in a.items()}}
        dcp.load(stock, storage_reader=dcp.FileSystemReader(os.path.join(path, "step_0000000001")), no_dist=True)
        readable = all(torch.equal(stock["model"][k].cpu(), a[k].full_tensor().cpu()) for k in a)
        return {"fsdp2_nccl_bitwise": equal, "stock_dcp_readable": readable}
    finally:
        dist.destroy_process_group()


def check_torchtitan(root: str, device: str = "cuda", width: int = 4096, layers: int = 8, steps: int = 6) -> dict:
    try:
        from torchtitan.components.optimizer import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import default_adamw

        from shardckpt.integrations.torchtitan import ShardckptCheckpointManager
    except ImportError as exc:
        return {"skipped": f"torchtitan >= 0.3 is not installed ({exc})"}

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
        optimizers = default_adamw(lr=1e-4).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
        return model, optimizers, schedulers

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    folder = os.path.join(root, "torchtitan")
    config = ShardckptCheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                                               extra={"overlap_copies": device == "cuda", "preemption_signals": ()})
    model, optimizers, schedulers = build()
    manager = config.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                           states={}, sd_adapter=None, base_folder="")
    x = torch.randn(256, width, device=device)
    at_save, blocked, step_s = {}, [], []
    for step in range(1, steps + 1):
        sync()
        t0 = time.perf_counter()
        optimizers.zero_grad()
        model(x).square().mean().backward()
        sync()
        step_s.append(time.perf_counter() - t0)
        manager.maybe_wait_for_staging()  # torchtitan's train_step: before the optimizer step
        optimizers.step()
        schedulers.step()
        t0 = time.perf_counter()
        manager.save(step)  # returns with the copies enqueued (overlap_copies)
        blocked.append(time.perf_counter() - t0)
        at_save[step] = [p.detach().clone() for p in model.parameters()]  # ordered before the next step's writes
    manager.close()
    fenced = True
    for step in (steps, 2):
        fresh, fresh_opt, fresh_sched = build()
        loader = ShardckptCheckpointManager.Config(enable=True, folder=folder, keep_latest_k=0, load_step=step,
                                                   extra={"preemption_signals": ()}).build(
            dataloader=None, model_parts=[fresh], optimizers=fresh_opt, lr_schedulers=fresh_sched, states={},
            sd_adapter=None, base_folder="")
        loader.load(step=step)
        loader.close()
        fenced = fenced and all(torch.equal(a, b) for a, b in zip(at_save[step], fresh.parameters()))
    return {
        "fenced_bitwise": fenced,
        "state_gib": round(3 * layers * width * width * 4 / 2**30, 2),  # fp32 parameters and two AdamW moments
        "median_blocked_s": round(statistics.median(blocked[1:]), 4),
        "median_fwd_bwd_s": round(statistics.median(step_s[1:]), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="state size of the blocked/overlap check")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    with tempfile.TemporaryDirectory(prefix="shardckpt-gpu-") as root:
        result["blocked_default"] = check_blocked_and_overlap(args.gib, root, overlap=False)
        result["blocked_and_overlap"] = check_blocked_and_overlap(args.gib, root, overlap=True)
        result["resume"] = check_resume(root)
        result["fsdp2"] = check_fsdp2(root)
        result["torchtitan"] = check_torchtitan(root)
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ok = (result["resume"]["bitwise_after_resume"] and all(result["fsdp2"].values())
          and result["torchtitan"].get("fenced_bitwise", True))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
