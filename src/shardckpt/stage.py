"""Host staging buffers, allocated once and reused between saves.

``save()`` blocks only while the state is copied into these buffers; the
background writer then reads them while training mutates the live tensors.
Each tensor has its own buffer, keyed by its path in the state dict and
re-allocated only when that tensor's shape, dtype or sharding changes (the
optimizer's first step creating its state, a new parameter). Everything that
is not a tensor is copied at every save (it is small: counters, a sampler's
position, user values), so a list that grows does not touch any buffer.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

_PLAIN = (int, float, bool, str, bytes, type(None))


def _leaf_signature(obj: torch.Tensor) -> tuple:
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        return ("dtensor", tuple(local.shape), local.dtype, tuple(obj.shape), tuple(obj.placements))
    return (type(obj).__name__, tuple(obj.shape), obj.dtype)


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
        self._buffers: dict[tuple, Any] = {}
        self._signatures: dict[tuple, tuple] = {}
        self.allocations = 0
        """How many ``stage()`` calls had to allocate a buffer; 1 in steady state."""

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        non_blocking = self.pin_memory and torch.cuda.is_available()
        allocated = [False]

        def walk(obj: Any, path: tuple) -> Any:
            if isinstance(obj, torch.Tensor):
                return self._copy_leaf(obj, path, non_blocking, allocated)
            if isinstance(obj, dict):
                return {k: walk(v, path + (k,)) for k, v in obj.items()}
            if isinstance(obj, list):
                return [walk(v, path + (i,)) for i, v in enumerate(obj)]
            if isinstance(obj, tuple):
                return tuple(walk(v, path + (i,)) for i, v in enumerate(obj))
            if isinstance(obj, _PLAIN):
                return obj
            if isinstance(obj, io.BytesIO):
                return io.BytesIO(obj.getvalue())
            return copy.deepcopy(obj)

        staged = walk(state_dict, ())
        # Buffers of tensors absent from this save stay: a light save (no optimizer
        # state) between full ones must not make the next full save allocate again.
        if allocated[0]:
            self.allocations += 1
        if non_blocking:
            torch.cuda.synchronize()
        return staged

    def _copy_leaf(self, obj: torch.Tensor, path: tuple, non_blocking: bool, allocated: list[bool]) -> Any:
        signature = _leaf_signature(obj)
        buf = self._buffers.get(path)
        if buf is None or self._signatures[path] != signature:
            self._buffers.pop(path, None)  # drop the old buffer before allocating its successor
            buf = _create_cpu_state_dict({"t": obj}, pin_memory=self.pin_memory)["t"]
            self._buffers[path] = buf
            self._signatures[path] = signature
            allocated[0] = True
        if isinstance(obj, DTensor) and isinstance(buf, DTensor) and buf is not obj:
            buf._local_tensor.copy_(obj._local_tensor, non_blocking=non_blocking)
        elif type(obj) is torch.Tensor or (isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor)):
            buf.copy_(obj, non_blocking=non_blocking)
        else:  # ShardedTensor and other tensor subclasses: torch's own per-shard copy
            buf = _copy_state_dict({"t": obj}, {"t": buf}, non_blocking=non_blocking, type_check=False)["t"]
        return buf

    def release(self) -> None:
        self._buffers.clear()
        self._signatures.clear()
