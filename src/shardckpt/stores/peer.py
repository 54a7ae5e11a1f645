"""Another node's peer daemon as a store: an adapter over :class:`~shardckpt.stores.peer_client.PeerClient`.

Keys are ``step_<N>/<name>``: the files of the peer's own committed copy of
step ``N`` (with ``owner``: of the replica it holds of that node's files).
What a peer serves is committed steps only, read-only: writes reach a peer as
whole replicas (``PeerClient.put_replica``, the replication daemon's job), so
``put_*`` and ``delete*`` raise :class:`PeerStoreReadOnly`.

Built on the client's public calls only (``list_steps``, ``held_files``,
``get`` with a byte range). The client answers every refusal with one error
type, so this adapter decides absence from the peer's own listing (its
committed steps, the files it holds of each) and sizes from the step's
manifest, which the peer serves too; verified fetches stream ranged GETs and
check size and checksum here, so a mismatch is a
:class:`~shardckpt.errors.CorruptCheckpointError` like on every store.
"""

from __future__ import annotations

import os
from typing import Any

from shardckpt.errors import CorruptCheckpointError, ObjectNotFoundError, RemoteError
from shardckpt.format import layout
from shardckpt.format.replicas import owner_dirname
from shardckpt.stores.base import Deadline, OnBytes, Store, range_past_end
from shardckpt.stores.peer_client import PeerClient

_PART = 8 << 20


class PeerStoreReadOnly(RemoteError):
    """A write or a deletion asked of a peer daemon, which takes replicas only whole."""

    retryable = False


class PeerStore(Store):
    """The committed steps a peer daemon serves (its own, or its replica of ``owner``'s files)."""

    def __init__(self, client: PeerClient, owner: str | None = None) -> None:
        self.client = client
        self.owner = owner
        self.url = f"peer://{client.addr}" + (f"/replica/{owner_dirname(owner)}" if owner else "")

    # ---- what the peer holds

    def _steps(self) -> set[int]:
        listing: dict[str, Any] = self.client.list_steps()
        held = listing.get("local") if self.owner is None else (listing.get("replicas") or {}).get(owner_dirname(self.owner))
        return {int(s) for s in (held or {}) if str(s).isdigit()}

    def _split(self, key: str) -> tuple[int, str] | None:
        head, _, name = key.strip("/").partition("/")
        step = layout.parse_step_dirname(head)
        return (step, name) if step is not None and name else None

    def _manifest(self, step: int) -> layout.Manifest:
        data = self.client.get(step, layout.MANIFEST_NAME, owner=self.owner)
        return layout.Manifest.from_json(data.decode("utf-8", errors="replace"), self.where(layout.step_dirname(step)))

    def _entry(self, key: str) -> tuple[int, str, int] | None:
        """``(step, name, size)`` of a file the peer holds, ``None`` when it holds none under ``key``."""
        parts = self._split(key)
        if parts is None or parts[0] not in self._steps():
            return None
        step, name = parts
        if name == layout.MANIFEST_NAME:
            return step, name, len(self.client.get(step, name, owner=self.owner))
        if name not in self.client.held_files(step, owner=self.owner):
            return None
        return step, name, self._manifest(step).files[name].size

    def _missing(self, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(
            f"{self.where(key)}: the peer holds no such file of a committed step. Remedy: check which steps the "
            f"peer holds (`shardckpt status` on that node), or read the step from another source."
        )

    # ---- reads

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        found = self._entry(key)
        if found is None:
            raise self._missing(key)
        step, name, size = found
        if length <= 0:
            return b""
        if offset < 0 or offset + length > size:
            raise range_past_end(self.where(key), offset, length, size, what="file",
                                 remedy="read the step from another source")
        return self.client.get(step, name, owner=self.owner, start=offset, end=offset + length)

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        found = self._entry(key)
        if found is None:
            return None
        return self.client.get(found[0], found[1], owner=self.owner)

    def _stream(self, key: str, like: str, sink: Any = None, on_bytes: OnBytes | None = None) -> tuple[int, str] | None:
        found = self._entry(key)
        if found is None:
            return None
        step, name, size = found
        digest = layout.Checksum.like(like)
        for start in range(0, size, _PART):
            data = self.client.get(step, name, owner=self.owner, start=start, end=min(size, start + _PART))
            digest.update(data)
            if sink is not None:
                sink.write(data)
            if on_bytes is not None:
                on_bytes(len(data))
        return size, digest.value()

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        return self._stream(key, like)

    def get_file(self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        try:
            with open(path, "wb") as f:
                got = self._stream(key, checksum, f, on_bytes)
            if got is None:
                raise self._missing(key)
            if got != (size, checksum):
                detail = f"{got[0]} bytes, expected {size}" if got[0] != size else "checksum differs from the manifest"
                raise CorruptCheckpointError(
                    f"{self.where(key)} is corrupt ({detail}); it was not used. Remedy: read the step from another "
                    f"source (the remote, or another peer)."
                )
        except BaseException:
            if os.path.exists(path):
                os.unlink(path)
            raise

    def exists(self, key: str, deadline: Deadline) -> bool:
        return self._entry(key) is not None

    # ---- listing

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        if prefix.strip("/"):
            return []
        return sorted(layout.step_dirname(s) for s in self._steps())

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        step = layout.parse_step_dirname(prefix.strip("/"))
        if step is None or step not in self._steps():
            return {}
        files = self._manifest(step).files
        return {n: files[n].size for n in self.client.held_files(step, owner=self.owner)}

    # ---- writes: not through this store

    def _read_only(self, what: str, key: str) -> PeerStoreReadOnly:
        return PeerStoreReadOnly(
            f"{what} {self.where(key)} refused: a peer daemon serves committed steps read-only and takes replicas "
            f"only whole (the replication daemon's PeerClient.put_replica). Remedy: write to the local or remote store."
        )

    def put_file(self, path: str, key: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        raise self._read_only("upload of", key)

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        raise self._read_only("upload of", key)

    def put_stream(self, key: str, chunks: Any, deadline: Deadline, on_bytes: OnBytes | None = None,
                   like: str | None = None) -> tuple[int, str, str | None]:
        raise self._read_only("upload of", key)

    def delete(self, key: str, deadline: Deadline) -> None:
        raise self._read_only("deletion of", key)

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        raise self._read_only("deletion under", prefix)
