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


class PeerTLSError(ShardckptError, OSError):
    """A key or certificate of the peer tier cannot be used (missing, unreadable, readable by others, or
    not matching); the message names the file and the remedy."""


class PeerError(RemoteError):
    """A peer request failed (refused, unreachable, or the bytes did not match). ``status`` is the
    peer's HTTP answer when it answered (404: it holds no such file), else ``None``."""

    def __init__(self, message: str, status: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


class PeerStoreReadOnly(RemoteError):
    """A write or a deletion asked of a peer daemon, which takes replicas only whole."""

    retryable = False


class ExportError(ShardckptError, ValueError):
    """The step cannot be exported as asked: no module key, an ambiguous one, an unsupported dtype."""


class ExportIOError(ShardckptError, OSError):
    """Reading the source or writing the output failed (no space, no permission); ``__cause__`` kept."""


class CopiesRacedError(SaveError):
    """A saved tensor was written while its device-to-host copy could still read it."""


class FailedElsewhere(SaveError):
    """This rank did not write because another rank failed before the write (that rank's error is the cause)."""
