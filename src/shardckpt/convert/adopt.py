"""Adopt a stock DCP checkpoint directory as a committed step of a local directory (a copy)."""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid

import torch

from shardckpt.dcp.planner import read_metadata
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout, step_dirs
from shardckpt.format import lineage as lineage_mod


def adopt(source: str, root: str, step: int, *, trust_pickles: bool = False) -> str:
    """Make a stock DCP checkpoint directory a committed step of ``root`` (a copy).

    The metadata is read with the restricted unpickler unless ``trust_pickles``;
    files are copied into a partial directory, hashed, and committed with a
    manifest last, like any save. The source is left untouched.
    """
    if not os.path.isfile(os.path.join(source, ".metadata")):
        raise CorruptCheckpointError(
            f"{source} has no .metadata: it is not a DCP checkpoint directory. Remedy: point at the "
            f"directory that torch.distributed.checkpoint.save wrote."
        )
    metadata = read_metadata(source, step, trust_pickles=trust_pickles)
    if os.path.exists(os.path.join(root, layout.step_dirname(step), layout.MANIFEST_NAME)):
        raise CorruptCheckpointError(
            f"step {step} is already committed in {root}. Remedy: adopt under another step number."
        )
    os.makedirs(root, exist_ok=True)
    partial = os.path.join(root, layout.partial_dirname(step, "adopt-" + uuid.uuid4().hex[:8]))
    os.makedirs(partial)
    files: dict[str, layout.FileEntry] = {}
    try:
        for name in sorted(os.listdir(source)):
            path = os.path.join(source, name)
            if not os.path.isfile(path) or name == layout.MANIFEST_NAME:
                continue
            shutil.copyfile(path, os.path.join(partial, name))
            size, digest, chunks = layout.file_sums(os.path.join(partial, name))
            match = re.match(r"__(\d+)_", name)
            files[name] = layout.FileEntry(size, digest, int(match.group(1)) if match else 0, chunks)
        ranks = {e.rank for n, e in files.items() if n.startswith("__")}
        keys = {}
        for fqn in metadata.state_dict_metadata:
            path = (metadata.planner_data or {}).get(fqn, (fqn,))
            keys[str(path[0])] = "stock"
        # The adopted step joins the live history of ``root`` (the head's lineage, stamped after
        # every step there): it must never revive a branch that a rollback abandoned.
        infos = lineage_mod.local_infos(root)
        head = lineage_mod.head(infos)
        manifest = layout.Manifest(
            step=step,
            world_size=(max(ranks) + 1) if ranks else 1,
            files=files,
            torch_version=str(torch.__version__),
            keys=keys,
            metadata={"adopted_from": os.path.abspath(source)},
            total_bytes=sum(e.size for e in files.values()),
            created=max(time.time(), head.created + 1e-3) if head is not None else time.time(),
            lineage=head.lineage.to_json() if head is not None else {},
            save_id="adopt-" + uuid.uuid4().hex[:12],
        )
        commit = step_dirs.commit_step(root, partial, manifest)
        step_dirs.finish_commit(commit)
        return commit.final
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
