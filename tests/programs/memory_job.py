"""The memory tier through crashes: one phase per launch (or per torchrun restart), the last one closes.

usage: memory_job.py DIR OUT PHASE [PHASE ...]

Runs as one process (no torchrun) or under torchrun; phase i runs at the
i-th start of the job (counted in ``OUT/starts``; a test starts the job once
per phase). A phase is a comma-separated list of actions:

  load=N       load() and check it returned N, the state bitwise the one saved at N (``load=none``: nothing)
  load@N=M     load(state, step=N) (a rollback) returns M, likewise checked
  train=A-B    train steps A..B, save() after each (memory every step, disk every 10)
  kill         every rank: a barrier, then SIGKILL (right after the last save() returned)
  killcopy=N   rank 1 (rank 0 alone) dies during its copy of step N (failpoint memory.copied); the other
               ranks die right after that save() returns
  reboot       every rank's copies look like those of another boot (rank 0 rewrites its records' boot id)
               or are gone (the other ranks remove theirs); the next actions use a new Checkpointer
  close        close(): a step newer in memory than on disk goes to disk, the memory is freed
  use=DIR:K:E  from here a Checkpointer on DIR with memory_keep=K, every_steps=E
  stall        the next disk write stalls (its writer thread sleeps) and never commits
  wait         wait() for the disk write in flight
  other=DIR    a second job on DIR keeps step 1 in memory and dies (SHARDCKPT_MEMORY_LINGER_S=1): its node's
               keeper frees the memory

MEMORY_JOB_SHM=DIR gives each node its own shared memory, DIR/node<n> (SHARDCKPT_SHM_DIR), as on
separate machines; n is MEMORY_JOB_NODE, else the node rank (GROUP_RANK).

After each save() the saved state is dumped (OUT/expect-<dir>-<step>.rank<r>.pt); a load
compares the live state with the dump of the step it returned (a plain tensor that differs by rank
with rank 0's value). OUT/phase<i>.rank<r>.json
records what each load returned and whether the state matched.
"""

import glob
import json
import os
import signal
import sys
import time

import common
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import _failpoints
from shardckpt.format import shm


def main() -> None:
    root, out, phases = sys.argv[1], sys.argv[2], sys.argv[3:]
    if os.environ.get("MEMORY_JOB_SHM"):
        node = os.environ.get("MEMORY_JOB_NODE") or os.environ.get("GROUP_RANK", "0")
        os.environ["SHARDCKPT_SHM_DIR"] = os.path.join(os.environ["MEMORY_JOB_SHM"], f"node{node}")
        os.makedirs(os.environ["SHARDCKPT_SHM_DIR"], exist_ok=True)
    distributed = "WORLD_SIZE" in os.environ
    rank, world = common.init() if distributed else (0, 1)
    starts = os.path.join(out, "starts")
    index = len(open(starts).read()) if os.path.exists(starts) else 0
    if distributed:
        dist.barrier()  # every rank read the count
    if rank == 0:
        with open(starts, "a") as f:
            f.write("x")
    torch.manual_seed(0)
    model = common.TinyNet(width=16)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"at": 0}
    # A plain tensor of more than 64 elements that differs by rank: every copy, the memory's too (each rank's
    # own, on its machine), holds rank 0's.
    stats = {"hist": torch.zeros(100)}
    state = {"model": model, "optimizer": optim, "extra": extra, "stats": stats}
    options = dict(local_dir=root, every_steps=10, memory_every_steps=1, memory_keep=3, keep_last=2,
                   preemption_signals=())
    ckpt = shardckpt.Checkpointer(**options)
    tag = [os.path.basename(root)]  # names the dumps of the Checkpointer in use
    torch.manual_seed(100 + rank)
    result = {"phase": index, "loads": []}

    def record() -> None:
        with open(os.path.join(out, f"phase{index}.rank{rank}.json"), "w") as f:
            json.dump(result, f)

    def snapshot() -> dict:
        return {"model": {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()},
                "optimizer": common.flat_tensors(optim.state_dict()), "extra": dict(extra),
                "rng": torch.get_rng_state(), "hist": stats["hist"] - rank}

    def same(step: int) -> bool:
        want, have = torch.load(os.path.join(out, f"expect-{tag[0]}-{step}.rank{rank}.pt")), snapshot()
        return (want["extra"] == have["extra"] and torch.equal(want["rng"], have["rng"])
                and torch.equal(want["hist"], stats["hist"])  # rank 0's value on every rank
                and all(torch.equal(want["model"][k], have["model"][k]) for k in want["model"])
                and want["optimizer"].keys() == have["optimizer"].keys()
                and all(torch.equal(want["optimizer"][k], have["optimizer"][k]) for k in want["optimizer"]))

    def train(first: int, last: int, kill_copy: int | None = None) -> None:
        for step in range(first, last + 1):
            x = torch.randn(4, 8)
            loss = model(x).square().mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
            extra["at"] = step
            stats["hist"] = torch.full((100,), 10.0 * step + rank)
            if step == kill_copy:
                record()
                if rank == min(1, world - 1):
                    _failpoints.arm("memory.copied", _failpoints.KILL)
            handle = ckpt.save(state, step)
            torch.save(snapshot(), os.path.join(out, f"expect-{tag[0]}-{step}.rank{rank}.pt"))
            result.setdefault("tiers", {})[step] = handle.tier
            if step == kill_copy:
                os.kill(os.getpid(), signal.SIGKILL)

    def die() -> None:
        record()
        if distributed:
            dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)

    for action in phases[index].split(","):
        name, _sep, arg = action.partition("=")
        if name == "load" or name.startswith("load@"):
            asked = int(name[5:]) if name.startswith("load@") else None
            got = ckpt.load(state, step=asked)
            result["loads"].append({"asked": asked, "got": got, "same": got is not None and same(got),
                                    "from": ckpt.status()["restored_from"]})
            if arg != ("none" if got is None else str(got)):
                result["error"] = f"load returned {got}, expected {arg}"
        elif name == "train":
            first, last = map(int, arg.split("-"))
            train(first, last)
        elif name == "killcopy":
            train(int(arg), int(arg), kill_copy=int(arg))
        elif name == "kill":
            die()
        elif name == "reboot":
            ns = shm.namespace(root)
            for path in glob.glob(os.path.join(ns, f"r{rank}-*")):
                if rank == 0 and path.endswith(".rec"):
                    with open(path) as f:
                        body = json.load(f)
                    body["boot_id"] = "0d15ea5e-0000-4000-8000-000000000000"
                    with open(path, "w") as f:
                        json.dump(body, f)
                elif rank != 0:
                    os.unlink(path)
            if distributed:
                dist.barrier()
            ckpt = shardckpt.Checkpointer(**options)  # as a new process would: it reads the shared memory afresh
        elif name == "close":
            ckpt.close()
            result.setdefault("steps", {})[tag[0]] = ckpt.steps()
        elif name == "use":
            path, keep, every = arg.split(":")
            options.update(local_dir=path, memory_keep=int(keep), every_steps=int(every))
            ckpt, tag[0] = shardckpt.Checkpointer(**options), os.path.basename(path)
        elif name == "wait":
            ckpt.wait()
        elif name == "stall":  # the next disk write stalls (its writer thread sleeps): it never commits
            _failpoints.arm("write.done", lambda: time.sleep(120))
        elif name == "other":
            os.environ["SHARDCKPT_MEMORY_LINGER_S"] = "1"
            other = shardckpt.Checkpointer(local_dir=arg, memory_every_steps=1, preemption_signals=())
            other.save({"model": model}, 1)
            result["other"] = shm.namespace(arg)
            die()
    record()
    if distributed:
        common.finish()


if __name__ == "__main__":
    main()
