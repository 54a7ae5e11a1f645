"""Committed steps as directories on the local tier: commit, withdraw, delete, clean up.

Everything here works on files and directory names only (no torch), so the
command line can list, verify and clean checkpoints without importing it.

A step exists once ``step_<N>/shardckpt.json`` does: it is written last
(tmp + fsync + rename) into ``.partial-step_<N>-<nonce>``, which is then
renamed into place. A step being deleted first loses its manifest (renamed
to ``shardckpt.json.deleted``), so an interrupted deletion is invisible and
recognisably ours to clean up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid

from shardckpt import _failpoints
from shardckpt.format import layout

log = logging.getLogger("shardckpt")

PROBE_PREFIX = ".shardckpt-probe-"
"""Files a job writes once to learn which ranks share the directory (see topology.py)."""


def own_files(directory: str, rank: int) -> list[str]:
    prefix = f"__{rank}_"
    names = [n for n in os.listdir(directory) if n.startswith(prefix) and not n.endswith(".tmp")]
    if rank == 0 and os.path.exists(os.path.join(directory, ".metadata")):
        names.append(".metadata")
    return sorted(names)


@dataclasses.dataclass
class Commit:
    """A step renamed into place whose outcome the other ranks have not confirmed yet."""

    root: str
    final: str
    displaced: str | None = None
    """An earlier copy of the same step number, set aside until the outcome is known."""


def commit_step(root: str, partial: str, manifest: layout.Manifest) -> Commit:
    """Write the manifest last and make the step visible.

    An earlier copy of the same step number (the step saved again, e.g. after a
    rollback) is first renamed out of the way, which hides it at once; it is
    kept aside by :func:`finish_commit`, or put back by :func:`undo_commit` when
    another rank failed to commit its part.
    """
    final = os.path.join(root, layout.step_dirname(manifest.step))
    layout.atomic_write_text(os.path.join(partial, layout.MANIFEST_NAME), manifest.to_json())
    _failpoints.hit("commit.manifest_written")
    displaced = None
    if os.path.exists(final):
        displaced = os.path.join(root, f"{layout.REPLACED_PREFIX}{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
        os.replace(final, displaced)
    try:
        os.replace(partial, final)
    except BaseException:
        if displaced is not None:
            os.replace(displaced, final)
        raise
    layout.fsync_dir(root)
    return Commit(root, final, displaced)


def finish_commit(commit: Commit) -> str | None:
    """Every rank committed: the earlier copy of the step (if any) is kept aside, never deleted.

    It is another version of the step number (another save): it moves to
    ``.kept-step_<N>-<its save id>``, which no listing reads as a step, until
    ``shardckpt gc`` removes it. Returns where it went.
    """
    if commit.displaced is None:
        return None
    name = os.path.basename(commit.final)
    try:
        kept_name = layout.kept_name(name, layout.read_manifest(commit.displaced))
    except Exception:  # noqa: BLE001 - an unreadable earlier copy is still kept
        kept_name = layout.kept_name(name, None)
    if kept_name.endswith("-"):
        kept_name += uuid.uuid4().hex[:8]
    kept = os.path.join(commit.root, kept_name)
    if os.path.exists(kept):
        kept += "-" + uuid.uuid4().hex[:8]
    os.replace(commit.displaced, kept)
    layout.fsync_dir(commit.root)
    return kept


def kept_versions(root: str) -> list[tuple[int, str]]:
    """Earlier saves set aside by later saves of the same step number: ``(step, path)``, by step."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith(layout.KEPT_PREFIX):
            step = layout.parse_step_dirname(name[len(layout.KEPT_PREFIX):].split("-", 1)[0])
            if step is not None:
                out.append((step, os.path.join(root, name)))
    return sorted(out)


def keep_aside(root: str, step: int) -> str | None:
    """Move the committed copy of ``step`` out of the way (a stale version of it); returns where."""
    final = os.path.join(root, layout.step_dirname(step))
    if not os.path.isdir(final):
        return None
    displaced = os.path.join(root, f"{layout.REPLACED_PREFIX}{os.path.basename(final)}-{uuid.uuid4().hex[:8]}")
    os.replace(final, displaced)
    return finish_commit(Commit(root, final, displaced))


def undo_commit(commit: Commit) -> None:
    """Another rank failed to commit: hide and remove this copy, put any earlier one back."""
    _hide_step(commit.final)
    trash = os.path.join(commit.root, f"{layout.TRASH_PREFIX}{os.path.basename(commit.final)}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(commit.final, trash)
    except FileNotFoundError:
        trash = ""
    if commit.displaced is not None:
        os.replace(commit.displaced, commit.final)
    layout.fsync_dir(commit.root)
    if trash:
        shutil.rmtree(trash, ignore_errors=True)


def _hide_step(step_dir: str) -> None:
    """Un-commit a step: its manifest is renamed aside (which also marks the directory as ours to delete)."""
    try:
        os.replace(os.path.join(step_dir, layout.MANIFEST_NAME), os.path.join(step_dir, layout.HIDDEN_MANIFEST_NAME))
    except FileNotFoundError:
        pass


def delete_step(root: str, step: int) -> None:
    """Delete a step so that an interruption leaves it invisible, never half-listed."""
    step_dir = os.path.join(root, layout.step_dirname(step))
    _hide_step(step_dir)
    layout.fsync_dir(step_dir)
    _failpoints.hit("retention.hidden")
    trash = os.path.join(root, f"{layout.TRASH_PREFIX}{layout.step_dirname(step)}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(step_dir, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def clean_leftovers(root: str, keep_nonce: str | None) -> list[str]:
    """Remove partial and trash directories of crashed saves (not ``keep_nonce``'s).

    A copy of a step set aside by a save of the same step number that never
    committed (the process died between the two renames) is put back.
    """
    removed = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(layout.REPLACED_PREFIX):
            step_name = name[len(layout.REPLACED_PREFIX) :].rsplit("-", 1)[0]
            final = os.path.join(root, step_name)
            if (
                layout.parse_step_dirname(step_name) is not None
                and not os.path.exists(os.path.join(final, layout.MANIFEST_NAME))
                and os.path.exists(os.path.join(path, layout.MANIFEST_NAME))
            ):
                if os.path.isdir(final):
                    shutil.rmtree(final, ignore_errors=True)
                os.replace(path, final)
                layout.fsync_dir(root)
                log.warning("shardckpt: put back %s: the save that replaced it never committed", final)
                continue
            if os.path.exists(os.path.join(path, layout.MANIFEST_NAME)):
                # A committed earlier save whose replacement committed too: kept aside, as always.
                kept = finish_commit(Commit(root, final, path))
                log.info("shardckpt: kept aside %s (an earlier save of %s) as %s", name, step_name, kept)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
        elif name.startswith(layout.TRASH_PREFIX) or name.startswith(PROBE_PREFIX) or (
            name.startswith(layout.PARTIAL_PREFIX) and not (keep_nonce and name.endswith("-" + keep_nonce))
        ):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            removed.append(name)
        elif layout.parse_step_dirname(name) is not None and not os.path.exists(
            os.path.join(path, layout.MANIFEST_NAME)
        ) and _looks_ours(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


def _looks_ours(step_dir: str) -> bool:
    # A step directory without manifest is only ours to delete when it is a
    # leftover of our own protocol: an interrupted deletion leaves its manifest
    # renamed aside. A directory with .metadata and no trace of ours may be a
    # stock DCP checkpoint someone put there: never deleted.
    return os.path.exists(os.path.join(step_dir, layout.HIDDEN_MANIFEST_NAME)) or not os.path.exists(
        os.path.join(step_dir, ".metadata")
    )
