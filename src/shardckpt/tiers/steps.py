"""A committed step on any store: the one step view.

Every tier holds the same layout (``step_<N>/`` with DCP's files and the
manifest ``shardckpt.json``, written last). Two classes describe it over any
:class:`~shardckpt.stores.base.Store`:

* :class:`StepView`: one committed step on one store: its manifest, which of
  its files this copy holds, ranged reads (the need-only restore's
  :class:`~shardckpt.tiers.ranged.Source`), verified fetch of whole files
  into a directory, a file's checked bytes, the check of every file
  (``shardckpt verify``).
* :class:`Steps`: the committed steps of a location (a local directory or a
  remote URL): their manifests, which are live (``lineage.py``), a step's
  view, deletion. :func:`open_steps` takes ``DIR`` or ``s3://bucket/prefix``
  / ``file:///path`` / any fsspec URL.

``ls``, ``verify``, ``inspect``, ``peek``, ``export`` and the restore's
fetches all go through these. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import uuid
from typing import Any, Callable

from shardckpt.format import layout, lineage, node_state, shm, step_dirs
from shardckpt.tiers import compressed, remote_commit
from shardckpt.tiers.missing import read_committed
from shardckpt.errors import CorruptCheckpointError, RemoteError, ShardckptError
from shardckpt.stores import Deadline, LocalDirStore, join, Store, TransferOptions, open_store, safe_url, split_url

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
            compressed.fetch_whole(self.store, key + compressed.SUFFIX, self.step, entry, form, path, self.deadline, on_bytes)
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
            raise CorruptCheckpointError(f"step {self.step}: {where} is not in the manifest; the step cannot be trusted")
        data = self.read(name, 0, entry.size) if self._form(name) is not None else \
            self.store.get_bytes(self.key(name), self.deadline)
        if data is None:
            raise CorruptCheckpointError(f"step {self.step}: file {where} named in the manifest is missing. "
                                         + layout.verify_remedy(self.step))
        problem = layout.file_problem(self.step, where, entry, len(data), layout.checksum_bytes(data, like=entry.checksum))
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
                    f"step {self.step}: file {where} named in the manifest is missing. {layout.verify_remedy(self.step)}"
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


class Steps:
    """The committed steps of one location; see :func:`open_steps`."""

    where: str
    store: Store
    unreadable: dict[int, str]
    """Committed steps whose manifest cannot be read, with the reason (filled by :meth:`manifests`)."""

    def manifests(self) -> dict[int, layout.Manifest]:
        """Every committed step with a readable manifest (see :attr:`unreadable` for the rest)."""
        raise NotImplementedError

    def view(self, manifest: layout.Manifest) -> StepView:
        return StepView(self.store, manifest)

    def step_where(self, step: int) -> str:
        return self.store.where(layout.step_dirname(step))

    def check(self, manifest: layout.Manifest, on_bytes: OnBytes | None = None) -> CheckReport:
        return self.view(manifest).check(on_bytes=on_bytes)

    def metadata_bytes(self, step: int) -> bytes:
        return StepView.of_step(self.store, step).metadata_bytes()

    def file_bytes(self, manifest: layout.Manifest, name: str) -> bytes:
        return self.view(manifest).file_bytes(name)

    def delete(self, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.store.close()

    def live(self, manifests: dict[int, layout.Manifest]) -> tuple[list[int], dict[int, str]]:
        return lineage.classify({s: lineage.info_of(m) for s, m in manifests.items()})

    def tiers(self, step: int, manifest: layout.Manifest) -> list[str]:
        """Which tiers hold the step, as far as this location can tell."""
        return ["remote"]


class LocalSteps(Steps):
    """A local directory (``local_dir``): steps are the ``step_<N>`` directories with a manifest."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.where = self.root
        self.store = LocalDirStore(self.root)
        self.unreadable = {}
        self._memory: dict[str, layout.Manifest] = {}
        if not os.path.isdir(self.root):
            raise ShardckptError(
                f"no checkpoint directory at {self.root}. Remedy: give the local_dir of a Checkpointer, or a "
                f"remote URL such as s3://bucket/prefix."
            )

    def manifests(self) -> dict[int, layout.Manifest]:
        out: dict[int, layout.Manifest] = {}
        self.unreadable = {}
        for step in layout.committed_steps(self.root):
            try:
                manifest = layout.read_manifest(self.step_where(step))
            except CorruptCheckpointError as exc:
                self.unreadable[step] = str(exc)
                continue
            if manifest is not None:
                out[step] = manifest
        return out

    def check(self, manifest: layout.Manifest, on_bytes: OnBytes | None = None) -> CheckReport:
        """The files this node's copy holds (a node-local copy may hold a part of a multi-node step)."""
        names, elsewhere = layout.copy_files(self.step_where(manifest.step), manifest)
        return self.view(manifest).check(names, on_bytes, elsewhere)

    def delete(self, step: int) -> None:
        step_dirs.delete_step(self.root, step)

    def memory(self) -> dict[int, layout.Manifest]:
        """The saves the memory tier holds complete (every rank's copy) of this directory on this machine
        (``format/shm.py``), the newest per step (``shardckpt status`` lists every copy held here)."""
        self._memory = {}
        for entry in shm.steps(self.root)["saves"]:
            if entry["complete_here"]:
                self._memory[entry["version"]] = layout.Manifest.from_json(entry["manifest"], shm.namespace(self.root))
        out: dict[int, layout.Manifest] = {}
        for manifest in sorted(self._memory.values(), key=lambda m: m.created):
            out[manifest.step] = manifest
        return out

    def tiers(self, step: int, manifest: layout.Manifest) -> list[str]:
        """``local``, ``peer`` once this node's peer daemon replicated it, ``remote`` once the uploader
        marked it committed there, ``memory`` while the memory tier holds it on this machine."""
        held = ["memory"] if layout.version_of(manifest) in self._memory else []
        if not os.path.exists(os.path.join(self.step_where(step), layout.MANIFEST_NAME)) and held:
            return held
        found = ["local"] + held
        if node_state.replicated(self.root, step, manifest):
            found.append("peer")
        try:
            with open(os.path.join(self.step_where(step), remote_commit.UPLOADED_NAME), encoding="utf-8") as f:
                mark = json.load(f)
        except (OSError, ValueError):
            return found
        if mark.get("files_digest") == remote_commit.files_digest(manifest) and "superseded_by" not in mark:
            found.append("remote")
        return found


class RemoteSteps(Steps):
    """A remote URL: steps are those the remote's index and listing show committed."""

    def __init__(self, url: str, options: TransferOptions | None = None) -> None:
        split_url(url)
        self.url = url.rstrip("/")
        self.where = safe_url(self.url)
        self.store = open_store(self.url, options)
        self.deadline_s = self.store.options.step_deadline_s
        self.unreadable = {}

    def manifests(self) -> dict[int, layout.Manifest]:
        deadline = Deadline(self.deadline_s)
        steps = remote_commit.remote_steps(self.store, deadline)
        out: dict[int, layout.Manifest] = {}
        self.unreadable = {}

        def one(step: int) -> None:
            try:
                manifest = remote_commit.remote_manifest(self.store, step, deadline)
            except CorruptCheckpointError as exc:
                self.unreadable[step] = str(exc)
                return
            if manifest is not None:
                out[step] = manifest

        self.store.run_all([lambda s=s: one(s) for s in steps], files=True)
        return dict(sorted(out.items()))

    def delete(self, step: int) -> None:
        remote_commit.delete_remote_step(self.store, step, Deadline(self.deadline_s))


# ---------------------------------------------------------------- whole steps into a directory


def fetch_step(
    store: Store,
    root: str,
    step: int,
    *,
    names: list[str] | None = None,
    manifest: layout.Manifest | None = None,
    progress_s: float = remote_commit.PROGRESS_S,
    verify_local: bool = False,
) -> set[str]:
    """Bring the remote ``step`` into ``root``; return the names fetched (each verified).

    When ``root`` already holds the committed step, only ``names`` (default:
    the files missing locally, and with ``verify_local`` also those failing
    their checksum) are fetched into it, each replacing the local file only
    once it passed. Otherwise the step is fetched into a partial directory
    and committed locally (manifest last) only after every file passed.
    """
    deadline = Deadline(store.options.step_deadline_s)
    step_dir = os.path.join(root, layout.step_dirname(step))
    local_manifest = layout.read_manifest(step_dir)
    remote = manifest or remote_commit.remote_manifest(store, step, deadline)
    if remote is None:
        raise RemoteError(
            f"step {step} is not committed on {safe_url(store.url)} (no manifest). "
            f"Remedy: pick a committed step (shardckpt ls on the remote) or check the URL."
        )
    if local_manifest is not None:
        if layout.files_digest(local_manifest) != layout.files_digest(remote):
            raise CorruptCheckpointError(
                f"step {step}: the local copy {step_dir} and the remote copy {store.where(layout.step_dirname(step))} "
                f"differ; refusing to mix them. Remedy: delete the local step directory, or load another step."
            )
        if names is not None:
            wanted = sorted(names)
        else:
            wanted = layout.missing_files(step_dir, local_manifest)
            if verify_local:
                wanted = sorted(set(wanted) | set(_failing_files(step_dir, local_manifest)))
        target = step_dir
    else:
        wanted = sorted(remote.files)
        os.makedirs(root, exist_ok=True)
        target = os.path.join(root, layout.partial_dirname(step, "fetch-" + uuid.uuid4().hex[:8]))
        os.makedirs(target)
    view = StepView(store, remote)
    total = sum(remote.files[n].size for n in wanted)
    progress = remote_commit.Progress(f"fetching step {step} from {safe_url(store.url)}", total, progress_s)

    def one(name: str) -> None:
        entry = remote.files[name]  # the view checks every file against it
        final = os.path.join(target, name)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{final}.fetch-{uuid.uuid4().hex[:8]}"
        try:
            view.fetch_whole(name, tmp, entry, progress.add)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    try:
        with progress:
            store.run_all([lambda n=n: one(n) for n in wanted], files=True)
        if target != step_dir:
            # The local copy holds the files as written: its manifest names no stored form.
            layout.atomic_write_text(os.path.join(target, layout.MANIFEST_NAME),
                                     dataclasses.replace(remote, stored={}).to_json())
            remote_commit.mark_uploaded(target, store.url, remote)
            commit_fetched(root, target, step_dir)
        else:
            remote_commit.mark_uploaded(step_dir, store.url, remote)
    except BaseException:
        if target != step_dir:
            shutil.rmtree(target, ignore_errors=True)
        raise
    took = progress.elapsed()
    if wanted:
        log.info(
            "shardckpt: fetched %d file(s) of step %d from %s: %.1f MiB in %.2f s",
            len(wanted), step, safe_url(store.url), total / 2**20, took,
        )
    return set(wanted)


def _failing_files(step_dir: str, manifest: layout.Manifest) -> list[str]:
    """Local files of the step that fail their size or checksum."""
    bad = []
    for name in manifest.files:
        try:
            layout.verify_files(step_dir, manifest, [name])
        except CorruptCheckpointError:
            bad.append(name)
    return bad


def commit_fetched(root: str, partial: str, step_dir: str) -> None:
    """A fetched partial copy renamed into place as the step (unless another committed it meanwhile)."""
    if os.path.isdir(step_dir):
        if layout.read_manifest(step_dir) is not None:
            shutil.rmtree(partial, ignore_errors=True)  # someone else committed it meanwhile
            return
        trash = os.path.join(root, f"{layout.TRASH_PREFIX}{os.path.basename(step_dir)}-{uuid.uuid4().hex[:8]}")
        os.replace(step_dir, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(partial, step_dir)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and layout.read_manifest(step_dir) is not None:
            shutil.rmtree(partial, ignore_errors=True)
            return
        raise
    layout.fsync_dir(root)


def open_steps(src: str, options: TransferOptions | None = None) -> Steps:
    """A local directory, or a remote URL (``s3://``, ``file://``, any fsspec scheme)."""
    if is_url(src):
        return RemoteSteps(src, options)
    return LocalSteps(src)
