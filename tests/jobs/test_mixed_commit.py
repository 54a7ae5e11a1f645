"""A remote commit never names objects of another save: asserted on what the bucket holds, not on a message.

Two directory copies of a 2-rank save of step 5 (one per rank, as two nodes
hold them); node A holds rank 0's files and commits. Node B alone saves step 5
again (its own disk only, so A's local copy is still the save A uploaded and
no "saved again here" check can stand in) and B's uploads of that save land
over the step's keys right after A found every node's marker of A's save:
only the check that every object is this save's own stands between A and a
commit of its manifest over B's bytes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import PROGRAMS, ROOT, child_env, run_torchrun
from s3server import BUCKET, reset_if_used

from shardckpt import _failpoints, stores
from shardckpt import steps as steps_mod
from shardckpt.errors import RemoteError
from shardckpt.format import layout
from shardckpt.remote import commit as remote_commit
from shardckpt.remote import listing as remote_listing

PROG = PROGRAMS / "multinode.py"


@pytest.fixture(autouse=True)
def fresh_bucket(request):
    reset_if_used(request)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_objects_of_another_save_landing_before_the_commit_are_never_committed(s3, tmp_path):
    base, out, base2, out2 = tmp_path / "nvme", tmp_path / "out", tmp_path / "nvme2", tmp_path / "out2"
    out.mkdir()
    out2.mkdir()
    run_torchrun(2, PROG, "save", base, out, "--layout", "rank", "--steps", "5")
    shutil.copytree(base, base2)
    # B's node saves step 5 again on its own disk (the copy; A's disk keeps the first save).
    run_torchrun(2, PROG, "resave", base2, out2, "--layout", "rank", "--steps", "5", "--seed", "1")
    node_a, node_b, node_b2 = base / "rank0", base / "rank1", base2 / "rank1"
    first = layout.read_manifest(str(node_a / layout.step_dirname(5)))
    second = layout.read_manifest(str(base2 / "rank0" / layout.step_dirname(5)))
    assert layout.version_of(first) != layout.version_of(second)
    b_first = {n for n, e in first.files.items() if e.rank == 1}
    assert b_first and all(first.files[n].checksum != second.files[n].checksum for n in b_first)

    url = f"s3://{BUCKET}/mixed-b"
    store = stores.open_store(url)
    deadline = stores.Deadline(30)
    assert remote_commit.push_step(store, str(node_b), 5, node="b", policy=None).state == remote_commit.WAITING
    seen_committed: list[str | None] = []

    def b_uploads_its_new_save() -> None:
        assert remote_commit.push_step(store, str(node_b2), 5, node="b", policy=None).state == remote_commit.WAITING

    def a_manifest_written() -> None:  # what a reader of the bucket would find committed at that moment
        manifest = remote_commit.remote_manifest(store, 5, deadline)
        seen_committed.append(None if manifest is None else layout.version_of(manifest))

    _failpoints.arm("upload.markers_checked", b_uploads_its_new_save)
    _failpoints.arm("upload.manifest_written", a_manifest_written)
    try:
        result = remote_commit.push_step(store, str(node_a), 5, node="a", policy=None)
    finally:
        for name in ("upload.markers_checked", "upload.manifest_written"):
            _failpoints._SPEC.pop(name, None)

    # What the bucket holds: B's objects are the second save's; no manifest, no step record of step 5, at
    # the end nor at any moment of A's pass (A never wrote its manifest over them).
    assert seen_committed == [], seen_committed
    assert remote_commit.remote_manifest(store, 5, deadline) is None
    assert remote_listing.committed_record(store, 5, deadline) is None
    assert remote_listing.remote_steps(store, deadline) == []
    for name in b_first:
        data = store.get_bytes(remote_commit.step_key(5, name), deadline)
        assert layout.checksum_bytes(data, like=second.files[name].checksum) == second.files[name].checksum, name
    assert result.state == remote_commit.WAITING, result
    with pytest.raises(RemoteError, match="not committed"):
        steps_mod.fetch_step(store, str(tmp_path / "nothing"), 5)

    # Once A's node holds the second save too, it commits, every object its own, and restores bitwise.
    assert remote_commit.push_step(store, str(base2 / "rank0"), 5, node="a", policy=None).state == \
        remote_commit.COMMITTED
    assert layout.version_of(remote_commit.remote_manifest(store, 5, deadline)) == layout.version_of(second)
    fetched = tmp_path / "fetched"
    steps_mod.fetch_step(store, str(fetched), 5)  # every file checked against the manifest
    store.close()
    subprocess.run([sys.executable, str(PROGRAMS / "single_restore.py"), str(fetched), str(out2 / "restored.pt")],
                   env=child_env(), check=True, cwd=str(ROOT), timeout=120)
    saved, restored = torch.load(out2 / "saved.pt"), torch.load(out2 / "restored.pt")
    assert restored["step"] == 5 and saved["tensors"].keys() == restored["tensors"].keys()
    for key, value in saved["tensors"].items():
        assert torch.equal(value, restored["tensors"][key]), key
    assert os.listdir(fetched) == [layout.step_dirname(5)]
