"""The local tier's DCP side: write a step's shards, read its metadata safely, load it back.

Writes go through :class:`CheckedWriter` (DCP's file writer, refusing to
report items its threads did not write). Reads take the step's ``.metadata``
through the allow-list unpickler (``safe_pickle``) unless the caller trusts
the checkpoint, and load non-tensor items with ``torch.load(weights_only=True)``.
The directory side (commit, withdraw, delete, clean-up) is ``step_dirs``.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import shutil
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from shardckpt.format import layout, step_dirs
from shardckpt.format import lineage as lineage_mod
from shardckpt.errors import CorruptCheckpointError, ShardckptError, UntrustedCheckpointError
from shardckpt.format.safe_pickle import safe_load_metadata

log = logging.getLogger("shardckpt")

try:
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # pragma: no cover - moved between torch releases
    from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore


class _HashingStream(io.RawIOBase):
    """A file opened for writing that checksums what passes through it.

    DCP writes a step's files front to back (``tell`` only records offsets),
    so the checksum of the writes is the checksum of the file and the commit
    need not read the files back. Anything else (a ``seek``) spoils it: the
    file is then hashed from disk as before.
    """

    def __init__(self, raw: Any, on_complete: Callable[[int, str], None] | None = None) -> None:
        super().__init__()
        self._raw = raw
        self.checksum: layout.Checksum | None = layout.Checksum(chunked=True)
        self.size = 0
        self._on_complete = on_complete
        self.announced: tuple[int, str] | None = None
        """(size, checksum) handed to ``on_complete`` when DCP asked for the descriptor (to fsync it)."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written is None or written != view.nbytes:  # a short write: let the disk tell the truth
            self.checksum = None
            written = view.nbytes if written is None else written
        if self.checksum is not None:
            self.checksum.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.checksum = None
        return self._raw.seek(offset, whence)

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._raw.flush()  # DCP asks for the descriptor to fsync it: nothing may wait in our buffer
        if self._on_complete is not None and self.checksum is not None and self.announced is None:
            # Every byte is written (the fsync is DCP's last step): the file can be read now.
            self.announced = (self.size, self.checksum.value())
            self._on_complete(*self.announced)
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        # DCP closes the stream itself after its fsync; the file is closed by create_stream.
        self._raw.flush()
        super().close()


_WRITING = threading.local()
"""``active`` in a thread while it writes a step's file (inside ``_HashingFileSystem.create_stream``)."""


def _install_crc_switch() -> None:
    """Make torch.save skip its per-record CRC-32 in the threads writing a step's files.

    DCP serialises every tensor with torch.save, whose zip records carry a
    CRC-32 of the data: a pass over every byte at about 1-2 GB/s, more CPU
    than the copy into the page cache. Every file of a step is already
    checksummed whole (xxh3-128, :class:`_HashingStream`) and verified on
    load, and torch.load reads records written without a CRC-32, so stock
    ``dcp.load`` reads the files as before. Only a thread inside
    ``create_stream`` sees the switch: torch.save anywhere else in the
    process (the training loop's own files) keeps its CRC-32.
    """
    original = getattr(torch.serialization, "get_crc32_options", None)
    if original is None or getattr(original, "shardckpt_switch", False):
        return

    def get_crc32_options() -> bool:
        if getattr(_WRITING, "active", False):
            return False
        return original()

    get_crc32_options.shardckpt_switch = True  # type: ignore[attr-defined]
    get_crc32_options.__doc__ = original.__doc__
    torch.serialization.get_crc32_options = get_crc32_options


class _HashingFileSystem(FileSystem):
    """DCP's local file system, remembering the checksum of every file it wrote whole.

    One instance per writer, hence per directory: files are known by name.
    """

    def __init__(self, on_file: Callable[[str, int, str], None] | None = None) -> None:
        super().__init__()
        _install_crc_switch()
        self._lock = threading.Lock()
        self._on_file = on_file
        """Called with (name, size, checksum) once each file is written whole: before its fsync when
        DCP asks for the descriptor, else as it is closed (again if it changed since)."""
        self.written: dict[str, tuple[int, str, str]] = {}
        self.errors: list[BaseException] = []
        """What failed while writing a file (DCP's writer threads only print their tracebacks)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        was = getattr(_WRITING, "active", False)
        _WRITING.active = True
        try:
            name = os.path.basename(path)
            on_file = self._on_file
            with open(path, mode) as raw:
                stream = _HashingStream(raw, (lambda size, digest: on_file(name, size, digest)) if on_file else None)
                yield stream
                raw.flush()
        except BaseException as exc:
            with self._lock:
                self.errors.append(exc)
            raise
        finally:
            _WRITING.active = was
        if stream.checksum is not None:
            entry = (stream.size, stream.checksum.value())
            with self._lock:
                self.written[os.path.basename(path)] = (*entry, stream.checksum.chunk_sums())
            if self._on_file is not None and stream.announced != entry:
                self._on_file(os.path.basename(path), *entry)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.written.pop(os.path.basename(path), None)
            if entry is not None:
                self.written[os.path.basename(new_path)] = entry


class CheckedWriter(FileSystemWriter):
    """DCP's file writer, refusing to report success for items it did not write.

    With ``thread_count > 1`` DCP writes files from helper threads; an
    exception in one of those (an object that cannot be serialised, an I/O
    error) is printed by the thread and lost, and the save would finish with
    metadata that points at nothing. Here every planned item must come back
    with a result, else the write fails, naming the items.

    Files are checksummed while they are written (:meth:`checksums`).
    """

    def __init__(self, *args: Any, on_file: Callable[[str, int, str], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fs = _HashingFileSystem(on_file)

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        written = {result.index for result in future.wait()}
        lost = [item.index.fqn for item in plan.items if item.index not in written]
        if lost:
            what = f"{len(lost)} item(s) were not written ({', '.join(sorted(lost)[:5])})"
            cause = self.fs.errors[0] if self.fs.errors else None
            if cause is None:
                raise OSError(f"{what}: a writer thread failed (its traceback is on this process's stderr)")
            if isinstance(cause, OSError):
                raise OSError(cause.errno, f"{what}: {cause.strerror or cause}") from cause
            raise ValueError(f"{what}: {type(cause).__name__}: {cause}") from cause
        return future

    def checksums(self, directory: str, names: list[str]) -> dict[str, tuple[int, str, str]]:
        """Size, checksum and chunk checksums of each of ``names`` in ``directory``: from the write, else read back."""
        out = {}
        for name in names:
            path = os.path.join(directory, name)
            seen = self.fs.written.get(name)
            if seen is not None and os.path.getsize(path) == seen[0]:
                out[name] = seen
            else:
                out[name] = layout.file_sums(path)
        return out


def dcp_write(
    state_dict: dict[str, Any], directory: str, *, process_group: Any, io_threads: int, rank: int,
    on_file: Callable[[str, int, str], None] | None = None,
) -> dict[str, tuple[int, str, str]]:
    """Write this rank's shards (and on rank 0 ``.metadata``) into ``directory``.

    Returns size, checksum and chunk checksums of each file this rank wrote, taken while writing.
    ``on_file(name, size, checksum)``: called as each file is complete.
    """
    writer = CheckedWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=io_threads,
                           on_file=on_file)
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist)
    return writer.checksums(directory, step_dirs.own_files(directory, rank))


# ------------------------------------------------------------------ loading


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


def dcp_read(
    target: dict[str, Any],
    step_dir: str,
    metadata: Metadata,
    planner: RestorePlanner,
    process_group: Any,
    *,
    step: int,
    entries: dict[str, layout.FileEntry] | None,
    copies: list[list[int]],
    checked: set[str] = frozenset(),  # type: ignore[assignment]
    sparse: Any = None,
    source: Any = None,
) -> list[tuple[str, str]]:
    """Read ``step_dir`` into ``target`` in place (:class:`dcp_reader.CheckedReader`).

    With ``entries`` (the manifest's files) every file not in ``checked`` is
    checksummed by one rank of its copy while it is read; returns this rank's
    ``(file, problem)`` pairs. ``target`` is taken as is: dcp.load would
    replace the top-level dict, losing entries the planner rebuilds there.
    ``sparse``: ``step_dir`` is a sparse copy (``ranged.SparseStep``) completed from
    ``source`` with the ranges its ranks read.
    """
    from shardckpt.tiers.dcp_reader import CheckedReader

    reader = CheckedReader(step_dir, metadata, step=step, entries=entries, copies=copies, skip=checked,
                           sparse=sparse, source=source, group=process_group)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        _load_state_dict(target, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        raise unwrap_failure(exc, f"reading {step_dir}") from exc
    return reader.failures


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
            size, digest, chunks = layout.file_sums(os.path.join(partial, name))
            match = re.match(r"__(\d+)_", name)
            files[name] = layout.FileEntry(size, digest, int(match.group(1)) if match else 0, chunks)
        ranks = {e.rank for n, e in files.items() if n.startswith("__")}
        keys = {}
        for fqn in metadata.state_dict_metadata:
            path = (metadata.planner_data or {}).get(fqn, (fqn,))
            keys[str(path[0])] = "stock"
        # The adopted step joins the live history of ``root`` (the head's lineage, stamped after
        # every step there): it must never revive a branch that a rollback abandoned.
        infos = lineage_mod.local_infos(root)
        head = lineage_mod.head(infos)
        manifest = layout.Manifest(
            step=step,
            world_size=(max(ranks) + 1) if ranks else 1,
            files=files,
            torch_version=torch.__version__,
            keys=keys,
            metadata={"adopted_from": os.path.abspath(source)},
            total_bytes=sum(e.size for e in files.values()),
            created=max(time.time(), head.created + 1e-3) if head is not None else time.time(),
            lineage=head.lineage.to_json() if head is not None else {},
            save_id="adopt-" + uuid.uuid4().hex[:12],
        )
        commit = step_dirs.commit_step(root, partial, manifest)
        step_dirs.finish_commit(commit)
        return commit.final
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
