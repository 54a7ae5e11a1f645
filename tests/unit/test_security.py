"""A checkpoint is untrusted input: loading it never runs code from it."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt.format import layout, manifest_schema


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
        size, digest = layout.checksum_file(str(step_dir / name))
        body["files"][name].update(size=size, checksum=digest)
    path.write_text(manifest_schema.seal(body))


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
        size, digest = layout.checksum_file(str(step_dir / name))
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


def _load_error(tmp_path, live=None, **kw):
    with pytest.raises(shardckpt.ShardckptError) as err:
        shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=(), **kw).load(
            live if live is not None else {"model": nn.Linear(4, 3)}
        )
    return err


def test_missing_metadata_is_named(tmp_path):
    step_dir = _save(tmp_path)
    (step_dir / ".metadata").unlink()
    err = _load_error(tmp_path)
    assert isinstance(err.value, shardckpt.CorruptCheckpointError)
    assert str(step_dir / ".metadata") in str(err.value) and "step 1" in str(err.value)


def test_manifest_naming_an_absent_file(tmp_path):
    step_dir = _save(tmp_path)
    path = step_dir / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    body["files"]["__7_0.distcp"] = {"size": 10, "checksum": "xxh3-128:" + "0" * 32, "rank": 7}
    path.write_text(manifest_schema.seal(body))  # consistent, as a writer's bug would leave it
    err = _load_error(tmp_path)
    assert isinstance(err.value, shardckpt.CorruptCheckpointError)
    assert str(step_dir / "__7_0.distcp") in str(err.value) and "missing" in str(err.value)


def test_step_from_another_run_is_refused(tmp_path):
    torch.manual_seed(0)
    with shardckpt.Checkpointer(local_dir=str(tmp_path), run_id="run-a", preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(4, 3)}, 1)
    err = _load_error(tmp_path, run_id="run-b")
    assert isinstance(err.value, shardckpt.ForeignCheckpointError)
    assert "run-a" in str(err.value) and "step 1" in str(err.value) and "Remedy" in str(err.value)
    # The same run, or no run id, loads it.
    live = {"model": nn.Linear(4, 3)}
    assert shardckpt.Checkpointer(local_dir=str(tmp_path), run_id="run-a", preemption_signals=()).load(live) == 1


def test_checkpoint_of_another_model_names_the_shapes(tmp_path):
    _save(tmp_path)
    err = _load_error(tmp_path, live={"model": nn.Linear(4, 5)})
    assert isinstance(err.value, shardckpt.StateMismatchError)
    assert "model.weight saved (3, 4), live (5, 4)" in str(err.value)
    assert "another model" in str(err.value)
