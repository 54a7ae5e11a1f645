"""A replica held here is used only when it is of the save the survey chose, never of another save of the number.

A node with an empty disk has no manifest of its own: nothing but the version
comparison of each replica's manifest with the chosen save stands between it
and a replica of another save of the same step number (an older save, e.g.
from before a rollback or a resave). The replica of the other save is placed
where it is read first (its owner's directory sorts before the chosen save's
replica), and also where it is read last, so that neither passes by the
order in which the replicas are listed.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt import stores
from shardckpt.format import layout, replicas
from shardckpt.node import uploader


def _model(value: float) -> nn.Linear:
    model = nn.Linear(32, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _hold_replica(holder, owner: str, step_dir) -> str:
    """The replica of ``step_dir`` that ``owner``'s daemon leaves on ``holder``: its files, the manifest last."""
    manifest = layout.read_manifest(str(step_dir))
    target = replicas.replica_dir(str(holder), owner, 1)
    os.makedirs(target)
    for name in manifest.files:
        shutil.copy2(step_dir / name, os.path.join(target, name))
    shutil.copy2(step_dir / layout.MANIFEST_NAME, os.path.join(target, layout.MANIFEST_NAME))
    return target


@pytest.mark.parametrize("order", ["other save first", "other save last", "other save alone"])
def test_a_node_with_an_empty_disk_never_restores_a_replica_of_another_save(tmp_path, order):
    """Step 1 is saved twice: save X (every weight 2.0, older) on one node, save Y (1.0) on another, which
    commits Y on the remote. A replacement node with an empty disk holds a replica of X (and, but for
    "alone", one of Y): it loads Y's values, takes nothing from X's replica and leaves it as it was. ("last"
    alone would pass with the version comparison removed: Y's replica, read first, completes the copy.)"""
    remote = f"file://{tmp_path / 'remote'}"
    older, owner, holder = tmp_path / "older", tmp_path / "owner", tmp_path / "holder"
    with shardckpt.Checkpointer(local_dir=str(older), preemption_signals=()) as ckpt:
        ckpt.save({"model": _model(2.0)}, 1)  # save X of step 1
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": _model(1.0)}, 1)  # save Y of step 1: the one that counts
    store = stores.open_store(remote, shardckpt.CheckpointConfig(local_dir=str(owner)).transfer_options())
    assert uploader.Uploader(str(owner), store, node="owner:0", once=True, poll_s=0.05).run() == 0
    x_dir, y_dir = older / layout.step_dirname(1), owner / layout.step_dirname(1)
    x, y = layout.read_manifest(str(x_dir)), layout.read_manifest(str(y_dir))
    assert layout.version_of(x) != layout.version_of(y) and set(x.files) == set(y.files)

    # Owner directories are listed in name order: "a..." is read before "z...".
    x_owner = {"other save first": "a-older:0", "other save last": "z-older:0", "other save alone": "a-older:0"}[order]
    x_held = _hold_replica(holder, x_owner, x_dir)
    if order != "other save alone":
        _hold_replica(holder, "m-owner:0" if order == "other save first" else "b-owner:0", y_dir)
    x_before = {n: os.stat(os.path.join(x_held, n)).st_mtime_ns for n in os.listdir(x_held)}

    fresh = _model(0.0)
    with shardckpt.Checkpointer(local_dir=str(holder), remote=remote, uploader="off", preemption_signals=()) as ckpt:
        assert ckpt.load({"model": fresh}) == 1
        used = ckpt.last_sources
    for key, value in fresh.state_dict().items():
        assert value.unique().tolist() == [1.0], (key, value.unique().tolist())  # Y's values, not X's 2.0
    assert "replicas here" not in used if order == "other save alone" else set(used) == {"replicas here"}, used
    assert {n: os.stat(os.path.join(x_held, n)).st_mtime_ns for n in os.listdir(x_held)} == x_before
    if order != "other save alone":  # the holder's copy is Y's, whole, none of X's files linked into it
        mine = holder / layout.step_dirname(1)
        assert layout.version_of(layout.read_manifest(str(mine))) == layout.version_of(y)
        layout.verify_files(str(mine), y)
        for name in x.files:
            assert os.stat(os.path.join(x_held, name)).st_ino != os.stat(mine / name).st_ino
