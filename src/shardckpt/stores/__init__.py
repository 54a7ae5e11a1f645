"""Stores: the one byte-mover interface (:mod:`.base`) and its implementations, one class each.

Imports only :mod:`shardckpt.format` and :mod:`shardckpt.errors` (and the
leaf helper :mod:`shardckpt._failpoints`).
"""

from shardckpt.stores.base import Deadline, Store, join
from shardckpt.stores.fsspec_store import FsspecStore
from shardckpt.stores.local import LocalDirStore, ReplicaDirStore
from shardckpt.stores.network import (
    NetworkStore,
    TransferOptions,
    check_remote_url,
    redact,
    safe_url,
    split_url,
)
from shardckpt.stores.registry import open_location, open_store
from shardckpt.stores.s3 import S3Store

__all__ = [
    "Deadline", "FsspecStore", "LocalDirStore", "NetworkStore", "ReplicaDirStore", "S3Store", "Store",
    "TransferOptions", "check_remote_url", "join", "open_location", "open_store", "redact", "safe_url",
    "split_url",
]
