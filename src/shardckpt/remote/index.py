"""The remote step index: what the committed steps are, without reading their manifests.

``<remote>/_index.json`` maps each committed step to its
:class:`~shardckpt.format.lineage.StepInfo` (created, lineage, kind, metrics,
version): all that finding the newest live step, its lineage and retention
need. It is a cache; the manifest stays the commit record:

* it is written after the manifest (by the committing node) and an entry is
  removed before its step is deleted;
* a survey takes one listing of the step directories and one GET of the
  index. An entry whose step directory the listing does not show is checked
  with a HEAD of its manifest (a listing may lag behind a commit on
  S3-compatible stores; the manifest proves the commit) and dropped only
  when that is gone (:func:`unlisted_commits`); a step directory
  without an entry (a crash between manifest and index, a bucket written
  before the index existed, an entry lost to a concurrent writer) has its
  manifest read, once: a committed one is added. The head (the most
  recently created step, whose lineage decides what is live) and the newest
  live step have their manifests read, so an entry whose manifest was
  removed or replaced is caught where it matters. Repairs are written back
  by the committing node only (its commit and its retention pass): a reader
  (another node's uploader, a restore, ``ls``) repairs in memory and never
  writes, so a survey that read the index before a retention pass cannot
  write the retired steps back after it.

One aggregated object rather than one object per step: a per-step entry
would need one GET per step to learn its contents, which is the cost being
removed. Within a job one process writes it (the committer's uploader, one
step at a time). A read-modify-write can still lose a concurrent writer's
change (two jobs on one prefix, ``shardckpt gc`` beside an uploader); both
kinds of loss heal: a lost addition is a directory without an entry, a lost
removal an entry without a directory.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping

from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.format import layout
from shardckpt.format import lineage as lineage_mod
from shardckpt.stores import Deadline, Store, join

log = logging.getLogger("shardckpt")

INDEX_NAME = "_index.json"
INDEX_FORMAT = "shardckpt-index/1"


def read(store: Store, deadline: Deadline) -> dict[int, lineage_mod.StepInfo] | None:
    """The index's entries; ``None`` when it is missing or unreadable (a survey rebuilds it)."""
    data = store.get_bytes(INDEX_NAME, deadline)
    if data is None:
        return None
    try:
        body = json.loads(data.decode("utf-8"))
        if not isinstance(body, dict) or body.get("format") != INDEX_FORMAT:
            raise ValueError(f"not a {INDEX_FORMAT} object")
        return {int(s): lineage_mod.StepInfo.from_json(int(s), e) for s, e in body["steps"].items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("shardckpt: the step index %s is unreadable (%s); rebuilding it from the manifests",
                    store.where(INDEX_NAME), exc)
        return None


def _entries(infos: Mapping[int, lineage_mod.StepInfo]) -> dict[str, Any]:
    return {str(s): infos[s].to_json() for s in sorted(infos)}


def write(store: Store, infos: Mapping[int, lineage_mod.StepInfo], deadline: Deadline) -> None:
    body = {"format": INDEX_FORMAT, "updated": time.time(), "steps": _entries(infos)}
    store.put_bytes(INDEX_NAME, json.dumps(body, sort_keys=True).encode(), deadline)


def record(store: Store, manifest: layout.Manifest, deadline: Deadline) -> None:
    """Add (or replace) the entry of a step just committed, by its committer, with the repairs
    a survey finds. Never raises: the index is repairable."""
    try:
        survey(store, deadline, {manifest.step: manifest}, write_back=True)
    except RemoteError as exc:
        log.warning("shardckpt: step %d is committed, but the step index %s was not updated (%s); "
                    "the next survey of the remote repairs it", manifest.step, store.where(INDEX_NAME), exc)


def forget(store: Store, steps: list[int], deadline: Deadline) -> None:
    """Remove the entries of steps about to be deleted (before they are: a stale entry must not outlive them)."""
    infos = read(store, deadline)
    if infos is None or not any(s in infos for s in steps):
        return
    write(store, {s: i for s, i in infos.items() if s not in steps}, deadline)


def step_dirs(store: Store, deadline: Deadline) -> list[int]:
    """The step directories on the remote (one listing), oldest first; committed or not."""
    steps = []
    for name in store.list_dirs("", deadline):
        step = layout.parse_step_dirname(name)
        if step is not None:
            steps.append(step)
    return sorted(steps)


def unlisted_commits(store: Store, steps: list[int], deadline: Deadline) -> set[int]:
    """Of the indexed ``steps`` the listing did not show, those whose manifest exists (a HEAD each).

    An S3-compatible store may list a prefix only some time after a PUT into
    it (the listing lags; GET and HEAD do not): a step committed a moment ago
    is then in the index but not in the listing. The manifest is what proves
    a commit, so the index entry is dropped only when a HEAD says it is gone
    (a step deleted without leaving the index first, which retention never
    does). Usually ``steps`` is empty and nothing is sent.
    """
    if not steps:
        return set()
    found = store.run_all(
        [lambda s=s: (s, store.exists(join(layout.step_dirname(s), layout.MANIFEST_NAME), deadline)) for s in steps],
        files=True,
    )
    shown = {s for s, there in found if there}
    if shown:
        log.info("shardckpt: step(s) %s of %s are committed (their manifest exists) but not listed yet; "
                 "the store's listing lags behind its writes", sorted(shown), store.where(""))
    return shown


def survey(
    store: Store, deadline: Deadline, known: Mapping[int, layout.Manifest] | None = None, *, write_back: bool = False,
    manifests_read: dict[int, layout.Manifest] | None = None,
) -> tuple[dict[int, lineage_mod.StepInfo], dict[int, str]]:
    """The committed steps' infos and the committed steps whose manifest cannot be read (with the reason).

    ``known``: manifests the caller has just read or written (not read again).
    See the module's docstring for what is read. ``write_back`` (the
    committer's commit and retention, ``shardckpt gc``): the index is
    written when it was missing or anything was repaired; any other caller
    leaves it as it is. ``manifests_read``: receives the manifests this survey read
    (a restore then fetches the step it chose without reading its manifest again).
    """
    dirs = set(step_dirs(store, deadline))
    cached = read(store, deadline)
    stored = dict(cached or {})
    dirs |= unlisted_commits(store, sorted(s for s in stored if s not in dirs), deadline)
    infos = {s: i for s, i in stored.items() if s in dirs}
    verified: set[int] = set()
    for step, manifest in (known or {}).items():
        # The caller has just written or read it: a listing that has not caught up does not drop it.
        dirs.add(step)
        infos[step] = lineage_mod.info_of(manifest)
        verified.add(step)
    unreadable: dict[int, str] = {}

    def look(step: int) -> tuple[int, Any]:
        try:
            return step, remote_manifest(store, step, deadline)
        except CorruptCheckpointError as exc:
            return step, exc

    def settle(steps: list[int]) -> None:
        for step, got in store.run_all([lambda s=s: look(s) for s in steps], files=True) if steps else []:
            verified.add(step)
            if isinstance(got, CorruptCheckpointError):
                unreadable[step] = str(got)
                infos.pop(step, None)
            elif got is None:
                infos.pop(step, None)  # no manifest: not committed (in progress, withdrawn or deleted)
            else:
                infos[step] = lineage_mod.info_of(got)
                if manifests_read is not None:
                    manifests_read[step] = got

    settle(sorted(s for s in dirs if s not in infos and s not in verified))
    while True:
        top = lineage_mod.head(infos)
        live, _abandoned = lineage_mod.classify(infos)
        check = sorted({s for s in ([top.step] if top else []) + live[-1:] if s not in verified})
        if not check:
            break
        settle(check)
    if write_back and (cached is None or json.dumps(_entries(infos)) != json.dumps(_entries(stored))):
        try:
            write(store, infos, deadline)
        except RemoteError as exc:
            log.warning("shardckpt: could not write the repaired step index %s: %s", store.where(INDEX_NAME), exc)
    return dict(sorted(infos.items())), unreadable


def step_key(step: int, name: str = "") -> str:
    return join(layout.step_dirname(step), name)


def remote_manifest(store: Store, step: int, deadline: Deadline) -> layout.Manifest | None:
    key = step_key(step, layout.MANIFEST_NAME)
    data = store.get_bytes(key, deadline)
    if data is None:
        return None
    manifest = layout.Manifest.from_json(data, store.where(key))  # decoded and validated at the boundary
    if manifest.step != step:
        raise CorruptCheckpointError(
            f"remote manifest {store.where(key)} describes step {manifest.step}, not {step}; the step cannot be trusted"
        )
    return manifest
