"""Replicas of other nodes' step files held in a node's ``local_dir`` (the peer tier's layout on disk).

A replica on its holder::

    <local_dir>/.shardckpt-replicas/<owner>/step_<N>/   the owner's files + its manifest
    <local_dir>/.shardckpt-replicas/<owner>/.partial-step_<N>-<version>/   while it arrives

It is written into the partial directory, every file checked against the
owner's manifest while it arrives (size and checksum), and committed by
renaming the manifest into place last, then the directory. Two saves of one
step number are told apart by the manifest's version
(:func:`shardckpt.format.layout.version_of`), never by the number.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from typing import Any

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout

REPLICAS_DIR = ".shardckpt-replicas"


def replicas_root(root: str) -> str:
    return os.path.join(root, REPLICAS_DIR)


def owner_dirname(node: str) -> str:
    """A node's name as a directory name (``host:1`` -> ``host_1``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", node)
    return "_" + name if name.startswith(".") or not name else name


def version_tag(manifest: layout.Manifest) -> str:
    """The manifest's version as a path component."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", layout.version_of(manifest))[:100]


def replica_dir(root: str, owner: str, step: int) -> str:
    return os.path.join(replicas_root(root), owner_dirname(owner), layout.step_dirname(step))


def committed_replicas(root: str) -> dict[str, dict[int, layout.Manifest]]:
    """``{owner dir: {step: manifest}}`` of the committed replicas held here (unreadable ones skipped)."""
    out: dict[str, dict[int, layout.Manifest]] = {}
    base = replicas_root(root)
    try:
        owners = sorted(os.listdir(base))
    except FileNotFoundError:
        return out
    for owner in owners:
        if owner.startswith("."):
            continue
        for step in layout.committed_steps(os.path.join(base, owner)):
            try:
                manifest = layout.read_manifest(os.path.join(base, owner, layout.step_dirname(step)))
            except CorruptCheckpointError:
                continue
            if manifest is not None:
                out.setdefault(owner, {})[step] = manifest
    return out


def placement(nodes: list[dict[str, Any]], owner: str, count: int) -> list[dict[str, Any]]:
    """The nodes that hold ``owner``'s replicas: the next ``count`` on the ring, other failure domains first.

    When fewer than ``count`` nodes lie outside the owner's domain, nodes of its
    domain fill the rest (a replica in the same rack still survives a lost node).
    """
    names = [n["node"] for n in nodes]
    if owner not in names or count <= 0:
        return []
    i = names.index(owner)
    ring = [nodes[(i + k) % len(nodes)] for k in range(1, len(nodes))]
    domain = nodes[i].get("domain")
    apart = [n for n in ring if not domain or n.get("domain") != domain]
    near = [n for n in ring if n not in apart]
    return (apart + near)[:count]


def file_size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def manifest_or_none(step_dir: str) -> layout.Manifest | None:
    try:
        return layout.read_manifest(step_dir)
    except CorruptCheckpointError:
        return None


def remove_step(step_dir: str, parent: str) -> None:
    """Delete a replica: its manifest first (an interrupted deletion leaves no step), then the rest."""
    try:
        os.unlink(os.path.join(step_dir, layout.MANIFEST_NAME))
    except OSError:
        pass
    trash = os.path.join(parent, f"{layout.TRASH_PREFIX}{os.path.basename(step_dir)}-{uuid.uuid4().hex[:8]}")
    os.rename(step_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)


def complete_across_any_loss(reports: list[Any], members: list[str]) -> tuple[int, str] | None:
    """The newest step that survives the loss of any one node, from facts every node shares.

    ``reports`` are what each node's committer said at one save's commit
    exchange: ``{"node": name, "steps": {step: [version, [holders]]}}`` for the
    steps of its live branch on its disk, holders being the nodes that answered
    "committed" for its files of that version. A step qualifies when every
    member reported it, all of the same save (version), each with at least one
    holder other than itself: its own copy and one replica then never share a
    node. Every node computes the same answer from the same gathered reports,
    so retention everywhere keeps the same steps. ``(step, version)`` or ``None``.
    """
    by_node = {r["node"]: r.get("steps") or {} for r in reports if isinstance(r, dict) and r.get("node") in members}
    if not members or set(by_node) != set(members):
        return None
    common: set[int] | None = None
    for steps in by_node.values():
        numbers = {int(s) for s in steps}
        common = numbers if common is None else common & numbers
    for step in sorted(common or (), reverse=True):
        facts = [by_node[n].get(step, by_node[n].get(str(step))) for n in members]
        versions = {f[0] for f in facts}
        if len(versions) == 1 and all(any(h != n for h in f[1]) for n, f in zip(members, facts)):
            return step, versions.pop()
    return None
