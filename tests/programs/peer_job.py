"""The peer tier under torchrun: K launchers make K "nodes" with node-local directories DIR/node<g>.

usage: peer_job.py save    DIR OUT [--steps N] [--kill]
       peer_job.py restore DIR OUT [--then-replace]

save:    N saves of an FSDP2 model (peer tier on by default: >= 2 nodes, node-local
         directories); step N-1 is waited for until it is peer-durable, each rank
         records status() in OUT/outcome.<rank>.json and rank 0 writes the full
         state of step N to OUT/saved.pt. With --kill every rank SIGKILLs itself
         right after step N is committed locally (OUT/killed.<rank> holds the time);
         before that save, each node's peer daemon is paused (SIGSTOP): the test
         resumes it once every trainer is dead.
restore: load the newest step (world size and nodes may differ from the save);
         rank 0 writes OUT/restored.pt; every rank records the elastic plan and
         where its node's copy took the step's files from (``last_sources``).
         With --then-replace (2 nodes): one more step, saved after a SIGTERM (the
         emergency save); when ``preempted`` turns true each node's local rank 0
         records whether its files of that step are committed in the other
         node's replica directory (OUT/sigterm.<node>.json). Rank 0 writes the
         state of that step to OUT/saved2.pt. Then node 1 is replaced: its daemon
         ends, its local_dir is deleted, and a new Checkpointer on every rank loads
         the newest step at the same world size (rank 0 writes OUT/restored2.pt,
         every rank OUT/replaced.<rank>.json).
"""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import time

import common
import torch
from multinode import build, full_state, train_step

import shardckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore"])
    parser.add_argument("dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--then-replace", action="store_true")
    args = parser.parse_args()
    rank, world = common.init()
    local_dir = os.path.join(args.dir, f"node{os.environ['GROUP_RANK']}")
    model, optim = build()
    state = {"model": model, "optimizer": optim, "extra": {"rank_count": world}}
    gen = torch.Generator().manual_seed(100 + rank)
    def checkpointer(**kw):
        return shardckpt.Checkpointer(local_dir=local_dir, keep_last=2, micro_batch_size=2, grad_accum_steps=2,
                                      mode="sync", **kw)

    ckpt = checkpointer(preemption_signals=() if not args.then_replace else (signal.SIGTERM,))
    outcome = {}
    if args.mode == "save":
        for step in range(1, args.steps + 1):
            train_step(model, optim, gen)
            if step == args.steps:
                tensors = full_state(model, optim)  # collective: every rank, before the last save
                if rank == 0:
                    torch.save({"step": step, "tensors": tensors}, os.path.join(args.out, "saved.pt"))
                deadline = time.monotonic() + 60
                while ckpt.status().get("latest_peer") != step - 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                outcome["status"] = ckpt.status()
                common.write_json(os.path.join(args.out, f"outcome.{rank}.json"), outcome)
                torch.distributed.barrier()  # every node's step N-1 is replicated before any daemon pauses
                if args.kill and int(os.environ["LOCAL_RANK"]) == 0:
                    # The node's daemon is paused until the test resumes it, after every trainer is
                    # dead: whatever it replicates of the last step, it does without a trainer.
                    with open(os.path.join(local_dir, ".shardckpt-remote", "peer.json")) as f:
                        os.kill(json.load(f)["pid"], signal.SIGSTOP)
                torch.distributed.barrier()
            ckpt.save(state, step)  # sync: committed locally on return
        if args.kill:
            common.write_json(os.path.join(args.out, f"killed.{rank}"), time.time())
            # Every rank has recorded its kill before any dies: torchrun ends a node's other ranks as
            # soon as one of them is gone, which could otherwise come before their record.
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.close()
    else:
        outcome["restored"] = ckpt.load(state)
        outcome["plan"] = dataclasses.asdict(ckpt.last_plan)
        outcome["sources"] = ckpt.last_sources
        if not args.then_replace:
            ckpt.close()
        tensors = full_state(model, optim)
        if rank == 0:
            torch.save({"step": outcome["restored"], "tensors": tensors}, os.path.join(args.out, "restored.pt"))
        common.write_json(os.path.join(args.out, f"outcome.{rank}.json"), outcome)
        if args.then_replace:
            sigterm_then_replace(args, ckpt, checkpointer, state, model, optim, gen, outcome["restored"], local_dir)
    common.finish()


def sigterm_then_replace(args, ckpt, checkpointer, state, model, optim, gen, step, local_dir) -> None:
    rank, node = torch.distributed.get_rank(), int(os.environ["GROUP_RANK"])
    other = os.path.join(args.dir, f"node{1 - node}", ".shardckpt-replicas")
    os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets a flag; the ranks agree on it at the next save
    while not ckpt.preempted and step < 10:  # the save the ranks agreed on is the emergency one
        step += 1
        train_step(model, optim, gen)
        tensors = full_state(model, optim)
        if rank == 0:
            torch.save({"step": step, "tensors": tensors}, os.path.join(args.out, "saved2.pt"))
        ckpt.save(state, step)
    held = [os.path.join(other, o, f"step_{step:010d}", "shardckpt.json") for o in os.listdir(other)] \
        if os.path.isdir(other) else []
    if int(os.environ["LOCAL_RANK"]) == 0:
        common.write_json(os.path.join(args.out, f"sigterm.{node}.json"), {
            "step": step, "preempted": ckpt.preempted, "replica_committed": any(os.path.exists(p) for p in held),
            "status": ckpt.status(),
        })
    ckpt.close()
    torch.distributed.barrier()
    if node == 1 and int(os.environ["LOCAL_RANK"]) == 0:  # node 1 is replaced: a new disk, a new daemon
        with open(os.path.join(local_dir, ".shardckpt-remote", "peer.json")) as f:
            os.kill(json.load(f)["pid"], signal.SIGKILL)
        shutil.rmtree(local_dir)
    torch.distributed.barrier()
    train_step(model, optim, gen)  # the live state moves on: only the load brings the saved one back
    fresh = checkpointer(preemption_signals=())
    outcome = {"restored": fresh.load(state), "plan": dataclasses.asdict(fresh.last_plan),
               "sources": fresh.last_sources}
    fresh.close()
    tensors = full_state(model, optim)
    if rank == 0:
        torch.save({"step": outcome["restored"], "tensors": tensors}, os.path.join(args.out, "restored2.pt"))
    common.write_json(os.path.join(args.out, f"replaced.{rank}.json"), outcome)


if __name__ == "__main__":
    main()
