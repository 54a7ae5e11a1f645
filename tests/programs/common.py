"""Shared pieces of the multi-rank test programs (run under torchrun)."""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))


def jobs(argv: list[str]) -> list[list[str]]:
    """The argument lists of the jobs in ``argv``, separated by "+": a program runs them one after the
    other in one launch (one process group, one torchrun start instead of several)."""
    out, current = [], []
    for token in argv:
        if token == "+":
            out.append(current)
            current = []
        else:
            current.append(token)
    out.append(current)
    return out


def init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    # A barrier before tearing gloo down keeps ranks from aborting at exit.
    dist.barrier()
    dist.destroy_process_group()
    # Then leave without the interpreter's teardown: gloo's threads can still abort a process
    # that finished its work ("terminate called without an active exception", exit -6), which
    # would fail a run whose results are all written. Every file was closed before this.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class TinyNet(nn.Module):
    def __init__(self, width: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(width, 10)
        self.fc3 = nn.Linear(10, 2)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(self.drop(torch.relu(self.fc1(x))))))


def full(t: torch.Tensor) -> torch.Tensor:
    """The full (unsharded) value of a tensor or DTensor, on CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def flat_tensors(sd, prefix=""):
    out = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(flat_tensors(v, f"{prefix}{i}."))
    elif isinstance(sd, torch.Tensor):
        out[prefix[:-1]] = full(sd)
    return out


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
