"""Host staging buffers, allocated once and reused between saves.

``save()`` blocks only while the state is copied into these buffers (by
default until the copies are complete, also on a GPU; with
``overlap_copies`` only until they are enqueued); the background writer
then reads them while training mutates the live tensors.
Each tensor has its own buffer, keyed by its path in the state dict and
re-allocated only when that tensor's shape, dtype or sharding changes (the
optimizer's first step creating its state, a new parameter). Everything that
is not a tensor is copied at every save (it is small: counters, a sampler's
position, user values), so a list that grows does not touch any buffer.
"""

from __future__ import annotations

import copy
import io
import threading
from typing import Any, Callable

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from shardckpt import _failpoints
from shardckpt.errors import CopiesRacedError

PLAIN = (int, float, bool, str, bytes, type(None))
"""The types of a staged state's values kept as they are (immutable): a list of them is copied, not walked."""


def plain_sequence(obj: Any) -> bool:
    """``obj`` is a list or tuple (not a subclass) of :data:`PLAIN` values (an optimizer's parameter names): it
    holds no tensor, copied or skipped whole rather than walked."""
    return type(obj) in (list, tuple) and all(type(v) in PLAIN for v in obj)


def leaf_signature(obj: torch.Tensor) -> tuple:
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
    """When the device-to-host copies of one save are done, and whether a source changed before.

    On a GPU the copies run on a side stream. By default ``save()`` calls
    :meth:`complete` and returns with them done. With ``overlap_copies`` it
    returns once they are *enqueued*: :meth:`order_after` (from the hooks on
    the fenced writes) makes later work on the current stream wait for them
    on the GPU, and :meth:`synchronize` blocks the writer thread until they
    are done before it reads the buffers. On a CPU the copies are done when
    ``stage()`` returns (unless deferred, below) and all three only check.

    ``sources`` are ``(key, tensor, version)``: each source tensor with its
    version counter at staging. The first of :meth:`order_after` (later
    writes on that stream wait for the copies) and the end of the copies
    settles the fence: a source whose counter moved by then may have been
    copied half-written, and :meth:`synchronize` raises
    :class:`CopiesRacedError` naming it instead of letting the step be written.
    ``deferred`` are copies not run yet (:attr:`HostStager.defer_cpu_copies`):
    they run where a GPU's would be waited for.
    """

    def __init__(
        self, event: Any = None, sources: list[tuple[str, torch.Tensor, int]] | None = None,
        deferred: list[Callable[[], Any]] | None = None, what: str = "this save",
    ) -> None:
        self.event = event
        self.what = what
        self.changed: list[str] = []
        """Keys of the sources written before the fence settled (empty: none)."""
        self._sources = sources or []
        self._deferred = deferred
        self._lock = threading.Lock()
        self._settled = not self._sources

    def done(self) -> bool:
        if self._deferred:
            return False
        event = self.event  # order_after() may drop it meanwhile
        return event is None or bool(event.query())

    def order_after(self) -> None:
        """Later work on the current stream runs after the copies (called before a fenced write)."""
        with self._lock:
            self._settle()
            self._run_deferred()
        event = self.event
        if event is not None:
            if event.query():
                self.event = None  # done: the next fenced write need not ask again
            else:
                torch.cuda.current_stream().wait_event(event)

    def complete(self) -> None:
        """Block until the copies are done; the fence is then settled."""
        with self._lock:
            self._run_deferred()
        event = self.event
        if event is not None:
            event.synchronize()
        with self._lock:
            self._settle()

    def synchronize(self) -> None:
        """The writer thread, before it reads the buffers: wait for the copies, refuse torn ones."""
        if not self.done():
            _failpoints.hit("stage.copies_pending")
        self.complete()
        if self.changed:
            shown = ", ".join(repr(k) for k in self.changed[:5]) + (" ..." if len(self.changed) > 5 else "")
            raise CopiesRacedError(
                f"{self.what}: {len(self.changed)} saved tensor(s) were written between save() and the end of their "
                f"device-to-host copy ({shown}), so the copy may hold them half-written; the step is not "
                f"written. Remedy: set overlap_copies=False (save() then returns with the copies done), or "
                f"make that write wait for the copies (call Checkpointer.wait_for_copies() before it)."
            )

    def _settle(self) -> None:
        if self._settled:
            return
        for key, tensor, version in self._sources:
            if _version(tensor) != version and key not in self.changed:
                self.changed.append(key)
        self._sources = []
        self._settled = True

    def _run_deferred(self) -> None:
        if self._deferred:
            with torch.no_grad():
                for copy_now in self._deferred:
                    copy_now()
            self._deferred = None


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors have no version counter
        return -1


def _tracked(obj: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose version counters tell a write to ``obj`` (the local shards of a sharded one)."""
    if isinstance(obj, DTensor):
        return [obj._local_tensor]
    shards = getattr(obj, "local_shards", None)
    if callable(shards) and type(obj) is not torch.Tensor:
        return [s.tensor for s in shards()]
    return [obj]


class HostStager:
    """Copies a state dict into reusable host (CPU) buffers.

    ``pin_memory`` pins them (CUDA: faster copies, and copies that run beside
    the next step's compute); ``max_pinned_bytes`` caps what is pinned, for
    hosts that cannot pin the whole state: tensors past the cap get pageable
    buffers, whose copies are synchronous and slower (the save blocks longer).
    """

    defer_cpu_copies = False
    """On a CPU, leave the copies to the fence (run at ``order_after`` or
    ``synchronize``), the way a GPU runs them after ``save()`` returns with
    ``overlap_copies``: the fence's checks can then be exercised without a GPU."""

    def __init__(self, pin_memory: bool = False, max_pinned_bytes: int | None = None) -> None:
        self.pin_memory = pin_memory
        self.max_pinned_bytes = max_pinned_bytes
        self.pinned_bytes = 0
        self._buffers: dict[tuple, Any] = {}
        self._signatures: dict[tuple, tuple] = {}
        self._stream: Any = None
        self._program: dict[tuple, tuple[Any, list[_Pair]]] = {}
        self._program_token: int | None = None
        self._done_token: int | None = None
        self.allocations = 0
        """How many ``stage()`` calls had to allocate a buffer; 1 in steady state."""

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any], what: str = "this save", plan: Any = None
              ) -> tuple[dict[str, Any], CopyFence]:
        """Copy ``state_dict`` into the buffers; returns the staged dict and the fence of its copies.

        ``what`` names the save in the fence's errors (``"step 12"``). ``plan`` (a ``saving.plan.SavePlan``):
        the subtrees at its ``fixed`` paths hold the same tensors at every save under it; their copies are
        recorded once (a *program*: buffer, source) and then run as one batched copy, without a walk.
        """
        on_gpu = torch.cuda.is_available() and _has_cuda_tensor(state_dict)
        deferred: list[Callable[[], Any]] | None = [] if not on_gpu and self.defer_cpu_copies else None
        track = on_gpu or deferred is not None
        allocated = [False]
        sources: list[tuple[str, torch.Tensor, int]] = []
        fixed: set[tuple] = set(plan.fixed) if plan is not None else set()
        if plan is None or self._program_token != plan.token:
            self._program, self._program_token = {}, (plan.token if plan is not None else None)
        self._done_token = None
        program = self._program
        batch: list[_Pair] = []
        recording: list[list[_Pair] | None] = []

        def walk(obj: Any, path: tuple, check: bool = True) -> Any:
            if check and path in fixed:
                return fixed_subtree(obj, path)
            if isinstance(obj, torch.Tensor):
                if track:
                    key = ".".join(str(p) for p in path)
                    sources.extend((key, t, _version(t)) for t in _tracked(obj))
                buf = self._copy_leaf(obj, path, on_gpu, allocated, deferred)
                if recording and recording[-1] is not None:
                    pair = _pair(buf, obj, path)
                    if pair is None:
                        recording[-1] = None  # a tensor type without a plain local tensor: walked at every save
                    else:
                        recording[-1].append(pair)
                return buf
            if isinstance(obj, dict):
                return {k: walk(v, path + (k,)) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                if plain_sequence(obj):
                    if recording and obj:
                        recording[-1] = None  # values that may change: walked at every save
                    return obj.copy() if type(obj) is list else obj  # (an optimizer's parameter names)
                if isinstance(obj, list):
                    return [walk(v, path + (i,)) for i, v in enumerate(obj)]
                return tuple(walk(v, path + (i,)) for i, v in enumerate(obj))
            if recording:
                recording[-1] = None  # a value that is not a tensor may change: walked at every save
            if isinstance(obj, PLAIN):
                return obj
            if isinstance(obj, io.BytesIO):
                return io.BytesIO(obj.getvalue())
            return copy.deepcopy(obj)

        def fixed_subtree(obj: Any, path: tuple) -> Any:
            found = program.get(path)
            if found is None:  # the first save under this plan: walked, and its copies recorded
                recording.append([])
                out = walk(obj, path, check=False)
                pairs = recording.pop()
                if pairs is not None:
                    program[path] = (out, pairs)
                return out
            skeleton, pairs = found
            if track:
                sources.extend((p.key, t, _version(t)) for p in pairs for t in p.tracked)
            batch.extend(pairs)
            return skeleton  # never changed by a reader: the writer and the record copy what they change

        def copy_batch() -> None:
            if batch:
                torch._foreach_copy_([p.buf for p in batch], [p.src for p in batch], non_blocking=on_gpu)

        if not on_gpu:
            staged = walk(state_dict, ())
            if deferred is not None:
                deferred.append(copy_batch)
            else:
                copy_batch()
            fence = CopyFence(sources=sources, deferred=deferred, what=what)
        else:
            # The copies go on a side stream, after what the compute stream queued so far.
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                staged = walk(state_dict, ())
                copy_batch()
                for _key, source, _v in sources:
                    if source.is_cuda:
                        source.record_stream(self._stream)  # not reused while the copy reads it
            event = torch.cuda.Event()
            event.record(self._stream)
            fence = CopyFence(event, sources=sources, what=what)
        # Buffers of tensors absent from this save stay: a light save (no optimizer
        # state) between full ones must not make the next full save allocate again.
        if allocated[0]:
            self.allocations += 1
        self._done_token = self._program_token
        return staged, fence

    def staged_under(self, plan: Any) -> bool:
        """The last copy ran under ``plan`` (its fixed tensors have their buffers, of the same layout)."""
        return self._done_token == plan.token

    def _copy_leaf(
        self, obj: torch.Tensor, path: tuple, non_blocking: bool, allocated: list[bool],
        deferred: list[Callable[[], Any]] | None = None,
    ) -> Any:
        signature = leaf_signature(obj)
        buf = self._buffers.get(path)
        if buf is None or self._signatures[path] != signature:
            old = self._buffers.pop(path, None)  # drop the old buffer before allocating its successor
            if old is not None and _local(old).is_pinned():
                self.pinned_bytes -= tensor_bytes(old)
            buf = self._allocate(obj, path)
            self._buffers[path] = buf
            self._signatures[path] = signature
            allocated[0] = True
        if deferred is not None:
            deferred.append(lambda: _copy_into(buf, obj, non_blocking))
            return buf
        return _copy_into(buf, obj, non_blocking)

    def _allocate(self, obj: torch.Tensor, path: tuple) -> Any:
        """A new buffer for the tensor ``obj`` at ``path`` of the state dict (the memory tier's slots
        hand out views of their shared memory instead)."""
        return _new_buffer(obj, self._pin(obj))

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
        self._program, self._program_token, self._done_token = {}, None, None
        self.pinned_bytes = 0


class _Pair:
    """One recorded copy of a staging program: the buffer's and the source's plain local tensors."""

    __slots__ = ("buf", "src", "key", "tracked")

    def __init__(self, buf: torch.Tensor, src: torch.Tensor, key: str, tracked: list[torch.Tensor]) -> None:
        self.buf, self.src, self.key, self.tracked = buf, src, key, tracked


def _pair(buf: Any, obj: torch.Tensor, path: tuple) -> _Pair | None:
    """The copy of ``obj`` into ``buf`` as two plain tensors (``None``: a type copied by torch's own helper)."""
    key = ".".join(str(p) for p in path)
    if isinstance(obj, DTensor) and isinstance(buf, DTensor) and buf is not obj:
        return _Pair(buf._local_tensor, obj._local_tensor, key, [obj._local_tensor])
    if (type(obj) is torch.Tensor or (isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor))) \
            and type(buf) is torch.Tensor and buf is not obj:
        return _Pair(buf, obj, key, _tracked(obj))
    return None


def _new_buffer(obj: torch.Tensor, pin: bool) -> Any:
    """An empty host buffer shaped like ``obj`` (for a DTensor: its local shard, same spec).

    A DTensor's buffer is built around a fresh local tensor: torch's generic
    helper deep-copies the DTensor, data included, before replacing its local
    tensor, and those transient copies (one per tensor, freed into the C heap)
    stayed resident: a state of many mid-sized shards grew the RSS to about
    twice the staged bytes.
    """
    if isinstance(obj, DTensor) and obj._local_tensor.dim() > 0 and obj._local_tensor.numel() > 0:
        local = obj._local_tensor
        buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
        return DTensor(buf, obj._spec, requires_grad=False)
    return _create_cpu_state_dict({"t": obj}, pin_memory=pin)["t"]


def _copy_into(buf: Any, obj: torch.Tensor, non_blocking: bool) -> Any:
    if isinstance(obj, DTensor) and isinstance(buf, DTensor) and buf is not obj:
        buf._local_tensor.copy_(obj._local_tensor, non_blocking=non_blocking)
    elif type(obj) is torch.Tensor or (isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor)):
        buf.copy_(obj, non_blocking=non_blocking)
    else:  # ShardedTensor and other tensor subclasses: torch's own per-shard copy
        buf = _copy_state_dict({"t": obj}, {"t": buf}, non_blocking=non_blocking, type_check=False)["t"]
    return buf


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
