"""A committed step on any store: the one step view.

Every tier holds the same layout (``step_<N>/`` with DCP's files and the
manifest ``shardckpt.json``, written last). :class:`StepView` describes one
committed step on one :class:`~shardckpt.stores.base.Store`: its manifest,
which of its files this copy holds, ranged reads (the need-only restore's
:class:`~shardckpt.remote.ranged.Source`), verified fetch of whole files
into a directory, a file's checked bytes, the check of every file
(``shardckpt verify``). The steps of a whole location are in
:mod:`shardckpt.steps.locations`.

``ls``, ``verify``, ``inspect``, ``peek``, ``export`` and the restore's
fetches all go through these. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.remote import compressed
from shardckpt.remote.missing import read_committed
from shardckpt.stores import Deadline, Store, join

log = logging.getLogger("shardckpt")

OnBytes = Callable[[int], None]


def is_url(src: str) -> bool:
    return "://" in src


class CheckReport:
    """The outcome of checking one step's files: problems name each bad file."""

    def __init__(self, step: int, names: list[str], size: int, elsewhere: list[list[int]] | None = None) -> None:
        self.step = step
        self.names = names
        self.bytes = size
        self.elsewhere = elsewhere or []
        self.problems: list[tuple[str, str]] = []

    @property
    def ok(self) -> bool:
        return not self.problems


def _problem(entry: layout.FileEntry, got: tuple[int, str] | None) -> str | None:
    if got is None:
        return "missing"
    size, digest = got
    if size != entry.size:
        return f"{size} bytes, the manifest says {entry.size} (truncated or overwritten)"
    if digest != entry.checksum:
        return f"fails its {entry.checksum.split(':')[0]} checksum (corrupted or tampered)"
    return None


class StepView:
    """One committed step on one store (``step_<N>/`` under the store's root).

    Serves as the need-only restore's source (``where``, ``read``,
    ``fetch_whole``, ``run_all``, ``request_bytes``).
    """

    def __init__(self, store: Store, manifest: layout.Manifest | None, *, step: int | None = None,
                 deadline_s: float | None = None, prefix: str | None = None) -> None:
        self.store = store
        self._manifest = manifest
        self.step = manifest.step if manifest is not None else step
        if self.step is None:
            raise ValueError("a step view needs a manifest or a step number")
        self.prefix = layout.step_dirname(self.step) if prefix is None else prefix
        """The step's directory under the store's root (``""``: the store's root is the step directory)."""
        options = getattr(store, "options", None)
        if deadline_s is None and options is not None:
            deadline_s = options.step_deadline_s
        self.deadline = Deadline(deadline_s)
        part = getattr(options, "part_size", 0) if options is not None else 0
        self.request_bytes = max(layout.CHUNK_BYTES, part)

    @classmethod
    def of_step(cls, store: Store, step: int) -> "StepView":
        """A view of ``step`` without its manifest: reads by name (ranges, whole files, ``.metadata``)."""
        return cls(store, None, step=step)

    @property
    def manifest(self) -> layout.Manifest:
        if self._manifest is None:
            raise CorruptCheckpointError(f"step {self.step} at {self.where()}: its manifest was not read")
        return self._manifest

    def key(self, name: str = "") -> str:
        return join(self.prefix, name)

    def where(self, name: str = "") -> str:
        return self.store.where(self.key(name))

    # ---- what the copy holds

    def held(self) -> list[str]:
        """The manifest's files this copy holds (present, whatever their bytes)."""
        present = self.store.list_sizes(self.key(), self.deadline)
        return sorted(n for n in self.manifest.files if n in present)

    # ---- reads

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the step's file ``name`` (checked by the caller's chunk sums);
        an object gone or cut short is :class:`CorruptCheckpointError` (``missing.py``)."""
        key = self.key(name)
        form = self._form(name)
        if form is not None:
            return compressed.read_range(self.store, key + compressed.SUFFIX, self.step, self.manifest.files[name],
                                         form, offset, length, self.deadline)
        return read_committed(self.store, key, self.step, self.deadline,
                              lambda: self.store.get_range(key, offset, length, self.deadline), end=offset + length)

    def _form(self, name: str) -> compressed.StoredForm | None:
        """The stored form of ``name`` when the remote holds it compressed (``Manifest.stored``)."""
        return None if self._manifest is None else compressed.form_of(self._manifest, name)

    def fetch_whole(self, name: str, path: str, entry: layout.FileEntry, on_bytes: OnBytes | None = None) -> None:
        """The whole file into ``path``, checked against ``entry`` (size and checksum); an object gone
        or of another size is :class:`CorruptCheckpointError` (``missing.py``)."""
        key = self.key(name)
        form = self._form(name)
        if form is not None:
            compressed.fetch_whole(self.store, key + compressed.SUFFIX, self.step, entry, form, path, self.deadline,
                                   on_bytes)
            return
        read_committed(self.store, key, self.step, self.deadline,
                       lambda: self.store.get_file(key, path, entry.size, entry.checksum, self.deadline, on_bytes),
                       entry=entry)

    def fetch_into(self, directory: str, names: list[str], on_bytes: OnBytes | None = None) -> None:
        """Files ``names`` of the step into ``directory``, each verified against the manifest, in parallel."""
        os.makedirs(directory, exist_ok=True)
        files = self.manifest.files
        self.store.run_all(
            [lambda n=n: self.fetch_whole(n, os.path.join(directory, n), files[n], on_bytes) for n in names], files=True
        )

    def run_all(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        return self.store.run_all(jobs)

    def file_bytes(self, name: str) -> bytes:
        """One file of the step, checked against its manifest entry (size and checksum)."""
        entry = self.manifest.files.get(name)
        where = self.where(name)
        if entry is None:
            raise CorruptCheckpointError(
                f"step {self.step}: {where} is not in the manifest; the step cannot be trusted"
            )
        data = self.read(name, 0, entry.size) if self._form(name) is not None else \
            self.store.get_bytes(self.key(name), self.deadline)
        if data is None:
            raise CorruptCheckpointError(f"step {self.step}: file {where} named in the manifest is missing. "
                                         + layout.verify_remedy(self.step))
        problem = layout.file_problem(self.step, where, entry, len(data),
                                      layout.checksum_bytes(data, like=entry.checksum))
        if problem:
            raise CorruptCheckpointError(problem)
        return data

    def metadata_bytes(self) -> bytes:
        """DCP's ``.metadata`` of the step as stored (checked by its reader)."""
        data = self.store.get_bytes(self.key(layout.METADATA_NAME), self.deadline)
        if data is None:
            raise CorruptCheckpointError(f"step {self.step}: {self.where(layout.METADATA_NAME)} is missing")
        return data

    # ---- verification

    def verify(self, names: list[str]) -> None:
        """Raise :class:`CorruptCheckpointError` naming the first of ``names`` that is missing or fails
        its size or checksum (each file is streamed once)."""
        for name in names:
            entry = self._object_entry(name)
            where = self.where(compressed.object_name(self.manifest, name))
            got = self.store.read_checksum(self.key(compressed.object_name(self.manifest, name)), entry.checksum,
                                           self.deadline)
            if got is None:
                raise CorruptCheckpointError(
                    f"step {self.step}: file {where} named in the manifest is missing. "
                    f"{layout.verify_remedy(self.step)}"
                )
            problem = layout.file_problem(self.step, where, entry, got[0], got[1])
            if problem:
                raise CorruptCheckpointError(problem)

    def check(self, names: list[str] | None = None, on_bytes: OnBytes | None = None,
              elsewhere: list[list[int]] | None = None) -> CheckReport:
        """Stream each named file (default: all) through its checksum; each is read once."""
        names = sorted(self.manifest.files) if names is None else names
        files = self.manifest.files
        report = CheckReport(self.step, names, sum(files[n].size for n in names), elsewhere)

        def one(name: str) -> tuple[str, str] | None:
            entry = self._object_entry(name)  # a compressed file: its stored object is checked
            got = self.store.read_checksum(self.key(compressed.object_name(self.manifest, name)), entry.checksum,
                                           self.deadline)
            if on_bytes is not None:
                on_bytes(files[name].size)
            problem = _problem(entry, got)
            return (name, problem) if problem else None

        report.problems = [p for p in self.store.run_all([lambda n=n: one(n) for n in names], files=True) if p]
        return report

    def _object_entry(self, name: str) -> layout.FileEntry:
        """What the object holding ``name`` must be: the file's entry, or its stored form's size and checksum."""
        entry = self.manifest.files[name]
        if self._form(name) is None:
            return entry
        _key, size, checksum = compressed.expected(self.manifest, name)
        return layout.FileEntry(size, checksum, entry.rank)
