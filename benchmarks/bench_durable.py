"""Time to durable on the local tier: from ``save()`` until the step is committed (case ``durable``).

    python benchmarks/bench_durable.py --gib 1 --repeats 3 [--dir DIR] [--tmpfs DIR|none] [--json FILE]

One process, a state of ``--gib`` fp32 in 64 MiB tensors. Every tool writes
the same bytes to the same disk (``--dir``, default the system's temp; group
``disk``), then again to a tmpfs (``--tmpfs``, default /dev/shm where it is
one; group ``tmpfs``): memory at several GB/s stands in for NVMe, where the
write path and not the device is the bound. The tmpfs group is skipped when
the host has no room for the files beside the state. Before
each timed write the previous output is deleted and ``os.sync()`` empties the
write-back queue, so no tool pays for another's dirty pages. Tools run
round-robin, the order rotating each round, after one warm-up call each:

  dd conv=fdatasync (floor)   ``dd if=/dev/zero bs=16M ... conv=fdatasync`` of the same bytes
  dd oflag=direct             the same through O_DIRECT (recorded as skipped where refused)
  shardckpt save → committed  ``Checkpointer.save(state, step).wait()`` (async mode, staging
                              buffers allocated by the warm-up; no retention in the timing)
  dcp.save                    stock DCP (fsyncs every file)
  torch.save + fsync          one file, ``os.fsync`` before close

Besides the times, each row has the CPU the write took (this process's
threads and dd's), in seconds per GiB: on a shared host the wall times
spread with the other loads, the CPU much less.
"""

from __future__ import annotations

import os
import resource
import shutil
import time

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import torch.distributed.checkpoint as dcp

import shardckpt  # noqa: E402


def default_tmpfs() -> str | None:
    """/dev/shm where it is mounted as a tmpfs, else None."""
    try:
        with open("/proc/mounts") as f:
            mounts = {fields[1]: fields[2] for fields in (line.split() for line in f) if len(fields) > 2}
    except OSError:
        return None
    return "/dev/shm" if mounts.get("/dev/shm") == "tmpfs" else None


def with_cpu(run, nbytes: int):
    """``run`` timed with the CPU it took (this process's threads and its children), in s per GiB.

    The write path's CPU is the part of its time that other loads on the host
    do not inflate: on a shared machine the wall times spread widely.
    """

    def measured() -> common.Measured:
        before = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        run()
        took = time.perf_counter() - t0
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (time.process_time() - before[0] + kids.ru_utime + kids.ru_stime
               - before[1].ru_utime - before[1].ru_stime)
        return common.Measured(took, {"cpu_s_per_gib": cpu / (nbytes / common.GIB)})

    return measured


def compare_in(result: dict, base: str | None, group: str, model, state, nbytes: int, repeats: int) -> None:
    """Every tool, writing under ``base`` (rows in ``group``)."""
    with common.scratch("durable", base) as root:
        out = root / "out"
        ours_dir = root / "shardckpt"
        step = [0]

        def clear() -> None:
            shutil.rmtree(out, ignore_errors=True)
            for old in ours_dir.glob("step_*"):  # committed steps of earlier rounds
                shutil.rmtree(old, ignore_errors=True)
            out.mkdir()
            os.sync()

        def ours() -> None:
            if step[0] == 0:
                common.require_memory(nbytes, "shardckpt's staging buffers")
            step[0] += 1
            ckpt.save(state, step[0]).wait()

        def torch_save() -> None:
            with open(out / "state.pt", "wb") as f:
                torch.save(model.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())

        ckpt = shardckpt.Checkpointer(local_dir=str(ours_dir), keep_last=None, preemption_signals=())
        tools = [
            common.Tool("dd conv=fdatasync (floor)",
                        with_cpu(lambda: common.dd_write(str(out / "dd.bin"), nbytes), nbytes),
                        before=clear, floor=True),
            common.Tool("dd oflag=direct (floor)",
                        with_cpu(lambda: common.dd_write(str(out / "dd.bin"), nbytes, direct=True), nbytes),
                        before=clear, floor=True),
            common.Tool("shardckpt save → committed", with_cpu(ours, nbytes), before=clear),
            common.Tool("dcp.save", with_cpu(lambda: dcp.save(state, checkpoint_id=str(out / "dcp")), nbytes),
                        before=clear),
            common.Tool("torch.save + fsync", with_cpu(torch_save, nbytes), before=clear),
        ]
        try:
            rows = common.compare(result, tools, repeats, group=group)
        finally:
            ckpt.close()
        common.add_rate(rows, nbytes)


def main() -> None:
    args = common.sized_args(__doc__, "timed writes per tool (median reported)",
                                    values={"--tmpfs": "a tmpfs to measure on as well (default /dev/shm where it "
                                                       "is one; 'none': the disk only)"})
    model, state, nbytes = common.sized_state(args.gib)
    result = common.new_result("durable", nbytes, repeats=args.repeats)
    compare_in(result, args.dir, "disk", model, state, nbytes, args.repeats)
    tmpfs = default_tmpfs() if args.tmpfs is None else None if args.tmpfs == "none" else args.tmpfs
    if tmpfs is not None:
        try:
            # The files of a write live in memory: dd's and one tool's at a time.
            common.require_memory(2 * nbytes, f"writing {common.fmt_bytes(nbytes)} to the tmpfs {tmpfs}")
            compare_in(result, tmpfs, "tmpfs", model, state, nbytes, args.repeats)
        except common.Skip as exc:
            common.add_skip(result, "every tool", str(exc), group="tmpfs")
    result["notes"].append("each write starts after os.sync() with the previous output deleted"
                           + (f"; tmpfs: {tmpfs}" if tmpfs else ""))
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
