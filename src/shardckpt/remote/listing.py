"""The committed steps on a remote: probing, listing, step records, withdrawal, deletion and retention.

What every reader of a remote needs of the commit protocol (:mod:`shardckpt.remote.commit`): which steps
are committed (the index, else a listing), a step's record (the few hundred bytes that say which save
it is), and, for the writers, the withdrawal of a commit and the deletion of retired steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from typing import Any

from shardckpt import _failpoints
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.format import lineage as lineage_mod
from shardckpt.format.retention import RetentionPolicy, plan_deletions
from shardckpt.remote import index as remote_index
from shardckpt.stores import Deadline, Store, join, safe_url

log = logging.getLogger("shardckpt")

files_digest = layout.files_digest
step_key = remote_index.step_key

PROBE_PREFIX = ".shardckpt-probe"


def probe(store: Store, deadline: Deadline, *, write: bool) -> None:
    """List the remote and, with ``write``, put and delete a small object: raises :class:`RemoteError`.

    A run that uploads checks this at its first save: a typo'd bucket or
    endpoint, or credentials that cannot write, must stop it at once rather
    than let it train for days with no copy in the remote.
    """
    store.list_dirs("", deadline)
    if write:
        key = join(PROBE_PREFIX, f"{uuid.uuid4().hex}.txt")
        store.put_bytes(key, b"shardckpt write probe; safe to delete\n", deadline)
        store.delete(key, deadline)


def newest_committed(store: Store, deadline: Deadline) -> tuple[list[int], layout.Manifest | None]:
    """The step directories on the remote and the manifest of the newest committed one.

    Reads manifests from the highest step number down until one exists (one
    GET in the usual case); an unreadable one counts as committed (its
    CorruptCheckpointError propagates).
    """
    dirs = remote_index.step_dirs(store, deadline)
    for step in reversed(dirs):
        manifest = remote_index.remote_manifest(store, step, deadline)
        if manifest is not None:
            return dirs, manifest
    return dirs, None


def remote_steps(store: Store, deadline: Deadline) -> list[int]:
    """Steps committed on the remote (their manifest exists, readable or not), oldest first.

    From the index (:func:`shardckpt.remote.index.survey`): one listing and
    one GET, not a request per step.
    """
    infos, unreadable = remote_index.survey(store, deadline)
    return sorted(set(infos) | set(unreadable))




def remote_manifests(
    store: Store, deadline: Deadline, steps: list[int] | None = None, unreadable: dict[int, str] | None = None
) -> dict[int, layout.Manifest]:
    """The manifests of the steps committed on the remote (of ``steps`` only, when given).

    Reads every manifest: for inspection of the whole remote; finding steps
    and retention use :func:`remote_infos` (the index).

    A remote manifest that cannot be read is left out (it must not decide what
    else is live) and put into ``unreadable`` with the reason when given (a
    restore reports such a step rather than pass over it), else a warning.
    """
    candidates = remote_index.step_dirs(store, deadline) if steps is None else sorted(steps)

    def one(step: int) -> tuple[int, layout.Manifest | None]:
        try:
            return step, remote_index.remote_manifest(store, step, deadline)
        except CorruptCheckpointError as exc:
            if unreadable is not None:
                unreadable[step] = str(exc)
            else:
                log.warning("shardckpt: skipping remote step %d: %s", step, exc)
            return step, None

    found = store.run_all([lambda s=s: one(s) for s in candidates], files=True) if candidates else []
    return {s: m for s, m in found if m is not None}


def remote_infos(
    store: Store, deadline: Deadline, read: dict[int, layout.Manifest] | None = None
) -> tuple[dict[int, list[Any]], dict[int, str]]:
    """``{step: StepInfo.to_json()}`` of the steps committed on the remote, and the committed
    steps whose manifest cannot be read (with the reason). From the index: O(1) manifests read
    (handed back in ``read``)."""
    infos, unreadable = remote_index.survey(store, deadline, manifests_read=read)
    return {s: i.to_json() for s, i in infos.items()}, unreadable




STEP_RECORD_NAME = "_committed.json"
STEP_RECORD_FORMAT = "shardckpt-step/1"


@dataclasses.dataclass
class StepRecord:
    """What a node needs to know of a committed step, without downloading its manifest."""

    files_digest: str
    save_id: str
    info: lineage_mod.StepInfo
    manifest: layout.Manifest | None = None
    """Set when the record was taken from the manifest (a step committed without a record)."""


def step_record_bytes(manifest: layout.Manifest) -> bytes:
    body = {"format": STEP_RECORD_FORMAT, "step": manifest.step, "files_digest": files_digest(manifest),
            "save_id": manifest.save_id, "info": lineage_mod.info_of(manifest).to_json()}
    return json.dumps(body, sort_keys=True).encode()


def committed_record(store: Store, step: int, deadline: Deadline) -> StepRecord | None:
    """The record of ``step`` when it is committed remotely, else ``None``.

    One GET of the step record (a few hundred bytes; first, so that an
    error answers with the store's error code) and a HEAD of the manifest;
    the manifest is read only when there is no record (a step committed
    before records, or whose committer died right after the manifest): an
    uncommitted step costs two 404s and no manifest GET. The
    record is written after the manifest and deleted before it; still, a
    record counts only beside its manifest: a commit withdrawn by the node
    whose upload raced it (:func:`withdraw_overwritten`) may lose its manifest
    while its committer, not knowing, writes the record.
    """
    data = store.get_bytes(step_key(step, STEP_RECORD_NAME), deadline)
    if not store.exists(step_key(step, layout.MANIFEST_NAME), deadline):
        return None
    if data is not None:
        try:
            body = json.loads(data.decode("utf-8"))
            if body.get("format") == STEP_RECORD_FORMAT and body.get("step") == step:
                return StepRecord(str(body["files_digest"]), str(body.get("save_id") or ""),
                                  lineage_mod.StepInfo.from_json(step, body["info"]))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            pass
        log.warning("shardckpt: the step record %s is unreadable; reading the manifest instead",
                    store.where(step_key(step, STEP_RECORD_NAME)))
    manifest = remote_index.remote_manifest(store, step, deadline)
    if manifest is None:
        return None
    return StepRecord(files_digest(manifest), manifest.save_id, lineage_mod.info_of(manifest), manifest)


def uncommit(store: Store, step: int, deadline: Deadline) -> None:
    """The step stops existing remotely: its record, then its manifest, go."""
    store.delete(step_key(step, STEP_RECORD_NAME), deadline)
    store.delete(step_key(step, layout.MANIFEST_NAME), deadline)


def delete_remote_step(store: Store, step: int, deadline: Deadline, *, indexed: bool = True) -> None:
    """Out of the index, un-commit (record and manifest away), then delete the rest.

    ``indexed=False``: the caller has already removed the step from the index.
    """
    if indexed:
        remote_index.forget(store, [step], deadline)
    uncommit(store, step, deadline)
    _failpoints.hit("upload.retention_hidden")
    store.delete_prefix(layout.step_dirname(step), deadline)


def apply_remote_retention(
    store: Store, policy: RetentionPolicy, deadline: Deadline, known: dict[int, layout.Manifest] | None = None,
    *, protect_known: bool = True,
) -> list[int]:
    """Retention over the live remote steps; steps abandoned by a rollback stay until ``shardckpt gc``.

    Decides from the index (:func:`shardckpt.remote.index.survey`; ``known``:
    manifests just committed, never deleted unless ``protect_known`` is
    False: the committer checked before its commit that retention keeps
    it), not by reading every manifest. The newest step is never deleted.
    The doomed steps leave the index (one write) before they are deleted.
    """
    infos, _unreadable = remote_index.survey(store, deadline, known, write_back=True)
    live, _abandoned = lineage_mod.classify(infos)
    doomed = plan_deletions(live, policy, infos=infos, protect=(known or ()) if protect_known else ())
    if doomed:
        remote_index.forget(store, list(doomed), deadline)
    for old in doomed:
        delete_remote_step(store, old, deadline, indexed=False)
        log.info("shardckpt: remote retention removed step %d from %s", old, safe_url(store.url))
    return doomed
