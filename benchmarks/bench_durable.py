"""Time to durable on the local tier: from ``save()`` until the step is committed (case ``durable``).

    python benchmarks/bench_durable.py --gib 1 --repeats 3 [--dir DIR] [--json FILE]

One process, a state of ``--gib`` fp32 in 64 MiB tensors. Every tool writes
the same bytes to the same disk (``--dir``, default the system's temp); before
each timed write the previous output is deleted and ``os.sync()`` empties the
write-back queue, so no tool pays for another's dirty pages. Tools run
round-robin, the order rotating each round, after one warm-up call each:

  dd conv=fdatasync (floor)   ``dd if=/dev/zero bs=16M ... conv=fdatasync`` of the same bytes
  dd oflag=direct             the same through O_DIRECT (recorded as skipped where refused)
  shardckpt save → committed  ``Checkpointer.save(state, step).wait()`` (async mode, staging
                              buffers allocated by the warm-up; no retention in the timing)
  dcp.save                    stock DCP (fsyncs every file)
  torch.save + fsync          one file, ``os.fsync`` before close
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed.checkpoint as dcp

import common  # noqa: E402  (puts src/ on sys.path)
import shardckpt  # noqa: E402


def main() -> None:
    args = common.sized_args(__doc__, "timed writes per tool (median reported)")
    model, state, nbytes = common.sized_state(args.gib)
    result = common.new_result("durable", nbytes, repeats=args.repeats)
    with common.scratch("durable", args.dir) as root:
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
            common.Tool("dd conv=fdatasync (floor)", lambda: common.dd_write(str(out / "dd.bin"), nbytes),
                        before=clear, floor=True),
            common.Tool("dd oflag=direct (floor)", lambda: common.dd_write(str(out / "dd.bin"), nbytes, direct=True),
                        before=clear, floor=True),
            common.Tool("shardckpt save → committed", ours, before=clear),
            common.Tool("dcp.save", lambda: dcp.save(state, checkpoint_id=str(out / "dcp")), before=clear),
            common.Tool("torch.save + fsync", torch_save, before=clear),
        ]
        try:
            rows = common.compare(result, tools, args.repeats)
        finally:
            ckpt.close()
        common.add_rate(rows, nbytes)
        result["notes"].append("each write starts after os.sync() with the previous output deleted")
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
