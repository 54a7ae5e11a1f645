"""The Store interface: the one byte-mover every tier implements.

A store holds objects under ``/``-separated keys relative to its root. It
knows nothing of steps, manifests or torch: the step view
(:mod:`shardckpt.steps`) and the commit protocol build on it.

Implementations, one class each: :class:`~shardckpt.stores.local.LocalDirStore`
(a directory on this node's disk), :class:`~shardckpt.stores.local.ReplicaDirStore`
(the replicas of another node's steps held here),
:class:`~shardckpt.stores.peer.PeerStore` (another node's peer daemon, over
HTTP), :class:`~shardckpt.stores.s3.S3Store` (boto3) and
:class:`~shardckpt.stores.fsspec_store.FsspecStore` (any fsspec URL). One
contract suite (``tests/jobs/test_store_contract.py``) runs the same cases over
all of them.

Semantics every implementation keeps (checked by the contract suite):

* **Missing object.** ``get_range``, ``get_file`` and ``read`` of an absent
  key raise :class:`~shardckpt.errors.ObjectNotFoundError`, whatever the
  backend; ``get_bytes``, ``read_checksum`` and ``recorded_checksum`` answer
  ``None`` (absence is an answer there); ``exists`` answers ``False``.
* **Ranges.** ``get_range(key, offset, length)`` returns exactly ``length``
  bytes; ``length == 0`` returns ``b""``; a range that reaches past the end of
  the object raises :class:`~shardckpt.errors.ObjectRangeError` (never a
  short answer, never a retry loop).
* **Verified whole files.** ``get_file`` writes ``path`` and checks its size
  and checksum against the caller's before returning; a mismatch raises
  :class:`~shardckpt.errors.CorruptCheckpointError` and leaves no file at
  ``path``. ``put_file`` refuses a local file whose bytes differ from the
  size and checksum given, and checks what the store holds afterwards.
* **Streams.** ``put_stream`` stores bytes as an iterator yields them (their
  size unknown beforehand) and answers their size and checksum; an exception
  raised by the iterator leaves no new object under the key (an earlier
  object there stays as it was).
* **Deletion.** ``delete`` of an absent key is not an error;
  ``delete_prefix`` removes every object under a prefix.
* **Concurrency.** Every method may be called from several threads at once.
  A writer never exposes a partial object under its key.
* **Retries** belong to the network stores (bounded by the caller's
  :class:`Deadline`); local stores do not retry.
* **Errors** leave a store as :class:`~shardckpt.errors.RemoteError` (an
  ``OSError``) subclasses or :class:`~shardckpt.errors.CorruptCheckpointError`,
  naming the object and the remedy, with the backend's exception as
  ``__cause__``.

Call order: none is required; a store is usable from construction to
:meth:`Store.close`. Which ranks call what is the callers' business (the
restore's sources are ordered in :mod:`shardckpt.restoring.sources`).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Callable, Iterable

from shardckpt.errors import ObjectRangeError


class Deadline:
    """A point in time that bounds a whole operation (all requests and retries)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self._end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float:
        return float("inf") if self._end is None else self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


def join(*parts: str) -> str:
    """Join key parts with ``/``, ignoring empty parts and stray slashes."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


OnBytes = Callable[[int], None]


def range_past_end(where: str, offset: int, length: int, size: int, *, what: str = "object",
                   remedy: str = "run `shardckpt verify` on the step") -> ObjectRangeError:
    """The error of every store for bytes ``[offset, offset + length)`` asked of ``where``, which holds ``size``."""
    return ObjectRangeError(
        f"bytes {offset}..{offset + length} of {where} asked, but the {what} holds {size} bytes. "
        f"Remedy: the {what} is shorter than its manifest says; {remedy}."
    )


def run_in_pool(pool: Any, jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run ``jobs`` on ``pool`` (a ``concurrent.futures`` executor); their results in order. The first
    error is raised, once the jobs not started are cancelled and the started ones have ended."""
    futures = [pool.submit(job) for job in jobs]
    try:
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)


class Store:
    """A place that holds objects under keys. See the module docstring for the contract."""

    url: str
    """Where the store's root is, for messages (credentials never included)."""

    def where(self, key: str) -> str:
        """A printable location of ``key`` (credentials never included)."""
        return f"{self.url}/{key}" if key else self.url

    # ---- whole files, verified

    def put_file(self, path: str, key: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> str | None:
        """Store the local file ``path`` under ``key``; refuses it unless its bytes have ``size`` and
        ``checksum``; ``on_bytes(n)`` is called as parts of it are stored. Returns the store's tag
        of the object written (its ETag on S3: the same tag in a listing means the same bytes), or
        ``None`` where the store has no such tag."""
        raise NotImplementedError

    def put_stream(self, key: str, chunks: Iterable[bytes], deadline: Deadline, on_bytes: OnBytes | None = None,
                   like: str | None = None) -> tuple[int, str, str | None]:
        """Store the bytes ``chunks`` yields under ``key``, sending them while later ones are still
        being produced; ``on_bytes(n)`` as parts of them are stored. Returns their size, their checksum
        (the algorithm of ``like``, the default one for ``None``) and the store's tag of the object
        (as :meth:`put_file`). An exception from ``chunks`` is raised as it is, and no new object is
        left under ``key``."""
        raise NotImplementedError(f"{type(self).__name__} does not store streams")

    def get_file(self, key: str, path: str, size: int, checksum: str, deadline: Deadline,
                 on_bytes: OnBytes | None = None) -> None:
        """Write the object to ``path`` and check it against ``size`` and ``checksum`` before returning;
        ``on_bytes(n)`` is called as parts of it arrive."""
        raise NotImplementedError

    def read_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        """Size and checksum (the algorithm of ``like``) of the stored bytes; ``None`` when absent."""
        raise NotImplementedError

    def recorded_checksum(self, key: str, like: str, deadline: Deadline) -> tuple[int, str] | None:
        """Size and checksum as cheaply as the store can tell (recorded at upload when it keeps that,
        else computed from the bytes); ``None`` when absent."""
        return self.read_checksum(key, like, deadline)

    # ---- small objects and ranges

    def put_bytes(self, key: str, data: bytes, deadline: Deadline) -> None:
        raise NotImplementedError

    def get_bytes(self, key: str, deadline: Deadline) -> bytes | None:
        """The whole object; ``None`` when absent."""
        raise NotImplementedError

    def get_range(self, key: str, offset: int, length: int, deadline: Deadline) -> bytes:
        """Bytes ``[offset, offset + length)`` of the object, exactly ``length`` of them."""
        raise NotImplementedError

    def exists(self, key: str, deadline: Deadline) -> bool:
        raise NotImplementedError

    # ---- listing and deletion

    def list_dirs(self, prefix: str, deadline: Deadline) -> list[str]:
        """Names of the "directories" directly under ``prefix``, sorted."""
        raise NotImplementedError

    def list_sizes(self, prefix: str, deadline: Deadline) -> dict[str, int]:
        """``{key relative to prefix: size}`` of every object under ``prefix``."""
        raise NotImplementedError

    def list_tags(self, prefix: str, deadline: Deadline,
                  names: list[str] | None = None) -> dict[str, tuple[int, str]] | None:
        """``{key relative to prefix: (size, tag)}`` of the objects under ``prefix`` (``names``: at
        least these, when the store can list only part of the prefix), the tags being those
        :meth:`put_file` returns; ``None`` where the store keeps no tags."""
        return None

    def delete(self, key: str, deadline: Deadline) -> None:
        """Remove one object; an absent one is not an error."""
        raise NotImplementedError

    def delete_prefix(self, prefix: str, deadline: Deadline) -> None:
        """Remove every object under ``prefix``."""
        raise NotImplementedError

    # ---- running several transfers

    def run_all(self, jobs: list[Callable[[], Any]], *, files: bool = False) -> list[Any]:
        """Run ``jobs`` (the store's own calls) and return their results in order; the first error
        is raised. Network stores run them concurrently; the default runs them one by one."""
        return [job() for job in jobs]

    def close(self) -> None:
        """Release threads and connections; the store is not used afterwards."""
