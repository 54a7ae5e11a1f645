"""The step views a directory copy completes itself from, after its own disk, and the copy being completed.

A *view* is one committed save of a step on one real store
(:class:`~shardckpt.steps.StepView` over a
:class:`~shardckpt.stores.base.Store`): the replicas of another node's files
held on this node (:class:`~shardckpt.stores.local.ReplicaDirStore`), another
node's peer daemon (:class:`~shardckpt.stores.peer.PeerStore`: its own copy,
and the replicas it holds), the remote. A view is made only of the save asked
for: its manifest is read from that store and must carry the chosen version
and the same file table, else the view is not offered (a replica of another
save of the step number never is). Each file taken from a view is verified
against the chosen manifest as it arrives, and a file that fails gives way to
the next view.

Every source of a restore is a :class:`Source` (this machine's shared memory,
the replicas held here, the peers, the remote), listed in the order of
:mod:`shardckpt.restoring.sources` (the one place that orders them): it has a
``kind``, says whether it gives a step ``whole`` (the memory tier: every
rank's copy read as it is) or file by file through ``views(step, version)``,
and ``offers()`` what it holds on this node for the survey.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from typing import Any, Protocol

from shardckpt import steps as steps_mod
from shardckpt import stores
from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.format import layout, replicas, step_dirs
from shardckpt.remote import commit as remote_commit
from shardckpt.remote.upload_marks import mark_uploaded
from shardckpt.stores.peer import PeerStore
from shardckpt.stores.peer_client import PeerClient
from shardckpt.stores.tls import fingerprint

log = logging.getLogger("shardckpt")


@dataclasses.dataclass
class View:
    """One committed save of a step on one store, with a name for messages and the kind of source."""

    kind: str
    name: str
    view: steps_mod.StepView
    listed: bool = True
    """Whether to list what the store holds first (a view asked for every file it should hold, e.g. the
    remote's committed step, whose compressed files are stored under other names, is not listed)."""


class Source(Protocol):
    """One source of a restore's bytes (the order they are read in: ``restoring/sources.py``)."""

    kind: str
    """The kind of source, as :attr:`Sources.report` counts it (``"memory"``, ``"replicas here"``, ``"peer"``,
    ``"remote"``)."""
    whole: bool
    """Whether it gives a step whole (every rank's copy read as it is, never file by file: the memory tier,
    whose holdings the survey learns from every rank's report) instead of through :meth:`views`."""

    def offers(self) -> dict[int, dict[str, list[str]]]:
        """What this source holds on this node, for the survey: ``{step: {version: [file names]}}``
        (``{}`` for a source whose holdings the survey learns otherwise: from the peers' own nodes, rank 0's
        listing of the remote, the memory tier's report)."""

    def views(self, step: int, version: str) -> list[View]:
        """Its views of the save ``version`` of ``step``, in the order to read them (``[]`` from a whole
        source)."""

    def close(self) -> None:
        """Release connections."""


def _manifest_of(store: stores.Store, step: int) -> layout.Manifest | None:
    """The committed manifest of ``step`` on ``store`` (``None``: none there); raises when unreadable."""
    key = stores.join(layout.step_dirname(step), layout.MANIFEST_NAME)
    data = store.get_bytes(key, stores.Deadline(60))
    manifest = None if data is None else layout.Manifest.from_json(data, store.where(key))
    return manifest if manifest is not None and manifest.step == step else None


def manifest_on(store: stores.Store, step: int, version: str, *, where: str) -> layout.Manifest | None:
    """The manifest of ``step`` on ``store`` when it is of the save ``version``, else ``None`` (absent, of
    another save, or unreadable: a warning names it)."""
    try:
        manifest = _manifest_of(store, step)
    except (CorruptCheckpointError, RemoteError, OSError) as exc:
        log.warning("shardckpt: step %d: %s cannot be read (%s); not used", step, where, stores.redact(str(exc)))
        return None
    if manifest is None or layout.version_of(manifest) != version:
        return None  # another save of that step number: never a source of this one
    return manifest


def held_sizes(store: stores.Store, step: int, manifest: layout.Manifest) -> dict[str, int]:
    """The manifest's files the store holds of ``step`` at their manifest size (content is checked on fetch)."""
    listed = store.list_sizes(layout.step_dirname(step), stores.Deadline(60))
    return {n: s for n, s in listed.items() if n in manifest.files and manifest.files[n].size == s}


class ReplicasHere:
    """The replicas of other nodes' files that this node holds (``.shardckpt-replicas/<owner>/``), one
    :class:`~shardckpt.stores.local.ReplicaDirStore` per owner. Used whether or not the tier is on."""

    kind = "replicas here"
    whole = False

    def __init__(self, root: str) -> None:
        self.root = root

    def _stores(self) -> list[stores.ReplicaDirStore]:
        base = replicas.replicas_root(self.root)
        try:
            owners = sorted(n for n in os.listdir(base) if not n.startswith("."))
        except FileNotFoundError:
            return []
        return [stores.ReplicaDirStore(os.path.join(base, owner), owner) for owner in owners]

    def offers(self) -> dict[int, dict[str, list[str]]]:
        out: dict[int, dict[str, list[str]]] = {}
        for store in self._stores():
            for name in store.list_dirs("", stores.Deadline(60)):
                step = layout.parse_step_dirname(name)
                if step is None:
                    continue
                try:
                    manifest = _manifest_of(store, step)
                except (CorruptCheckpointError, OSError):
                    continue  # an unreadable replica offers nothing
                if manifest is None:
                    continue
                names = out.setdefault(step, {}).setdefault(layout.version_of(manifest), [])
                names.extend(n for n in held_sizes(store, step, manifest) if n not in names)
        return out

    def views(self, step: int, version: str) -> list[View]:
        found = []
        for store in self._stores():
            where = f"the replica of node {store.owner} held here ({store.where(layout.step_dirname(step))})"
            manifest = manifest_on(store, step, version, where=where)
            if manifest is not None:
                found.append(View(self.kind, where, steps_mod.StepView(store, manifest)))
        return found

    def close(self) -> None:
        pass


class PeerTierFacts(Protocol):
    """What a restore reads of the node's peer tier (:class:`shardckpt.node.peer_tier.PeerTier`): whether it
    is on and this rank commits its copy, the job's members, and what a client needs to reach them."""

    on: bool
    committer: bool
    client_context: Any
    """The pinned client-side TLS context (``None`` before the tier has its keys)."""
    node_name: str
    nodes: list[dict[str, Any]]
    admission: Any
    """The member's admission tokens (:mod:`shardckpt.stores.admission`), or ``None``."""


class Peers:
    """Every other node of the job through its peer daemon (mutual TLS, its certificate pinned): its own
    copy of the step and the replicas it holds, as :class:`~shardckpt.stores.peer.PeerStore` views. Only
    while the peer tier is on; what each daemon serves its node reports in the survey itself."""

    kind = "peer"
    whole = False

    def __init__(self, tier: PeerTierFacts | None) -> None:
        self._tier = tier
        self._clients: list[tuple[str, PeerClient]] = []

    def on(self) -> bool:
        tier = self._tier
        return bool(tier is not None and tier.on and tier.committer and tier.client_context is not None)

    def offers(self) -> dict[int, dict[str, list[str]]]:
        return {}

    def _peers(self) -> list[tuple[str, PeerClient]]:
        if not self._clients and self.on():
            tier = self._tier
            me = tier.node_name
            self._clients = [(n["node"], PeerClient(n["addr"], tier.client_context, expect=fingerprint(n["cert"]),
                                                    admission=tier.admission))
                             for n in tier.nodes if n["node"] != me]
        return self._clients

    def views(self, step: int, version: str) -> list[View]:
        found = []
        for node, client in self._peers():
            try:
                listing = client.list_steps()
            except RemoteError as exc:
                log.warning("shardckpt: step %d: cannot list the steps of peer %s: %s", step, node, exc)
                continue
            owners: list[str | None] = [None] if (listing.get("local") or {}).get(str(step)) == version else []
            owners += sorted(o for o, held in (listing.get("replicas") or {}).items() if held.get(str(step)) == version)
            for owner in owners:
                store = PeerStore(client, owner)
                where = f"peer {node}" + (f" (its replica of {owner})" if owner else "")
                manifest = manifest_on(store, step, version, where=where)
                if manifest is not None:
                    found.append(View(self.kind, where, steps_mod.StepView(store, manifest)))
        return found

    def close(self) -> None:
        for _node, client in self._clients:
            client.close()
        self._clients = []


class RemoteSource:
    """The remote (any store, ``config.remote``): the step's committed save there, read file by file through
    one view of its manifest, unlisted (its compressed files are stored under other names). Rank 0 lists
    it in the survey; the manifests the survey read are not read again. Also the source of a need-only
    copy's ranges (``remote/ranged.py``) and of a refetch after a bad read (``restoring/sources.py``)."""

    kind = "remote"
    whole = False

    def __init__(self, config: Any) -> None:
        self.config = config
        self.surveyed: dict[int, layout.Manifest] = {}
        """Remote manifests read by the survey of the step being completed (rank 0's)."""
        self._store: stores.Store | None = None

    def store(self) -> stores.Store:
        """The remote store (opened on first use, closed by :meth:`close`)."""
        if self._store is None:
            self._store = stores.open_store(self.config.remote, self.config.transfer_options())
        return self._store

    def where(self) -> str:
        return stores.safe_url(self.config.remote)

    def manifest(self, step: int, deadline: stores.Deadline) -> layout.Manifest | None:
        """The remote manifest of ``step``: the survey's when it read it (one read per node per restore)."""
        surveyed = self.surveyed.get(step)
        return surveyed if surveyed is not None else remote_commit.remote_manifest(self.store(), step, deadline)

    def offers(self) -> dict[int, dict[str, list[str]]]:
        return {}

    def views(self, step: int, version: str) -> list[View]:
        """The committed step's view; :class:`~shardckpt.errors.RemoteError` when it is no longer committed."""
        manifest = self.manifest(step, stores.Deadline(self.config.step_deadline_s))
        if manifest is None:
            raise RemoteError(f"step {step} is no longer committed on {self.where()}")
        return [View(self.kind, self.where(), steps_mod.StepView(self.store(), manifest), listed=False)]

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class CopyFill:
    """This node's directory copy of the chosen save of a step, completed file by file from views.

    When the copy holds that save, files land in its step directory (each
    renamed into place once verified). Otherwise (it holds nothing of the step,
    or another save of it, which is kept aside first) they land in a partial
    directory, committed by :meth:`commit` with the manifest written last.
    """

    def __init__(self, root: str, step: int, version: str, *, stale: bool, remote_url: str | None = None) -> None:
        self.root, self.step, self.version = root, step, version
        self.step_dir = os.path.join(root, layout.step_dirname(step))
        if stale:
            kept = step_dirs.keep_aside(root, step)
            log.warning("shardckpt: step %d in %s is another save than the one being restored (a stale copy, e.g. "
                        "from before a rollback elsewhere): kept aside as %s; completing the one that counts",
                        step, self.step_dir, kept)
        mine = layout.read_manifest(self.step_dir)
        same = mine is not None and layout.version_of(mine) == version
        self.manifest: layout.Manifest | None = mine if same else None
        self.target = self.step_dir if self.manifest is not None else None
        self.received: set[str] = set()
        self.report: dict[str, dict[str, int]] = {}
        """Per kind of source: files and bytes taken from it, files it offered that failed their check."""
        self.failures: list[tuple[str, str, Exception]] = []
        """``(kind of source, file, error)`` of every file a view failed to give."""
        self.remote_url = remote_url

    @property
    def partial(self) -> bool:
        return self.target is not None and self.target != self.step_dir

    def holds(self) -> list[str]:
        """The manifest's files present in the copy now."""
        if self.manifest is None or self.target is None:
            return []
        return sorted(set(self.manifest.files) - set(layout.absent_files(self.target, self.manifest)))

    def lacking(self) -> list[str] | None:
        """The manifest's files absent from the copy (``None``: no manifest of the save here yet)."""
        if self.manifest is None or self.target is None:
            return None
        return layout.absent_files(self.target, self.manifest)

    def adopt_manifest(self, manifest: layout.Manifest) -> bool:
        """Take the save's manifest from a view (this copy had none): a partial directory to fill."""
        if self.manifest is not None:
            return layout.files_digest(manifest) == layout.files_digest(self.manifest)
        self.manifest = dataclasses.replace(manifest, stored={})
        os.makedirs(self.root, exist_ok=True)
        self.target = os.path.join(self.root, layout.partial_dirname(self.step, "fill-" + uuid.uuid4().hex[:8]))
        os.makedirs(self.target)
        return True

    def _count(self, kind: str, key: str, n: int = 1) -> None:
        self.report.setdefault(kind, {"files": 0, "bytes": 0, "refused": 0})[key] += n

    def fill(self, found: list[View]) -> None:
        """Take each file the copy lacks from the first of ``found`` that holds it; a file that fails its
        check (or a view that fails) gives way to the next view."""
        for source in found:
            if self.manifest is None:
                if not self.adopt_manifest(source.view.manifest):
                    continue
            elif layout.files_digest(source.view.manifest) != layout.files_digest(self.manifest):
                log.warning("shardckpt: step %d: %s has the save's version but another file table; not used",
                            self.step, source.name)
                continue
            lacking = self.lacking() or []
            if not lacking:
                return
            if source.listed:
                try:
                    held = held_sizes(source.view.store, self.step, source.view.manifest)
                except (RemoteError, OSError) as exc:
                    log.warning("shardckpt: step %d: cannot list %s: %s", self.step, source.name,
                                stores.redact(str(exc)))
                    continue
                take = [n for n in lacking if held.get(n) == self.manifest.files[n].size]
            else:
                take = lacking
            if take:
                self._take(source, take)

    def _take(self, source: View, names: list[str]) -> None:
        assert self.manifest is not None and self.target is not None
        files = self.manifest.files

        def one(name: str) -> tuple[str, Exception | None]:
            final = os.path.join(self.target, name)
            tmp = f"{final}.fill-{uuid.uuid4().hex[:8]}"
            try:
                source.view.fetch_whole(name, tmp, files[name])
                os.replace(tmp, final)
                return name, None
            except (CorruptCheckpointError, RemoteError, OSError) as exc:
                return name, exc
            finally:
                if os.path.lexists(tmp):
                    os.unlink(tmp)

        results = source.view.store.run_all([lambda n=n: one(n) for n in names], files=True)
        failed = [(n, why) for n, why in results if why is not None]
        self.failures += [(source.kind, n, why) for n, why in failed]
        for name, why in results:
            if why is None:
                self.received.add(name)
                self._count(source.kind, "files")
                self._count(source.kind, "bytes", files[name].size)
        if failed:
            self._count(source.kind, "refused", len(failed))
            log.warning("shardckpt: step %d: %d file(s) from %s not used (%s: %s); taken from the next source",
                        self.step, len(failed), source.name, failed[0][0], stores.redact(str(failed[0][1])))

    def count_own(self) -> None:
        """The files the copy held of the save before any view (its own disk), for :attr:`report`."""
        own = [n for n in self.holds() if n not in self.received] if self.manifest is not None else []
        if own:
            self.report["own disk"] = {"files": len(own), "bytes": sum(self.manifest.files[n].size for n in own),
                                       "refused": 0}

    def commit(self, remote_manifest: layout.Manifest | None = None) -> None:
        """A partial copy complete: its manifest written last, the directory renamed into place (a copy that
        holds the save stays as it is). ``remote_manifest``: the step is committed on the remote as this
        save; the copy gets the upload mark that says so (the uploader sends nothing again)."""
        if not self.partial:
            if remote_manifest is not None and self.remote_url:
                mark_uploaded(self.step_dir, self.remote_url, remote_manifest)
            return
        assert self.manifest is not None and self.target is not None
        if self.lacking():
            raise CorruptCheckpointError(f"step {self.step}: {len(self.lacking() or [])} file(s) of this node's copy "
                                         f"came from no source ({', '.join((self.lacking() or [])[:5])})")
        layout.atomic_write_text(os.path.join(self.target, layout.MANIFEST_NAME), self.manifest.to_json())
        if remote_manifest is not None and self.remote_url:
            mark_uploaded(self.target, self.remote_url, remote_manifest)
        layout.fsync_dir(self.target)
        steps_mod.commit_fetched(self.root, self.target, self.step_dir)
        self.target = self.step_dir

    def abandon(self) -> None:
        """Remove a partial copy that will not be committed."""
        if self.partial and self.target is not None:
            shutil.rmtree(self.target, ignore_errors=True)
            self.target = None
