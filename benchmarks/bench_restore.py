"""Restore from the local tier, warm and cold page cache (case ``restore``), and per state kind (``restore_kinds``).

    python benchmarks/bench_restore.py --gib 1 --repeats 3 [--kinds] [--dir DIR] [--json FILE]

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

With ``--kinds``, the same ``--gib`` of fp32 is saved once per kind of state
and restored, warm cache, checksums verified, against reading that step's files:

  module             ``{"model": model}``
  optimizer          ``{"model": model, "optimizer": Adam}``: the model a third of the bytes, Adam's two
                     moments the rest
  dict of tensors    ``{"model": model.state_dict()}``
  nested plain values  the tensors in dicts (some with int keys) and lists, beside numbers and strings
  stateful object    an object with ``state_dict()`` / ``load_state_dict()`` holding the tensors
"""

from __future__ import annotations

from typing import Any

import common  # noqa: E402  (puts src/ on sys.path)
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import shardckpt  # noqa: E402


class Holder:
    """A stateful object whose state is its own tensors and a counter."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors, self.count = tensors, 7

    def state_dict(self) -> dict:
        return {"tensors": {f"t{i}": t for i, t in enumerate(self.tensors)}, "count": self.count}

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for i, t in enumerate(self.tensors):
                t.copy_(sd["tensors"][f"t{i}"])
        self.count = sd["count"]


def kind_states(gib: float):
    """``(kind, state, live tensors)`` per kind of state, each about ``gib`` of fp32."""
    nbytes = int(gib * common.GIB)
    model = common.make_model(nbytes)
    # F821 is silenced on the lambdas below: each reads a name the del further down removes, and is only called
    # while the generator waits at its own yield, before that del runs.
    yield "module", {"model": model}, lambda: list(model.parameters())  # noqa: F821
    sd = model.state_dict()
    yield "dict of tensors", {"model": sd}, lambda: list(sd.values())  # noqa: F821
    ts = list(sd.values())
    nested = {"name": "run", "layers": [{"w": t, "index": i} for i, t in enumerate(ts[::2])],
              "by_id": {i: {"w": t, "scale": 0.5} for i, t in enumerate(ts[1::2])}}
    yield ("nested plain values", {"values": nested},
           lambda: [d["w"] for d in nested["layers"]] + [d["w"] for d in nested["by_id"].values()])  # noqa: F821
    holder = Holder(ts)
    yield "stateful object", {"holder": holder}, lambda: list(holder.tensors)  # noqa: F821
    del model, sd, ts, nested, holder
    small = common.make_model(nbytes // 3)
    opt = torch.optim.Adam(small.parameters(), lr=1e-3)
    for p in small.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for p in small.parameters():
        p.grad = None

    def opt_tensors() -> list[torch.Tensor]:
        return [v for s in opt.state.values() for v in s.values() if v.numel() > 1] + list(small.parameters())

    yield "optimizer", {"model": small, "optimizer": opt}, opt_tensors


def save_step(state: dict, root) -> tuple[Any, list[str], int]:
    """Save ``state`` as step 1 under ``root``: ``(step dir, its files, bytes on disk)``."""
    ckpt = shardckpt.Checkpointer(local_dir=str(root), mode="sync", keep_last=None, preemption_signals=())
    ckpt.save(state, 1)
    ckpt.close()
    (step_dir,) = root.glob("step_*")
    return step_dir, common.files_under(step_dir), sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())


def load_step(state: dict, root, verify: bool = True) -> None:
    """``Checkpointer(...).load(state)`` of step 1 under ``root`` in a fresh checkpointer."""
    c = shardckpt.Checkpointer(local_dir=str(root), verify_on_load=verify, preemption_signals=())
    try:
        if c.load(state) != 1:
            raise RuntimeError("load() did not restore step 1")
    finally:
        c.close()


def kinds_main(args) -> None:
    result = common.new_result("restore_kinds", int(args.gib * common.GIB), repeats=args.repeats)
    for kind, state, tensors in kind_states(args.gib):
        with common.scratch("restore-kinds", args.dir) as root:
            _step_dir, files, on_disk = save_step(state, root)
            check = common.RestoreCheck(None, tensors)
            tools = [
                common.Tool("read the step's files (floor)", lambda files=files: common.read_files(files), floor=True),
                check.wrap(common.Tool("shardckpt load", lambda state=state, root=root: load_step(state, root))),
            ]
            common.add_rate(common.compare(result, tools, args.repeats, group=kind), on_disk)
            result["notes"].append(f"{kind}: {len(files)} files, {common.fmt_bytes(on_disk)} on disk")
    result["notes"].append("warm page cache, checksums verified (the default)")
    common.emit(result, args.json)


def main() -> None:
    args = common.sized_args(__doc__, "timed restores per tool and cache state (per kind with --kinds)",
                             {"--kinds": "restore each kind of state instead, warm cache, verified"})
    if args.kinds:
        kinds_main(args)
        return
    model, state, nbytes = common.sized_state(args.gib)
    result = common.new_result("restore", nbytes, repeats=args.repeats)
    with common.scratch("restore", args.dir) as root:
        step_dir, files, on_disk = save_step(state, root)
        check = common.RestoreCheck(model)

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
                check.wrap(common.Tool("shardckpt load", lambda: load_step(state, root, True))),
                check.wrap(common.Tool("shardckpt load, no verify", lambda: load_step(state, root, False))),
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
