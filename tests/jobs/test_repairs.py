"""The remedies our errors name must repair what they name; upload trouble must reach the trainer.

Against moto's and rclone's S3 servers over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import free_port, wait_for  # noqa: E402
from s3server import BUCKET, reset_if_used, stop_uploaders, transfer_options  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import cli, stores  # noqa: E402
from shardckpt import steps as steps_mod  # noqa: E402
from shardckpt.format import layout
from shardckpt.node import node_registry, uploader, uploader_client

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=2.0)


def saved_steps(local_dir: Path, url: str, steps, width=64, **options) -> dict[int, dict]:
    """Saves (no uploader), then one uploader pass: every step committed on both tiers."""
    model = torch.nn.Linear(width, width)
    out = {}
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=()) as ckpt:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(float(step))
            ckpt.save({"model": model}, step).wait()
            out[step] = {k: v.clone() for k, v in model.state_dict().items()}
    store = stores.open_store(url, transfer_options(**options))
    assert uploader.Uploader(str(local_dir), store, node="n0", once=True, poll_s=0.05).run() == 0
    return out


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))


def test_pull_replaces_a_local_file_that_fails_its_checksum(s3, tmp_path, capsys):
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/pull"
    saved_steps(local_dir, url, [1])
    shard = local_dir / layout.step_dirname(1) / "__0_0.distcp"
    flip(shard)
    assert cli.main(["verify", str(local_dir)]) == 1
    capsys.readouterr()
    assert cli.main(["pull", "--remote", url, "--local", str(local_dir), "--step", "1"]) == 0
    said = capsys.readouterr().out
    assert "fetched 1 missing or failing file(s): __0_0.distcp" in said, said
    assert cli.main(["verify", str(local_dir)]) == 0


def test_push_replaces_a_remote_object_that_fails_its_checksum(s3, tmp_path, capsys):
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/push"
    saved_steps(local_dir, url, [1])
    key = f"push/{layout.step_dirname(1)}/__0_0.distcp"
    client = s3.client()
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x20
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(shardckpt.CorruptCheckpointError) as err:  # what a new instance meets
        shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, uploader="off",
                               preemption_signals=()).load({"model": torch.nn.Linear(64, 64)})
    assert "shardckpt push" in str(err.value)
    assert cli.main(["push", "--local", str(local_dir), "--remote", url, "--step", "1"]) == 0
    said = capsys.readouterr().out
    assert "replaced 1 corrupt object(s): __0_0.distcp" in said, said
    fixed = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert fixed == (local_dir / layout.step_dirname(1) / "__0_0.distcp").read_bytes()


def test_push_replaces_a_compressed_remote_object_that_fails_its_checksum(s3, tmp_path, capsys):
    """The remedy the error names, for an object stored compressed: encoded again, the same bytes as before."""
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/push-compressed"
    saved = saved_steps(local_dir, url, [1], width=512, compression="bytegroup-zstd")
    key = f"push-compressed/{layout.step_dirname(1)}/__0_0.distcp.szc"
    client = s3.client()
    stored = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    data = bytearray(stored)
    data[len(data) // 2] ^= 0x20
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(shardckpt.CorruptCheckpointError) as err:
        shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, uploader="off",
                               preemption_signals=()).load({"model": torch.nn.Linear(512, 512)})
    assert "shardckpt push" in str(err.value), str(err.value)
    assert cli.main(["push", "--local", str(local_dir), "--remote", url, "--step", "1"]) == 0
    said = capsys.readouterr().out
    assert "replaced 1 corrupt object(s): __0_0.distcp" in said, said
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == stored
    model = torch.nn.Linear(512, 512)
    assert shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh2"), remote=url, uploader="off",
                                  preemption_signals=()).load({"model": model}) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved[1].items())


@pytest.mark.parametrize("on_corrupt", ["fallback", "error"])
def test_a_corrupt_local_file_is_fetched_again_before_any_fallback(s3, tmp_path, caplog, on_corrupt):
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/refetch"
    saved = saved_steps(local_dir, url, [1, 2])
    flip(local_dir / layout.step_dirname(2) / "__0_0.distcp")
    model = torch.nn.Linear(64, 64)
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, uploader="off", on_corrupt=on_corrupt,
                                  preemption_signals=())
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        assert ckpt.load({"model": model}) == 2  # the good remote copy, not step 1
    ckpt.close()
    assert "replaced 1 file(s)" in caplog.text
    for k, v in saved[2].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert cli.main(["verify", str(local_dir), "--all"]) == 0


def test_large_download_is_hashed_while_it_streams(s3, tmp_path, monkeypatch):
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/big"
    saved_steps(local_dir, url, [1], width=1700)  # an ~11 MiB shard: ranged download (5 MiB parts)
    store = stores.open_store(url, transfer_options())
    reads = []
    real = layout.checksum_file
    monkeypatch.setattr(layout, "checksum_file", lambda path, like=None: reads.append(path) or real(path, like))
    try:
        fetched = steps_mod.fetch_step(store, str(tmp_path / "fresh"), 1)
    finally:
        store.close()
    assert "__0_0.distcp" in fetched
    assert reads == []  # every byte was checked as it arrived, none read back from disk
    step_dir = tmp_path / "fresh" / layout.step_dirname(1)
    monkeypatch.undo()
    layout.verify_files(str(step_dir), layout.read_manifest(str(step_dir)))
    # A flipped byte in the middle of the big object is still caught.
    key = f"big/{layout.step_dirname(1)}/__0_0.distcp"
    data = bytearray(s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[7 * MiB] ^= 0x01
    s3.client().put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    store = stores.open_store(url, transfer_options())
    try:
        with pytest.raises(shardckpt.CorruptCheckpointError, match="corrupt"):
            steps_mod.fetch_step(store, str(tmp_path / "again"), 1)
    finally:
        store.close()


def test_unreachable_store_shows_in_the_trainers_log_and_close_says_why_it_waits(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(uploader_client, "HEALTH_EVERY_S", 0.0)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    ckpt = shardckpt.Checkpointer(
        local_dir=str(tmp_path / "local"), remote=f"s3://{BUCKET}/down", endpoint_url=dead, request_timeout_s=1.0,
        remote_max_attempts=2, backoff_max_s=0.1, step_deadline_s=5.0, drain_timeout_s=2.0, preemption_signals=(),
        on_remote_unavailable="warn",
    )
    model = torch.nn.Linear(8, 8)
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        ckpt.save({"model": model}, 1).wait()
        local_dir = str(tmp_path / "local")
        wait_for(lambda: node_registry.read_status(local_dir).get("last_error"), 120,
                 "the uploader to record its error")
        ckpt.save({"model": model}, 2).wait()
        warned = [r.getMessage() for r in caplog.records if "uploads to" in r.getMessage()]
        assert warned and "are failing" in warned[0] and dead.split("//")[1] in warned[0], caplog.text
        ckpt.close()
    waits = [r.getMessage() for r in caplog.records if "close() waits up to" in r.getMessage()]
    assert waits and "drain_timeout_s" in waits[0] and "close(timeout=" in waits[0], caplog.text
    assert ckpt.status()["drain"]["pending_steps"] == [1, 2]
