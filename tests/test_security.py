"""A checkpoint is untrusted input: loading it never runs code from it."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt import layout


class _Payload:
    """Unpickling this runs ``os.system`` (what an attacker would plant)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _save(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    state = {"model": model, "extra": {"epoch": 1}}
    with shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()) as ckpt:
        ckpt.save(state, 1)
    return tmp_path / layout.step_dirname(1)


def _rewrite_manifest(step_dir):
    """Keep the manifest consistent with the tampered files, as an attacker would."""
    path = step_dir / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    for name in body["files"]:
        size, digest = layout.sha256_file(str(step_dir / name))
        body["files"][name].update(size=size, sha256=digest)
    path.write_text(json.dumps(body))


def test_crafted_metadata_pickle_is_refused_unrun(tmp_path):
    step_dir = _save(tmp_path)
    marker = tmp_path / "pwned"
    (step_dir / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    _rewrite_manifest(step_dir)
    with pytest.raises(shardckpt.UntrustedCheckpointError) as err:
        shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()).load({"model": nn.Linear(4, 3)})
    assert "posix.system" in str(err.value) or "os.system" in str(err.value)
    assert ".metadata" in str(err.value) and "trust_pickles" in str(err.value)
    assert not marker.exists()


def test_crafted_object_item_is_refused_unrun(tmp_path):
    # An attacker with write access to the storage plants a step whose plain
    # value unpickles into a call of os.system, with a matching manifest.
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    step_dir = tmp_path / layout.step_dirname(1)
    torch.manual_seed(0)
    planted = {"model": nn.Linear(4, 3).state_dict(), "extra": {"evil": _Payload(str(marker))}}
    dcp.save(planted, storage_writer=dcp.FileSystemWriter(str(step_dir)), no_dist=True)
    files = {}
    for name in os.listdir(step_dir):
        size, digest = layout.sha256_file(str(step_dir / name))
        files[name] = layout.FileEntry(size, digest, 0)
    manifest = layout.Manifest(step=1, world_size=1, files=files, keys={"model": "module", "extra": "value"})
    (step_dir / layout.MANIFEST_NAME).write_text(manifest.to_json())
    assert not marker.exists()

    live = {"model": nn.Linear(4, 3)}
    with pytest.raises(shardckpt.UntrustedCheckpointError) as err:
        shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()).load(live)
    assert "extra.evil" in str(err.value) and "trust_pickles" in str(err.value)
    assert not marker.exists()


def test_plain_checkpoint_loads_under_the_allow_list(tmp_path):
    _save(tmp_path)
    live = {"model": nn.Linear(4, 3)}
    assert shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()).load(live) == 1
    assert live["extra"] == {"epoch": 1}
