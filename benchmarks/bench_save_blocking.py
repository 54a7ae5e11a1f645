"""Time the training loop is blocked per checkpoint, shardckpt vs the alternatives (case ``blocked``).

Run under torchrun (2 ranks by default), e.g.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        benchmarks/bench_save_blocking.py --gib 1.0 --repeat 3 [--tool NAME ...] [--json FILE]

The state is an FSDP2-sharded model (the parameters split over the ranks;
``--gib`` of fp32 in total). For each tool the time until the training loop
could continue is measured on every rank; the slowest rank counts. One
warm-up save comes first (not counted; shown as "first": shardckpt allocates
its staging buffers there, DCP's process mode starts its daemons); the table
shows the median over ``--repeat`` saves and its ratio to the floor: a copy
of the same local shards into host buffers that already exist.

Tools (``--tool``, default all of them, one after another):

  floor              copy into preallocated host buffers
  shardckpt          ``shardckpt.save`` (async): returns once staged into its reused buffers
  dcp_save           ``dcp.save``: returns once written
  dcp_async          ``dcp.async_save``, thread mode, default stager (copies inside the call)
  dcp_async_process  ``dcp.async_save(async_checkpointer_type=PROCESS)``: a daemon per rank writes
  dcp_async_staged   ``dcp.async_save`` with ``DefaultStager(StagingOptions(use_pinned_memory=False,
                     use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))``,
                     blocked until its ``staging_completion`` (the optimizer may not step before)
  torch_save         rank 0 gathers the full state and ``torch.save``s it

Plain tensors (group "plain"): each rank holds as many bytes as its local shards in a
dict of plain tensors, the same values on every rank (a replica: DCP writes one copy).
shardckpt compares plain values across ranks by content (an xxh3-128 digest of each
tensor's staged bytes, taken in the background writer before the write):

  floor_plain                 copy of the plain tensors into preallocated host buffers
  shardckpt_plain             ``shardckpt.save`` of the plain tensors (compared by digest); extra
                              columns: ``compare_s``, the part of the blocked time spent comparing
                              the plain values (``values.agree``, timed around the call),
                              ``digest_s``, the time hashing those tensors takes on one rank
                              (off the blocked path; measured after each save), ``committed_s``
  shardckpt_plain_uncompared  the same tensors wrapped in ``shardckpt.PerRank`` (never compared):
                              its blocked time against ``shardckpt_plain`` is what the comparison
                              adds to the time the loop waits

Each rank's RSS high-water mark is reset before every tool and reported
(largest rank), with its growth over the tool's saves as a multiple of the
rank's staged bytes (one copy of the state: 1.0×); ``benchmarks/run.py`` starts a fresh torchrun per tool and
also samples the RAM of all processes (DCP's daemons included). DCP's async
saves get a gloo group of their own: on CPU they deadlock on the trainer's.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import shardckpt  # noqa: E402

TOOLS = {
    "floor": "copy into preallocated host buffers (floor)",
    "shardckpt": "shardckpt.save (async)",
    "dcp_save": "dcp.save (sync)",
    "dcp_async": "dcp.async_save (thread, default stager)",
    "dcp_async_process": "dcp.async_save (process)",
    "dcp_async_staged": "dcp.async_save (DefaultStager, async staging)",
    "torch_save": "rank-0 torch.save of the full state",
    "floor_plain": "copy of the plain tensors into preallocated host buffers (floor)",
    "shardckpt_plain": "shardckpt.save of plain tensors (compared by digest)",
    "shardckpt_plain_uncompared": "shardckpt.save of the same tensors in PerRank (not compared)",
}
PLAIN = {"floor_plain", "shardckpt_plain", "shardckpt_plain_uncompared"}
"""The tools of the group "plain" (their ratios are to ``floor_plain``)."""
# Host memory a tool needs beyond the model, as a multiple of the whole state (all ranks of the node).
MEMORY = {"floor": 1.0, "shardckpt": 1.0, "dcp_save": 0.3, "dcp_async": 1.0, "dcp_async_process": 2.0,
          "dcp_async_staged": 1.0, "torch_save": 1.3, "floor_plain": 2.0, "shardckpt_plain": 2.0,
          "shardckpt_plain_uncompared": 2.0}


def build_model(total_bytes: int, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 2048
    layers = max(1, round(total_bytes / (width * width * 4)))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


class Context:
    """What the tools share: the state, the scratch root, a side group, the rounds."""

    def __init__(self, model: nn.Module, root: str, repeat: int) -> None:
        self.model = model
        self.state = {"model": model}
        self.root = root
        self.repeat = repeat
        self.rank = dist.get_rank()
        self.side = dist.new_group(backend="gloo")
        self.local_shards = [p.to_local() for p in model.parameters()]

    def plain(self) -> dict[str, torch.Tensor]:
        """As many bytes as this rank's local shards, as plain tensors with the same values on every rank."""
        if not hasattr(self, "_plain"):
            generator = torch.Generator().manual_seed(1)
            self._plain = {f"t{i}": torch.randn(t.shape, generator=generator) for i, t in enumerate(self.local_shards)}
        return self._plain

    def rounds(self) -> range:
        return range(self.repeat + 1)  # round 0 is the warm-up

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def remove(self, name: str) -> None:
        """Delete a finished save (every rank is done with it first)."""
        dist.barrier()
        if self.rank == 0:
            path = self.path(name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        dist.barrier()


Tool = Callable[[Context], Iterator[Any]]


def floor(ctx: Context) -> Iterator[float]:
    buffers = [torch.empty_like(t) for t in ctx.local_shards]
    for _ in ctx.rounds():
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(buffers, ctx.local_shards):
            b.copy_(t)
        yield time.perf_counter() - t0


def shardckpt_save(ctx: Context) -> Iterator[float]:
    ckpt = shardckpt.Checkpointer(local_dir=ctx.path("shardckpt"), keep_last=1, preemption_signals=())
    try:
        for i in ctx.rounds():
            dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save(ctx.state, i)
            yield time.perf_counter() - t0
            handle.wait()
    finally:
        ckpt.close()


def floor_plain(ctx: Context) -> Iterator[float]:
    tensors = list(ctx.plain().values())
    buffers = [torch.empty_like(t) for t in tensors]
    for _ in ctx.rounds():
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        yield time.perf_counter() - t0


def shardckpt_plain(ctx: Context, *, compared: bool = True) -> Iterator[tuple[float, dict]]:
    from shardckpt.state import values

    spent = [0.0]
    agree = values.agree

    def timed_agree(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return agree(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    values.agree = timed_agree  # the blocked time's share spent comparing (save() calls values.agree)
    plain = ctx.plain()
    state = {"tensors": plain if compared else shardckpt.PerRank(plain)}
    name = "plain" if compared else "plain_uncompared"
    ckpt = shardckpt.Checkpointer(local_dir=ctx.path(name), keep_last=1, preemption_signals=())
    try:
        for i in ctx.rounds():
            dist.barrier()
            spent[0] = 0.0
            t0 = time.perf_counter()
            handle = ckpt.save(state, i)
            blocked = time.perf_counter() - t0
            compare = spent[0]
            handle.wait()
            committed = time.perf_counter() - t0
            t1 = time.perf_counter()
            for t in plain.values():
                values.digest(t)
            yield blocked, {"compare_s": compare, "digest_s": time.perf_counter() - t1, "committed_s": committed}
    finally:
        values.agree = agree
        ckpt.close()


def shardckpt_plain_uncompared(ctx: Context) -> Iterator[tuple[float, dict]]:
    return shardckpt_plain(ctx, compared=False)


def dcp_save(ctx: Context) -> Iterator[float]:
    for i in ctx.rounds():
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(ctx.state, checkpoint_id=ctx.path(f"dcp_save_{i}"))
        yield time.perf_counter() - t0
        ctx.remove(f"dcp_save_{i}")


def dcp_async(ctx: Context, **kwargs: Any) -> Iterator[float]:
    for i in ctx.rounds():
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(ctx.state, checkpoint_id=ctx.path(f"dcp_async_{i}"), process_group=ctx.side, **kwargs)
        yield time.perf_counter() - t0
        future.result()
        ctx.remove(f"dcp_async_{i}")


def dcp_async_process(ctx: Context) -> Iterator[float]:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return dcp_async(ctx, async_checkpointer_type=AsyncCheckpointerType.PROCESS)


def dcp_async_staged(ctx: Context) -> Iterator[tuple[float, dict]]:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=False))
    try:
        for i in ctx.rounds():
            dist.barrier()
            t0 = time.perf_counter()
            response = dcp.async_save(ctx.state, checkpoint_id=ctx.path(f"dcp_staged_{i}"), process_group=ctx.side,
                                      async_stager=stager)
            returned = time.perf_counter() - t0
            response.staging_completion.result()
            yield time.perf_counter() - t0, {"returned_s": returned}
            response.upload_completion.result()
            ctx.remove(f"dcp_staged_{i}")
    finally:
        stager.close()


def torch_save(ctx: Context) -> Iterator[float]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # only rank 0 keeps the gathered tensors
    for i in ctx.rounds():
        dist.barrier()
        t0 = time.perf_counter()
        full = get_model_state_dict(ctx.model, options=options)
        if ctx.rank == 0:
            torch.save(full, ctx.path(f"torch_save_{i}.pt"))
        del full
        dist.barrier()
        yield time.perf_counter() - t0
        ctx.remove(f"torch_save_{i}.pt")


RUNNERS: dict[str, Tool] = {
    "floor": floor,
    "shardckpt": shardckpt_save,
    "dcp_save": dcp_save,
    "dcp_async": dcp_async,
    "dcp_async_process": dcp_async_process,
    "dcp_async_staged": dcp_async_staged,
    "torch_save": torch_save,
    "floor_plain": floor_plain,
    "shardckpt_plain": shardckpt_plain,
    "shardckpt_plain_uncompared": shardckpt_plain_uncompared,
}


def agreed_skip(ctx: Context, name: str, total_bytes: int) -> str | None:
    """Rank 0 checks that the tool's memory fits; every rank gets the same answer."""
    reason = None
    if ctx.rank == 0:
        try:
            common.require_memory(MEMORY[name] * total_bytes, TOOLS[name])
        except common.Skip as exc:
            reason = str(exc)
    box = [reason]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def measure(ctx: Context, name: str) -> tuple[list[float], dict[str, Any]]:
    gc.collect()
    common.reset_peak_rss()
    before = common.rss_bytes()
    times: list[float] = []
    extra: dict[str, list[float]] = {}
    first = None
    for i, got in enumerate(RUNNERS[name](ctx)):
        seconds, more = got if isinstance(got, tuple) else (got, {})
        seconds = common.slowest(seconds)
        if i == 0:
            first = seconds
            continue
        times.append(seconds)
        for k, v in more.items():
            extra.setdefault(k, []).append(common.slowest(v))
    peak = common.peak_rss_bytes()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (peak, peak - before))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in extra.items()}
    staged = sum(t.numel() * t.element_size() for t in ctx.local_shards)
    out.update(first_s=first, peak_rss_rank_bytes=max(p for p, _ in gathered),
               rss_growth_rank_bytes=max(g for _, g in gathered),
               rss_growth_x_staged=max(g for _, g in gathered) / staged)
    return times, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="total state size in GiB (default 1.0)")
    parser.add_argument("--repeat", "--repeats", type=int, default=3, help="timed saves per tool (median reported)")
    parser.add_argument("--tool", action="append", choices=list(TOOLS), help="tool to run (repeatable; default all)")
    parser.add_argument("--dir", default=None, help="where the scratch directory goes (default: the system's temp)")
    parser.add_argument("--json", help="write the result here (rank 0)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    box = [tempfile.mkdtemp(prefix="shardckpt-bench-blocked-", dir=args.dir) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model = build_model(int(args.gib * common.GIB), world)
    ctx = Context(model, box[0], args.repeat)
    local_bytes = sum(t.numel() * t.element_size() for t in ctx.local_shards)
    total_t = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(total_t)
    total = int(total_t.item())
    result = common.new_result("blocked", total, repeats=args.repeat, world_size=world, rank_bytes=local_bytes)
    try:
        for name in args.tool or list(TOOLS):
            reason = agreed_skip(ctx, name, total)
            if reason is not None:
                if rank == 0:
                    common.add_skip(result, TOOLS[name], reason)
                continue
            times, extra = measure(ctx, name)
            if rank == 0:
                common.add_row(result, TOOLS[name], times, floor=name in ("floor", "floor_plain"),
                               group="plain" if name in PLAIN else "", **extra)
                print(f"{TOOLS[name]}: median {statistics.median(times):.3f} s, first {extra['first_s']:.3f} s",
                      flush=True)
        if rank == 0:
            result["notes"].append(f"{world} ranks, FSDP2 on CPU (gloo), {common.fmt_bytes(local_bytes)} per rank; "
                                   "blocked time of the slowest rank")
            common.emit(result, args.json)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
