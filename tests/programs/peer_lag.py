"""Three nodes, one replica lagging, then a node lost: retention on every node decides from agreed facts.

usage: peer_lag.py save    DIR OUT     (3 nodes x 1 rank, node-local directories, keep_last=1)
       peer_lag.py restore DIR OUT     (the 2 surviving nodes x 1 rank)

save:  step 1 is saved and becomes peer-durable everywhere (every node's files on the next node of
       the ring); node 2's daemon is then paused (SIGSTOP): node 1's files of later steps never reach
       their holder, and node 2's own never leave. Steps 2 and 3 are saved; node 0 waits until each is
       peer-durable (its holder, node 1, is fine). Rank 0 writes the full state of every step to
       OUT/saved.<step>.pt; each rank writes its node's committed steps to OUT/kept.<rank>.json.
restore: load the newest step the survivors can rebuild; rank 0 writes OUT/restored.pt and
       OUT/restored.json.
"""

import argparse
import json
import os
import signal
import time

import common
import torch
from multinode import build, full_state, train_step

import shardckpt
from shardckpt.format import layout


def wait_peer(ckpt, step: int) -> None:
    deadline = time.monotonic() + 60
    while ckpt.status().get("latest_peer") != step:
        if time.monotonic() > deadline:
            raise SystemExit(f"step {step} did not become peer-durable: {ckpt.status()}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("dir")
    parser.add_argument("out")
    args = parser.parse_args()
    rank, _world = common.init()
    node = int(os.environ["GROUP_RANK"])
    local_dir = os.path.join(args.dir, f"node{node}")
    model, optim = build()
    state = {"model": model, "optimizer": optim}
    gen = torch.Generator().manual_seed(100 + rank)
    # A restore goes past a newer step whose lost node's files are nowhere (on_corrupt="fallback").
    ckpt = shardckpt.Checkpointer(local_dir=local_dir, keep_last=1, mode="sync", preemption_signals=(),
                                  on_corrupt="fallback" if args.mode == "restore" else "error")
    if args.mode == "save":
        for step in (1, 2, 3):
            train_step(model, optim, gen)
            tensors = full_state(model, optim)  # collective: every rank
            if rank == 0:
                torch.save({"step": step, "tensors": tensors}, os.path.join(args.out, f"saved.{step}.pt"))
            ckpt.save(state, step)
            if step == 1 or node == 0:
                wait_peer(ckpt, step)
            torch.distributed.barrier()  # step 1: every node's files are on their holder before the pause
            if step == 1 and node == 2:
                with open(os.path.join(local_dir, ".shardckpt-remote", "peer.json")) as f:
                    os.kill(json.load(f)["pid"], signal.SIGSTOP)  # the lagging replica, until the test ends it
            torch.distributed.barrier()
        common.write_json(os.path.join(args.out, f"kept.{rank}.json"), layout.committed_steps(local_dir))
        ckpt.close(timeout=2)  # node 1's and node 2's step 3 cannot become peer-durable
    else:
        restored = ckpt.load(state)
        ckpt.close(timeout=2)
        tensors = full_state(model, optim)
        if rank == 0:
            torch.save({"step": restored, "tensors": tensors}, os.path.join(args.out, "restored.pt"))
            common.write_json(os.path.join(args.out, "restored.json"), {"restored": restored})
    common.finish()


if __name__ == "__main__":
    main()
