"""Another node's peer daemon as a store: an adapter over :class:`~shardckpt.stores.peer_client.PeerClient`.

Keys are ``step_<N>/<name>``: the files of the peer's own committed copy of
step ``N`` (with ``owner``: of the replica it holds of that node's files).
What a peer serves is committed steps only, read-only: writes reach a peer as
whole replicas (``PeerClient.put_replica``, the replication daemon's job), so
``put_*`` and ``delete*`` raise :class:`PeerStoreReadOnly`.

Reads are one request each on the client's kept connections: a whole file is
one GET streamed through its checksum (several files side by side in
:meth:`PeerStore.run_all`, one connection each), a range one ranged GET. The
peer's answer says what is absent (404: :class:`ObjectNotFoundError`) and how
long a file is (a range past its end: :class:`ObjectRangeError` naming the
size); listings come from the peer's own listing of its committed steps.
"""

from __future__ import annotations

import concurrent.futures
import re
from typing import Any, Callable

from shardckpt.errors import (
    CorruptCheckpointError,
    ObjectNotFoundError,
    PeerError,
    PeerStoreReadOnly,
)
from shardckpt.format import layout
from shardckpt.format.replicas import owner_dirname
from shardckpt.stores.base import Deadline, OnBytes, Store, range_past_end, run_in_pool
from shardckpt.stores.peer_client import PeerClient


class PeerStore(Store):
    """The committed steps a peer daemon serves (its own, or its replica of ``owner``'s files)."""

    def __init__(self, client: PeerClient, owner: str | None = None) -> None:
        self.client = client
        self.owner = owner
        self.url = f"peer://{client.addr}" + (f"/replica/{owner_dirname(owner)}" if owner else "")

    # ---- what the peer holds

    def _steps(self) -> set[int]:
        listing: dict[str, Any] = self.client.list_steps()
        held = (listing.get("local") if self.owner is None
                else (listing.get("replicas") or {}).get(owner_dirname(self.owner)))
        return {int(s) for s in (held or {}) if str(s).isdigit()}

    def _split(self, key: str) -> tuple[int, str] | None:
        head, _, name = key.strip("/").partition("/")
        step = layout.parse_step_dirname(head)
        return (step, name) if step is not None and name else None

    def _manifest(self, step: int) -> layout.Manifest:
        data = self.client.get(step, layout.MANIFEST_NAME, owner=self.owner)
        return layout.Manifest.from_json(data.decode("utf-8", errors="replace"), self.where(layout.step_dirname(step)))

    def _held(self, key: str) -> bool:
        parts = self._split(key)
        if parts is None or parts[0] not in self._steps():
            return False
        return parts[1] == layout.MANIFEST_NAME or parts[1] in self.client.held_files(parts[0], owner=self.owner)

    def _missing(self, key: str, cause: BaseException | None = None) -> ObjectNotFoundError:
        err = ObjectNotFoundError(
            f"{self.where(key)}: the peer holds no such file of a committed step. Remedy: check which steps the "
            f"peer holds (`shardckpt status` on that node), or read the step from another source."
        )
        err.__cause__ = cause
        return err

    def _parts(self, key: str) -> tuple[int, str]:
        parts = self._split(key)
        if parts is None:
            raise self._missing(key)
        return parts

    # ---- reads

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        step, name = self._parts(key)
        if length <= 0:
            if not self._held(key):
                raise self._missing(key)
            return b""
        try:
            data = self.client.get(step, name, owner=self.owner, start=max(0, offset), end=offset + length)
        except PeerError as exc:
            if exc.status == 404:
                raise self._missing(key, exc) from exc
            if exc.status == 416:
                raise self._past_end(key, offset, length, exc.headers.get("content-range", "")) from exc
            raise
        if offset < 0 or len(data) != length:
            raise self._past_end(key, offset, length, f"*/{offset + len(data)}" if offset >= 0 else "")
        return data

    def _past_end(self, key: str, offset: int, length: int, content_range: str) -> Exception:
        found = re.search(r"/(\d+)$", content_range)
        size = int(found.group(1)) if found else -1
        return range_past_end(self.where(key), offset, length, size, what="file",
                              remedy="read the step from another source")

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        step, name = self._parts(key)
        try:
            return self.client.get(step, name, owner=self.owner)
        except PeerError as exc:
            if exc.status == 404:
                return None
            raise

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        step, name = self._parts(key)
        digest = layout.Checksum.like(like)
        try:
            size = self.client.stream(step, name, digest.update, owner=self.owner)
        except PeerError as exc:
            if exc.status == 404:
                return None
            raise
        return size, digest.value()

    def get_file(self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        step, name = self._parts(key)
        entry = layout.FileEntry(size, checksum, 0)
        try:
            self.client.get_file(step, name, path, entry, owner=self.owner, on_bytes=on_bytes)
        except PeerError as exc:
            if exc.status == 404:
                raise self._missing(key, exc) from exc
            raise
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{self.where(key)} is corrupt ({exc}). Remedy: read the step from "
                                         f"another source (the remote, or another peer).") from exc

    def exists(self, key: str, deadline: Deadline) -> bool:
        return self._split(key) is not None and self._held(key)

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

    # ---- several transfers

    def run_all(self, jobs: list[Callable[[], Any]], *, files: bool = False) -> list[Any]:
        """The jobs side by side, one of the client's connections each."""
        if len(jobs) <= 1 or self.client.connections <= 1:
            return [job() for job in jobs]
        with concurrent.futures.ThreadPoolExecutor(min(len(jobs), self.client.connections),
                                                   thread_name_prefix="shardckpt-peer-get") as pool:
            return run_in_pool(pool, jobs)

    def close(self) -> None:
        self.client.close()

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
