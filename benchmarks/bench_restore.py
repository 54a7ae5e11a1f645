"""Restore from the local tier, warm and cold page cache (case ``restore``).

    python benchmarks/bench_restore.py --gib 1 --repeats 3 [--dir DIR] [--json FILE]

One process. A state of ``--gib`` fp32 is saved once with shardckpt; then
the same live model is restored from that step by:

  read the step's files (floor)  plain ``read`` of every file of the step through one reused
                                 buffer (``cat files > /dev/null``)
  shardckpt load                 ``Checkpointer(...).load(state)``, checksums verified (default)
  shardckpt load, no verify      the same with ``verify_on_load=False``
  dcp.load                       stock ``dcp.load`` of the step directory into
                                 ``get_model_state_dict`` + ``set_model_state_dict``

each ``--repeats`` times with the page cache warm, then with it cold: before
every cold run the step's files are evicted (``os.sync()`` and
``posix_fadvise(DONTNEED)`` per file; ``drop_caches`` where that leaves pages
cached and this runs as root), checked with ``mincore``. The warm-up call of
every loader restores into zeroed parameters and compares a checksum of
every tensor with the saved state.
"""

from __future__ import annotations


import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import common  # noqa: E402  (puts src/ on sys.path)
import shardckpt  # noqa: E402


def main() -> None:
    args = common.sized_args(__doc__, "timed restores per tool and cache state")
    model, state, nbytes = common.sized_state(args.gib)
    result = common.new_result("restore", nbytes, repeats=args.repeats)
    with common.scratch("restore", args.dir) as root:
        ckpt = shardckpt.Checkpointer(local_dir=str(root), mode="sync", keep_last=None, preemption_signals=())
        ckpt.save(state, 1)
        ckpt.close()
        (step_dir,) = root.glob("step_*")
        files = common.files_under(step_dir)
        on_disk = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
        check = common.RestoreCheck(model)

        def load(verify: bool) -> None:
            c = shardckpt.Checkpointer(local_dir=str(root), verify_on_load=verify, preemption_signals=())
            try:
                if c.load(state) != 1:
                    raise RuntimeError("load() did not restore step 1")
            finally:
                c.close()

        def stock() -> None:
            sd = {"model": get_model_state_dict(model)}
            dcp.load(sd, checkpoint_id=str(step_dir))
            set_model_state_dict(model, sd["model"])

        methods: set[str] = set()

        def cold() -> None:
            methods.add(common.evict(files))

        for group, prepare in (("warm", None), ("cold", cold)):
            tools = [
                common.Tool("read the step's files (floor)", lambda: common.read_files(files), floor=True),
                check.wrap(common.Tool("shardckpt load", lambda: load(True))),
                check.wrap(common.Tool("shardckpt load, no verify", lambda: load(False))),
                check.wrap(common.Tool("dcp.load", stock)),
            ]
            if prepare is not None:
                tools = [common.before_each(t, prepare) for t in tools]
            common.add_rate(common.compare(result, tools, args.repeats, group=group), on_disk)
        result["notes"].append(f"{len(files)} files, {common.fmt_bytes(on_disk)} on disk; cold: evicted by "
                               f"{' / '.join(sorted(methods)) or 'n/a'} after os.sync(), <= 2 % of pages left cached "
                               "(mincore)")
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
