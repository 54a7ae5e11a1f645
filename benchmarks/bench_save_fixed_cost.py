"""A save's fixed cost (case ``save_fixed_cost``): what ``save()`` costs beyond the copy of the bytes.

    .venv/bin/python benchmarks/bench_save_fixed_cost.py [--part small,breakdown,training,large]
                     [--calls 60] [--steps 40] [--gib 1] [--repeats 3] [--json FILE]

One process, every figure a ratio to a floor measured in the same run:

small      The GPT of ``examples/train_gpt.py`` (4 layers, d=128, block 64, AdamW after one step:
           about 200 tensors, about 10 MiB). Floor: a per-tensor copy of the same tensors (parameters,
           buffers, optimizer state) into host buffers allocated beforehand. Against it, one call of
           each kind after another (the order rotating), ``--calls`` of each: ``save()`` kept in memory
           only (``memory_every_steps=1``), ``save()`` to disk without the memory tier (the time it
           blocks; the write, waited for afterwards, untimed), and a call the interval skips (µs).
breakdown  Where a memory ``save()``'s time goes: the parts of the save path timed by wrapping them
           (the plan's check, the RNG state, agree, staging with its layout check, record), per call, median.
training   That GPT trained with batch 16 (one process): steps/s without checkpoints against a memory
           save every step, the two kinds of step alternating one by one (``--steps`` x ``--repeats``).
large      A model of ``--gib`` fp32 parameters (16 MiB tensors, no optimizer): a memory save against
           the per-tensor copy, alternating, ``--repeats`` each after two warm-up saves.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import torch.nn as nn

import shardckpt  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))


def gpt_state() -> tuple[dict[str, Any], nn.Module, torch.optim.Optimizer, torch.Tensor]:
    import train_gpt

    torch.manual_seed(0)
    model = train_gpt.GPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 65, (4096,))
    state = {"model": model, "optimizer": optim, "train": {"iter": 0, "lr": 1e-3, "note": "gpt"}}
    train_step(model, optim, data)  # the optimizer's state exists
    return state, model, optim, data


def train_step(model: nn.Module, optim: torch.optim.Optimizer, data: torch.Tensor) -> None:
    ix = torch.randint(0, len(data) - 65, (16,))
    x = torch.stack([data[i:i + 64] for i in ix])
    y = torch.stack([data[i + 1:i + 65] for i in ix])
    loss = model(x, y)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def live_tensors(model: nn.Module, optim: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    out = [t for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    if optim is not None:
        out += [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def copier(tensors: list[torch.Tensor]) -> Callable[[], None]:
    buffers = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        with torch.no_grad():
            for b, t in zip(buffers, tensors):
                b.copy_(t)

    return copy


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def open_ckpt(root: Path, **options: Any) -> Any:
    return shardckpt.Checkpointer(local_dir=str(root), keep_last=1, preemption_signals=(), **options)


def paired(values: list[float], floor: list[float]) -> float:
    return statistics.median(v / f for v, f in zip(values, floor))


# ---------------------------------------------------------------- small


def part_small(args: argparse.Namespace, scratch: Path) -> dict:
    state, model, optim, _data = gpt_state()
    tensors = live_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result = common.new_result("save_fixed_cost", nbytes, repeats=args.calls)
    floor = copier(tensors)
    memory = open_ckpt(scratch / "memory", every_steps=10**9, memory_every_steps=1)
    disk = open_ckpt(scratch / "disk", every_steps=1)
    skipper = open_ckpt(scratch / "skip", every_steps=10**9)
    step = [0]

    def memory_save() -> None:
        step[0] += 1
        memory.save(state, step[0])

    handle: list[Any] = [None]

    def disk_save() -> None:
        step[0] += 1
        handle[0] = disk.save(state, step[0])

    def skipped() -> None:
        step[0] += 1
        skipper.save(state, step[0] * 10**9 + 1)

    try:
        for _ in range(3):  # warm-up: both slots, the staging buffers, the writer
            memory_save()
            disk_save()
            handle[0].wait()
            skipped()
            floor()
        tools = [("copy into preallocated buffers (floor)", floor), ("memory save()", memory_save),
                 ("disk save(), blocked", disk_save)]
        times: dict[str, list[float]] = {name: [] for name, _f in tools}
        for i in range(args.calls):
            for name, fn in tools[i % 3:] + tools[:i % 3]:
                times[name].append(timed(fn))
                if fn is disk_save:
                    handle[0].wait()  # the write, outside the time
        skip_us = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                skipped()
            skip_us.append((time.perf_counter() - t0) / 200 * 1e6)
    finally:
        for c in (memory, disk, skipper):
            c.close()
    floor_t = times[tools[0][0]]
    for name, _fn in tools:
        common.add_row(result, name, times[name], group="small", floor=name == tools[0][0],
                       paired_ratio=paired(times[name], floor_t))
    common.add_row(result, "a call the interval skips (µs)", skip_us, group="skip")
    result["notes"].append(f"small: GPT 4 layers x 128 + AdamW, {len(tensors)} tensors, {common.fmt_bytes(nbytes)}; "
                           f"{args.calls} calls of each, one after another")
    return result


# ---------------------------------------------------------------- breakdown


def _targets() -> list[tuple[Any, str, str]]:
    """The parts of the save path to time: (owner, attribute, label); those missing are left out."""
    from shardckpt.saving import commit, saver
    from shardckpt.saving import memory as memory_mod
    from shardckpt.state import capture as state_mod
    from shardckpt.state import values

    plan_cls = getattr(saver, "SavePlan", None)
    found: list[tuple[Any, str, str]] = [
        (state_mod, "capture", "capture by DCP (state.capture)"),
        (plan_cls, "holds", "plan checked (SavePlan.holds)"),
        (plan_cls, "refresh", "RNG state into the plan's tensors (SavePlan.refresh)"),
        (plan_cls, "capture", "capture under the plan"),
        (values, "agree", "values.agree"),
        (memory_mod.MemoryTier, "stage", "staging (layout check + copy)"),
        (memory_mod.MemoryTier, "_wanted", "layout check (MemoryTier._wanted)"),
        (memory_mod.MemoryTier, "record", "record (values + JSON)"),
        (commit.StepWriter, "held", "manifest (StepWriter.held)"),
    ]
    return [(o, a, label) for o, a, label in found if o is not None and hasattr(o, a)]


def part_breakdown(args: argparse.Namespace, scratch: Path) -> dict:
    state, model, optim, _data = gpt_state()
    tensors = live_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result = common.new_result("save_fixed_cost_breakdown", nbytes, repeats=args.calls)
    spent: dict[str, float] = {}
    originals = []
    for owner, attr, label in _targets():
        fn = getattr(owner, attr)
        originals.append((owner, attr, fn))

        def wrapped(*a: Any, _fn: Callable = fn, _label: str = label, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, wrapped)
    ckpt = open_ckpt(scratch / "breakdown", every_steps=10**9, memory_every_steps=1)
    floor = copier(tensors)
    per: dict[str, list[float]] = {}
    try:
        for step in range(1, 4):
            ckpt.save(state, step)
        for step in range(4, 4 + args.calls):
            spent.clear()
            per.setdefault("copy (floor)", []).append(timed(floor))
            per.setdefault("save() total", []).append(timed(lambda: ckpt.save(state, step)))
            for label, s in spent.items():
                per.setdefault(label, []).append(s)
    finally:
        ckpt.close()
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
    for label, values in per.items():
        common.add_row(result, label, values, group="breakdown", floor=label == "copy (floor)")
    return result


# ---------------------------------------------------------------- training


def part_training(args: argparse.Namespace, scratch: Path) -> dict:
    state, model, optim, data = gpt_state()
    nbytes = sum(t.numel() * t.element_size() for t in live_tensors(model, optim))
    result = common.new_result("save_fixed_cost_training", nbytes, unit="steps/s", better="higher",
                               ratio_label="baseline", repeats=args.repeats)
    ckpt = open_ckpt(scratch / "gpt", every_steps=10**9, memory_every_steps=1)
    plain: list[float] = []
    saved: list[float] = []
    n = [0]

    def step(save: bool) -> float:
        t0 = time.perf_counter()
        train_step(model, optim, data)
        n[0] += 1
        state["train"]["iter"] = n[0]
        if save:
            ckpt.save(state, n[0])
        return time.perf_counter() - t0

    try:
        for i in range(4 + 2 * args.steps * args.repeats):
            took = step(save=i % 2 == 1)
            if i >= 4:
                (saved if i % 2 else plain).append(took)
    finally:
        ckpt.close()
    common.add_row(result, "no checkpoints (baseline)", [1 / t for t in plain], group="training", floor=True,
                   step_s=statistics.median(plain))
    common.add_row(result, "a memory save every step", [1 / t for t in saved], group="training",
                   step_s=statistics.median(saved), paired_ratio=paired([1 / t for t in saved], [1 / t for t in plain]))
    return result


# ---------------------------------------------------------------- large


def part_large(args: argparse.Namespace, scratch: Path) -> dict:
    width = 2048
    layers = max(1, round(args.gib * common.GIB / (width * width * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    tensors = live_tensors(model, None)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    result = common.new_result("save_fixed_cost_large", nbytes, repeats=args.repeats)
    floor = copier(tensors)
    ckpt = open_ckpt(scratch / "large", every_steps=10**9, memory_every_steps=1)
    state = {"model": model}
    f_t: list[float] = []
    m_t: list[float] = []
    try:
        ckpt.save(state, 1)
        ckpt.save(state, 2)
        floor()
        for i in range(args.repeats):
            if i % 2:
                m_t.append(timed(lambda: ckpt.save(state, 3 + i)))
                f_t.append(timed(floor))
            else:
                f_t.append(timed(floor))
                m_t.append(timed(lambda: ckpt.save(state, 3 + i)))
    finally:
        ckpt.close()
    common.add_row(result, "copy into preallocated buffers (floor)", f_t, group="large", floor=True)
    common.add_row(result, "memory save()", m_t, group="large", paired_ratio=paired(m_t, f_t))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="small,breakdown,training,large")
    parser.add_argument("--calls", type=int, default=60, help="calls of each kind (small, breakdown)")
    parser.add_argument("--steps", type=int, default=40, help="training steps of each kind per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0, help="state size of the large part (GiB)")
    parser.add_argument("--dir", default=None, help="where the scratch directory goes")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (1: the copies of the floor and of save() alike on one core, "
                             "unaffected by a second thread's scheduling on shared cores)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = {"small": part_small, "breakdown": part_breakdown, "training": part_training, "large": part_large}
    scratch = Path(tempfile.mkdtemp(prefix="shardckpt-bench-fixed-", dir=args.dir))
    results = []
    try:
        for name in args.part.split(","):
            results.append(parts[name](args, scratch))
            print("\n".join(common.table([common.summarize(results[-1])])), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    common.emit(common.merge(results), args.json)


if __name__ == "__main__":
    main()
