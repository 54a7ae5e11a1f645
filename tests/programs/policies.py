"""Checkpoint policies at 2 ranks (DDP, gloo): best-by-metric, light/full, run config, trainable-only, remote_every,
every_seconds (fixed and "auto").

usage: policies.py best-light-config DIR OUT
       policies.py best-remote DIR REMOTE OUT
       policies.py remote-every DIR REMOTE OUT
       policies.py trainable DIR OUT
       policies.py MODE ARGS... + MODE ARGS...   (several jobs in turn in one launch)

Every rank writes OUT/result.<rank>.json; rank 0's shardckpt warnings also go
to OUT/warnings.log, its info lines to OUT/info.log. ``trainable`` also has
rank 0 write OUT/trainable.pt: the adapter weights and optimizer state saved.
"""

import copy
import json
import logging
import os
import signal
import sys
import time

import common
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import shardckpt

WIDTH = 512  # the frozen base: 4 x 512 x 512, about 4 MiB; the adapter a few KiB
LOSSES = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 6.0, 6: 7.0}


def model_state(width: int = 8):
    torch.manual_seed(0)
    model = DistributedDataParallel(common.TinyNet(width=width))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim, {"model": model, "optimizer": optim, "extra": {"at": 0}}


def train(model, optim, state, step):
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()
    state["extra"]["at"] = step


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def from_rank0(value):
    """Rank 0's value on every rank (what only rank 0's clock can tell)."""
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def kinds(directory):
    from shardckpt.format import layout

    return {s: layout.read_manifest(os.path.join(directory, layout.step_dirname(s))).kind
            for s in layout.committed_steps(directory)}


def preempted_light_step(root, rank):
    """full_every=3 with a preemption signal: the save it triggers is full, where the schedule says light."""
    model, optim, state = model_state()
    directory = os.path.join(root, "preempt-light")
    ckpt = shardckpt.Checkpointer(local_dir=directory, full_every=3, keep_last=None,
                                  preemption_signals=(signal.SIGUSR1,))
    saved = []
    for step in range(1, 10):
        train(model, optim, state, step)
        if ckpt.save(state, step) is not None:
            saved.append(step)
        if step == 1 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # voted at save 2, acted on at save 3 (light by schedule)
        if ckpt.preempted:
            break
    ckpt.close()
    return {"saved": saved, "preempted": ckpt.preempted, "kinds": kinds(directory)}


def every_seconds(root, rank, every, steps, pause, **options):
    """Saves by time at 2 ranks: rank 0's clock decides, the vote makes every rank save at the same call."""
    model, optim, state = model_state()
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, f"every-{every}"), every_seconds=every, keep_last=1,
                                  preemption_signals=(), **options)
    saved, starts = [], []
    for step in range(1, steps + 1):
        train(model, optim, state, step)
        t = time.monotonic()
        handle = ckpt.save(state, step)
        if handle is not None:
            handle.wait()
            saved.append(step)
            starts.append(t)
        time.sleep(pause)
    interval = ckpt._policy.interval_s()
    ckpt.close()
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return {"saved": saved, "rank0_gaps": from_rank0(gaps), "rank0_interval": from_rank0(interval)}


def best_light_config(root, out, rank):
    result = {}
    # best by metric: the example of the docs
    model, optim, state = model_state()
    best_dir = os.path.join(root, "best")
    ckpt = shardckpt.Checkpointer(local_dir=best_dir, keep_last=2, keep_best=1, best_metric="val_loss",
                                  best_mode="min", run_config={"lr": 0.1, "model": {"width": 8}},
                                  preemption_signals=())
    saved = {}
    for step in range(1, 7):
        train(model, optim, state, step)
        ckpt.save(state, step, metrics={"val_loss": LOSSES[step]}).wait()
        saved[step] = params(model)
    ckpt.close()
    result["best_steps"] = ckpt.steps()
    model, optim, state = model_state()
    again = shardckpt.Checkpointer(local_dir=best_dir, best_metric="val_loss", preemption_signals=(),
                                   run_config={"lr": 0.2, "model": {"width": 8}, "extra": 1})
    result["best_loaded"] = again.load(state, step="best")
    result["best_params_equal"] = same(params(model), saved[4])
    again.close()

    # light and full: every third save is full
    model, optim, state = model_state()
    light_dir = os.path.join(root, "light")
    ckpt = shardckpt.Checkpointer(local_dir=light_dir, full_every=3, keep_last=2, keep_last_light=2,
                                  preemption_signals=())
    for step in range(1, 9):
        train(model, optim, state, step)
        ckpt.save(state, step).wait()
        saved[step] = params(model)
    ckpt.close()
    result["light_steps"] = ckpt.steps()
    model, optim, state = model_state()
    fresh = shardckpt.Checkpointer(local_dir=light_dir, preemption_signals=())
    result["default_loaded"] = fresh.load(state)
    result["default_params_equal"] = same(params(model), saved[7])
    result["default_has_optimizer_state"] = bool(optim.state)
    model, optim, state = model_state()
    result["light_loaded"] = fresh.load(state, step=8)
    result["light_params_equal"] = same(params(model), saved[8])
    result["light_left_optimizer_empty"] = not any(optim.state.values())
    fresh.close()

    result["preempt_light"] = preempted_light_step(root, rank)
    result["every_fixed"] = every_seconds(root, rank, 0.6, 12, 0.15)
    result["every_auto"] = every_seconds(root, rank, "auto", 14, 0.2, mtbf_s=1)
    return result


def best_remote(root, url, out, rank):
    model, optim, state = model_state()
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, "node"), remote=url, keep_last=2, keep_best=1,
                                  best_metric="val_loss", remote_keep_last=2, drain_timeout_s=120,
                                  preemption_signals=())
    saved = {}
    for step in range(1, 7):
        train(model, optim, state, step)
        ckpt.save(state, step, metrics={"val_loss": LOSSES[step]}).wait()
        saved[step] = params(model)
    ckpt.close()
    torch.distributed.barrier()
    model, optim, state = model_state()
    fresh = shardckpt.Checkpointer(local_dir=os.path.join(root, f"empty-{rank}"), remote=url, uploader="off",
                                   best_metric="val_loss", preemption_signals=())
    loaded = fresh.load(state, step="best")
    fresh.close()
    return {"local_steps": ckpt.steps(), "best_from_remote": loaded, "params_equal": same(params(model), saved[4])}


def remote_every(root, url, out, rank):
    model, optim, state = model_state()
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, "node"), remote=url, remote_every=3, keep_last=2,
                                  drain_timeout_s=120, preemption_signals=(signal.SIGUSR1,))
    saved = []
    for step in range(1, 20):
        train(model, optim, state, step)
        handle = ckpt.save(state, step)
        if handle is not None:
            handle.wait()
            saved.append(step)
        if step == 4 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # one rank's preemption notice: the vote spreads it
        if ckpt.preempted:
            break
    ckpt.close()
    torch.distributed.barrier()  # rank 0 (the committer) drains the uploads in close(), then applies retention
    return {"saved": saved, "preempted_at": saved[-1] if ckpt.preempted else None, "local_steps": ckpt.steps()}


class Adapter(nn.Module):
    """A LoRA-like bottleneck with a buffer of its own (kept: its module is trainable)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(WIDTH, 4, bias=False)
        self.up = nn.Linear(4, WIDTH, bias=False)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls += 1
        return self.up(self.down(x))


class Adapted(nn.Module):
    """A frozen base of four WIDTH x WIDTH layers and a norm, with a small trainable adapter."""

    def __init__(self, base_seed: int) -> None:
        super().__init__()
        torch.manual_seed(base_seed)
        self.base = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
        self.norm = nn.LayerNorm(WIDTH)
        for p in list(self.base.parameters()) + list(self.norm.parameters()):
            p.requires_grad_(False)
        torch.manual_seed(1000 + base_seed)
        self.adapter = Adapter()

    def forward(self, x):
        return self.norm(self.base(x)) + self.adapter(x)


def optimizer_states_equal(a, b) -> bool:
    """The same per-parameter state, value by value, and the same hyperparameters."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for key, entries in b["state"].items():
        if entries.keys() != a["state"][key].keys():
            return False
        for name, value in entries.items():
            other = a["state"][key][name]
            if torch.is_tensor(value) != torch.is_tensor(other):
                return False
            if not (torch.equal(value, other) if torch.is_tensor(value) else value == other):
                return False
    return bool(b["state"])


def trainable(root, out, rank):
    def build(base_seed):
        model = DistributedDataParallel(Adapted(base_seed))
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, optim

    model, optim = build(0)
    for step in range(1, 3):
        model(torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(step))).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    sizes = {}
    for name, only in (("full", False), ("adapters", True)):
        ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, name), trainable_only=only, preemption_signals=())
        ckpt.save({"model": model, "optimizer": optim}, 2).wait()
        ckpt.close()
        step_dir = os.path.join(root, name, "step_0000000002")
        with open(os.path.join(step_dir, "shardckpt.json")) as f:
            manifest = json.load(f)
        sizes[name] = manifest["total_bytes"]
        frozen = manifest.get("frozen", {})
    saved = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    buffers = {n: b.clone() for n, b in model.module.named_buffers()}
    saved_optim = copy.deepcopy(optim.state_dict())
    if rank == 0:
        torch.save({"params": {n: v for n, v in saved.items() if n.startswith("adapter.")}, "buffers": buffers,
                    "optimizer": saved_optim}, os.path.join(out, "trainable.pt"))
    # The base comes from elsewhere (the same seed: the same weights), the adapters from the checkpoint.
    fresh, fresh_optim = build(0)
    ckpt = shardckpt.Checkpointer(local_dir=os.path.join(root, "adapters"), preemption_signals=())
    loaded = ckpt.load({"model": fresh, "optimizer": fresh_optim})
    got = dict(fresh.module.named_parameters())
    equal = all(torch.equal(got[n], v) for n, v in saved.items())
    got_buffers = dict(fresh.module.named_buffers())
    buffers_equal = all(torch.equal(got_buffers[n], v) for n, v in buffers.items())
    optim_restored = optimizer_states_equal(fresh_optim.state_dict(), saved_optim)
    # Another base: loads, with a warning naming the keys that differ.
    other, other_optim = build(1)
    ckpt.load({"model": other, "optimizer": other_optim})
    ckpt.close()
    return {"sizes": sizes, "frozen_keys": sorted(frozen.get("model", {})), "loaded": loaded,
            "bitwise": equal, "buffers_equal": buffers_equal, "optim_restored": optim_restored}


def main() -> None:
    rank, _world = common.init()
    for job in common.jobs(sys.argv[1:]):
        run(job, rank)
    common.finish()


def run(argv: list[str], rank: int) -> None:
    mode, out = argv[0], argv[-1]
    handlers = []
    if rank == 0:
        handler = logging.FileHandler(os.path.join(out, "warnings.log"))
        handler.setLevel(logging.WARNING)
        info = logging.FileHandler(os.path.join(out, "info.log"))
        info.setLevel(logging.INFO)
        handlers = [handler, info]
        for h in handlers:
            logging.getLogger("shardckpt").addHandler(h)
        logging.getLogger("shardckpt").setLevel(logging.INFO)
    if mode == "best-light-config":
        result = best_light_config(argv[1], out, rank)
    elif mode == "best-remote":
        result = best_remote(argv[1], argv[2], out, rank)
    elif mode == "remote-every":
        result = remote_every(argv[1], argv[2], out, rank)
    else:
        result = trainable(argv[1], out, rank)
    for h in handlers:  # the next job's lines go to its own OUT
        logging.getLogger("shardckpt").removeHandler(h)
        h.close()
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
