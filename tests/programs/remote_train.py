"""Save to a remote through per-node local dirs, or restore from it (under torchrun).

usage: remote_train.py save    BASE REMOTE OUT STEPS     local_dir = BASE/node<GROUP_RANK>
       remote_train.py restore BASE REMOTE OUT           restore the newest step, dump the state
       remote_train.py hang    BASE REMOTE OUT STEPS     save STEPS steps, start step STEPS+1 whose write
                                                         stalls before its local commit; wait to be killed
       remote_train.py deadnode BASE REMOTE OUT          node 1's uploader dies after step 1: steps 2-4
                                                         cannot commit; OUT.failed gets node 0's status once
                                                         they are reported failed; on OUT.go node 1's
                                                         uploader starts again and step 5 is saved

Environment: RT_WIDTH (the model's width, default 24), RT_CHUNK (bytes per chunk checksum,
default the library's), RT_LOAD_TWICE=1 (restore loads the step twice: the second load of
the same step at the same world size reads what the first one fetched), RT_DDP=1 (the model
and optimizer are replicated on every rank, as with DDP, instead of sharded by FSDP2),
RT_REPLICA=W (the state also holds "replica", a module of width W held whole by every rank).

OUT receives (rank 0) torch.save of the full model and optimizer tensors and
the step, for bitwise comparison by the test.
"""

import json
import os
import signal
import sys
import time

import common
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import shardckpt


def build():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = common.TinyNet(width=int(os.environ.get("RT_WIDTH", "24")))
    if os.environ.get("RT_DDP") == "1":
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in (net.fc1, net.fc2, net.fc3):
        fully_shard(layer, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def replica():
    """A module every rank holds whole (its saved values differ from the initial ones)."""
    width = int(os.environ.get("RT_REPLICA", "0"))
    if not width:
        return None
    torch.manual_seed(1)
    return common.TinyNet(width=width)


def dump(model, optim, step, out, rank, extra=None):
    flat = common.flat_tensors(get_model_state_dict(model))
    flat.update({"optim." + k: v for k, v in common.flat_tensors(get_optimizer_state_dict(model, optim)).items()})
    if extra is not None:
        flat.update({"replica." + k: v.detach().clone() for k, v in extra.state_dict().items()})
    if rank == 0:
        torch.save({"step": step, "tensors": flat}, out)


def held_report(local_dir, out):
    """On each node's first rank: the chunks its sparse copy says it holds that fail their checksum on disk."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    import json

    from shardckpt.format import layout
    from shardckpt.remote import ranged

    report = {"held": 0, "bad": []}
    for sparse in sorted(n for n in os.listdir(local_dir) if n.startswith(ranged.SPARSE_PREFIX)):
        directory = os.path.join(local_dir, sparse)
        manifest = ranged._read_manifest_copy(directory)
        with open(os.path.join(directory, ranged.HELD_NAME), encoding="utf-8") as f:
            held = json.load(f)
        for name, indices in held.items():
            entry = manifest.files[name]
            chunk, sums = layout.chunk_table(entry.chunks, entry.size)
            with open(os.path.join(directory, name), "rb") as f:
                for i in indices:
                    report["held"] += 1
                    if layout.chunk_sum(os.pread(f.fileno(), chunk, i * chunk)) != sums[i]:
                        report["bad"].append([sparse, name, i])
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f)


def main() -> None:
    mode, base, remote, out = sys.argv[1:5]
    if os.environ.get("RT_CHUNK"):
        from shardckpt.format import layout

        layout.CHUNK_BYTES = int(os.environ["RT_CHUNK"])
    rank, world = common.init()
    node = os.environ.get("GROUP_RANK", "0")
    local_dir = os.path.join(base, f"node{node}")
    if mode == "deadnode":
        deadnode(build, local_dir, remote, out, rank, node)
        common.finish()
        return
    model, optim = build()
    ckpt = shardckpt.Checkpointer(
        local_dir=local_dir, remote=remote, keep_last=2, remote_keep_last=2, drain_timeout_s=120,
        preemption_signals=(),
    )
    state = {"model": model, "optimizer": optim}
    extra = replica()
    if extra is not None:
        state["replica"] = extra
    if mode == "restore":
        step = ckpt.load(state)
        if os.environ.get("RT_LOAD_TWICE") == "1":
            # What the first load gave, and whether every chunk its sparse copy holds is intact, before the
            # second load (which checks held chunks from disk and would mend a bad one) reads it again.
            dump(model, optim, step, out + ".first", rank, extra)
            held_report(local_dir, f"{out}.held{node}.json")
            assert ckpt.load(state) == step
        dump(model, optim, step, out, rank, extra)
        ckpt.close()
        common.finish()
        return
    steps = int(sys.argv[5])
    # Replicated state stays alike on every rank: the same inputs everywhere.
    gen = torch.Generator().manual_seed(100 + (0 if os.environ.get("RT_DDP") == "1" else rank))
    for step in range(1, steps + 1):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        if extra is not None:
            with torch.no_grad():
                for p in extra.parameters():
                    p.add_(float(step))
        ckpt.save(state, step).wait()
    dump(model, optim, steps, out, rank, extra)
    if mode == "hang":
        # The next save stalls once its files are written, before its local commit: killed
        # there, it is a save abandoned after its files were uploaded early.
        from shardckpt import _failpoints

        _failpoints.arm("write.done", lambda: time.sleep(3600))
        ckpt.save(state, steps + 1)
        if rank == 0:
            with open(out + ".ready", "w") as f:
                f.write(str(steps))
        while True:
            time.sleep(1)
    ckpt.close()
    common.finish()


def deadnode(build, local_dir, remote, out, rank, node):
    """Node 1's uploader is a sidecar of its own (started here, SIGKILLed after step 1)."""
    from shardckpt.format import layout
    from shardckpt.node import node_registry, uploader_client
    from shardckpt.remote import commit as remote_commit

    uploader_client.HEALTH_EVERY_S = 0.2  # save() looks at the uploader's status often (default 10 s)
    lead = os.environ["LOCAL_RANK"] == "0"
    model, optim = build()
    state = {"model": model, "optimizer": optim}
    ckpt = shardckpt.Checkpointer(
        local_dir=local_dir, remote=remote, keep_last=None, remote_keep_last=2, drain_timeout_s=60,
        uploader="auto" if node == "0" else "external", preemption_signals=(),
    )
    gen = torch.Generator().manual_seed(100 + rank)

    def wait(pred, timeout, what):
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise SystemExit(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.1)

    def uploaded(step):
        return remote_commit.is_uploaded(os.path.join(local_dir, layout.step_dirname(step)), remote)

    def save(step):
        model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        ckpt.save(state, step).wait()

    def sidecar():
        uploader_client.spawn_uploader(local_dir, remote, ckpt._uploads.uploader_args())
        wait(lambda: node_registry.uploader_running(local_dir) is not None, 30, "node 1's uploader to start")

    if lead and node == "1":
        sidecar()
    torch.distributed.barrier()
    save(1)
    if lead:
        wait(lambda: uploaded(1), 60, "step 1 committed remotely")
    torch.distributed.barrier()
    if lead and node == "1":
        os.kill(node_registry.uploader_running(local_dir), signal.SIGKILL)
        wait(lambda: node_registry.uploader_running(local_dir) is None, 30, "node 1's uploader to die")
    torch.distributed.barrier()
    saved = {}
    for step in (2, 3, 4):
        save(step)
        saved[step] = time.time()
    if lead and node == "0":
        def reported():
            ckpt._uploads.check_health()  # what save() does, here without saving more
            return set(ckpt.status()["failed_commits"]) >= {2, 3, 4}

        wait(reported, 60, "steps 2-4 reported failed")
        st = ckpt.status()
        body = {"saved": saved, "reported": time.time(),
                "status": {k: st[k] for k in ("latest_remote", "failed_commits", "pending_upload_steps")}}
        with open(out + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(out + ".tmp", out + ".failed")
        wait(lambda: os.path.exists(out + ".go"), 120, "the test to measure")
    torch.distributed.barrier()
    if lead and node == "1":
        sidecar()
    save(5)
    if lead:
        wait(lambda: uploaded(5), 60, "step 5 committed remotely")
    torch.distributed.barrier()
    ckpt.close()


if __name__ == "__main__":
    main()
