"""The remote commit protocol, upload side: push a step, commit it last, withdraw a commit an upload broke.

Reading and retiring committed steps is :mod:`shardckpt.remote.listing`.

Remote layout (``<remote>`` is the URL given as ``remote=``)::

    <remote>/step_<N>/.metadata, __<rank>_<i>.distcp ...   the step's files
    <remote>/step_<N>/_nodes/ranks-<a>-<b>-<n>.json          one marker per node
    <remote>/step_<N>/shardckpt.json                         the manifest, LAST
    <remote>/step_<N>/_committed.json                        the step record: a few hundred bytes
    <remote>/_index.json                                     the committed steps' infos (a cache)

Protocol for one step, run by every node's uploader on its own (uploaders
coordinate through the remote store and local files only, never through the
trainer's process group):

1. The node's files of the locally committed step (the manifest's files
   present in its local step directory; ``.metadata``, which every
   node-local copy holds, by the committer alone) are uploaded concurrently,
   each verified after upload (size, the manifest's checksum, and the
   store's own CRC32 checksum headers where it returns them).
2. The node looks for a commit of another save of the step its uploads may
   have overwritten (and withdraws it), then writes its marker: the ranks it
   holds files for, the checksum of each file it uploaded and the tag (ETag)
   each PUT returned (:mod:`shardckpt.remote.node_markers`).
3. Exactly one node, the *committer* (the one holding rank 0's first
   shard file), waits until the markers' files cover every file of the
   manifest (``.metadata`` by its own marker) with matching checksums and
   one listing shows every object with the size and tag its node's marker
   names; then it uploads the manifest, and lists again (a foreign object
   found then withdraws the commit; the argument is in
   :mod:`shardckpt.remote.node_markers`). From that moment the step exists
   remotely; before, it does not exist for anyone. Then it writes the step record (files digest, save id,
   created, lineage: what the other nodes need to know of the commit, so
   that no node but the committer downloads the manifest, which grows with
   the job) and adds the step to the index (:mod:`shardckpt.remote.index`),
   which lets finding the newest step and retention work without reading
   every manifest. A step committed without a record (by an earlier
   version, or a crash right after the manifest) is read from its manifest.
4. The committer applies the remote retention policy (never the newest
   step, only after a newer step is committed). Every node marks its local
   copy as committed remotely (``step_<N>/.shardckpt-uploaded.json``); only
   then may local retention delete it.

A step that fails (after the store's per-request retries, or past the
step's deadline) raises here; the uploader (:mod:`shardckpt.node.uploader`)
reports it and retries later with capped backoff. It is never half-committed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, Mapping

from shardckpt import _failpoints
from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.format import layout, step_dirs
from shardckpt.format import lineage as lineage_mod
from shardckpt.format.retention import RetentionPolicy, plan_deletions
from shardckpt.remote import compressed, node_markers
from shardckpt.remote import index as remote_index
from shardckpt.remote.listing import (
    STEP_RECORD_NAME,
    apply_remote_retention,
    committed_record,
    step_record_bytes,
    uncommit,
)
from shardckpt.remote.upload_marks import (  # noqa: F401 - part of this module's API
    UPLOADED_NAME,
    for_upload,
    is_uploaded,
    local_bytes,
    mark_uploaded,
    pending_steps,
    present_files,
)
from shardckpt.stores import Deadline, Store, safe_url

log = logging.getLogger("shardckpt")

NODES_DIR = node_markers.NODES_DIR
MARKER_FORMAT = node_markers.MARKER_FORMAT
missing_ranks = node_markers.missing_ranks
MarkerCache = node_markers.MarkerCache
COMMITTED = "committed"
SUPERSEDED = "superseded"
WAITING = "waiting"
GONE = "gone"


# ------------------------------------------------------------ small helpers

from shardckpt.stores.progress import PROGRESS_S, Progress  # noqa: E402,F401 - used here and by callers

files_digest = layout.files_digest


step_key = remote_index.step_key
remote_manifest = remote_index.remote_manifest


# ------------------------------------------------------------ push (upload side)


@dataclasses.dataclass
class PushResult:
    state: str
    uploaded_bytes: int = 0
    detail: str = ""
    marked: str | None = None
    """The files digest whose node marker this node has on the remote (its part is done)."""
    committer: bool = False
    """This node commits the step (it polls the markers; it writes a failed step's report)."""


_marker_name = node_markers.marker_name


def _committer_file(manifest: layout.Manifest) -> str:
    """The file whose holder commits the step: rank 0's first shard file.

    (Every node-local copy holds ``.metadata``, so it cannot single one out.)
    """
    shards = [n for n in manifest.files if n != layout.METADATA_NAME]
    if not shards:
        return layout.METADATA_NAME
    return min(shards, key=lambda n: (manifest.files[n].rank, n))


def _upload_set(held: list[str], committer: bool) -> list[str]:
    """The files this node uploads and names in its marker: all it holds, but ``.metadata``
    only on the committer. Every node-local copy holds the same ``.metadata``; one PUT of
    it per step, not one per node."""
    return held if committer else [n for n in held if n != layout.METADATA_NAME]


def _read_local_manifest(step_dir: str) -> tuple[bytes, layout.Manifest] | None:
    """The manifest's bytes and their parse: the one version this pass works with."""
    path = os.path.join(step_dir, layout.MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data, layout.Manifest.from_json(data, path)


def _saved_again(step_dir: str, digest: str) -> bool:
    """The local step now holds other content than the manifest this pass started with."""
    try:
        current = layout.read_manifest(step_dir)
    except CorruptCheckpointError:
        return True
    return current is None or files_digest(current) != digest


def push_step(
    store: Store,
    root: str,
    step: int,
    *,
    node: str,
    policy: RetentionPolicy | None,
    skip_upload_digest: str | None = None,
    progress_s: float = PROGRESS_S,
    verify_remote: bool = False,
    early: Mapping[tuple[int, str], Mapping[str, tuple[int, str]]] | None = None,
    early_tags: Mapping[tuple[int, str], Mapping[str, str]] | None = None,
    markers: MarkerCache | None = None,
    early_forms: Mapping[tuple[int, str], Mapping[str, dict[str, Any]]] | None = None,
) -> PushResult:
    """One pass of the protocol for one step of this node (see the module docstring).

    The manifest is read once; every file is checked against *that* manifest
    as it is uploaded, and those very manifest bytes are uploaded last. A step
    saved again locally while it uploads (same number, other content) makes
    this pass stop (``WAITING``, retried with the new content), so a remote
    step never mixes files and manifest of different saves.

    ``verify_remote`` (``shardckpt push``): when the step is already
    committed remotely, download and check this node's objects of it and
    upload again those that fail.

    ``early``: what this node uploaded of saves before their local commit
    (:class:`shardckpt.remote.early_upload.EarlyUploads`), ``{(step, save_id):
    {name: (size, checksum)}}``: a file sent early whose size and checksum
    equal this manifest's is not sent again. Not used when an earlier save of
    the step was committed remotely (its objects may have replaced them).
    ``early_tags``: the store's tags of those uploads, ``{(step, save_id): {name: tag}}``;
    ``early_forms``: the stored forms of those sent compressed, ``{(step, save_id): {name: form}}``.

    ``markers``: the node markers read by earlier passes (the committer's
    polls read each marker once); a pass without it reads them all.
    """
    step_dir = os.path.join(root, layout.step_dirname(step))
    local = _read_local_manifest(step_dir)
    if local is None:
        return PushResult(GONE)
    manifest_bytes, manifest = local
    digest = files_digest(manifest)
    deadline = Deadline(store.options.step_deadline_s)
    held = present_files(step_dir, manifest)
    committer = bool(held) and _committer_file(manifest) in held
    mine = _upload_set(held, committer)
    # The step record, not the manifest: only the committer ever downloads the whole manifest.
    record = committed_record(store, step, deadline)
    committed = None if record is None else (
        manifest if record.files_digest == digest
        else record.manifest or remote_index.remote_manifest(store, step, deadline)
    )
    if committed is not None:
        if files_digest(committed) == digest:
            # Any node's copy of .metadata may repair the remote one (it is the same file).
            repaired = _repair_remote(store, step_dir, step,
                                      remote_index.remote_manifest(store, step, deadline) or manifest, held,
                                      deadline) if verify_remote else []
            mark_uploaded(step_dir, store.url, manifest)
            detail = (f"already committed; replaced {len(repaired)} corrupt object(s): {', '.join(repaired)}"
                      if repaired else "already committed")
            return PushResult(COMMITTED, sum(manifest.files[n].size for n in repaired), detail)
        if committed.created >= manifest.created:
            raise RemoteError(
                f"step {step}: {store.where(layout.step_dirname(step))} is already committed with different, "
                f"newer content (another run writing to the same prefix?); it is not overwritten. Remedy: point "
                f"remote= at a prefix of its own, or delete that remote step if it is stale."
            )
        # This step was saved again (e.g. after a rollback): the committer
        # retires the remote copy of the earlier save first (its manifest
        # away: the step stops existing remotely), then all nodes upload the
        # new files as for any step. Only a save that knows the remote one as
        # an earlier version of its own history may do that: its lineage left
        # it (a rollback), or this directory set it aside when saving again.
        if not _replaces(root, step, manifest, committed):
            raise RemoteError(
                f"step {step}: {store.where(layout.step_dirname(step))} is committed by another save (created "
                f"{_when(committed.created)}) that this run's history does not replace (two instances writing to "
                f"the same prefix?); it is not overwritten and this step is not uploaded. Remedy: give each run its "
                f"own remote= prefix; or delete that remote step (`shardckpt gc`) if it is stale."
            )
        if not committer:
            return PushResult(WAITING, detail="waiting for the committing node to retire an earlier save of this step")
        log.warning(
            "shardckpt: step %d was saved again locally; retiring its earlier remote copy at %s",
            step, store.where(layout.step_dirname(step)),
        )
        remote_index.forget(store, [step], deadline)
        uncommit(store, step, deadline)
    if not mine:
        return _superseded_or(store, step_dir, step, manifest, PushResult(
            WAITING, detail="this node holds no file of the step"), deadline)
    ranks = sorted({manifest.files[n].rank for n in mine})
    marker_key = step_key(step, f"{NODES_DIR}/{_marker_name(ranks)}")
    marker: dict[str, Any] = {
        "format": MARKER_FORMAT,
        "node": node,
        "ranks": ranks,
        "files": {n: manifest.files[n].checksum for n in mine},
        "files_digest": digest,
    }
    sent = 0
    if skip_upload_digest != digest:
        existing = store.get_bytes(marker_key, deadline)
        if existing is None or node_markers.parse(existing).get("files_digest") != digest:
            sent_early = (early or {}).get((step, manifest.save_id), {}) if committed is None else {}
            stored, misfit = compressed.early_forms(manifest, (early_forms or {}).get((step, manifest.save_id), {}))
            todo = [n for n in mine
                    if n in misfit or sent_early.get(n) != (manifest.files[n].size, manifest.files[n].checksum)]
            early_given = (early_tags or {}).get((step, manifest.save_id), {})
            tags = {n: early_given[n] for n in mine if n not in todo and early_given.get(n)}
            stored = {n: form for n, form in stored.items() if n in mine and n not in todo}
            total = sum(manifest.files[n].size for n in todo)
            _failpoints.hit("upload.checked_remote")
            progress = Progress(f"uploading step {step} to {safe_url(store.url)}", total, progress_s)
            shards = sorted((n for n in todo if n != layout.METADATA_NAME), key=lambda n: -manifest.files[n].size)
            compress = compressed.chooser(store, root, min(60.0, deadline.remaining())) if shards else None

            def send(name: str) -> None:
                entry = manifest.files[name]
                path = os.path.join(step_dir, name)
                if compress is not None and compress(name, entry.size):
                    form, tag = compressed.put_compressed(store, step_key(step, name), path, entry, step, deadline,
                                                          progress.add)
                    stored[name] = form.to_json()
                else:
                    tag = store.put_file(path, step_key(step, name), entry.size, entry.checksum, deadline, progress.add)
                if tag:
                    tags[name] = tag

            try:
                with progress:
                    store.run_all([lambda n=n: send(n) for n in todo], files=True)
            except (FileNotFoundError, CorruptCheckpointError):
                # A file vanished or differs from the manifest: the step was deleted or saved
                # again meanwhile (else the local copy is damaged: the error stands).
                if layout.read_manifest(step_dir) is None:
                    return PushResult(GONE)
                if _saved_again(step_dir, digest):
                    return PushResult(WAITING, detail=SAVED_AGAIN)
                raise
            sent = total - sum(manifest.files[n].size - f["size"] for n, f in stored.items() if n in todo)
            if stored:  # the committer writes them into the remote manifest
                marker["stored"] = stored
            _failpoints.hit("upload.files_sent")
            withdraw_overwritten(store, step, {n: (manifest.files[n].size, manifest.files[n].checksum) for n in mine},
                                 digest, deadline)
            if tags:
                marker["tags"] = {n: tags[n] for n in sorted(tags)}
            store.put_bytes(marker_key, json.dumps(marker, sort_keys=True).encode(), deadline)
            _failpoints.hit("upload.marker_written")
    if not committer:
        waiting = PushResult(WAITING, sent, "waiting for the committing node", marked=digest)
        return _superseded_or(store, step_dir, step, manifest, waiting, deadline)
    stored_forms: dict[str, dict[str, Any]] = {}
    ready, why, tags = _all_markers_present(store, step, manifest, digest, deadline, markers, stored_forms)
    if not ready:
        return _superseded_or(store, step_dir, step, manifest,
                              PushResult(WAITING, sent, why, marked=digest, committer=True), deadline)
    _failpoints.hit("upload.markers_checked")
    late = _retired_before_commit(store, step_dir, step, manifest, policy, sent, deadline)
    if late is not None:
        return late
    # Identity, not sizes: every object must be this save's (the argument is in node_markers'
    # docstring). The listing before the manifest was taken with the markers; the one after
    # it catches an upload racing the commit; retention runs only on a verified commit.
    # The remote manifest: the local one, plus the stored form of the files uploaded compressed.
    remote = dataclasses.replace(manifest, stored=stored_forms) if stored_forms else manifest
    missing, foreign = node_markers.foreign_objects(store, step, remote, tags, deadline)
    if foreign or missing:
        why = f"{SAVED_AGAIN_ELSEWHERE}: {foreign[0]}" if foreign else missing[0]
        return PushResult(WAITING, sent, why, marked=digest, committer=True)
    if _saved_again(step_dir, digest):  # another save of the number may be uploading from other nodes
        return PushResult(WAITING, sent, SAVED_AGAIN, marked=digest, committer=True)
    store.put_bytes(step_key(step, layout.MANIFEST_NAME), remote.to_json().encode() if stored_forms else manifest_bytes,
                    deadline)
    _failpoints.hit("upload.manifest_written")
    missing, foreign = node_markers.foreign_objects(store, step, remote, tags, deadline)
    if foreign or missing:
        store.delete(step_key(step, layout.MANIFEST_NAME), deadline)
        why = f"{SAVED_AGAIN_ELSEWHERE}: {foreign[0]}" if foreign else missing[0]
        log.warning("shardckpt: step %d: withdrew the remote commit at %s: %s", step,
                    store.where(layout.step_dirname(step)), why)
        return PushResult(WAITING, sent, why, marked=digest, committer=True)
    _failpoints.hit("upload.identity_confirmed")
    try:
        store.put_bytes(step_key(step, STEP_RECORD_NAME), step_record_bytes(manifest), deadline)
    except RemoteError as exc:  # the step is committed; the other nodes read its manifest instead
        log.warning("shardckpt: step %d is committed, but its step record %s was not written: %s", step,
                    store.where(step_key(step, STEP_RECORD_NAME)), exc)
    remote_index.record(store, manifest, deadline)
    mark_uploaded(step_dir, store.url, manifest)
    if markers is not None:
        markers.forget(step)
    if policy is not None:
        try:
            apply_remote_retention(store, policy, deadline, known={step: manifest}, protect_known=False)
        except (RemoteError, CorruptCheckpointError) as exc:
            log.warning("shardckpt: step %d is committed on %s, but remote retention failed: %s", step,
                        safe_url(store.url), exc)
    return PushResult(COMMITTED, sent, committer=True)


def withdraw_overwritten(
    store: Store, step: int, mine: Mapping[str, tuple[int, str]], digest: str, deadline: Deadline
) -> list[str]:
    """After this node's uploads of a save of ``step`` (``mine``: ``{name: (size, checksum)}``;
    ``digest``: that save's files digest, empty before its local commit): a commit of another
    save of the step that names one of these keys with other bytes is withdrawn (its record, manifest and index entry
    go). Returns the keys that clashed. One HEAD when the step is not committed.

    The uploads were started while the step was not committed (by any save):
    a commit found now was made while they ran, and may hold this node's
    objects under another save's manifest (see :mod:`shardckpt.remote.node_markers`).
    """
    if not store.exists(step_key(step, layout.MANIFEST_NAME), deadline):
        return []
    record = committed_record(store, step, deadline)
    if record is None or record.files_digest == digest:
        return []
    committed = record.manifest or remote_index.remote_manifest(store, step, deadline)
    theirs = committed.files if committed is not None else {}
    clash = sorted(n for n, got in mine.items() if n in theirs and (theirs[n].size, theirs[n].checksum) != got)
    if clash:
        remote_index.forget(store, [step], deadline)
        uncommit(store, step, deadline)
        log.warning(
            "shardckpt: step %d: another save of it was committed at %s while this node uploaded over its "
            "objects (%s); that commit is withdrawn (it no longer holds its own bytes) and this save "
            "commits in its place once every node has uploaded it", step,
            store.where(layout.step_dirname(step)), store.where(step_key(step, clash[0])))
    return clash


SAVED_AGAIN = "saved again locally while uploading; starting over with the new content"
SAVED_AGAIN_ELSEWHERE = "objects of another save of this step number are on the remote; not committed"


def _retired_before_commit(
    store: Store, step_dir: str, step: int, manifest: layout.Manifest, policy: RetentionPolicy | None, sent: int,
    deadline: Deadline,
) -> PushResult | None:
    """``SUPERSEDED`` when retention would remove this step as soon as it is committed, else ``None``.

    Steps waiting for the slowest node are polled most-due first, not in
    order: a step may be ready only after newer steps of its history have
    committed. It is committed then when retention keeps it beside them (its
    retention pass then removes what is older), never just to be counted
    out: a step retention has already passed over must not come back.
    """
    if policy is None or not any(s > step for s in remote_index.step_dirs(store, deadline)):
        return None
    infos, _unreadable = remote_index.survey(store, deadline, {step: manifest})
    live, _abandoned = lineage_mod.classify(infos)
    newer = [s for s in live if s > step]
    if not newer or step not in plan_deletions(live, policy, infos=infos):
        return None
    mark_uploaded(step_dir, store.url, manifest, superseded_by=newer[-1])
    return PushResult(SUPERSEDED, sent, f"superseded by step {newer[-1]}, committed remotely first; "
                                        f"retention keeps that one, not this")


def _replaces(root: str, step: int, manifest: layout.Manifest, committed: layout.Manifest) -> bool:
    """Whether the local save ``manifest`` may retire the remote's ``committed`` save of the step."""
    theirs = lineage_mod.info_of(committed)
    if lineage_mod.excluded_by(lineage_mod.Lineage.from_json(manifest.lineage), step, theirs.lineage) is not None:
        return True  # a rollback (or start_fresh) left that save's history
    loaded_at = (manifest.run or {}).get("loaded_at")
    if isinstance(loaded_at, (int, float)) and committed.created < loaded_at:
        # Saved before this run loaded its history, committed only since (an earlier run's
        # uploader finishing after its trainer died): an orphan this run's save supersedes.
        return True
    kept = layout.kept_name(layout.step_dirname(step), committed)
    return any(os.path.basename(path).startswith(kept) for _s, path in step_dirs.kept_versions(root))


def _when(created: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(created))


def _repair_remote(
    store: Store, step_dir: str, step: int, manifest: layout.Manifest, names: list[str], deadline: Deadline
) -> list[str]:
    """Download and check this node's objects of a committed step (``manifest``: the remote's, naming
    the stored form of compressed files); upload again those that fail."""
    def check(name: str) -> str | None:
        obj, size, checksum = compressed.expected(manifest, name)
        got = store.read_checksum(step_key(step, obj), checksum, deadline)
        return None if got == (size, checksum) else name

    bad = sorted(n for n in store.run_all([lambda n=n: check(n) for n in names], files=True) if n)
    for name in bad:
        entry = manifest.files[name]
        log.warning("shardckpt: remote object %s fails its checksum; uploading it again",
                    store.where(step_key(step, compressed.object_name(manifest, name))))
        if name in manifest.stored:
            compressed.put_again(store, step_key(step, name), os.path.join(step_dir, name), entry, step,
                                 compressed.StoredForm.from_json(manifest.stored[name]), deadline)
        else:
            store.put_file(os.path.join(step_dir, name), step_key(step, name), entry.size, entry.checksum, deadline)
    return bad


def _superseded_or(
    store: Store, step_dir: str, step: int, manifest: layout.Manifest, waiting: PushResult, deadline: Deadline
) -> PushResult:
    """A step still waiting while a newer step of its history is committed remotely is superseded.

    (Its commit may have come and gone: remote retention may have removed it
    before this node looked.) It is marked done locally, which lets local
    retention drop it; the newer step is the one that is safe remotely. A
    newer step of another branch (this one was saved after a rollback) does
    not count.

    One GET of the index (:mod:`shardckpt.remote.index`), whatever the
    number of newer steps (those blocked too cost nothing), and the step
    record of the newer step it names (the index is a cache; the record
    proves the commit). A newer commit the index misses is seen at a later
    poll, once the committer's next write has repaired the index.
    """
    infos = remote_index.read(store, deadline) or {}
    mine = lineage_mod.info_of(manifest)
    for other in sorted((s for s in infos if s > step), reverse=True):
        if infos[other].created < manifest.created:
            continue
        if lineage_mod.excluded_by(infos[other].lineage, step, mine.lineage) is not None:
            continue
        latest = committed_record(store, other, deadline)
        if latest is None or latest.info.created < manifest.created:
            continue
        if lineage_mod.excluded_by(latest.info.lineage, step, mine.lineage) is not None:
            continue
        mark_uploaded(step_dir, store.url, manifest, superseded_by=other)
        return PushResult(SUPERSEDED, waiting.uploaded_bytes, f"superseded by step {other}, committed remotely")
    return waiting


def _all_markers_present(
    store: Store, step: int, manifest: layout.Manifest, digest: str, deadline: Deadline, cache: MarkerCache | None,
    stored: dict[str, dict[str, Any]] | None = None,
) -> tuple[bool, str, dict[str, str]]:
    """Whether the markers of this save cover every file; the tags they give. ``stored`` is filled
    with the stored forms the markers report (files uploaded compressed)."""
    markers = node_markers.read_markers(store, step, deadline, cache)
    if stored is not None:
        stored.update(compressed.from_markers(markers, manifest, digest))
    covered, tags, _present = node_markers.coverage(markers, manifest, digest)
    missing = sorted(set(manifest.files) - covered)
    if missing:
        return False, f"waiting for node markers covering {len(missing)} file(s), e.g. {missing[0]}", tags
    return True, "", tags
