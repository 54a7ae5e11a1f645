"""Restricted unpickling of DCP's ``.metadata``.

DCP stores its metadata as a pickle; unpickling an untrusted pickle can run
arbitrary code. Checkpoints come from shared storage, so shardckpt reads the
metadata with an unpickler that resolves only the plain data classes DCP
uses (an allow-list) and refuses everything else before it is called.
"""

from __future__ import annotations

import io
import pickle

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


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
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
