"""A committed step's object that is gone or cut short is damage, not an outage.

The manifest is the commit record: every file it names must be there, of
its size. When a read of one fails, the store raises a :class:`RemoteError`
(whose remedy is about reachability and credentials):
:class:`ObjectNotFoundError` for an absent object,
:class:`ObjectRangeError` for a range past the end of a truncated one,
another for a failed transfer. An absent object is damage at once (the
store's contract says so); otherwise one HEAD decides what it was: the
object is gone or of another size than the manifest's (a
:class:`CorruptCheckpointError` naming the step, the object and the remedy,
so ``on_corrupt="fallback"`` applies and a damaged step never reads as an
unreachable remote), or the store failed (the original error). Used by the
step view (:class:`shardckpt.steps.StepView`) for every read of a
committed step's file.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from shardckpt.errors import CorruptCheckpointError, ObjectNotFoundError, RemoteError
from shardckpt.format import layout
from shardckpt.stores import Deadline, Store

T = TypeVar("T")


def read_committed(
    store: Store, key: str, step: int, deadline: Deadline, call: Callable[[], T], *,
    entry: layout.FileEntry | None = None, end: int = 0,
) -> T:
    """``call()``: a read of ``key``, an object of the committed ``step`` that the manifest's
    ``entry`` describes (or, without it, that holds at least ``end`` bytes: a ranged read).
    A missing or resized object is reported as :class:`CorruptCheckpointError`."""
    try:
        return call()
    except RemoteError as exc:
        like = entry.checksum if entry is not None else f"{layout.CHECKSUM_ALGO}:"
        try:
            held = None if isinstance(exc, ObjectNotFoundError) else store.recorded_checksum(key, like, deadline)
        except RemoteError:
            raise exc from exc.__cause__
        if held is not None and (held[0] == entry.size if entry is not None else held[0] >= end):
            raise
        size = f"the manifest says {entry.size}" if entry is not None else f"the read needs {end}"
        what = "missing from the remote" if held is None else f"{held[0]} bytes on the remote, {size}"
        raise CorruptCheckpointError(
            f"step {step}: {store.where(key)} is {what} (deleted, truncated or overwritten). Remedy: load an "
            f"earlier step (load(state, step=N), or on_corrupt='fallback'), or upload the step again from a node "
            f"that holds it (`shardckpt push`)."
        ) from exc
