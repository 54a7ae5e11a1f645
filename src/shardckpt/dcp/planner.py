"""DCP's metadata read safely, the reader over verified metadata, and the restore's load planner.

``.metadata`` is read through the allow-list unpickler (``safe_pickle``)
unless the caller trusts the checkpoint; non-tensor items load with
``torch.load(weights_only=True)``. Knows no tier.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from shardckpt.errors import (
    CorruptCheckpointError,
    ShardckptError,
    UntrustedCheckpointError,
)
from shardckpt.format import layout
from shardckpt.format.safe_pickle import safe_load_metadata

try:
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - moved between torch releases
    from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore


def read_metadata(
    step_dir: str, step: int, *, trust_pickles: bool = False, entry: layout.FileEntry | None = None
) -> Metadata:
    """DCP's metadata of a step; ``entry``: its manifest entry, checked before a byte is unpickled
    (damage must read as damage, not as an untrusted pickle)."""
    path = os.path.join(step_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"step {step}: {path} is missing; the step cannot be loaded. "
            f"Remedy: load an earlier step or restore the file from the remote tier."
        ) from None
    problem = entry and layout.file_problem(step, path, entry, len(data), layout.checksum_bytes(data, entry.checksum))
    if problem:
        raise CorruptCheckpointError(problem)
    if trust_pickles:
        return pickle.loads(data)
    return safe_load_metadata(data, path)


class TrustingReader(FileSystemReader):
    """FileSystemReader whose metadata comes from our already-verified parse."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._shardckpt_metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._shardckpt_metadata
        # FileSystemReader keeps the storage_data for reads.
        self.storage_data = md.storage_data
        return md


class RestorePlanner(DefaultLoadPlanner):
    """Loads live targets in place and rebuilds chosen entries from the metadata.

    ``rebuild(path)`` says whether a saved entry (its unflattened path) should
    be materialised from the checkpoint even though the live state dict does
    not hold it (plain values, stateful objects, this rank's RNG entry).
    A rebuilt tensor is read straight into ``into(path, metadata)`` when that
    returns one (the caller's own tensor of the saved shape and dtype), else
    into a new one. Non-tensor items load with ``torch.load(weights_only=True)``:
    no code from the checkpoint runs.
    """

    def __init__(
        self,
        rebuild: Callable[[tuple], bool],
        *,
        allow_partial_load: bool,
        trust_pickles: bool,
        into: Callable[[tuple, TensorStorageMetadata], torch.Tensor | None] | None = None,
    ) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self._rebuild = rebuild
        self._into = into
        self._trust = trust_pickles

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        assert_metadata(metadata)
        for fqn, md in metadata.state_dict_metadata.items():
            path = (metadata.planner_data or {}).get(fqn, (fqn,))
            if not self._rebuild(tuple(path)):
                continue
            value: Any = md
            if isinstance(md, TensorStorageMetadata):
                value = self._into(tuple(path), md) if self._into is not None else None
                if value is None:
                    value = torch.empty(md.size, dtype=md.properties.dtype)
            set_element(state_dict, path, value)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=not self._trust)
        except pickle.UnpicklingError as exc:
            raise UntrustedCheckpointError(
                f"the saved item {fqn!r} holds objects outside the safe allow-list "
                f"(loading it could run code from the checkpoint): {exc}. Remedy: only if you trust "
                f"this checkpoint's origin, load with trust_pickles=True."
            ) from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def assert_metadata(metadata: Metadata | None) -> None:
    if metadata is None:
        raise CorruptCheckpointError("DCP metadata is missing for this step")


def unwrap_failure(exc: CheckpointException, doing: str) -> BaseException:
    """The first of our own errors inside DCP's per-rank failure report, else a readable one."""
    failures = sorted(exc.failures.items())
    for _rank, pair in failures:
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, ShardckptError):
            return inner
    rank, pair = failures[0] if failures else (0, (exc, None))
    inner = pair[0] if isinstance(pair, tuple) else pair
    return CorruptCheckpointError(
        f"{doing} failed on rank {rank}: {type(inner).__name__}: {inner}. "
        f"Remedy: run `shardckpt verify` on the directory, or load an earlier step."
    )
