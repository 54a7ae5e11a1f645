"""Training slowdown from checkpointing every N steps (case ``training``).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/bench_train.py --steps 100 --every 5 --repeats 3 [--json FILE]

Also runs as one plain process (no DDP). A small MLP (``--width`` x
``--layers``, about 4 MB of parameters; with AdamW about 13 MB of state) is
trained on a fixed random batch, wrapped in DDP under torchrun. Every round
runs ``--steps`` steps of each variant, the order rotating:

  no checkpointing (baseline)
  shardckpt.save every N      ``Checkpointer.save({"model", "optimizer"}, step)`` every
                              ``--every`` steps (async, keep_last=2)
  dcp.async_save every N      stock DCP, thread mode, its own gloo group, a fresh
                              ``get_state_dict`` per save; a save waits for the previous one

A round's time runs from a barrier to the end of the last step and of the
last save (slowest rank). Reported: steps/s (median over rounds) and its
ratio to the baseline: 1.0 means checkpointing costs nothing.

The peer tier (case ``peer_training``): ``--nodes 2`` run as one plain process
starts two torchrun launchers of this script (``--nnodes 2 --node-rank i``,
1 rank each, static rendezvous on 127.0.0.1): two simulated nodes, each with
its own directory. The variants are then the baseline and shardckpt.save every
N with ``peer_replicas=0`` and with ``peer_replicas=1`` (each node's daemon
sends its files of each committed step to the other node while the loop
trains). After a replicating round, and outside its time, the newest step is
waited for until it is peer-durable, so that no transfer spills into the next
round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import shardckpt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps per variant and round")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (median reported)")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds each step also waits, as if the accelerator computed (the demo's loop: 0.1)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp)")
    parser.add_argument("--json", help="write the result here (rank 0)")
    parser.add_argument("--nodes", type=int, default=0,
                        help="2: two simulated nodes, checkpointing with and without the peer tier (see above)")
    args = parser.parse_args()
    distributed = "WORLD_SIZE" in os.environ
    if args.nodes and not distributed:
        sys.exit(launch_nodes(args.nodes))
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    def barrier() -> None:
        if distributed:
            dist.barrier()

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model: torch.nn.Module = torch.nn.Sequential(*layers)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    def train_step() -> None:
        optim.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optim.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)

    for _ in range(5):  # warm-up; also creates the optimizer state
        train_step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state_bytes = param_bytes + sum(t.numel() * t.element_size() for s in optim.state.values()
                                    for t in s.values() if torch.is_tensor(t))

    box = [tempfile.mkdtemp(prefix="shardckpt-bench-train-", dir=args.dir) if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(box, src=0)
    root = box[0]
    side = dist.new_group(backend="gloo") if distributed else None
    node_dir = os.path.join(root, f"node{os.environ.get('GROUP_RANK', '0')}") if args.nodes else root
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(node_dir, "shardckpt"), keep_last=2, preemption_signals=(),
                                  **({"peer_replicas": 0} if args.nodes else {}))
    state = {"model": model, "optimizer": optim}
    counter = [0]

    def ours(step: int) -> Any:
        counter[0] += 1
        return ckpt.save(state, counter[0])

    replicating = shardckpt.Checkpointer(local_dir=os.path.join(node_dir, "replicated"), keep_last=2,
                                         preemption_signals=(), peer_replicas=1) if args.nodes else None

    def replicated(step: int) -> Any:
        counter[0] += 1
        return replicating.save(state, counter[0])

    def drain_replicated() -> None:
        replicating.wait()

    def settle_replicated() -> None:
        """Outside the round's time: the newest step peer-durable before the next round starts."""
        deadline = time.monotonic() + 120
        while replicating.status().get("latest_peer") != counter[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        barrier()

    pending: list[Any] = []

    def stock(step: int) -> Any:
        if pending:
            pending.pop().result()
        counter[0] += 1
        model_sd, optim_sd = get_state_dict(model, optim)
        future = dcp.async_save({"model": model_sd, "optimizer": optim_sd}, process_group=side,
                                checkpoint_id=os.path.join(root, f"dcp_{counter[0]}"))
        pending.append(future)

    def drain_ours() -> None:
        ckpt.wait()

    def drain_stock() -> None:
        if pending:
            pending.pop().result()
        barrier()
        if rank == 0:
            for name in os.listdir(root):
                if name.startswith("dcp_"):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    variants: list[tuple[str, Callable[[int], Any] | None, Callable[[], None] | None]] = [
        ("no checkpointing (baseline)", None, None),
        (f"shardckpt.save every {args.every}" + (", peer_replicas=0" if args.nodes else ""), ours, drain_ours),
    ]
    if args.nodes:
        variants.append((f"shardckpt.save every {args.every}, peer_replicas=1", replicated, drain_replicated))
    else:
        variants.append((f"dcp.async_save every {args.every}", stock, drain_stock))

    def run(save: Callable[[int], Any] | None, drain: Callable[[], None] | None) -> float:
        barrier()
        t0 = time.perf_counter()
        for step in range(1, args.steps + 1):
            train_step()
            if save is not None and step % args.every == 0:
                save(step)
        if drain is not None:
            drain()
        return common.slowest(time.perf_counter() - t0)

    for _, save, drain in variants[1:]:  # one save each first (not counted): buffers, groups, threads
        save(0)
        drain()
    rates: dict[str, list[float]] = {label: [] for label, _, _ in variants}
    for r in range(args.repeats):
        k = r % len(variants)
        for label, save, drain in variants[k:] + variants[:k]:
            rates[label].append(args.steps / run(save, drain))
            if save is replicated:
                settle_replicated()
        if rank == 0:
            print(f"  round {r + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f} steps/s" for k, v in rates.items()),
                  flush=True)
    ckpt.close()
    if replicating is not None:
        peer_durable = replicating.status().get("latest_peer")
        replicating.close()
    if rank == 0:
        result = common.new_result("peer_training" if args.nodes else "training", state_bytes, unit="steps/s",
                                   better="higher", ratio_label="no checkpointing", repeats=args.repeats,
                                   world_size=world, steps=args.steps, every=args.every, step_sleep=args.step_sleep)
        for i, (label, _, _) in enumerate(variants):
            common.add_row(result, label, rates[label], floor=i == 0)
        result["notes"].append(
            f"{'DDP over ' + str(world) + ' ranks (gloo)' if distributed else 'one process'}, MLP {args.layers} x "
            f"{args.width}, batch {args.batch}, AdamW: {common.fmt_bytes(state_bytes)} of state per save; "
            f"a checkpoint every {args.every} steps")
        if args.nodes:
            result["notes"].append(
                f"{args.nodes} simulated nodes (torchrun --nnodes {args.nodes} --node-rank i on 127.0.0.1, 1 rank "
                f"each, a directory each); peer_replicas=1: each node's daemon replicates every committed step to "
                f"the other node during the round (the newest step, {peer_durable}, peer-durable at the end)")
        common.emit(result, args.json)
        shutil.rmtree(root, ignore_errors=True)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def launch_nodes(nodes: int) -> int:
    """Run this script as ``nodes`` simulated nodes: one torchrun launcher each, 1 rank, static rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launchers = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                                   f"--node-rank={i}", "--nproc-per-node=1", "--rdzv-backend=static",
                                   "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                                   os.path.abspath(__file__), *sys.argv[1:]]) for i in range(nodes)]
    codes = [p.wait() for p in launchers]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    main()
