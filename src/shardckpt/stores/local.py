"""Directories on this node's disk as stores: the local tier and the replicas held here.

:class:`LocalDirStore` is a directory (the local tier's ``local_dir``, or any
other); keys are paths under it. Writes go to a temporary name, are fsynced
and renamed into place (the directory fsynced too), so a crash never leaves a
partial object under its name. Nothing here retries: a local error is final.
:class:`ReplicaDirStore` is the same over the directory where this node
holds the replicas of another node's steps.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Iterable

from shardckpt.errors import CorruptCheckpointError, ObjectNotFoundError, RemoteError
from shardckpt.format import layout
from shardckpt.stores.base import Deadline, OnBytes, Store, range_past_end

_CHUNK = 8 << 20
_TMP = ".tmp-"


class LocalDirStore(Store):
    """A directory on this node's disk."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def path(self, key: str) -> str:
        key = key.strip("/")
        if key and (key.startswith("..") or "/../" in f"/{key}/"):
            raise RemoteError(f"key {key!r} leaves the store's directory {self.root}; it was not used")
        return os.path.join(self.root, key) if key else self.root

    def where(self, key: str) -> str:
        return self.path(key)

    def _missing(self, key: str, exc: BaseException | None = None) -> ObjectNotFoundError:
        err = ObjectNotFoundError(
            f"{self.where(key)}: there is no such file. Remedy: check the directory and that the step "
            f"is committed there (`shardckpt ls {self.root}`)."
        )
        err.__cause__ = exc
        return err

    # ---- writing

    def _write(self, key: str, chunks, like: str | None) -> tuple[int, str, str]:
        """Write ``chunks`` to a temporary file beside ``key``; its path, size and checksum."""
        target = self.path(key)
        parent = os.path.dirname(target)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{target}{_TMP}{uuid.uuid4().hex[:8]}"
        digest = layout.Checksum.like(like)
        n = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
                    n += len(chunk)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink(tmp)
            raise
        return tmp, n, digest.value()

    def _place(self, tmp: str, key: str) -> None:
        target = self.path(key)
        os.replace(tmp, target)
        layout.fsync_dir(os.path.dirname(target))

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        tmp, _, _ = self._write(key, [data], None)
        self._place(tmp, key)

    def put_file(self, path: str, key: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        with open(path, "rb") as f:
            tmp, n, got = self._write(key, iter(lambda: f.read(_CHUNK), b""), checksum)
        if n != size or got != checksum:
            _unlink(tmp)
            raise CorruptCheckpointError(
                f"local file {path} differs (size or checksum) from what was asked to be stored, so it was "
                f"not stored at {self.where(key)}. Remedy: run `shardckpt verify` on its directory."
            )
        self._place(tmp, key)
        if on_bytes is not None:
            on_bytes(n)

    def put_stream(self, key: str, chunks: Iterable[bytes], deadline: Deadline, on_bytes: OnBytes | None = None,
                   like: str | None = None) -> tuple[int, str, str | None]:
        tmp, n, got = self._write(key, chunks, like)  # an error of the stream removes the temporary file
        self._place(tmp, key)
        if on_bytes is not None:
            on_bytes(n)
        return n, got, None

    # ---- reading

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise self._missing(key, exc) from exc
        try:
            size = os.fstat(fd).st_size
            if length <= 0:
                return b""
            if offset < 0 or offset + length > size:
                raise range_past_end(path, offset, length, size, what="file")
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def get_file(self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        src = self.path(key)
        digest = layout.Checksum.like(checksum)
        n = 0
        try:
            with open(src, "rb") as f, open(path, "wb") as dst:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    digest.update(chunk)
                    dst.write(chunk)
                    n += len(chunk)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if os.path.exists(src):
                raise  # the destination's directory is missing: the caller's problem
            _unlink(path)
            raise self._missing(key, exc) from exc
        except BaseException:
            _unlink(path)
            raise
        if n != size or digest.value() != checksum:
            _unlink(path)
            detail = f"{n} bytes, expected {size}" if n != size else "checksum differs from the manifest"
            raise CorruptCheckpointError(
                f"{src} is corrupt ({detail}); it was not copied. Remedy: run `shardckpt verify` on "
                f"{self.root}, and load an earlier step or fetch the step again from another copy."
            )
        if on_bytes is not None:
            on_bytes(n)

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        try:
            return layout.checksum_file(self.path(key), like=like)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def exists(self, key: str, deadline: Deadline) -> bool:
        return os.path.isfile(self.path(key))

    # ---- listing and deletion

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        try:
            with os.scandir(self.path(prefix)) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        base = self.path(prefix)
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if _TMP in name:
                    continue
                full = os.path.join(dirpath, name)
                try:
                    out[os.path.relpath(full, base).replace(os.sep, "/")] = os.path.getsize(full)
                except FileNotFoundError:
                    continue  # deleted while listed
        return out

    def delete(self, key: str, deadline: Deadline) -> None:
        _unlink(self.path(key))

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        path = self.path(prefix)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)


class ReplicaDirStore(LocalDirStore):
    """The replicas of ``owner``'s steps that this node holds (``replica_root``), as a store.

    A replica's files are written once and replaced only whole (a new file renamed over the name), so a
    verified fetch onto this node's disk links the file instead of copying it when it can (the same file
    system); the linked bytes are checked against the size and checksum all the same."""

    def __init__(self, replica_root: str, owner: str) -> None:
        super().__init__(replica_root)
        self.owner = owner

    def get_file(self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        src = self.path(key)
        try:
            os.link(src, path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if os.path.lexists(src):
                raise  # the destination's directory is missing: the caller's problem
            raise self._missing(key, exc) from exc
        except OSError:
            super().get_file(key, path, size, checksum, deadline, on_bytes)  # another file system: a copy
            return
        try:
            got = layout.checksum_file(path, like=checksum)
        except BaseException:
            _unlink(path)
            raise
        if got != (size, checksum):
            _unlink(path)
            detail = f"{got[0]} bytes, expected {size}" if got[0] != size else "checksum differs from the manifest"
            raise CorruptCheckpointError(
                f"{src} is corrupt ({detail}); it was not used. Remedy: the replica is replaced at the owner's "
                f"next replication; read the step from another source meanwhile."
            )
        if on_bytes is not None:
            on_bytes(size)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        pass
