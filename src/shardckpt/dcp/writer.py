"""The DCP writer: a step's shards written with DCP's file writer, checked and checksummed.

Writes go through :class:`CheckedWriter` (DCP's file writer, refusing to
report items its threads did not write); every file is checksummed while it
is written. The directory side (commit, withdraw, delete, clean-up) is
``format/step_dirs.py``. Knows no tier.
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from shardckpt.format import layout, step_dirs


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
    on_file: Callable[[str, int, str], None] | None = None, planner: Any = None,
) -> dict[str, tuple[int, str, str]]:
    """Write this rank's shards (and on rank 0 ``.metadata``) into ``directory``.

    Returns size, checksum and chunk checksums of each file this rank wrote, taken while writing.
    ``on_file(name, size, checksum)``: called as each file is complete; ``planner``: DCP's save
    planner (``None``: its default one over ``state_dict``).
    """
    writer = CheckedWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=io_threads,
                           on_file=on_file)
    no_dist = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=no_dist, planner=planner)
    return writer.checksums(directory, step_dirs.own_files(directory, rank))
