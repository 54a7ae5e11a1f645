"""shardckpt: async sharded checkpoints of the full PyTorch training state.

Public names only. ``Checkpointer`` is the object API; ``init`` / ``save`` /
``load`` / ``close`` / ``status`` act on a default instance configured by
``init(...)`` or, when ``init`` was not called, by ``SHARDCKPT_*``
environment variables.
"""

from __future__ import annotations

import logging as _logging
import os as _os
import threading as _threading
from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:  # pragma: no cover
    from typing import Any

    from shardckpt.checkpointer import Checkpointer
    from shardckpt.restoring.elastic import ElasticPlan
    from shardckpt.restoring.step_peek import StepPeek
    from shardckpt.saving.handle import SaveHandle

from shardckpt._version import __version__  # noqa: E402, F401 - re-exported: shardckpt.__version__

# torch-free parts, imported at once; the rest (and torch with it) on first
# use, so that `shardckpt ls` and friends start in well under a second.
from shardckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    InsufficientSpaceError,
    MetaDeviceError,
    ObjectNotFoundError,
    ObjectRangeError,
    RemoteError,
    SaveError,
    ShardckptError,
    StateMismatchError,
    UntrustedCheckpointError,
)
from shardckpt.format.retention import AnyOf, KeepAll, KeepBest, KeepEvery, KeepLast  # noqa: E402
from shardckpt.options import CheckpointConfig, OnCorrupt, OnDiskFull, OnRemoteUnavailable, SaveMode, UploaderMode  # noqa: E402

_LAZY = {
    "Checkpointer": "checkpointer",
    "SaveHandle": "saving.handle",
    "ResumableSampler": "state.sampler",
    "epoch_order": "state.sampler",
    "rank_slice": "state.sampler",
    "BatchPolicy": "restoring.elastic",
    "ElasticPlan": "restoring.elastic",
    "ElasticPolicy": "restoring.elastic",
    "LRRule": "restoring.elastic",
    "OnInexact": "restoring.elastic",
    "PerRank": "state.per_rank",
    "StepPeek": "restoring.step_peek",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardckpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AnyOf",
    "BatchPolicy",
    "ElasticPlan",
    "ElasticPolicy",
    "LRRule",
    "OnInexact",
    "PerRank",
    "UploaderMode",
    "epoch_order",
    "last_plan",
    "rank_slice",
    "CheckpointConfig",
    "CheckpointNotFoundError",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "ForeignCheckpointError",
    "InsufficientSpaceError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "ObjectNotFoundError",
    "ObjectRangeError",
    "OnCorrupt",
    "OnDiskFull",
    "OnRemoteUnavailable",
    "RemoteError",
    "ResumableSampler",
    "SaveError",
    "SaveHandle",
    "SaveMode",
    "ShardckptError",
    "StepPeek",
    "StateMismatchError",
    "MetaDeviceError",
    "UntrustedCheckpointError",
    "close",
    "init",
    "load",
    "peek",
    "save",
    "status",
]


def __dir__() -> list[str]:
    """The public names (the lazy ones included, without importing them)."""
    return sorted({*__all__, "__version__"})


def _configure_logging() -> None:
    """One INFO line per save/restore unless the application configured logging."""
    logger = _logging.getLogger("shardckpt")
    level = _os.environ.get("SHARDCKPT_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
    elif logger.level == _logging.NOTSET:
        logger.setLevel(_logging.INFO)
    if not logger.handlers and not _logging.getLogger().handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


_configure_logging()

_default: Any = None
_default_lock = _threading.Lock()


def _checkpointer_class() -> type:
    """The facade's class, imported on first use (it imports torch; ``import shardckpt`` does not)."""
    from shardckpt.checkpointer import Checkpointer

    return Checkpointer


def init(config: CheckpointConfig | None = None, **kwargs: Any) -> "Checkpointer":
    """Create (or replace) the default instance used by the module-level calls."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
        if config is None:
            config = CheckpointConfig.from_env(**kwargs)
        elif kwargs:
            raise ConfigError("pass either a CheckpointConfig or keyword options, not both")
        _default = _checkpointer_class()(config)
        return _default


def _instance() -> "Checkpointer":
    global _default
    with _default_lock:
        if _default is None:
            _default = _checkpointer_class()(CheckpointConfig.from_env())
        return _default


def save(state: dict[str, Any], step: int, **kwargs: Any) -> "SaveHandle | None":
    """``Checkpointer.save`` on the default instance."""
    return _instance().save(state, step, **kwargs)


def load(state: dict[str, Any], step: int | None = None, **kwargs: Any) -> int | None:
    """``Checkpointer.load`` on the default instance."""
    return _instance().load(state, step, **kwargs)


def peek(step: int | None = None, **kwargs: Any) -> "StepPeek | None":
    """``Checkpointer.peek`` on the default instance: a read-only look, no process group needed."""
    return _instance().peek(step, **kwargs)


def status() -> dict[str, Any]:
    """``Checkpointer.status`` of the default instance."""
    return _instance().status()


def close(timeout: float | None = None) -> None:
    """Flush and close the default instance (a later call creates a new one)."""
    global _default
    with _default_lock:
        instance, _default = _default, None
    if instance is not None:
        instance.close(timeout)


def last_plan() -> "ElasticPlan | None":
    """The elastic plan of the default instance's last ``load()`` (``None`` before one)."""
    with _default_lock:
        instance = _default
    return None if instance is None else instance.last_plan

