"""Any fsspec filesystem as a store (``file://`` for NFS-style mounts, ``gs://``, ...).

fsspec is imported lazily (``check_remote_url`` gives the install hint).
On a ``file://`` URL objects are written to a temporary name, fsynced and
renamed, so a crash never leaves a partial object under its name.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Iterable

from shardckpt import _failpoints
from shardckpt.errors import RemoteError
from shardckpt.format import layout
from shardckpt.stores.base import Deadline, OnBytes, range_past_end
from shardckpt.stores.network import NetworkStore, TransferOptions, split_url
from shardckpt.stores.transfer import (
    Transient,
    check_download,
    copy_checked,
    file_chunks,
    guarded,
    local_mismatch,
)

_XATTR = "user.shardckpt.checksum"
"""Extended attribute of a ``file://`` remote object: the checksum it was uploaded with."""


class FsspecStore(NetworkStore):
    """Any fsspec filesystem (``file://`` for NFS-style mounts, ``gs://``, ...)."""

    def __init__(self, url: str, options: TransferOptions) -> None:
        super().__init__(url, options)
        import fsspec

        scheme, rest = split_url(url)
        self.fs = fsspec.filesystem(scheme, **options.storage_options)
        self.root = rest if scheme != "file" else "/" + rest.lstrip("/")
        self.retryable_types = NetworkStore.retryable_types
        self.local = scheme in ("file", "local")
        """A filesystem path (``file://``, e.g. an NFS mount): writes go to a temporary name,
        are fsynced and renamed, so a crash never leaves a partial object under its name."""

    def is_retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        return isinstance(exc, (OSError, Transient)) or super().is_retryable(exc)

    def path(self, key: str) -> str:
        return self.root + ("/" + key.strip("/") if key.strip("/") else "")

    def _write(
        self, key: str, chunks: Callable[[], Any], like: str | None = None, expect: tuple[int, str] | None = None
    ) -> tuple[int, str]:
        """Write an object; returns the size and checksum of what was written.

        With ``expect`` (size, checksum), an object whose bytes differ is not
        put in place (on a local filesystem; object stores replace whole objects anyway).
        """
        target = self.path(key)
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self.local:
            f = self.fs.open(target, "wb")
            try:
                got = copy_checked(chunks(), f, like=like)
            except BaseException:
                # Abandoned unfinished: closing would store what was written so far under the key.
                getattr(f, "discard", lambda: None)()
                f.closed = True
                raise
            f.close()
            return got
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                got = copy_checked(chunks(), f, like=like)
                _failpoints.hit("remote.file_written")
                f.flush()
                os.fsync(f.fileno())
            if expect is None or got == expect:
                os.replace(tmp, target)
                layout.fsync_dir(parent)
            return got
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        self.retry(lambda: self._write(key, lambda: [data]), "upload of", key, deadline)

    def put_file(
        self, path: str, key: str, size: int, checksum: str, deadline: Deadline,
        on_bytes: Callable[[int], None] | None = None
    ) -> None:
        def chunks():
            with open(path, "rb") as f:
                yield from file_chunks(f)

        n, digest = self.retry(lambda: self._write(key, chunks, like=checksum, expect=(size, checksum)), "upload of",
                               key, deadline)
        if n != size or digest != checksum:
            raise local_mismatch(path, self.where(key), "differs (size or checksum)")
        self._record(key, checksum)
        self._check_size(key, size, deadline, on_bytes)

    def put_stream(self, key: str, chunks: Iterable[bytes], deadline: Deadline, on_bytes: OnBytes | None = None,
                   like: str | None = None) -> tuple[int, str, str | None]:
        n, digest = self.once(lambda: self._write(key, lambda: guarded(chunks), like=like), "upload of", key)
        self._record(key, digest)
        self._check_size(key, n, deadline, on_bytes)
        return n, digest, None

    def _check_size(self, key: str, size: int, deadline: Deadline, on_bytes: OnBytes | None) -> None:
        """What the store holds under ``key`` after an upload is ``size`` bytes (then ``on_bytes(size)``)."""
        got = self.retry(lambda: self.fs.info(self.path(key))["size"], "verification of", key, deadline)
        if got != size:
            raise RemoteError(f"uploaded object {self.where(key)} is {got} bytes, expected {size}; it will be retried")
        if on_bytes is not None:
            on_bytes(size)

    def _record(self, key: str, checksum: str) -> None:
        """On a filesystem path: the checksum goes with the file (its inode: a file written over it by
        anyone else has none), so that the commit's identity check need not read it again."""
        if self.local:
            try:
                os.setxattr(self.path(key), _XATTR, checksum.encode())
            except (OSError, AttributeError):
                pass

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        def call() -> bytes | None:
            try:
                with self.fs.open(self.path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return self.retry(call, "download of", key, deadline)

    def exists(self, key: str, deadline: Deadline) -> bool:
        return self.retry(lambda: self.fs.exists(self.path(key)), "lookup of", key, deadline)

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        def call() -> bytes:
            with self.fs.open(self.path(key), "rb") as f:
                if length <= 0:
                    return b""
                f.seek(offset)
                data = f.read(length)
            if len(data) != length:
                total = self.fs.size(self.path(key))
                if total is not None and offset + length > total:
                    raise range_past_end(self.where(key), offset, length, total)
                raise Transient(f"short ranged read of {self.where(key)}")
            return data

        return self.retry(call, "download of", key, deadline)

    def recorded_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        if self.local:
            try:
                path = self.path(key)
                recorded = os.getxattr(path, _XATTR).decode()
                return os.path.getsize(path), recorded
            except FileNotFoundError:
                return None
            except (OSError, AttributeError, UnicodeDecodeError):
                pass  # no extended attributes here: hash the bytes
        return self.read_checksum(key, like, deadline)

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        def call() -> tuple[int, str] | None:
            digest = layout.Checksum.like(like)
            n = 0
            try:
                with self.fs.open(self.path(key), "rb") as f:
                    for chunk in file_chunks(f):
                        digest.update(chunk)
                        n += len(chunk)
            except FileNotFoundError:
                return None
            return n, digest.value()

        return self.retry(call, "verification of", key, deadline)

    def get_file(
        self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
        on_bytes: Callable[[int], None] | None = None
    ) -> None:
        def call() -> tuple[int, str]:
            with self.fs.open(self.path(key), "rb") as src, open(path, "wb") as dst:
                return copy_checked(file_chunks(src), dst, like=checksum)

        try:
            got_size, got_sha = self.retry(call, "download of", key, deadline)
        except BaseException:
            if os.path.exists(path):
                os.unlink(path)
            raise
        check_download(path, self.where(key), size, checksum, got_size, got_sha)
        if on_bytes is not None:
            on_bytes(got_size)

    def _ls(self, prefix: str) -> list[dict]:
        try:
            return self.fs.ls(self.path(prefix), detail=True)
        except FileNotFoundError:
            return []

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        entries = self.retry(lambda: self._ls(prefix), "listing of", prefix, deadline)
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        base = self.path(prefix).rstrip("/")

        def call() -> dict[str, int]:
            try:
                found = self.fs.find(base, detail=True)
            except FileNotFoundError:
                return {}
            out = {}
            for name, info in found.items():
                name = name if name.startswith("/") or not base.startswith("/") else name
                rel = name[len(base):].lstrip("/") if name.startswith(base) else name.rsplit("/", 1)[-1]
                out[rel] = int(info.get("size") or 0)
            return out

        return self.retry(call, "listing of", prefix, deadline)

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        def call() -> None:
            try:
                self.fs.rm(self.path(prefix), recursive=True)
            except FileNotFoundError:
                pass

        self.retry(call, "deletion under", prefix, deadline)

    def delete(self, key: str, deadline: Deadline) -> None:
        def call() -> None:
            try:
                self.fs.rm(self.path(key))
            except FileNotFoundError:
                pass

        self.retry(call, "deletion of", key, deadline)
