"""A failure one rank met during a restore, carried to every rank in one gather and raised alike on each.

Every collective step of :mod:`shardckpt.restoring.sources` gathers each rank's outcome over the ``ctl``
side group; a :class:`Failure` is what crosses ranks for an error (picklable, a few hundred bytes), and
:func:`raise_first` turns the gathered list back into one exception: a corrupt file before a network failure,
so that every rank raises the same one.
"""

from __future__ import annotations

import dataclasses

from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.stores import redact


@dataclasses.dataclass(frozen=True)
class Failure:
    """An error of one rank: whether a file was found damaged (else a store or a network failed), and the
    message, credentials redacted."""

    corrupt: bool
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> "Failure":
        """A :class:`CorruptCheckpointError` is damage; anything else a store or the network failing."""
        if isinstance(exc, CorruptCheckpointError):
            return cls(True, str(exc))
        return cls(False, redact(str(exc)))

    @classmethod
    def damage(cls, exc: BaseException) -> "Failure":
        """``exc`` counted as damage whatever its type (a copy that cannot be committed is not usable)."""
        return cls(True, str(exc))

    def error(self, more: str = "") -> Exception:
        return (CorruptCheckpointError if self.corrupt else RemoteError)(self.message + more)


def raise_first(failures: list[Failure | None], more: str = "") -> None:
    """Raise the first gathered failure, a corrupt file before a network failure.

    ``more`` (with ``{}`` for the count of the other failures) is appended when there are several.
    """
    found = [f for f in failures if f is not None]
    if not found:
        return
    first = next((f for f in found if f.corrupt), found[0])
    raise first.error(more.format(len(found) - 1) if more and len(found) > 1 else "")
