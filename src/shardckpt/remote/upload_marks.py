"""This node's marks on its local step directories: which steps were uploaded to which remote.

A step directory holds ``.shardckpt-uploaded.json`` once the uploader committed
that very save (same file table) on the remote; retention of the local tier
and ``shardckpt status`` read it.
"""

from __future__ import annotations

import json
import os
import time

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.stores import safe_url

UPLOADED_NAME = ".shardckpt-uploaded.json"
files_digest = layout.files_digest


def present_files(step_dir: str, manifest: layout.Manifest) -> list[str]:
    """Manifest files present in ``step_dir`` with their recorded size."""
    missing = set(layout.missing_files(step_dir, manifest))
    return sorted(n for n in manifest.files if n not in missing)


def mark_uploaded(step_dir: str, url: str, manifest: layout.Manifest, superseded_by: int | None = None) -> None:
    body = {"remote": safe_url(url), "files_digest": files_digest(manifest), "time": time.time()}
    if superseded_by is not None:
        body["superseded_by"] = superseded_by
    try:
        layout.atomic_write_text(os.path.join(step_dir, UPLOADED_NAME), json.dumps(body))
    except FileNotFoundError:
        pass  # the step was deleted meanwhile


def is_uploaded(step_dir: str, url: str) -> bool:
    """True when the local step carries a mark that *its content* is committed on ``url``.

    The mark names the digest of the files that were committed: a step saved
    again under the same number (a rollback, a restart) has other files, so
    an old mark does not count for it.
    """
    try:
        with open(os.path.join(step_dir, UPLOADED_NAME), encoding="utf-8") as f:
            body = json.load(f)
        manifest = layout.read_manifest(step_dir)
    except (OSError, ValueError):
        return False
    if manifest is None or body.get("remote") != safe_url(url):
        return False
    return body.get("files_digest") == files_digest(manifest)


def for_upload(step_dir: str) -> bool:
    """False for a step its manifest keeps local (``remote_every`` skipped it)."""
    try:
        manifest = layout.read_manifest(step_dir)
    except CorruptCheckpointError:
        return True  # let the upload report it
    return manifest is None or manifest.upload


def pending_steps(root: str, url: str) -> list[int]:
    """Committed local steps that are to be uploaded and are not committed on ``url`` yet."""
    out = []
    for step in layout.committed_steps(root):
        step_dir = os.path.join(root, layout.step_dirname(step))
        if not is_uploaded(step_dir, url) and for_upload(step_dir):
            out.append(step)
    return out


def local_bytes(root: str, step: int) -> int:
    step_dir = os.path.join(root, layout.step_dirname(step))
    try:
        manifest = layout.read_manifest(step_dir)
    except CorruptCheckpointError:
        return 0
    if manifest is None:
        return 0
    return sum(manifest.files[n].size for n in present_files(step_dir, manifest))
