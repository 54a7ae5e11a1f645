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


def split_bytes(state_dict: dict[str, Any], own_keys: set[str]) -> tuple[int, int]:
    """``(own, shared)``: tensor bytes only this rank writes (DTensor shards, the entries under
    ``own_keys``: per-rank keys) and bytes of plain tensors every rank holds alike (a DDP replica:
    DCP writes one copy of those, from one rank)."""
    own = shared = 0
    for key, value in state_dict.items():
        if key in own_keys:
            own += tensor_bytes(value)
            continue
        stack = [value]
        while stack:
            obj = stack.pop()
            if isinstance(obj, DTensor):
                own += tensor_bytes(obj)
            elif isinstance(obj, torch.Tensor):
                shared += tensor_bytes(obj)
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                stack.extend(obj)
    return own, shared


class CopyFence:
    """When the device-to-host copies of one save are done.

    On a GPU the copies run on a side stream and ``save()`` returns once they
    are *enqueued*: :meth:`order_after` makes later work on the current
    stream wait for them on the GPU (the optimizer step that would change the
    saved tensors; the CPU does not wait), :meth:`synchronize` blocks the
    writer thread until they are done before it reads the buffers. On a CPU
    the copies are done when ``stage()`` returns: both are no-ops.
    """

    def __init__(self, event: Any = None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def order_after(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostStager:
    """Copies a state dict into reusable host (CPU) buffers.

    ``pin_memory`` pins them (CUDA: faster copies, and copies that run beside
    the next step's compute); ``max_pinned_bytes`` caps what is pinned, for
    hosts that cannot pin the whole state: tensors past the cap get pageable
    buffers, whose copies are synchronous and slower (the save blocks longer).
    """

    def __init__(self, pin_memory: bool = False, max_pinned_bytes: int | None = None) -> None:
        self.pin_memory = pin_memory
        self.max_pinned_bytes = max_pinned_bytes
        self.pinned_bytes = 0
        self._buffers: dict[tuple, Any] = {}
        self._signatures: dict[tuple, tuple] = {}
        self._stream: Any = None
        self.allocations = 0
        """How many ``stage()`` calls had to allocate a buffer; 1 in steady state."""

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], CopyFence]:
        """Copy ``state_dict`` into the buffers; returns the staged dict and the fence of its copies."""
        on_gpu = torch.cuda.is_available() and _has_cuda_tensor(state_dict)
        allocated = [False]
        sources: list[torch.Tensor] = []

        def walk(obj: Any, path: tuple) -> Any:
            if isinstance(obj, torch.Tensor):
                if on_gpu:
                    sources.append(obj._local_tensor if isinstance(obj, DTensor) else obj)
                return self._copy_leaf(obj, path, on_gpu, allocated)
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

        if not on_gpu:
            staged = walk(state_dict, ())
            fence = CopyFence()
        else:
            # The copies go on a side stream, after what the compute stream queued so far.
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                staged = walk(state_dict, ())
                for source in sources:
                    if source.is_cuda:
                        source.record_stream(self._stream)  # not reused while the copy reads it
            event = torch.cuda.Event()
            event.record(self._stream)
            fence = CopyFence(event)
        # Buffers of tensors absent from this save stay: a light save (no optimizer
        # state) between full ones must not make the next full save allocate again.
        if allocated[0]:
            self.allocations += 1
        return staged, fence

    def _copy_leaf(self, obj: torch.Tensor, path: tuple, non_blocking: bool, allocated: list[bool]) -> Any:
        signature = _leaf_signature(obj)
        buf = self._buffers.get(path)
        if buf is None or self._signatures[path] != signature:
            old = self._buffers.pop(path, None)  # drop the old buffer before allocating its successor
            if old is not None and _local(old).is_pinned():
                self.pinned_bytes -= tensor_bytes(old)
            buf = _create_cpu_state_dict({"t": obj}, pin_memory=self._pin(obj))["t"]
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

    def _pin(self, obj: torch.Tensor) -> bool:
        """Pin this buffer: pinning is on, and it fits under ``max_pinned_bytes``."""
        if not self.pin_memory:
            return False
        nbytes = tensor_bytes(obj)
        if self.max_pinned_bytes is not None and self.pinned_bytes + nbytes > self.max_pinned_bytes:
            return False
        self.pinned_bytes += nbytes
        return True

    def release(self) -> None:
        self._buffers.clear()
        self._signatures.clear()
        self.pinned_bytes = 0


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _has_cuda_tensor(obj: Any) -> bool:
    if isinstance(obj, DTensor):
        return obj._local_tensor.is_cuda
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_has_cuda_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in obj)
    return False
