"""Where a stored tensor's bytes lie inside a DCP shard file (a ``torch.save`` zip written uncompressed).

:func:`stored_tensor` reads a record's pickle with an unpickler that builds nothing but the layout
(storage key, dtype, offset, size, stride) and finds the storage's member in the zip's central
directory, so that :class:`~shardckpt.dcp.reader.CheckedReader` can ``readinto`` the destination
tensor directly. Anything it does not recognise answers ``None``: the caller goes through ``torch.load``.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import io
import math
import os
import pickle
import struct
import zipfile
from typing import Any

import torch
from torch.storage import _get_dtype_from_pickle_storage_type as _dtype_of_storage


@dataclasses.dataclass
class StoredTensor:
    """Where a stored tensor's bytes lie in its file, and how they are laid out."""

    data_offset: int
    """Absolute offset of the first byte of the tensor's storage in the file."""
    dtype: torch.dtype
    size: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize


# ------------------------------------------------------------ the record's layout


class _Slice(io.RawIOBase):
    """A read-only window [start, start + length) of an open file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        want = min(len(buf), self._len - self._pos)
        if want <= 0:
            return 0
        got = os.preadv(self._f.fileno(), [memoryview(buf)[:want]], self._start + self._pos)
        self._pos += got
        return got


class _Ref:
    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _Layout:
    def __init__(self, ref: _Ref, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.ref, self.offset, self.size, self.stride = ref, offset, tuple(size), tuple(stride)


def _rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *_rest: Any) -> _Layout:
    if not isinstance(storage, _Ref):
        raise pickle.UnpicklingError("not a plain storage")
    return _Layout(storage, storage_offset, size, stride)


class _LayoutUnpickler(pickle.Unpickler):
    """Reads a tensor record's ``data.pkl`` only for its layout; refuses everything else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            try:
                return _dtype_of_storage(name)
            except (KeyError, AttributeError) as exc:
                raise pickle.UnpicklingError(f"{module}.{name}") from exc
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError("unexpected persistent id")
        return _Ref(pid[1], str(pid[2]), int(pid[4]))


_LOCAL_SIG, _EOCD_SIG = b"PK\x03\x04", b"PK\x05\x06"
_ZIP64_EOCD_SIG, _ZIP64_LOCATOR_SIG = b"PK\x06\x06", b"PK\x06\x07"
_EOCD_LEN, _ZIP64_LOCATOR_LEN = 22, 20


def central_directory(f: Any, offset: int, length: int) -> tuple[int, str | None]:
    """Where the central directory of the zip archive filling exactly [offset, offset + length) starts.

    Returns ``(cd_offset, None)`` (relative to ``offset``) when the record is
    one archive that begins at ``offset`` and whose end-of-central-directory
    record (zip64 or not, no comment) lies at its very end, with the central
    directory just before it; else ``(-1, what is wrong)``. A record whose
    length in ``.metadata`` runs into the next record fails here: its end is
    the other record's end.
    """
    if length < 30 + _EOCD_LEN:
        return -1, f"is {length} bytes, too short for a zip archive"
    if os.pread(f.fileno(), 4, offset) != _LOCAL_SIG:
        return -1, "does not start with a zip entry"
    eocd = os.pread(f.fileno(), _EOCD_LEN, offset + length - _EOCD_LEN)
    if len(eocd) != _EOCD_LEN or eocd[:4] != _EOCD_SIG or struct.unpack("<H", eocd[20:22])[0] != 0:
        return -1, "does not end with a zip archive's end record"
    cd_size, cd_offset = struct.unpack("<II", eocd[12:20])
    cd_end = length - _EOCD_LEN
    locator_at = cd_end - _ZIP64_LOCATOR_LEN
    locator = os.pread(f.fileno(), _ZIP64_LOCATOR_LEN, offset + locator_at) if locator_at >= 0 else b""
    if locator[:4] == _ZIP64_LOCATOR_SIG:
        (zip64_at,) = struct.unpack("<Q", locator[8:16])
        zip64 = os.pread(f.fileno(), 56, offset + zip64_at) if 0 <= zip64_at <= locator_at - 56 else b""
        if len(zip64) != 56 or zip64[:4] != _ZIP64_EOCD_SIG:
            return -1, "has a zip64 end record that is not inside it"
        (record_size,) = struct.unpack("<Q", zip64[4:12])
        if zip64_at + 12 + record_size != locator_at:
            return -1, "has a zip64 end record that does not reach its end"
        cd_size, cd_offset = struct.unpack("<QQ", zip64[40:56])
        cd_end = zip64_at
    if cd_offset + cd_size != cd_end:
        return -1, (f"has a central directory at [{cd_offset}, {cd_offset + cd_size}) "
                    f"that does not end where its end record starts ({cd_end})")
    return cd_offset, None


def stored_tensor(f: Any, offset: int, length: int) -> StoredTensor | None:
    """The layout of the tensor DCP stored at [offset, offset + length), or None if unusual.

    Usual: one uncompressed storage holding exactly the tensor, contiguous,
    from its first element, in an archive that fills the record exactly
    (:func:`central_directory`). Anything else is left to ``torch.load``.
    """
    cd_offset, problem = central_directory(f, offset, length)
    if problem is not None:
        return None
    try:
        with zipfile.ZipFile(_Slice(f, offset, length)) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            pkl = [n for n in infos if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                return None
            prefix = pkl[0][: -len("data.pkl")]
            stored = [n for n in infos if n.startswith(prefix + "data/")]
            if len(stored) != 1:
                return None
            if zf.start_dir != cd_offset or any(i.header_offset >= cd_offset for i in infos.values()):
                return None  # zipfile found another archive than the one that fills the record
            start = _member_start(f, offset, infos[pkl[0]], cd_offset)
            if start is None:
                return None
            # Read raw: records of a step carry no CRC-32 (the file's checksum covers them), which
            # zipfile's own read would refuse.
            lay = _LayoutUnpickler(io.BytesIO(os.pread(f.fileno(), infos[pkl[0]].file_size, start))).load()
            info = infos[stored[0]]
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError):
        return None
    if (not isinstance(lay, _Layout) or info.compress_type != zipfile.ZIP_STORED
            or stored[0] != prefix + "data/" + lay.ref.key):
        return None
    numel = math.prod(lay.size)
    expected_stride, acc = [], 1
    for d in reversed(lay.size):
        expected_stride.append(acc)
        acc *= d
    contiguous = all(s == e for s, e, d in zip(lay.stride, reversed(expected_stride), lay.size) if d > 1)
    if lay.offset != 0 or numel != lay.ref.numel or not contiguous or info.file_size != numel * lay.ref.dtype.itemsize:
        return None
    start = _member_start(f, offset, info, cd_offset)
    if start is None:
        return None
    return StoredTensor(start, lay.ref.dtype, lay.size)


def _member_start(f: Any, offset: int, info: zipfile.ZipInfo, cd_offset: int) -> int | None:
    """Where the bytes of an uncompressed member of the archive at ``offset`` start, or None if unusual."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    header = os.pread(f.fileno(), 30, offset + info.header_offset)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = offset + info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > offset + cd_offset:
        return None
    return start


def memory_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")
