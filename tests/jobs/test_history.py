"""A run's history across rollbacks and re-saves, on both tiers.

Rollback: the steps after the step rolled back to are kept but never resumed
by default, nor counted by retention. Re-saving a step number while the
uploader sends the earlier save of it never commits a remote step that mixes
the two. A ``file://`` remote never shows a half-written object.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import PROGRAMS, ROOT, child_env, run_torchrun  # noqa: E402
from s3server import BUCKET, reset_if_used, stop_uploaders  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import _failpoints, cli, stores  # noqa: E402
from shardckpt.format import layout, manifest_schema
from shardckpt.remote import commit as remote_commit  # noqa: E402
from shardckpt.remote import listing as remote_listing


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=30.0)


def remote_steps(url: str) -> list[int]:
    store = stores.open_store(url)
    try:
        return remote_listing.remote_steps(store, stores.Deadline(60))
    finally:
        store.close()


def test_rollback_resumes_the_new_branch_and_keeps_the_old_until_gc(s3, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    url = f"s3://{BUCKET}/rollback"
    run_torchrun(2, PROGRAMS / "rollback.py", ckpt, url, out, env=child_env(**s3.env()), timeout=300)
    for rank in (0, 1):
        got = json.loads((out / f"result.{rank}.json").read_text())
        assert got["rolled"] == 100 and got["at_rollback"] == 100, got
        assert got["resumed"] == 130, got  # not 300: that branch was abandoned
        assert got["from_remote"] == 130, got
        # each load replaced a scrambled state with step 130's, locally and from the bucket alone
        for where in ("resumed_state", "remote_state"):
            assert got[where] == {"extra": {"at": 130}, "model_equal": True}, (where, got)
    # keep_last=3 kept the new branch whole; the abandoned steps stay until gc, on both tiers
    assert layout.committed_steps(str(ckpt)) == [110, 120, 130, 200, 300]
    assert remote_steps(url) == [110, 120, 130, 200, 300]
    for tier in (str(ckpt), url):
        assert cli.main(["ls", tier]) == 0
        listing = capsys.readouterr().out
        for step in (200, 300):
            assert any(line.split()[0] == str(step) and "abandoned: rolled back to step 100" in line
                       for line in listing.splitlines()), (tier, listing)
        assert "abandoned" not in next(line for line in listing.splitlines() if line.split()[0] == "130")
        assert cli.main(["gc", tier, "--keep-last", "3"]) == 0
        assert "deleting step 300 (abandoned" in capsys.readouterr().out
    assert layout.committed_steps(str(ckpt)) == [110, 120, 130]
    assert remote_steps(url) == [110, 120, 130]


def save_step(local_dir: Path, step: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Linear(48, 48)
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=()) as ckpt:
        ckpt.save({"model": model}, step).wait()


def check_remote_step_consistent(s3, prefix: str, step: int) -> layout.Manifest:
    client = s3.client()
    base = f"{prefix}/{layout.step_dirname(step)}"
    body = client.get_object(Bucket=BUCKET, Key=f"{base}/{layout.MANIFEST_NAME}")["Body"].read().decode()
    manifest = layout.Manifest.from_json(body, base)
    for name, entry in manifest.files.items():
        data = client.get_object(Bucket=BUCKET, Key=f"{base}/{name}")["Body"].read()
        assert layout.checksum_bytes(data, like=entry.checksum) == entry.checksum, name
    return manifest


def test_step_saved_again_while_it_uploads_is_never_mixed(s3, tmp_path):
    local_dir = tmp_path / "local"
    url = f"s3://{BUCKET}/resave"
    save_step(local_dir, 1, seed=1)
    first = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
    # Right after this node's files went up, the same step number is saved again (other content).
    _failpoints.arm("upload.files_sent", lambda: save_step(local_dir, 1, seed=2))
    store = stores.open_store(url)
    try:
        result = remote_commit.push_step(store, str(local_dir), 1, node="n0", policy=None)
        second = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
        assert remote_commit.files_digest(second) != remote_commit.files_digest(first)
        # The pass that uploaded the first save sees, right before committing it, that the step
        # was saved again: nothing is committed under the first save's manifest.
        assert result.state == remote_commit.WAITING and result.detail == remote_commit.SAVED_AGAIN, result
        assert layout.MANIFEST_NAME not in {k.rsplit("/", 1)[-1] for k in s3.keys("resave/")}
        # The new local step is not taken for uploaded.
        assert not remote_commit.is_uploaded(str(local_dir / layout.step_dirname(1)), url)
        assert remote_commit.pending_steps(str(local_dir), url) == [1]
        result = remote_commit.push_step(store, str(local_dir), 1, node="n0", policy=None)
    finally:
        store.close()
    assert result.state == remote_commit.COMMITTED
    committed = check_remote_step_consistent(s3, "resave", 1)
    assert remote_commit.files_digest(committed) == remote_commit.files_digest(second)
    assert remote_commit.is_uploaded(str(local_dir / layout.step_dirname(1)), url)


def test_file_remote_killed_while_writing_shows_no_object(tmp_path):
    local_dir, mount = tmp_path / "local", tmp_path / "nfs"
    save_step(local_dir, 1, seed=1)
    manifest = layout.read_manifest(str(local_dir / layout.step_dirname(1)))
    # Objects written by a push: every file, the node marker, then the manifest last (compression off:
    # no measuring of the link, whose probe would be a write of its own).
    manifest_write = len(manifest.files) + 2
    proc = subprocess.run(
        [sys.executable, "-m", "shardckpt.cli", "push", "--local", str(local_dir), "--remote", f"file://{mount}",
         "--no-verify", "--compression", "off"],
        env=child_env(SHARDCKPT_FAILPOINTS=f"remote.file_written@{manifest_write}"), cwd=str(ROOT), timeout=120,
    )
    assert proc.returncode == -9  # SIGKILLed while the manifest was half written
    step_dir = mount / layout.step_dirname(1)
    assert not (step_dir / layout.MANIFEST_NAME).exists()  # not under its name, so not committed
    assert [p.name for p in step_dir.iterdir() if ".tmp-" in p.name]  # the partial object is elsewhere
    assert remote_steps(f"file://{mount}") == []
    # A later push commits it; the leftover does not disturb it.
    assert cli.main(["push", "--local", str(local_dir), "--remote", f"file://{mount}"]) == 0
    assert remote_steps(f"file://{mount}") == [1]
    layout.verify_files(str(step_dir), layout.read_manifest(str(step_dir)))


# ------------------------------------------------------------ one process: two rollbacks, a lineage that cannot be


def _net(value: float) -> torch.nn.Linear:
    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(value)
    return net


def _saves(local_dir: Path, steps, *, load: int | None = None) -> int | None:
    """One instance: load ``load`` (when given), then save each step with the model's values set to it."""
    net = _net(-1.0)
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=()) as ckpt:
        loaded = ckpt.load({"model": net}, step=load) if load is not None else None
        for step in steps:
            with torch.no_grad():
                for p in net.parameters():
                    p.fill_(float(step))
            ckpt.save({"model": net}, step).wait()
    return loaded


def _resumed(local_dir: Path, **kw) -> tuple[int | None, float]:
    net = _net(-1.0)
    with shardckpt.Checkpointer(local_dir=str(local_dir), preemption_signals=(), **kw) as ckpt:
        step = ckpt.load({"model": net})
    return step, float(net.weight[0, 0])


def test_after_two_rollbacks_the_branch_of_the_last_one_is_resumed(tmp_path):
    """Save 10, 20, 30; roll back to 10 and save 25, 26; roll back to 20 and save 21: the run resumes 21, and
    the branch the second rollback left (25, 26) is abandoned although its numbers are higher."""
    _saves(tmp_path, [10, 20, 30])
    assert _saves(tmp_path, [25, 26], load=10) == 10
    assert _saves(tmp_path, [21], load=20) == 20
    assert _resumed(tmp_path) == (21, 21.0)
    with shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()) as ckpt:
        assert ckpt.peek().step == 21
    assert cli.main(["gc", str(tmp_path), "--keep-last", "10"]) == 0
    assert layout.committed_steps(str(tmp_path)) == [10, 20, 21]  # 25, 26 and 30 were abandoned


def _relineage(local_dir: Path, step: int, lineage: dict) -> None:
    """Another lineage in a step's manifest, sealed again: a manifest as a bug (or a hand) could write it."""
    path = local_dir / layout.step_dirname(step) / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    body["lineage"] = lineage
    path.write_text(manifest_schema.seal(body))


def test_a_sealed_manifest_whose_lineage_does_not_fit_is_an_error_never_a_fresh_start(tmp_path, caplog):
    # The only step, on a branch its history never started: once load() returned None (logged at INFO).
    only = tmp_path / "only"
    _saves(only, [5])
    _relineage(only, 5, {"branch": "x", "forks": []})
    with pytest.raises(shardckpt.CorruptCheckpointError, match=r"step 5: manifest .*step_0000000005.* lineage"):
        _resumed(only)
    with pytest.raises(shardckpt.CorruptCheckpointError, match="step 5"):
        shardckpt.Checkpointer(local_dir=str(only), preemption_signals=()).peek()
    with pytest.raises(shardckpt.CorruptCheckpointError, match="step 5"):  # nothing to fall back to
        _resumed(only, on_corrupt="fallback")
    # A step below the step its branch started from, and two steps recording another history of one branch.
    runs = tmp_path / "runs"
    _saves(runs, [10, 20, 30])
    _relineage(runs, 10, {"branch": "b", "forks": [[5, "b"]]})
    _relineage(runs, 20, {"branch": "b", "forks": [[5, "b"]]})
    _relineage(runs, 30, {"branch": "b", "forks": [[8, "b"]]})
    with pytest.raises(shardckpt.CorruptCheckpointError) as err:
        _resumed(runs)
    assert "step 30" in str(err.value) and "started at step 8" in str(err.value) and "step 10" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert _resumed(runs, on_corrupt="fallback") == (20, 20.0)
    assert "step 30" in caplog.text and "falling back" in caplog.text
    _relineage(runs, 20, {"branch": "b", "forks": [[25, "b"]]})
    with pytest.raises(shardckpt.CorruptCheckpointError, match=r"step 20: manifest .* below step 25"):
        shardckpt.Checkpointer(local_dir=str(runs), preemption_signals=()).load({"model": _net(0.0)}, step=20)
