"""The exception family.

Every error a user can meet derives from :class:`ShardckptError`. Storage
problems additionally derive from :class:`OSError` so that callers already
handling I/O failures keep working; the original backend exception is kept as
``__cause__``. Messages name the step, the path and what to do about it.
"""

from __future__ import annotations


class ShardckptError(Exception):
    """Base class of every error raised by shardckpt."""


class ConfigError(ShardckptError, ValueError):
    """An option has an invalid value; the message names the field."""


class CheckpointNotFoundError(ShardckptError, FileNotFoundError):
    """The requested step is not committed on any configured tier."""


class CorruptCheckpointError(ShardckptError, OSError):
    """A file of a committed step is missing, truncated or fails its checksum."""


class StateMismatchError(ShardckptError, KeyError):
    """The checkpoint does not fit the live state (missing or unexpected keys)."""

    def __init__(self, message: str, missing=(), unexpected=()):
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class MetaDeviceError(StateMismatchError):
    """The state to load into holds tensors on the meta device: materialize it (``to_empty()``) first."""


class ForeignCheckpointError(ShardckptError, ValueError):
    """The step was written by another run (its manifest's ``run_id`` differs)."""


class InsufficientSpaceError(ShardckptError, OSError):
    """The local tier has too little free space for the next save."""


class SaveError(ShardckptError, RuntimeError):
    """A background save failed; the previous committed steps are intact."""


class UntrustedCheckpointError(ShardckptError, ValueError):
    """A checkpoint holds content that would execute code when loaded."""


class RemoteError(ShardckptError, OSError):
    """The remote tier failed after retries (unreachable, denied, or missing)."""


class ObjectNotFoundError(RemoteError, FileNotFoundError):
    """A store holds no object under the key asked for (every store raises this one type)."""

    retryable = False


class ObjectRangeError(RemoteError):
    """A byte range asked of a store reaches past the end of its object."""

    retryable = False
