"""A step's upload mark counts only for the content it was written for.

The uploader marks a step uploaded after its commit; when the step is saved
again between that commit and the mark (a rollback, a restart saving the same
number), the mark lands in the new save's directory. It names the digest of
the files committed, so the new save is still pending and goes up at the next
pass: the remote ends holding the new save, not the earlier one.
"""

from __future__ import annotations

import torch

import shardckpt
from shardckpt import _failpoints, stores
from shardckpt import steps as steps_mod
from shardckpt.format import layout
from shardckpt.remote import commit as remote_commit


def _save(local_dir, step: int, value: float) -> None:
    model = torch.nn.Linear(48, 48)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=()) as ckpt:
        ckpt.save({"model": model}, step).wait()


def test_a_step_saved_again_between_its_commit_and_its_mark_is_uploaded_again(tmp_path):
    local_dir, url = tmp_path / "local", f"file://{tmp_path / 'remote'}"
    _save(local_dir, 1, 1.0)
    first = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
    store = stores.open_store(url, shardckpt.CheckpointConfig(local_dir=str(local_dir)).transfer_options())
    _failpoints.arm("upload.identity_confirmed", lambda: _save(local_dir, 1, 2.0))
    try:
        assert remote_commit.push_step(store, str(local_dir), 1, node="n0", policy=None).state == \
            remote_commit.COMMITTED
    finally:
        _failpoints._SPEC.pop("upload.identity_confirmed", None)
    second = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
    assert layout.files_digest(second) != layout.files_digest(first)
    deadline = stores.Deadline(30)
    assert layout.files_digest(remote_commit.remote_manifest(store, 1, deadline)) == layout.files_digest(first)

    # The new save carries the earlier save's mark, and is pending all the same.
    assert remote_commit.pending_steps(str(local_dir), url) == [1]
    assert remote_commit.push_step(store, str(local_dir), 1, node="n0", policy=None).state == remote_commit.COMMITTED
    committed = remote_commit.remote_manifest(store, 1, deadline)
    assert layout.files_digest(committed) == layout.files_digest(second)
    assert remote_commit.pending_steps(str(local_dir), url) == []
    fresh = torch.nn.Linear(48, 48)
    steps_mod.fetch_step(store, str(tmp_path / "fetched"), 1)  # every file checked against the manifest
    store.close()
    with shardckpt.Checkpointer(local_dir=str(tmp_path / "fetched"), preemption_signals=()) as ckpt:
        assert ckpt.load({"model": fresh}) == 1
    assert all(p.unique().tolist() == [2.0] for p in fresh.parameters())  # the new save's values
