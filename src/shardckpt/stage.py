"""Host staging buffers, allocated once and reused between saves.

``save()`` blocks only while the state is copied into these buffers; the
background writer then reads them while training mutates the live tensors.
Buffers are re-allocated only when the structure of the state changes (a new
key, a new shape or dtype: e.g. the optimizer's first step creates its state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor


def _signature(obj: Any, path: tuple = ()) -> list:
    out: list = []
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        out.append((path, "dtensor", tuple(local.shape), local.dtype, tuple(obj.shape)))
    elif isinstance(obj, torch.Tensor):
        out.append((path, "tensor", tuple(obj.shape), obj.dtype))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.extend(_signature(value, path + (key,)))
        out.append((path, "dict", len(obj)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.extend(_signature(value, path + (i,)))
        out.append((path, type(obj).__name__, len(obj)))
    else:
        out.append((path, "object"))
    return out


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data this rank holds in ``obj`` (local shards for DTensor)."""
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        return local.numel() * local.element_size()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class HostStager:
    """Copies a state dict into reusable host (CPU) buffers."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[str, Any] | None = None
        self._signature: list | None = None
        self.allocations = 0
        """How many times buffers were (re)allocated; 1 in steady state."""

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _signature(state_dict)
        if self._buffers is None or signature != self._signature:
            self._buffers = None  # drop the old buffers before allocating new ones
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=self.pin_memory)
            self._signature = signature
            self.allocations += 1
        non_blocking = self.pin_memory and torch.cuda.is_available()
        staged = _copy_state_dict(state_dict, self._buffers, non_blocking=non_blocking, type_check=False)
        if non_blocking:
            torch.cuda.synchronize()
        return staged

    def release(self) -> None:
        self._buffers = None
        self._signature = None
