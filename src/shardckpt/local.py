"""Local tier: DCP write into a partial directory, commit, and DCP read back.

Call order for one save (all ranks unless noted):

1. ``write_step``: ``dcp.save`` of the staged state into
   ``<local_dir>/.partial-step_<N>-<nonce>`` over the ``io`` side group;
   every rank hashes the files it wrote (rank 0 also ``.metadata``); the
   file tables are all-gathered.
2. ``commit_step`` (one rank per node, the node leader): manifest written
   into the partial directory (tmp + fsync + rename), then the directory is
   renamed to ``step_<N>`` and the parent fsynced. From here the step exists.
3. A barrier on the ``io`` group; retention runs on the node leader.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import re
import shutil
import uuid
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from . import _failpoints, layout
from .errors import CorruptCheckpointError, ShardckptError, UntrustedCheckpointError
from .safe_pickle import safe_load_metadata
from .topology import PROBE_PREFIX

log = logging.getLogger("shardckpt")

try:
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - moved between torch releases
    from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore


def own_files(directory: str, rank: int) -> list[str]:
    prefix = f"__{rank}_"
    names = [n for n in os.listdir(directory) if n.startswith(prefix) and not n.endswith(".tmp")]
    if rank == 0 and os.path.exists(os.path.join(directory, ".metadata")):
        names.append(".metadata")
    return sorted(names)


def hash_files(directory: str, names: list[str], rank: int) -> dict[str, tuple[int, str, int]]:
    out = {}
    for name in names:
        size, digest = layout.checksum_file(os.path.join(directory, name))
        out[name] = (size, digest, rank)
    return out


class CheckedWriter(FileSystemWriter):
    """DCP's file writer, refusing to report success for items it did not write.

    With ``thread_count > 1`` DCP writes files from helper threads; an
    exception in one of those (an object that cannot be serialised, an I/O
    error) is printed by the thread and lost, and the save would finish with
    metadata that points at nothing. Here every planned item must come back
    with a result, else the write fails, naming the items.
    """

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        written = {result.index for result in future.wait()}
        lost = [item.index.fqn for item in plan.items if item.index not in written]
        if lost:
            raise OSError(
                f"{len(lost)} item(s) were not written ({', '.join(sorted(lost)[:5])}): a writer thread failed "
                f"(its traceback is on this process's stderr)"
            )
        return future


def dcp_write(state_dict: dict[str, Any], directory: str, *, process_group: Any, io_threads: int) -> None:
    writer = CheckedWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=io_threads)
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist)


@dataclasses.dataclass
class Commit:
    """A step renamed into place whose outcome the other ranks have not confirmed yet."""

    root: str
    final: str
    displaced: str | None = None
    """An earlier copy of the same step number, set aside until the outcome is known."""


def commit_step(root: str, partial: str, manifest: layout.Manifest) -> Commit:
    """Write the manifest last and make the step visible.

    An earlier copy of the same step number (the step saved again, e.g. after a
    rollback) is first renamed out of the way, which hides it at once; it is
    deleted by :func:`finish_commit`, or put back by :func:`undo_commit` when
    another rank failed to commit its part.
    """
    final = os.path.join(root, layout.step_dirname(manifest.step))
    layout.atomic_write_text(os.path.join(partial, layout.MANIFEST_NAME), manifest.to_json())
    _failpoints.hit("commit.manifest_written")
    displaced = None
    if os.path.exists(final):
        displaced = os.path.join(root, f"{layout.REPLACED_PREFIX}{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
        os.replace(final, displaced)
    try:
        os.replace(partial, final)
    except BaseException:
        if displaced is not None:
            os.replace(displaced, final)
        raise
    layout.fsync_dir(root)
    return Commit(root, final, displaced)


def finish_commit(commit: Commit) -> None:
    """Every rank committed: the earlier copy of the step (if any) goes."""
    if commit.displaced is not None:
        shutil.rmtree(commit.displaced, ignore_errors=True)


def undo_commit(commit: Commit) -> None:
    """Another rank failed to commit: hide and remove this copy, put any earlier one back."""
    _hide_step(commit.final)
    trash = os.path.join(commit.root, f"{layout.TRASH_PREFIX}{os.path.basename(commit.final)}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(commit.final, trash)
    except FileNotFoundError:
        trash = ""
    if commit.displaced is not None:
        os.replace(commit.displaced, commit.final)
    layout.fsync_dir(commit.root)
    if trash:
        shutil.rmtree(trash, ignore_errors=True)


def _hide_step(step_dir: str) -> None:
    """Un-commit a step: its manifest is renamed aside (which also marks the directory as ours to delete)."""
    try:
        os.replace(os.path.join(step_dir, layout.MANIFEST_NAME), os.path.join(step_dir, layout.HIDDEN_MANIFEST_NAME))
    except FileNotFoundError:
        pass


def delete_step(root: str, step: int) -> None:
    """Delete a step so that an interruption leaves it invisible, never half-listed."""
    step_dir = os.path.join(root, layout.step_dirname(step))
    _hide_step(step_dir)
    layout.fsync_dir(step_dir)
    _failpoints.hit("retention.hidden")
    trash = os.path.join(root, f"{layout.TRASH_PREFIX}{layout.step_dirname(step)}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(step_dir, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(root: str, keep_nonce: str | None) -> list[str]:
    """Remove partial and trash directories of crashed saves (not ``keep_nonce``'s).

    A copy of a step set aside by a save of the same step number that never
    committed (the process died between the two renames) is put back.
    """
    removed = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(layout.REPLACED_PREFIX):
            step_name = name[len(layout.REPLACED_PREFIX) :].rsplit("-", 1)[0]
            final = os.path.join(root, step_name)
            if (
                layout.parse_step_dirname(step_name) is not None
                and not os.path.exists(os.path.join(final, layout.MANIFEST_NAME))
                and os.path.exists(os.path.join(path, layout.MANIFEST_NAME))
            ):
                if os.path.isdir(final):
                    shutil.rmtree(final, ignore_errors=True)
                os.replace(path, final)
                layout.fsync_dir(root)
                log.warning("shardckpt: put back %s: the save that replaced it never committed", final)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
        elif name.startswith(layout.TRASH_PREFIX) or name.startswith(PROBE_PREFIX) or (
            name.startswith(layout.PARTIAL_PREFIX) and not (keep_nonce and name.endswith("-" + keep_nonce))
        ):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            removed.append(name)
        elif layout.parse_step_dirname(name) is not None and not os.path.exists(
            os.path.join(path, layout.MANIFEST_NAME)
        ) and _looks_ours(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def _looks_ours(step_dir: str) -> bool:
    # A step directory without manifest is only ours to delete when it is a
    # leftover of our own protocol: an interrupted deletion leaves its manifest
    # renamed aside. A directory with .metadata and no trace of ours may be a
    # stock DCP checkpoint someone put there: never deleted.
    return os.path.exists(os.path.join(step_dir, layout.HIDDEN_MANIFEST_NAME)) or not os.path.exists(
        os.path.join(step_dir, ".metadata")
    )


# ------------------------------------------------------------------ loading


def read_metadata(step_dir: str, step: int, *, trust_pickles: bool = False) -> Metadata:
    path = os.path.join(step_dir, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"step {step}: {path} is missing; the step cannot be loaded. "
            f"Remedy: load an earlier step or restore the file from the remote tier."
        ) from None
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
    Non-tensor items load with ``torch.load(weights_only=True)``: no code from
    the checkpoint runs.
    """

    def __init__(self, rebuild: Callable[[tuple], bool], *, allow_partial_load: bool, trust_pickles: bool) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self._rebuild = rebuild
        self._trust = trust_pickles

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        assert_metadata(metadata)
        for fqn, md in metadata.state_dict_metadata.items():
            path = (metadata.planner_data or {}).get(fqn, (fqn,))
            if not self._rebuild(tuple(path)):
                continue
            value: Any = md
            if isinstance(md, TensorStorageMetadata):
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


def dcp_read(target: dict[str, Any], step_dir: str, metadata: Metadata, planner: RestorePlanner, process_group: Any) -> None:
    # The loader entry point below takes ``target`` as is: dcp.load would
    # replace the top-level dict, losing entries the planner rebuilds there.
    reader = TrustingReader(step_dir, metadata)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        _load_state_dict(target, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        raise unwrap_failure(exc, f"reading {step_dir}") from exc


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


def adopt(source: str, root: str, step: int, *, trust_pickles: bool = False) -> str:
    """Make a stock DCP checkpoint directory a committed step of ``root`` (a copy).

    The metadata is read with the restricted unpickler unless ``trust_pickles``;
    files are copied into a partial directory, hashed, and committed with a
    manifest last, like any save. The source is left untouched.
    """
    if not os.path.isfile(os.path.join(source, ".metadata")):
        raise CorruptCheckpointError(
            f"{source} has no .metadata: it is not a DCP checkpoint directory. Remedy: point at the "
            f"directory that torch.distributed.checkpoint.save wrote."
        )
    metadata = read_metadata(source, step, trust_pickles=trust_pickles)
    if os.path.exists(os.path.join(root, layout.step_dirname(step), layout.MANIFEST_NAME)):
        raise CorruptCheckpointError(
            f"step {step} is already committed in {root}. Remedy: adopt under another step number."
        )
    os.makedirs(root, exist_ok=True)
    partial = os.path.join(root, layout.partial_dirname(step, "adopt-" + uuid.uuid4().hex[:8]))
    os.makedirs(partial)
    files: dict[str, layout.FileEntry] = {}
    try:
        for name in sorted(os.listdir(source)):
            path = os.path.join(source, name)
            if not os.path.isfile(path) or name == layout.MANIFEST_NAME:
                continue
            shutil.copyfile(path, os.path.join(partial, name))
            size, digest = layout.checksum_file(os.path.join(partial, name))
            match = re.match(r"__(\d+)_", name)
            files[name] = layout.FileEntry(size, digest, int(match.group(1)) if match else 0)
        ranks = {e.rank for n, e in files.items() if n.startswith("__")}
        keys = {}
        for fqn in metadata.state_dict_metadata:
            path = (metadata.planner_data or {}).get(fqn, (fqn,))
            keys[str(path[0])] = "stock"
        manifest = layout.Manifest(
            step=step,
            world_size=(max(ranks) + 1) if ranks else 1,
            files=files,
            torch_version=torch.__version__,
            keys=keys,
            metadata={"adopted_from": os.path.abspath(source)},
            total_bytes=sum(e.size for e in files.values()),
        )
        commit = commit_step(root, partial, manifest)
        finish_commit(commit)
        return commit.final
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
