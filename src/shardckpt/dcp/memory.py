"""A step held in memory, read through DCP: its items described at save, its metadata and reader at restore.

At save each rank describes what it staged (:func:`describe`): every tensor
(plain or DTensor) as DCP would plan it (fqn, dtype, local shape, global
size, the chunk's offsets) with its offset in the rank's buffer, and every
non-tensor item serialised as bytes ``torch.load`` reads (:func:`_pickled`). At restore the
descriptions of all saving ranks make one DCP :class:`Metadata`
(:func:`metadata`), so the restore's planner, key matching and resharding run
exactly as for a step on disk; :class:`MemoryReader` then reads each item
from the buffers held on this machine straight into the live tensors (a read
of the file, as from the page cache; a part of a tensor through a mapping); and
:class:`RecordPlanner` writes a copy in memory as DCP files (``close()`` puts
the newest memory step on disk). Knows no tier.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from shardckpt.dcp.record_layout import memory_of as _memory_of
from shardckpt.errors import ShardckptError
from shardckpt.format import shm

try:
    from torch.distributed.checkpoint._traverse import narrow_tensor_by_index  # type: ignore
except ImportError:  # pragma: no cover - moved between torch releases
    from torch.distributed._shard._utils import narrow_tensor_by_index  # type: ignore


class MemoryMiss(ShardckptError):
    """The restore on this rank needs bytes that no copy held on its machine has (another layout than saved, or
    a copy gone or not checking out). ``gone``: the memory itself is gone (no step is read from it)."""

    def __init__(self, message: str, *, gone: bool = False) -> None:
        super().__init__(message)
        self.gone = gone


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.rsplit(".", 1)[-1], None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def describe(
    staged: dict[str, Any], offset_of: Callable[[torch.Tensor], int], cache: dict[tuple[str, int], list[Any]],
) -> tuple[list[list[Any]], list[tuple[str, bytes]], dict[str, list[Any]]]:
    """What one rank staged, as DCP would plan it: ``(tensors, values, planner_data)``.

    ``tensors``: ``[fqn, dtype, local shape, global size, chunk offsets, offset]`` where ``offset_of``
    gives the local tensor's offset in the rank's buffer; ``values``: ``(fqn, torch.save bytes)`` of
    every other item; ``planner_data``: each fqn's path. ``cache`` keeps the entries of buffers seen
    before (the same buffer object of the same fqn describes itself alike).
    """
    tensors: list[list[Any]] = []
    values: list[tuple[str, bytes]] = []
    planner_data: dict[str, list[Any]] = {}
    pickled = cache.pop(_VALUES, {})
    kept: dict[str, tuple[type, Any, bytes]] = {}
    try:
        chunks = _flatten(staged, cache)
    except _Twice:
        return _describe_flat(staged, offset_of)
    for flat, mappings, memo in chunks:
        if memo is not None and memo[3] is not None:  # the same buffers as at the last save: described alike
            tensors.extend(memo[3][0])
            planner_data.update(memo[3][1])
            continue
        described: list[list[Any]] = []
        for fqn, obj in flat.items():
            if isinstance(obj, torch.Tensor):
                key = (fqn, id(obj))
                entry = cache.get(key)
                if entry is None:
                    entry = cache[key] = _tensor_entry(fqn, obj, offset_of)
                described.append(entry)
            else:
                before = pickled.get(fqn)
                plain = _plain(obj)
                frozen = tuple(obj) if plain and type(obj) is list else obj  # (a list: its items as they are now)
                if before is not None and type(obj) is before[0] and plain and _equal(frozen, before[1]):
                    data = before[2]  # the same plain value as at the last save: its bytes again, not pickled
                else:
                    data = _pickled(obj)
                if plain:
                    kept[fqn] = (type(obj), frozen, data)
                values.append((fqn, data))
        paths = {fqn: list(path) for fqn, path in mappings.items()}
        if memo is not None:
            memo[3] = (described, paths)
        tensors.extend(described)
        planner_data.update(paths)
    cache[_VALUES] = kept  # type: ignore[assignment]
    if len(planner_data) != len(tensors) + len(values):  # a name twice: DCP's own flattening names it
        cache.pop(_FLAT, None)
        return _describe_flat(staged, offset_of)
    return tensors, values, planner_data


def _describe_flat(staged: dict[str, Any], offset_of: Callable[[torch.Tensor], int]
                   ) -> tuple[list[list[Any]], list[tuple[str, bytes]], dict[str, list[Any]]]:
    """:func:`describe` over DCP's own flattening of ``staged`` in one dict (nothing reused)."""
    flat, mappings = flatten_state_dict(staged)
    tensors = [_tensor_entry(fqn, obj, offset_of) for fqn, obj in flat.items() if isinstance(obj, torch.Tensor)]
    values = [(fqn, _pickled(obj)) for fqn, obj in flat.items() if not isinstance(obj, torch.Tensor)]
    return tensors, values, {fqn: list(path) for fqn, path in mappings.items()}


def _tensor_entry(fqn: str, obj: torch.Tensor, offset_of: Callable[[torch.Tensor], int]) -> list[Any]:
    """``[fqn, dtype, local shape, global size, chunk offsets, offset]`` of a staged tensor, as DCP plans it."""
    local = obj._local_tensor if isinstance(obj, DTensor) else obj
    data = _create_write_items(fqn, obj)[0].tensor_data
    return [fqn, str(local.dtype), list(data.chunk.sizes), list(data.size), list(data.chunk.offsets),
            offset_of(local)]


def _pickled(obj: Any) -> bytes:
    """A non-tensor item as bytes ``torch.load`` reads: a plain value (scalars, a tuple or list of them: a step
    counter, a learning rate) in ``torch.save``'s stream format, made by ``pickle`` (:func:`_stream_format`);
    anything else as DCP writes it (``torch.save``)."""
    if _plain(obj):
        frame = _stream_format()
        if frame is not None:
            return frame[0] + pickle.dumps(obj, _STREAM_PROTOCOL) + frame[1]
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


_STREAM_PROTOCOL = 2
"""The pickle protocol ``torch.save`` writes (its ``DEFAULT_PROTOCOL``)."""
_stream_frame: list[tuple[bytes, bytes] | None] = []


def _stream_format() -> tuple[bytes, bytes] | None:
    """What ``torch.save(obj, f, _use_new_zipfile_serialization=False)`` writes around the pickle of an ``obj``
    that holds no tensor: its header (magic number, protocol version, system info) and its empty list of
    storages. ``torch.save``'s own zip format costs a zip archive per value (100-250 µs for one int, more than
    the rest of a save's record); this one a pickle (well under a µs). Derived once from ``torch.save`` itself
    and checked on a probe value; ``None`` (every value through ``torch.save``) when this torch writes
    otherwise."""
    if not _stream_frame:
        probe = (7, 2.5, "probe", None, True, b"x", [1])
        buf = io.BytesIO()
        frame = None
        try:
            torch.save(probe, buf, _use_new_zipfile_serialization=False)
            whole, body = buf.getvalue(), pickle.dumps(probe, _STREAM_PROTOCOL)
            tail = pickle.dumps([], _STREAM_PROTOCOL)
            head = whole[:len(whole) - len(body) - len(tail)]
            if whole == head + body + tail and torch.load(io.BytesIO(whole), weights_only=True) == probe:
                frame = (head, tail)
        except Exception:  # noqa: BLE001 - a torch without this format: torch.save's own, for every value
            frame = None
        _stream_frame.append(frame)
    return _stream_frame[0]


_VALUES = ("values", 0)
"""``describe``'s cache key of the last save's pickled plain values: ``{fqn: (type, value, bytes)}``."""
_FLAT = ("flat", 0)
"""``describe``'s cache key of the flattened subtrees of the last save: ``{id: (subtree, flat, mappings)}``."""
_SCALARS = (int, float, str, bytes, bool, type(None))


def _plain(obj: Any) -> bool:
    """A value made of scalars, a tuple or list of them (compared by value, a list by a copy of its items:
    reusing its bytes is safe)."""
    if type(obj) in _SCALARS:
        return True
    return type(obj) in (tuple, list) and all(type(v) in _SCALARS for v in obj)


def _equal(a: Any, b: Any) -> bool:
    """Equal with the same types throughout (``1 == 1.0 == True``, ``0.0 == -0.0`` pickle differently)."""
    if type(a) is tuple:
        return type(b) is tuple and len(a) == len(b) and all(map(_same_scalar, a, b))
    return _same_scalar(a, b)


def _same_scalar(x: Any, y: Any) -> bool:
    return type(x) is type(y) and bool(x == y) and (type(x) is not float or math.copysign(1, x) == math.copysign(1, y))


def _flatten(staged: dict[str, Any], cache: dict[Any, Any]) -> list[tuple[dict[str, Any], dict[str, Any], Any]]:
    """DCP's ``flatten_state_dict`` of ``staged`` as chunks ``(flat, mappings, memo)`` in its order, two levels at
    a time: a subtree that is the same object as at the last save (a staging program's buffers, which never change
    under one plan) is not walked again. ``memo``: the cache entry ``[subtree, flat, mappings, derived]`` of a
    subtree made of tensors only (``derived``: what the caller made of it at the last save, ``None`` at first);
    ``None`` for any other chunk."""
    before = cache.pop(_FLAT, {})
    now: dict[int, list[Any]] = {}
    chunks: list[tuple[dict[str, Any], dict[str, Any], Any]] = []
    for key, value in staged.items():
        top = before.get(id(value))
        if top is not None and top[0] is value:  # the whole entry is as it was (a module's buffers)
            chunks.append((top[1], top[2], top))
            now[id(value)] = top
            continue
        parts = list(value.items()) if isinstance(value, dict) and value else [(None, value)]
        mine: list[tuple[dict[str, Any], dict[str, Any], Any]] = []
        loose_f: dict[str, Any] = {}
        loose_m: dict[str, Any] = {}
        for sub, v in parts:
            if isinstance(v, torch.Tensor):  # a leaf: its path joined by dots, as DCP names it
                path = (str(key),) if sub is None else (str(key), str(sub))
                fqn = ".".join(path)
                if fqn in loose_f:
                    raise _Twice  # (1 and "1")
                loose_f[fqn], loose_m[fqn] = v, path
                continue
            if loose_f:
                mine.append((loose_f, loose_m, None))
                loose_f, loose_m = {}, {}
            hit = before.get(id(v))
            if hit is not None and hit[0] is v and isinstance(v, dict):
                memo: Any = hit
            else:
                f, m = _flat_plain((str(key),) if sub is None else (str(key), str(sub)), v)
                memo = [v, f, m, None] if isinstance(v, dict) and all(
                    isinstance(t, torch.Tensor) for t in f.values()) else None
                if memo is None:
                    mine.append((f, m, None))
                    continue
            now[id(v)] = memo  # tensors only: the same object holds the same leaves
            mine.append((memo[1], memo[2], memo))
        if loose_f:
            mine.append((loose_f, loose_m, None))
        if isinstance(value, dict) and value and all(  # (a memo's chunk holds tensors only: not walked again)
                n is not None or all(isinstance(t, torch.Tensor) for t in f.values()) for f, _m, n in mine):
            kf: dict[str, Any] = {}
            km: dict[str, Any] = {}
            for f, m, _n in mine:
                kf.update(f)
                km.update(m)
            if len(kf) != sum(len(f) for f, _m, _n in mine):
                raise _Twice  # ("b.c" beside "b": {"c": ...})
            entry = [value, kf, km, None]
            now[id(value)] = entry
            mine = [(kf, km, entry)]
        chunks.extend(mine)
    cache[_FLAT] = now
    return chunks


TWICE = ("two entries of the state have the same name: DCP names each entry by its keys joined with '.', so a "
         "key holding a '.' meets a nested one (\"b.c\" beside \"b\": {\"c\": ...}), as 1 meets \"1\"")
"""What a state whose flattened names collide is told (a memory save and a disk write alike)."""


def names_twice(exc: BaseException | str) -> bool:
    """``exc`` is DCP's error for a name two entries of the state flatten to."""
    return "duplicated flatten key" in str(exc)


class _Twice(Exception):
    """Two leaves of one entry flatten to the same name: DCP's own flattening names it (raising)."""


class _NotPlain(Exception):
    """A subtree :func:`_flat_plain` leaves to DCP's own flattening."""


def _flat_plain(path: tuple, value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's ``flatten_state_dict`` of ``value`` at ``path``, the same keys, paths and leaves in the same order,
    without its generic walk where the subtree is made of plain dicts, lists of scalars or of plain dicts, and
    leaves (an optimizer's ``param_groups``: its ``isinstance(..., Mapping)`` per list item is most of its cost);
    anything else goes to DCP's."""
    flat: dict[str, Any] = {}
    mappings: dict[str, Any] = {}

    def walk(at: tuple, obj: Any) -> None:
        kind = type(obj)
        if kind is dict:
            for k, v in obj.items():
                walk(at + (str(k),), v)
            return
        if kind is list:
            if all(type(v) in _SCALARS for v in obj):
                pass  # a leaf
            elif obj and all(type(v) is dict for v in obj):
                for i, v in enumerate(obj):
                    walk(at + (i,), v)
                return
            else:
                raise _NotPlain
        elif not (kind in _SCALARS or kind is tuple or isinstance(obj, torch.Tensor)):
            raise _NotPlain  # (a Mapping or list of another type is DCP's to walk)
        fqn = ".".join(map(str, at))
        if fqn in flat:
            raise _NotPlain  # DCP says which key is duplicated
        flat[fqn], mappings[fqn] = obj, at

    try:
        walk(path, value)
    except _NotPlain:
        nested: Any = value
        for part in reversed(path):
            nested = {part: nested}
        return flatten_state_dict(nested)
    return flat, mappings


def metadata(tables: list[dict[str, Any]]) -> Metadata:
    """DCP's metadata of a save from every saving rank's description (the same on every rank)."""
    sd: dict[str, Any] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}
    planner_data: dict[str, Any] = {}
    for table in tables:
        for fqn, dtype, shape, size, offsets, _offset in table["tensors"]:
            md = sd.get(fqn)
            if md is None:
                md = sd[fqn] = TensorStorageMetadata(TensorProperties(dtype=_dtype(dtype)), torch.Size(size), [])
                seen[fqn] = set()
            if tuple(offsets) not in seen[fqn]:  # a tensor every rank holds alike (a DDP replica) is one chunk
                seen[fqn].add(tuple(offsets))
                md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape)))
        for fqn, _offset, _length in table["values"]:
            sd.setdefault(fqn, BytesStorageMetadata())
        planner_data.update({fqn: tuple(path) for fqn, path in table["planner_data"].items()})
    return Metadata(state_dict_metadata=sd, planner_data=planner_data, storage_data={})


class Copy:
    """One rank's copy of the save held on this machine, read-only: its buffer, values and description."""

    def __init__(self, rank: int, buffer_path: str, buffer_size: int, values_path: str, values_size: int,
                 table: dict[str, Any]) -> None:
        self.rank = rank
        self.table = table
        self._buffer_path, self._buffer_size = buffer_path, buffer_size
        self._values_path, self._values_size = values_path, values_size
        self._map: mmap.mmap | None = None
        self._fd: int | None = None
        self._values: bytes | None = None

    @classmethod
    def of(cls, ns: str, rec: Any) -> Copy:
        """The copy a memory record (``format/shm.Record``) of the namespace ``ns`` describes."""
        table = {"tensors": rec.tensors, "values": rec.values, "planner_data": rec.planner_data}
        return cls(rec.rank, os.path.join(ns, rec.buffer), rec.buffer_size, os.path.join(ns, rec.values_file),
                   rec.values_size, table)

    def open(self) -> None:
        """Open the buffer and read the values now (raises :class:`OSError`): the files may go after this
        (a keeper's purge), the open copy stays readable."""
        if self._fd is None:
            fd = os.open(self._buffer_path, os.O_RDONLY | os.O_NOFOLLOW)
            if os.fstat(fd).st_size < self._buffer_size:
                os.close(fd)
                raise OSError(f"{self._buffer_path} is shorter than its record says")
            self._fd = fd
        if self._values is None:
            with open(self._values_path, "rb") as f:
                self._values = f.read(self._values_size)
            if len(self._values) < self._values_size:
                raise OSError(f"{self._values_path} is shorter than its record says")

    def digest(self) -> str | None:
        """The checksum of the copy's bytes (``format/shm.digest`` of its buffer, then its values)."""
        self.open()
        with mmap.mmap(self._fd, max(1, self._buffer_size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as region:
            with memoryview(region) as whole:
                return shm.digest([whole[:self._buffer_size], self._values])

    def read_into(self, target: torch.Tensor, dtype: str, shape: list[int], offset: int) -> bool:
        """Read the tensor recorded at ``offset`` straight into ``target`` when it is that whole tensor, on the
        CPU and contiguous (one copy by the kernel, as a read from the page cache); False otherwise."""
        if (target.device.type != "cpu" or not target.is_contiguous() or str(target.dtype) != dtype
                or list(target.shape) != list(shape) or not target.numel()):
            return False
        view = _memory_of(target)
        if offset < 0 or offset + view.nbytes > self._buffer_size:
            raise MemoryMiss(f"[{offset}, {offset + view.nbytes}) lies outside the buffer of {self._buffer_size} bytes")
        try:
            self.open()
            done = 0
            while done < view.nbytes:
                got = os.preadv(self._fd, [view[done:]], offset + done)
                if got <= 0:
                    raise MemoryMiss(f"{self._buffer_path} ends at {offset + done}, before the tensor it records")
                done += got
        except OSError as exc:
            raise MemoryMiss(f"{self._buffer_path} cannot be read ({exc})") from exc
        return True

    def tensor(self, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
        """The tensor recorded at ``offset``: a read-only view of the mapped buffer with a storage of its own."""
        if self._map is None:
            try:
                self.open()
                # Populated at once: one pass of the kernel instead of a fault per page while copying.
                self._map = mmap.mmap(self._fd, max(1, self._buffer_size), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                      prot=mmap.PROT_READ)
            except OSError as exc:
                raise MemoryMiss(f"{self._buffer_path} cannot be read ({exc})") from exc
        kind = _dtype(dtype)
        count = math.prod(shape)
        if offset < 0 or offset + count * kind.itemsize > self._buffer_size:
            raise MemoryMiss(f"[{offset}, {offset + count * kind.itemsize}) lies outside the buffer of "
                             f"{self._buffer_size} bytes")
        if not count:
            return torch.empty(shape, dtype=kind)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only memory: only read from here
            return torch.frombuffer(self._map, dtype=kind, count=count, offset=offset).view(shape)

    def value(self, offset: int, length: int) -> bytes:
        try:
            self.open()
        except OSError as exc:
            raise MemoryMiss(f"{self._values_path} cannot be read ({exc})") from exc
        if offset < 0 or offset + length > len(self._values):
            raise MemoryMiss(f"[{offset}, {offset + length}) lies outside the values of {len(self._values)} bytes")
        return self._values[offset:offset + length]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still alive: the mapping goes with it
                pass
            self._map = None


def check_copy(ns: str, rec: Any, copy: Copy) -> str | None:
    """Why the copy of the record ``rec`` (``format/shm.Record``) does not check out against its checksum
    (``None``: it does, or it has none: killed before it was taken)."""
    found = shm.read_sum(ns, rec)
    if found is None:
        return None
    where = f"the copy of rank {rec.rank} of step {rec.step} in {ns}"
    if "error" in found:
        return f"{where}: its checksum is {found['error']}"
    if found.get("step") != rec.step or found.get("save_id") != rec.save_id:
        return (f"{where}: its checksum names step {found.get('step')} (id:{found.get('save_id')}), the record "
                f"step {rec.step} ({rec.version})")
    try:
        value = copy.digest()
    except OSError as exc:
        return f"{where} cannot be read ({exc})"
    if value != found.get("digest"):
        return f"{where} does not match its checksum ({value}, recorded {found.get('digest')}): the memory changed"
    return None


class MemoryReader(StorageReader):
    """DCP's storage reader over the copies of one save held on this machine (this rank's own first).

    Each read item is looked up by fqn and chunk in the copies; a rank whose plan needs
    an item none of them holds fails the plan (:class:`MemoryMiss`, on every rank alike:
    DCP gathers the planning errors) before a byte is read.
    """

    def __init__(self, md: Metadata, copies: list[Copy], *, step: int, where: str) -> None:
        super().__init__()
        self._md = md
        self._copies = copies
        self._step, self._where = step, where
        self._tensors: dict[tuple[str, tuple[int, ...]], tuple[Copy, list[Any]]] = {}
        self._values: dict[str, tuple[Copy, int, int]] = {}
        for copy in copies:
            for entry in copy.table["tensors"]:
                self._tensors.setdefault((entry[0], tuple(entry[4])), (copy, entry))
            for fqn, offset, length in copy.table["values"]:
                self._values.setdefault(fqn, (copy, offset, length))

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self) -> Metadata:
        return self._md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        lacking = [item.storage_index.fqn for item in plan.items if self._find(item) is None]
        if lacking:
            raise MemoryMiss(
                f"step {self._step} in memory ({self._where}): this rank reads {len(lacking)} item(s) that no copy on "
                f"this machine holds ({', '.join(sorted(set(lacking))[:5])}): the state is laid out otherwise than "
                f"when it was saved"
            )
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _find(self, item: Any) -> Any:
        if item.type == LoadItemType.BYTE_IO:
            return self._values.get(item.storage_index.fqn)
        return self._tensors.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        for item in plan.items:
            found = self._find(item)
            if item.type == LoadItemType.BYTE_IO:
                copy, offset, length = found
                planner.load_bytes(item, io.BytesIO(copy.value(offset, length)))
                continue
            copy, entry = found
            target = planner.resolve_tensor(item).detach()
            whole = all(o == 0 for o in item.storage_offsets) and list(item.lengths) == list(entry[2])
            if whole and copy.read_into(target, entry[1], entry[2], entry[5]):
                planner.commit_tensor(item, target)
                continue
            source = narrow_tensor_by_index(copy.tensor(entry[1], entry[2], entry[5]), item.storage_offsets,
                                            item.lengths)
            if target.size() != source.size():
                raise ValueError(f"{item.storage_index.fqn}: holds {tuple(source.size())}, the state expects "
                                 f"{tuple(target.size())}")
            target.copy_(source)
            planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


class RecordPlanner(DefaultSavePlanner):
    """DCP's save planner over one rank's copy in memory: its items as recorded, its bytes from the mapping.

    What DCP writes from it is what a save of the live state would have written (the same items,
    chunks and ``torch.save`` bytes); DCP's global planning (deduplication, metadata) is its own.
    """

    def __init__(self, copy: Copy) -> None:
        super().__init__()
        self._copy = copy
        self._data: dict[MetadataIndex, tuple[Any, ...]] = {}

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator
        self.mappings = {fqn: tuple(path) for fqn, path in self._copy.table["planner_data"].items()}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, dtype, shape, size, offsets, offset in self._copy.table["tensors"]:
            index = MetadataIndex(fqn, torch.Size(offsets))
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties(dtype=_dtype(dtype)), size=torch.Size(size))))
            self._data[index] = (dtype, shape, offset)
        for fqn, offset, length in self._copy.table["values"]:
            index = MetadataIndex(fqn)
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            self._data[index] = (offset, length)
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        found = self._data[write_item.index]
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._copy.value(*found))
        return self._copy.tensor(*found)
