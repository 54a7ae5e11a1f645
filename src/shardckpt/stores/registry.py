"""Choose a store by URL scheme (the way fsspec's registry does).

* ``s3://bucket/prefix`` (or ``s3a://``) -> :class:`~shardckpt.stores.s3.S3Store` (boto3);
* a plain path (no ``://``) -> :class:`~shardckpt.stores.local.LocalDirStore`;
* anything else (``file:///mnt/nfs/run``, ``gs://...``) ->
  :class:`~shardckpt.stores.fsspec_store.FsspecStore`, fsspec imported lazily with an install hint.
"""

from __future__ import annotations

from shardckpt.stores.base import Store
from shardckpt.stores.fsspec_store import FsspecStore
from shardckpt.stores.local import LocalDirStore
from shardckpt.stores.network import TransferOptions, check_remote_url, split_url
from shardckpt.stores.s3 import S3Store


def open_store(url: str, options: TransferOptions | None = None) -> Store:
    """The store a remote URL names; raises :class:`~shardckpt.errors.ConfigError` for a bad URL."""
    check_remote_url(url)
    options = options or TransferOptions()
    scheme, _ = split_url(url)
    if scheme in ("s3", "s3a"):
        return S3Store(url, options)
    return FsspecStore(url, options)


def open_location(where: str, options: TransferOptions | None = None) -> Store:
    """A remote URL's store, or a :class:`LocalDirStore` for a plain directory path."""
    if "://" not in where:
        return LocalDirStore(where)
    return open_store(where, options)
