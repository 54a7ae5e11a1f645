"""The memory tier (case ``memory``): blocked time, restore after a SIGKILL, training slowdown, host RSS.

    .venv/bin/python benchmarks/bench_memory.py --gib 1 --repeats 3 [--part blocked,restore] [--json FILE]
    .venv/bin/python benchmarks/bench_memory.py --part training --steps 40 --repeats 5 [--json FILE]

One process per part, every figure a ratio to a floor measured in the same run:

blocked   A model of ``--gib`` fp32 parameters in one process (no optimizer: the
          bytes a copy moves are the parameters'). Floor: a copy of the parameters
          into host buffers allocated beforehand ("today's copy floor"); against it
          ``shardckpt.save`` without the memory tier (its staging copy), kept in
          memory only (``memory_every_steps=1``, the disk never due), and kept in
          memory and written to disk (``every_steps=1``), in alternating rounds.
          Two warm-up saves each (both slots allocated), then the median of
          ``--repeats``. The memory tools
          also report the growth of the process's RSS high-water mark over their
          saves against ``(memory_keep + 1)`` x the staged bytes (target <= 1.1).
restore   A child process saves the model to both tiers and is SIGKILLed right
          after ``save()`` returned. Then fresh processes, in rotating order, each
          timing only its restore into the live model (allocated before): the bytes
          copied from the shared memory into the model's tensors (floor: one copy
          of the bytes), ``Checkpointer.load`` from memory, and ``Checkpointer.load``
          from the disk (warm page cache; the memory hidden by pointing
          ``SHARDCKPT_SHM_DIR`` at an empty directory).
training  The GPT of ``examples/train_gpt.py`` (``--n-layer 4 --n-embd 128
          --block-size 64``, batch 16, AdamW; one process): steps/s without
          checkpoints (baseline) against a memory save every step (the disk never
          due), the two kinds of step alternating one by one (``--steps`` x
          ``--repeats`` of each).
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import shardckpt  # noqa: E402
from shardckpt.format import shm  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))


def add_paired(rows: list[dict]) -> None:
    """Each row's median ratio to the floor measured in the same round (rounds rotate the order): the load of
    shared cores moves both sides of a pair alike, where it moves the medians of separate rows apart."""
    floor = next((r for r in rows if r["floor"]), None)
    for row in rows:
        if floor is not None and len(row["values"]) == len(floor["values"]):
            row["extra"]["paired_ratio"] = statistics.median(v / f for v, f in zip(row["values"], floor["values"]))


def build_model(total_bytes: int, fill: bool = True) -> nn.Module:
    width = 2048
    layers = max(1, round(total_bytes / (width * width * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to_empty(device="cpu")
    if fill:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    return model


def staged_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------- blocked


def part_blocked(args: argparse.Namespace, scratch: Path) -> dict:
    model = build_model(int(args.gib * common.GIB))
    nbytes = staged_bytes(model)
    result = common.new_result("memory", nbytes, repeats=args.repeats)
    state = {"model": model}
    params = list(model.parameters())
    tools = [
        ("shardckpt.save, no memory tier", dict(every_steps=1)),
        ("shardckpt.save kept in memory only", dict(every_steps=10**9, memory_every_steps=1)),
        ("shardckpt.save kept in memory and written to disk", dict(every_steps=1, memory_every_steps=1)),
    ]

    def open_ckpt(i: int, options: dict) -> Any:
        return shardckpt.Checkpointer(local_dir=str(scratch / f"blocked-{i}"), keep_last=1, preemption_signals=(),
                                      **options)

    # The RSS high-water mark of each tool on its own: from before its Checkpointer exists, over three saves.
    rss: dict[str, dict] = {}
    for i, (label, options) in enumerate(tools):
        gc.collect()
        common.reset_peak_rss()
        before = common.rss_bytes()
        ckpt = open_ckpt(i, options)
        try:
            for step in range(1, 4):
                ckpt.save(state, step).wait()
            growth = common.peak_rss_bytes() - before
        finally:
            ckpt.close()
            shutil.rmtree(scratch / f"blocked-{i}", ignore_errors=True)
        rss[label] = {"rss_growth_rank_bytes": growth, "rss_growth_x_staged": growth / nbytes}
        if options.get("memory_every_steps"):
            rss[label]["rss_growth_x_kept"] = growth / (2 * nbytes)  # memory_keep=1: two slots

    # The time save() blocks, every tool in the same rounds (the order rotating), after two warm-up saves each.
    buffers = [torch.empty_like(p) for p in params]

    def floor() -> None:
        with torch.no_grad():
            for b, p in zip(buffers, params):
                b.copy_(p)

    handles: dict[str, Any] = {}

    def saver(label: str, ckpt: Any) -> common.Tool:
        step = [1]
        ckpt.save(state, 1).wait()  # with compare's warm-up: both slots of the memory tier exist before the rounds

        def run() -> None:
            step[0] += 1
            handles[label] = ckpt.save(state, step[0])

        return common.Tool(label, run, after=lambda: handles[label].wait())  # the write, untimed

    ckpts = [open_ckpt(i, options) for i, (_label, options) in enumerate(tools)]
    try:
        rows = common.compare(result, [common.Tool("copy into preallocated host buffers (floor)", floor, floor=True)]
                              + [saver(label, c) for (label, _o), c in zip(tools, ckpts)], args.repeats,
                              group="blocked")
    finally:
        for ckpt in ckpts:
            ckpt.close()
    add_paired(rows)
    for row in rows:
        row["extra"].update(rss.get(row["tool"], {}))
    result["notes"].append(f"blocked: one process, {common.fmt_bytes(nbytes)} of fp32 parameters, the tools in "
                           f"alternating rounds; RSS growth: each tool on its own over 3 saves, from before its "
                           f"Checkpointer existed (kept: / (memory_keep + 1) x staged, memory_keep=1)")
    return result


# ---------------------------------------------------------------- restore


def restore_child(args: argparse.Namespace) -> None:
    """One fresh process: build the model, then time one restore of it (``--child restore:<how>``)."""
    how = args.child.split(":", 1)[1]
    root = args.root
    model = build_model(int(args.gib * common.GIB), fill=False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the pages exist: the restore is timed, not the first touch of the model's memory
    state = {"model": model}
    # What any process pays once before its first restore, whichever tier it reads (torch imports its compiler
    # on the first state-dict call, about a second here): paid before the clock starts, by every child alike.
    get_model_state_dict(model)
    if how == "save":
        ckpt = shardckpt.Checkpointer(local_dir=root, every_steps=1, memory_every_steps=1, preemption_signals=())
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        ckpt.save(state, 1).wait()
        torch.save(common.fingerprint(model), os.path.join(root, "expected.pt"))
        os.kill(os.getpid(), signal.SIGKILL)  # right after save() returned: no close()
    if how == "floor":
        records = shm.read_records(root)[0]
        by_name = dict(model.named_parameters())
        t0 = time.perf_counter()
        for rec in records:
            fd = os.open(os.path.join(shm.namespace(root), rec.buffer), os.O_RDONLY)
            region = mmap.mmap(fd, rec.buffer_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            os.close(fd)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                raw = torch.frombuffer(region, dtype=torch.uint8)
            with torch.no_grad():
                for fqn, dtype, shape, _size, _offsets, offset in rec.tensors:
                    name = fqn.split(".", 1)[1]
                    if name in by_name:
                        n = by_name[name].numel() * 4
                        by_name[name].copy_(raw[offset:offset + n].view(torch.float32).view(shape))
            del raw
            region.close()
        took = time.perf_counter() - t0
    else:
        ckpt = shardckpt.Checkpointer(local_dir=root, preemption_signals=())
        t0 = time.perf_counter()
        got = ckpt.load(state)
        took = time.perf_counter() - t0
        where = ckpt.status()["restored_from"] or ""
        if got != 1 or where.startswith("memory") != (how == "memory"):
            raise SystemExit(f"restored {got} from {where}, expected step 1 from {how}")
    if common.fingerprint(model) != torch.load(os.path.join(root, "expected.pt")):
        raise SystemExit(f"{how}: the model does not hold the saved values")
    print(json.dumps({"seconds": took}), flush=True)
    os._exit(0)  # no close(): it would write the memory step to disk and free it


def part_restore(args: argparse.Namespace, scratch: Path) -> dict:
    root = scratch / "restore"
    hidden = scratch / "no-shm"
    hidden.mkdir()
    env = dict(os.environ, SHARDCKPT_MEMORY_LINGER_S="900", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

    def child(how: str, extra_env: dict | None = None) -> float:
        cmd = [sys.executable, __file__, "--child", f"restore:{how}", "--root", str(root), "--gib", str(args.gib)]
        proc = subprocess.run(cmd, env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=1800)
        if how == "save":
            if proc.returncode != -signal.SIGKILL:
                raise RuntimeError(f"the saving child ended with {proc.returncode}: {proc.stderr[-2000:]}")
            return 0.0
        if proc.returncode != 0:
            raise RuntimeError(f"{how}: {proc.returncode}: {proc.stdout[-1000:]} {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])["seconds"]

    child("save")
    nbytes = shm.held_bytes(str(root))
    result = common.new_result("memory", nbytes, repeats=args.repeats)
    tools = [
        common.Tool("copy from the shared memory into the model (floor)", lambda: common.Measured(child("floor")),
                    floor=True),
        common.Tool("shardckpt load from memory", lambda: common.Measured(child("memory"))),
        common.Tool("shardckpt load from the disk (warm cache)",
                    lambda: common.Measured(child("disk", {"SHARDCKPT_SHM_DIR": str(hidden)}))),
    ]
    try:
        add_paired(common.compare(result, tools, args.repeats, group="restore after SIGKILL"))
    finally:
        shm.purge(str(root))
    result["notes"].append("restore: each run a fresh process (as after a crash), the restore alone timed; the "
                           "saving process was SIGKILLed right after save() returned")
    return result


# ---------------------------------------------------------------- training


def part_training(args: argparse.Namespace, scratch: Path) -> dict:
    import train_gpt

    torch.manual_seed(0)
    model = train_gpt.GPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": optim, "train": {"iter": 0}}
    data = torch.randint(0, 65, (4096,))
    nbytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    result = common.new_result("memory_training", nbytes, unit="steps/s", better="higher", ratio_label="baseline",
                               repeats=args.repeats)
    ckpt = shardckpt.Checkpointer(local_dir=str(scratch / "gpt"), every_steps=10**9, memory_every_steps=1,
                                  preemption_signals=())
    step = [0]

    def train(save: bool) -> float:
        t0 = time.perf_counter()
        ix = torch.randint(0, len(data) - 65, (16,))
        x = torch.stack([data[i:i + 64] for i in ix])
        y = torch.stack([data[i + 1:i + 65] for i in ix])
        loss = model(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step[0] += 1
        state["train"]["iter"] = step[0]
        if save:
            ckpt.save(state, step[0])
        return time.perf_counter() - t0

    # Steps with and without a save alternate one by one, so that a load that comes and goes on the shared
    # cores weighs on both alike; the first steps (the optimizer's state, the slots) are not counted.
    plain: list[float] = []
    saved: list[float] = []
    try:
        for i in range(4 + 2 * args.steps * args.repeats):
            took = train(save=i % 2 == 1)
            if i >= 4:
                (saved if i % 2 else plain).append(took)
    finally:
        ckpt.close()
    common.add_row(result, "no checkpoints (baseline)", [1 / t for t in plain], group="training", floor=True,
                   step_s=statistics.median(plain))
    common.add_row(result, "a memory save every step", [1 / t for t in saved], group="training",
                   step_s=statistics.median(saved))
    result["notes"].append(f"training: the GPT of examples/train_gpt.py, 4 layers x 128, block 64, batch 16, AdamW "
                           f"({common.fmt_bytes(nbytes)} of state), one process; {args.steps * args.repeats} steps of "
                           f"each, alternating one by one")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="state size of the blocked and restore parts (GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="training steps per round")
    parser.add_argument("--part", default="blocked,restore",
                        help="blocked, restore (seconds) or training (steps/s: on its own)")
    parser.add_argument("--dir", default=None, help="where the scratch directory goes")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        restore_child(args)
        return
    parts = {"blocked": part_blocked, "restore": part_restore, "training": part_training}
    scratch = Path(tempfile.mkdtemp(prefix="shardckpt-bench-memory-", dir=args.dir))
    results = []
    try:
        for name in args.part.split(","):
            results.append(parts[name](args, scratch))
            print("\n".join(common.table([common.summarize(results[-1])])), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    merged = common.merge(results)
    common.emit(merged, args.json)


if __name__ == "__main__":
    main()
