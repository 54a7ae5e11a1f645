"""A checkpoint location as the command line sees it: a local directory or a remote URL.

Both tiers hold the same layout (``step_<N>/`` with DCP's files and the
manifest ``shardckpt.json``, written last). :func:`open_tier` takes either
``DIR`` or ``s3://bucket/prefix`` / ``file:///path`` / any fsspec URL and
gives the same operations: list the committed steps with their manifests,
say which are live (``lineage.py``), check a step's files against its
manifest, read its DCP metadata, delete a step. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from shardckpt.format import layout, lineage, step_dirs
from shardckpt.tiers import remote_commit
from shardckpt.errors import CorruptCheckpointError, ShardckptError
from shardckpt.tiers.remote import Deadline, Store, TransferOptions, open_store, safe_url, split_url


def is_url(src: str) -> bool:
    return "://" in src


class Tier:
    """Operations shared by both tiers; see :func:`open_tier`."""

    where: str

    def manifests(self) -> dict[int, layout.Manifest]:
        """Every committed step with a readable manifest (see :attr:`unreadable` for the rest)."""
        raise NotImplementedError

    unreadable: dict[int, str]
    """Committed steps whose manifest cannot be read, with the reason (filled by :meth:`manifests`)."""

    def step_where(self, step: int) -> str:
        raise NotImplementedError

    def check(self, manifest: layout.Manifest, on_bytes: Callable[[int], None] | None = None) -> "CheckReport":
        raise NotImplementedError

    def metadata_bytes(self, step: int) -> bytes:
        raise NotImplementedError

    def file_bytes(self, manifest: layout.Manifest, name: str) -> bytes:
        """One file of the step, checked against its manifest entry (size and checksum)."""
        entry = manifest.files.get(name)
        where = f"{self.step_where(manifest.step)}/{name}"
        if entry is None:
            raise CorruptCheckpointError(f"step {manifest.step}: {where} is not in the manifest; the step cannot be trusted")
        data = self._raw_file(manifest.step, name)
        if data is None:
            raise CorruptCheckpointError(f"step {manifest.step}: file {where} named in the manifest is missing. "
                                         + layout.verify_remedy(manifest.step))
        problem = layout.file_problem(manifest.step, where, entry, len(data),
                                      layout.checksum_bytes(data, like=entry.checksum))
        if problem:
            raise CorruptCheckpointError(problem)
        return data

    def _raw_file(self, step: int, name: str) -> bytes | None:
        raise NotImplementedError

    def delete(self, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def live(self, manifests: dict[int, layout.Manifest]) -> tuple[list[int], dict[int, str]]:
        return lineage.classify({s: lineage.info_of(m) for s, m in manifests.items()})

    def tiers(self, step: int, manifest: layout.Manifest) -> list[str]:
        """Which tiers hold the step, as far as this tier can tell."""
        return ["remote"]


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


class LocalTier(Tier):
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.where = self.root
        self.unreadable = {}
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

    def step_where(self, step: int) -> str:
        return os.path.join(self.root, layout.step_dirname(step))

    def check(self, manifest: layout.Manifest, on_bytes: Callable[[int], None] | None = None) -> CheckReport:
        step_dir = self.step_where(manifest.step)
        names, elsewhere = layout.copy_files(step_dir, manifest)
        report = CheckReport(manifest.step, names, sum(manifest.files[n].size for n in names), elsewhere)
        for name in names:
            entry = manifest.files[name]
            try:
                size, digest = layout.checksum_file(os.path.join(step_dir, name), like=entry.checksum)
            except FileNotFoundError:
                report.problems.append((name, "missing"))
                continue
            if size != entry.size:
                report.problems.append((name, f"{size} bytes, the manifest says {entry.size} (truncated or overwritten)"))
            elif digest != entry.checksum:
                report.problems.append((name, f"fails its {entry.checksum.split(':')[0]} checksum (corrupted or tampered)"))
            if on_bytes is not None:
                on_bytes(entry.size)
        return report

    def metadata_bytes(self, step: int) -> bytes:
        path = os.path.join(self.step_where(step), layout.METADATA_NAME)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise CorruptCheckpointError(f"step {step}: {path} is missing") from None

    def _raw_file(self, step: int, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.step_where(step), name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def delete(self, step: int) -> None:
        step_dirs.delete_step(self.root, step)

    def tiers(self, step: int, manifest: layout.Manifest) -> list[str]:
        """``local``, ``peer`` once this node's peer daemon replicated it, ``remote`` once the uploader
        marked it committed there."""
        from shardckpt.node import peer_daemon

        found = self._local_remote(step, manifest)
        if peer_daemon.replicated(self.root, step, manifest):
            found.insert(1, "peer")
        return found

    def _local_remote(self, step: int, manifest: layout.Manifest) -> list[str]:
        try:
            with open(os.path.join(self.step_where(step), remote_commit.UPLOADED_NAME), encoding="utf-8") as f:
                mark = json.load(f)
        except (OSError, ValueError):
            return ["local"]
        uploaded = mark.get("files_digest") == remote_commit.files_digest(manifest) and "superseded_by" not in mark
        return ["local", "remote"] if uploaded else ["local"]


class RemoteTier(Tier):
    def __init__(self, url: str, options: TransferOptions | None = None) -> None:
        split_url(url)
        self.url = url.rstrip("/")
        self.where = safe_url(self.url)
        self.store: Store = open_store(self.url, options)
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

    def step_where(self, step: int) -> str:
        return self.store.where(layout.step_dirname(step))

    def check(self, manifest: layout.Manifest, on_bytes: Callable[[int], None] | None = None) -> CheckReport:
        """Stream every object of the step through its checksum (each is downloaded once)."""
        names = sorted(manifest.files)
        report = CheckReport(manifest.step, names, manifest.total_bytes)
        deadline = Deadline(self.deadline_s)

        def one(name: str) -> tuple[str, str] | None:
            entry = manifest.files[name]
            got = self.store.read_checksum(remote_commit.step_key(manifest.step, name), entry.checksum, deadline)
            if on_bytes is not None:
                on_bytes(entry.size)
            if got is None:
                return name, "missing"
            size, digest = got
            if size != entry.size:
                return name, f"{size} bytes, the manifest says {entry.size}"
            if digest != entry.checksum:
                return name, f"fails its {entry.checksum.split(':')[0]} checksum"
            return None

        report.problems = [p for p in self.store.run_all([lambda n=n: one(n) for n in names], files=True) if p]
        return report

    def metadata_bytes(self, step: int) -> bytes:
        data = self.store.get_bytes(remote_commit.step_key(step, layout.METADATA_NAME), Deadline(self.deadline_s))
        if data is None:
            raise CorruptCheckpointError(f"step {step}: {self.step_where(step)}/.metadata is missing")
        return data

    def _raw_file(self, step: int, name: str) -> bytes | None:
        return self.store.get_bytes(remote_commit.step_key(step, name), Deadline(self.deadline_s))

    def delete(self, step: int) -> None:
        remote_commit.delete_remote_step(self.store, step, Deadline(self.deadline_s))

    def close(self) -> None:
        self.store.close()


def open_tier(src: str, options: TransferOptions | None = None) -> Tier:
    """A local directory, or a remote URL (``s3://``, ``file://``, any fsspec scheme)."""
    if is_url(src):
        return RemoteTier(src, options)
    return LocalTier(src)

