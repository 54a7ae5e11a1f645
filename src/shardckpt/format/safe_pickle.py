"""Restricted unpickling of DCP's ``.metadata``.

DCP stores its metadata as a pickle; unpickling an untrusted pickle can run
arbitrary code. Checkpoints come from shared storage, so shardckpt reads the
metadata with an unpickler that resolves only the plain data classes DCP
uses (an allow-list) and refuses everything else before it is called.

CPython 3.11.0-3.11.4 pickle an Enum member as ``getattr(cls, name)``
(``builtins.getattr``; 3.10, 3.11.5+ and 3.12+ pickle it by value), and DCP's
metadata holds such members (``_MEM_FORMAT_ENCODING``). ``builtins.getattr``
therefore resolves to :func:`_enum_member`, which returns only a member, by
name, of an allow-listed Enum class (:data:`_ENUM_MEMBERS`) and refuses any
other object or name: nothing else is opened up.
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import Any

import torch

from shardckpt.errors import CorruptCheckpointError, UntrustedCheckpointError

_ALLOWED: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


_ENUM_MEMBERS: dict[tuple[str, str], set[str]] = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): {
        "TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT",
    },
}
"""The Enum classes (each also in :data:`_ALLOWED`) whose members may come as ``getattr(cls, name)``, and the names."""


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """``builtins.getattr`` as the allow-list sees it: an allow-listed Enum class's member by name, nothing else."""
    for (module, qualname), names in _ENUM_MEMBERS.items():
        allowed = getattr(__import__(module, fromlist=[qualname]), qualname)
        if cls is allowed and isinstance(name, str) and name in names and name in allowed.__members__:
            return allowed.__members__[name]
    raise pickle.UnpicklingError(f"refusing to load builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, "
                                 f"{name!r}): only a member of an allow-listed Enum class")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if module == "builtins" and name == "getattr":
            return _enum_member
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def safe_load_metadata(data: bytes, where: str):
    """Unpickle DCP metadata, allowing only DCP's own data classes."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UntrustedCheckpointError(
            f"{where}: {exc}; the file holds objects that could run code when loaded, so it was "
            f"refused unread. Remedy: if you created this checkpoint yourself and trust its origin, "
            f"load with trust_pickles=True; otherwise delete it."
        ) from exc
    except Exception as exc:  # truncated or garbage bytes
        raise CorruptCheckpointError(f"{where} is unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpointError(f"{where} does not hold DCP metadata (found {type(metadata).__name__})")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata
