"""Multi-node save/restore under torchrun (two launchers make two "nodes" on one machine).

usage: multinode.py save    DIR OUT --layout shared|local|rank [--steps N]
       multinode.py restore DIR OUT --layout shared|local|rank
       multinode.py faults  DIR OUT --layout shared,local
       multinode.py resume  DIR OUT --layout shared|local|rank
       multinode.py resave  DIR OUT --layout shared|local|rank

``--layout shared``: every node uses DIR itself; ``local``: node g uses
DIR/node<g> (GROUP_RANK), as node-local NVMe would be; ``rank``: rank r uses
DIR/rank<r> (one directory copy per rank, from a single launcher).

save:    N async saves of an FSDP2 model (every rank's state changes each
         step); rank 0 writes OUT/saved.pt (full tensors, the step) and every
         rank OUT/outcome.<rank>.json.
restore: load the newest step, rank 0 writes OUT/restored.pt. With
         --corrupt-transfer a first load has one bit of the first chunk
         sent between nodes flipped on the way (must be refused), the
         second load none.
resume:  load() as a relaunched job does, recording what it raised; then a
         Checkpointer with start_fresh=True loads and saves steps 1 and 2.
resave:  load(step=N-1) and save step N again (another save of the number);
         rank 0 writes OUT/saved.pt.
faults:  a sequence of saves in which one rank fails at a named point of the
         commit path (write, hash, commit, retention), once per layout of the
         comma-separated list, each in DIR/<layout> (one launch for both:
         the same job twice would start the same processes twice); every
         rank records the outcome of every step per layout in
         OUT/outcome.<rank>.json.
"""

import argparse
import json
import os
import re

import common
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardckpt
from shardckpt import _failpoints
from shardckpt.format import layout


def build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = common.TinyNet(width=24)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (net.fc1, net.fc2, net.fc3):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, optim, gen):
    model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def full_state(model, optim):
    flat = common.flat_tensors(get_model_state_dict(model))
    flat.update({"optim." + k: v for k, v in common.flat_tensors(get_optimizer_state_dict(model, optim)).items()})
    return flat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "restore", "faults", "resume", "resave"])
    parser.add_argument("dir")
    parser.add_argument("out")
    parser.add_argument("--layout", required=True, help="shared|local|rank (faults: a comma-separated list)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--corrupt-transfer", action="store_true")
    parser.add_argument("--no-fresh", action="store_true", help="resume: only the load")
    parser.add_argument("--seed", type=int, default=0, help="offsets the data's seed (resave: other bytes)")
    args = parser.parse_args()
    kinds = args.layout.split(",")
    if not set(kinds) <= {"shared", "local", "rank"} or (len(kinds) > 1 and args.mode != "faults"):
        parser.error(f"--layout {args.layout}: shared, local or rank (a list in faults mode only)")
    rank, world = common.init()
    local_dir = layout_dir(args.dir, kinds[0], rank)
    model, optim = build()
    state = {"model": model, "optimizer": optim, "extra": {"rank_count": world}}
    gen = torch.Generator().manual_seed(100 + rank + 1000 * args.seed)
    outcome = {}

    if args.mode == "save":
        ckpt = shardckpt.Checkpointer(local_dir=local_dir, keep_last=None, preemption_signals=())
        for step in range(1, args.steps + 1):
            train_step(model, optim, gen)
            ckpt.save(state, step)  # async: the next save waits for this one
        ckpt.close()
        outcome = {"steps": ckpt.steps()}
        tensors = full_state(model, optim)  # collective (DTensor.full_tensor): every rank
        if rank == 0:
            torch.save({"step": args.steps, "tensors": tensors}, os.path.join(args.out, "saved.pt"))
    elif args.mode == "restore":
        ckpt = shardckpt.Checkpointer(local_dir=local_dir, preemption_signals=())
        if args.corrupt_transfer:
            _failpoints.arm("peer.chunk_read", _failpoints.FLIP)  # reached by the sending ranks only
            try:
                outcome["damaged_transfer"] = f"loaded step {ckpt.load(state)}"
            except shardckpt.ShardckptError as exc:
                outcome["damaged_transfer"] = f"{type(exc).__name__}: {exc}"
            step_dir = os.path.join(local_dir, f"step_{ckpt.steps()[-1]:010d}")
            outcome["held_after_damage"] = sorted(os.listdir(step_dir))
            manifest = layout.read_manifest(step_dir)
            outcome["bad_after_damage"] = [
                n for n in outcome["held_after_damage"] if n in manifest.files
                and layout.checksum_file(os.path.join(step_dir, n))[1] != manifest.files[n].checksum
            ]
        step = ckpt.load(state)
        outcome["sources"] = ckpt.last_sources
        ckpt.close()
        outcome.update(restored=step, extra=state["extra"])
        tensors = full_state(model, optim)
        if rank == 0:
            torch.save({"step": step, "tensors": tensors}, os.path.join(args.out, "restored.pt"))
    elif args.mode == "resume":
        ckpt = shardckpt.Checkpointer(local_dir=local_dir, preemption_signals=())
        try:
            outcome["restored"] = ckpt.load(state)
        except shardckpt.ShardckptError as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        ckpt.close()
        if args.no_fresh:
            with open(os.path.join(args.out, f"outcome.{rank}.json"), "w") as f:
                json.dump(outcome, f)
            common.finish()
            return
        fresh = shardckpt.Checkpointer(local_dir=local_dir, start_fresh=True, keep_last=None, preemption_signals=())
        outcome["fresh_restored"] = fresh.load(state)
        for step in (1, 2):
            train_step(model, optim, gen)
            fresh.save(state, step).wait()
        fresh.close()
        outcome["fresh_steps"] = fresh.steps()
    elif args.mode == "resave":
        ckpt = shardckpt.Checkpointer(local_dir=local_dir, keep_last=None, preemption_signals=())
        ckpt.load(state, step=args.steps - 1)
        train_step(model, optim, gen)
        train_step(model, optim, gen)
        ckpt.save(state, args.steps).wait()
        ckpt.close()
        tensors = full_state(model, optim)
        if rank == 0:
            torch.save({"step": args.steps, "tensors": tensors}, os.path.join(args.out, "saved.pt"))
    else:
        for kind in kinds:
            outcome[kind] = {}
            run_faults(kind, state, model, optim, gen, layout_dir(os.path.join(args.dir, kind), kind, rank),
                       outcome[kind])
    with open(os.path.join(args.out, f"outcome.{rank}.json"), "w") as f:
        json.dump(outcome, f)
    common.finish()


def layout_dir(base: str, kind: str, rank: int) -> str:
    """This rank's checkpoint directory under ``base`` for a layout (see the module's docstring)."""
    node = os.environ.get("GROUP_RANK", "0")
    return {"shared": base, "local": os.path.join(base, f"node{node}"), "rank": os.path.join(base, f"rank{rank}")}[kind]


def run_faults(kind, state, model, optim, gen, local_dir, outcome) -> None:
    """Every rank saves the same steps; FAULTS says which rank fails where.

    The failing rank is a non-committer for write and hash failures, and the
    committer of the second node's copy (the last rank's copy) for commit
    and retention failures, where one copy may already have committed.
    """
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    late_committer = world // 2 if kind == "local" else 0
    faults = {
        2: (1, "write.done"),
        4: (world - 1, "write.hashed"),
        6: (late_committer, "commit.manifest_written"),
        8: (late_committer, "commit.renamed"),
        10: (late_committer, "retention.hidden"),
    }
    ckpt = shardckpt.Checkpointer(local_dir=local_dir, keep_last=2, preemption_signals=())
    snapshots = {}
    for step in range(1, 12):
        train_step(model, optim, gen)
        who, point = faults.get(step, (None, None))
        if who == rank:
            _failpoints.arm(point, "raise")
        outcome[str(step)] = _save(ckpt, state, step)
        snapshots[step] = full_state(model, optim)
    # Step 11 saved again (other content) while the second node's commit fails: the
    # first node's copy must be put back as it was.
    train_step(model, optim, gen)
    if rank == late_committer:
        _failpoints.arm("commit.renamed", "raise")
    outcome["11-again"] = _save(ckpt, state, 11, force=True)
    train_step(model, optim, gen)
    outcome["12"] = _save(ckpt, state, 12)
    ckpt.close()
    outcome["committed"] = ckpt.steps()
    # The copy of step 11 that survived is the first save's.
    fresh_model, fresh_optim = build()
    again = shardckpt.Checkpointer(local_dir=local_dir, preemption_signals=())
    loaded = again.load({"model": fresh_model, "optimizer": fresh_optim, "extra": {}}, step=11)
    again.close()
    got = full_state(fresh_model, fresh_optim)
    outcome["step11_is_first_save"] = loaded == 11 and all(torch.equal(got[k], v) for k, v in snapshots[11].items())


def _save(ckpt, state, step, force=False) -> str:
    """``ok``, or ``failed on rank R: <error>`` as the SaveError says (the same on every rank)."""
    try:
        handle = ckpt.save(state, step, force=force)
        handle.wait()
    except shardckpt.SaveError as exc:
        found = re.search(r"failed on rank (\d+) \((\w+): ([^)]*)\)", str(exc))
        return f"failed on rank {found.group(1)}: {found.group(3)}" if found else f"unexpected: {exc}"
    return "ok"


if __name__ == "__main__":
    main()
