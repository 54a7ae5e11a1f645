"""The committed steps of a location: a local directory or a remote URL.

:class:`Steps` lists a location's committed steps (their manifests, which are
live by ``lineage.py``), gives a step's :class:`~shardckpt.steps.view.StepView`
and deletes; :func:`open_steps` takes ``DIR`` or ``s3://bucket/prefix`` /
``file:///path`` / any fsspec URL; :func:`fetch_step` copies a whole step into
a directory, verified, and commits it there. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import uuid
from typing import Iterable, Mapping

from shardckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, RemoteError, ShardckptError
from shardckpt.format import layout, lineage, node_state, shm, step_dirs
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import index as remote_index
from shardckpt.remote import listing as remote_listing
from shardckpt.steps.view import CheckReport, OnBytes, StepView, is_url
from shardckpt.stores import Deadline, LocalDirStore, Store, TransferOptions, open_store, safe_url, split_url

log = logging.getLogger("shardckpt")


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
        steps = remote_listing.remote_steps(self.store, deadline)
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
        remote_listing.delete_remote_step(self.store, step, Deadline(self.deadline_s))


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


def not_committed(step: int, where: str, committed: Iterable[int], remedy: str) -> CheckpointNotFoundError:
    """The error for a step asked of ``where`` that is not committed there, naming those that are."""
    listed = sorted(committed) or "none"
    return CheckpointNotFoundError(f"step {step} is not committed in {where}; committed: {listed}. {remedy}")


def remote_step(store: Store, step: int | None, where: str, remedy: str, deadline: Deadline
                ) -> tuple[int, layout.Manifest]:
    """``step`` of the remote ``store`` (default: the newest live one) and its manifest; :func:`not_committed`
    (with ``remedy``) when it is not committed there, or no longer is once its manifest is read."""
    if step is None:
        step = choose_step(remote_index.survey(store, deadline)[0], None, where, remedy)
    manifest = remote_commit.remote_manifest(store, step, deadline)
    if manifest is None:
        raise not_committed(step, where, remote_listing.remote_steps(store, deadline), remedy)
    return step, manifest


def choose_step(infos: Mapping[int, lineage.StepInfo], step: int | None, where: str, remedy: str) -> int:
    """``step`` when it is committed (else :func:`not_committed`, with ``remedy``), else the newest live step."""
    if step is not None:
        if step not in infos:
            raise not_committed(step, where, infos, remedy)
        return step
    live, _abandoned = lineage.classify(dict(infos))
    if not live:
        raise CheckpointNotFoundError(
            f"no committed step in {where}. Remedy: check the path or URL (it must hold step_<N> directories "
            f"with a manifest, {layout.MANIFEST_NAME})."
        )
    return live[-1]
