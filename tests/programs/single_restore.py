"""Restore the newest step of DIR in one process without a process group; write its full tensors.

usage: single_restore.py DIR OUT
"""

import sys

import common  # noqa: F401  (puts src/ on the path)
import torch

import shardckpt


def main() -> None:
    ckpt_dir, out = sys.argv[1:3]
    torch.manual_seed(0)
    model = common.TinyNet(width=24)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = shardckpt.Checkpointer(local_dir=ckpt_dir, preemption_signals=())
    state = {"model": model, "optimizer": optim, "extra": {}}
    step = ckpt.load(state)
    ckpt.close()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    flat = common.flat_tensors(get_model_state_dict(model))
    flat.update({"optim." + k: v for k, v in common.flat_tensors(get_optimizer_state_dict(model, optim)).items()})
    torch.save({"step": step, "tensors": flat}, out)


if __name__ == "__main__":
    main()
