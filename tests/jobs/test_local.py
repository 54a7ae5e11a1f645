"""Single-process behaviour of the local tier: policies, commit, retention, bad input."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import PROGRAMS, mount_tmpfs, run_torchrun

import shardckpt
from shardckpt.format import layout, manifest_schema


def make_state(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    return {"model": model, "optimizer": optim, "scheduler": sched}


def train(state, steps=1):
    for _ in range(steps):
        loss = state["model"](torch.randn(5, 6)).pow(2).mean()
        state["optimizer"].zero_grad()
        loss.backward()
        state["optimizer"].step()
        state["scheduler"].step()


def ckpt_for(path, **kw):
    kw.setdefault("preemption_signals", ())
    return shardckpt.Checkpointer(local_dir=str(path), **kw)


def params(state):
    return [p.detach().clone() for p in state["model"].parameters()]


def test_interval_policy_and_force(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path, every_steps=5, keep_last=None) as ckpt:
        handles = {}
        for step in range(1, 13):
            train(state)
            handles[step] = ckpt.save(state, step)
        forced = ckpt.save(state, 13, force=True)
        assert forced is not None
        assert forced.wait(timeout=60).endswith("step_0000000013")
        assert forced.done()
    assert [s for s, h in handles.items() if h is not None] == [5, 10]
    assert ckpt.steps() == [5, 10, 13]


def test_retention_keeps_last_and_every(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path, keep_last=2, keep_every=4) as ckpt:
        for step in range(1, 11):
            ckpt.save(state, step)
    assert ckpt.steps() == [4, 8, 9, 10]
    assert sorted(os.listdir(tmp_path)) == [layout.step_dirname(s) for s in (4, 8, 9, 10)]


def test_values_restore_into_empty_dict_and_staging_buffers_are_reused(tmp_path):
    state = make_state()
    state["extra"] = {"epoch": 3, "name": "run-a", "best": torch.tensor([1.5, 2.5])}
    state["tokens_seen"] = 12345
    with ckpt_for(tmp_path) as ckpt:
        for step in range(1, 5):
            train(state)
            ckpt.save(state, step)
        # The optimizer state exists from step 1 on: one allocation of host buffers.
        assert ckpt._stager.allocations == 1
    # The live dict has the objects but none of the plain values: they come back.
    fresh = make_state(1)
    assert ckpt_for(tmp_path).load(fresh) == 4
    assert fresh["extra"]["epoch"] == 3 and fresh["extra"]["name"] == "run-a"
    assert torch.equal(fresh["extra"]["best"], torch.tensor([1.5, 2.5]))
    assert fresh["tokens_seen"] == 12345
    # An empty dict gets the plain values; the modules it cannot hold are reported
    # (strict) or skipped (strict=False).
    with pytest.raises(shardckpt.StateMismatchError, match="model"):
        ckpt_for(tmp_path).load({})
    empty: dict = {}
    assert ckpt_for(tmp_path).load(empty, strict=False) == 4
    assert empty["tokens_seen"] == 12345 and empty["extra"]["name"] == "run-a"
    assert "model" not in empty


def test_a_save_of_a_sharded_state_holds_one_copy_of_it(tmp_path):
    # DTensor shards of 4 MiB (as FSDP2 holds them): staging once deep-copied every DTensor, data
    # included, to make its buffer, and those transient copies stayed in the C heap: the RSS grew
    # ~2.5x the staged bytes.
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(1, PROGRAMS / "stage_memory.py", str(tmp_path / "ckpt"), str(out), timeout=120)
    result = json.loads((out / "result.0.json").read_text())
    assert result["staged"] == 16 << 22
    assert result["hwm_growth"] <= 1.1 * result["staged"], result


def test_torch_save_outside_a_save_keeps_its_crc32(tmp_path):
    import zipfile

    state = make_state()
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)  # the step's files are written without torch.save's per-record CRC-32
    assert torch.serialization.get_crc32_options() is True
    torch.save(torch.arange(1000.0), tmp_path / "mine.pt")
    with zipfile.ZipFile(tmp_path / "mine.pt") as archive:
        assert any(info.CRC for info in archive.infolist())
        assert archive.testzip() is None


def test_committed_step_is_a_stock_dcp_checkpoint(tmp_path):
    state = make_state()
    train(state, 2)
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 2)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].state_dict().items()}}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / layout.step_dirname(2))), no_dist=True)
    for key, value in state["model"].state_dict().items():
        assert torch.equal(target["model"][key], value)


def test_nothing_to_resume_returns_none(tmp_path):
    assert ckpt_for(tmp_path / "empty").load(make_state()) is None


def test_checksum_mismatch_names_file_and_fallback_loads_previous(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path, keep_last=None) as ckpt:
        train(state)
        ckpt.save(state, 1)
        ckpt.wait()
        at_step1 = params(state)
        train(state)
        ckpt.save(state, 2)
    shard = tmp_path / layout.step_dirname(2) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))

    with pytest.raises(shardckpt.CorruptCheckpointError) as err:
        ckpt_for(tmp_path).load(make_state(1))
    assert str(shard) in str(err.value) and "step 2" in str(err.value) and "Remedy" in str(err.value)

    restored = make_state(1)
    assert ckpt_for(tmp_path, on_corrupt="fallback").load(restored) == 1
    assert all(torch.equal(a, b) for a, b in zip(at_step1, params(restored)))


def test_truncated_file_is_detected(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)
    shard = tmp_path / layout.step_dirname(1) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(shardckpt.CorruptCheckpointError, match="truncated"):
        ckpt_for(tmp_path).load(make_state(1))


def test_manifest_with_sha256_entries_still_verifies(tmp_path):
    # Manifests written before checksums named their algorithm hold a bare
    # "sha256" per file; they load, and corruption is still caught.
    import hashlib

    state = make_state()
    with ckpt_for(tmp_path) as ckpt:
        train(state)
        ckpt.save(state, 1)
    saved = params(state)
    step_dir = tmp_path / layout.step_dirname(1)
    path = step_dir / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    del body["digest"]  # nor did they carry a digest of their own content
    for name, entry in body["files"].items():
        del entry["checksum"]
        entry["sha256"] = hashlib.sha256((step_dir / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(body))
    assert layout.read_manifest(str(step_dir)).files["__0_0.distcp"].checksum.startswith("sha256:")

    restored = make_state(1)
    assert ckpt_for(tmp_path).load(restored) == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, params(restored)))

    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(shardckpt.CorruptCheckpointError, match="sha256 checksum"):
        ckpt_for(tmp_path).load(make_state(1))

    body["files"]["__0_0.distcp"] = {"size": 1, "checksum": "crc7:00", "rank": 0}
    path.write_text(json.dumps(body))
    with pytest.raises(shardckpt.CorruptCheckpointError, match="unknown kind"):
        ckpt_for(tmp_path).load(make_state(1))


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    state = make_state()
    train(state)
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)
    torch.manual_seed(3)
    other = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3), nn.ReLU(), nn.Linear(3, 1))
    optim = torch.optim.AdamW(other.parameters())
    live = {"model": other, "optimizer": optim}
    with pytest.raises(shardckpt.StateMismatchError) as err:
        ckpt_for(tmp_path).load(live)
    message = str(err.value)
    assert "model.4.weight" in message and "model.4.bias" in message
    assert "scheduler" in message  # saved, but the live state has no scheduler
    assert str(tmp_path / layout.step_dirname(1)) in message and "strict=False" in message
    assert "model.4.weight" in err.value.missing

    # strict=False loads what matches and keeps the rest as initialised.
    new_layer = other[4].weight.detach().clone()
    assert ckpt_for(tmp_path).load(live, strict=False) == 1
    assert torch.equal(other[0].weight, state["model"][0].weight)
    assert torch.equal(other[4].weight, new_layer)


def test_stock_dcp_directory_is_not_a_step(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)
    stock = tmp_path / layout.step_dirname(5)
    dcp.save({"model": state["model"].state_dict()}, storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True)
    ckpt = ckpt_for(tmp_path)
    assert ckpt.steps() == [1]
    assert ckpt.load(make_state(1)) == 1
    with pytest.raises(shardckpt.CheckpointNotFoundError) as err:
        ckpt.load(make_state(1), step=5)
    assert "no shardckpt manifest" in str(err.value) and "torch.distributed.checkpoint.load" in str(err.value)


def test_crashed_save_leftovers_are_invisible_and_cleaned(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)
    # What a save killed before its commit leaves: a partial directory with shards.
    partial = tmp_path / layout.partial_dirname(2, "1-deadbeef")
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half written")
    assert ckpt_for(tmp_path).steps() == [1]
    with ckpt_for(tmp_path) as again:
        again.save(state, 2)
    assert not partial.exists()
    assert again.steps() == [1, 2]


def test_background_error_reraises_on_next_call_and_keeps_previous(tmp_path):
    state = make_state()
    ckpt = ckpt_for(tmp_path)
    ckpt.save(state, 1).wait()
    state["bad"] = {"fn": lambda: 0}  # staged fine, but the writer cannot serialise it
    ckpt.save(state, 2)
    with pytest.raises(shardckpt.SaveError, match="step 2"):
        ckpt.wait()
    del state["bad"]
    assert ckpt.steps() == [1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".partial")]
    ckpt.save(state, 3).wait()
    assert ckpt.steps() == [1, 3]
    ckpt.close()


def test_disk_full_on_small_filesystem(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    mount_tmpfs(mount, "size=2m", "disk full on a small filesystem")
    try:
        state = make_state()
        with ckpt_for(mount) as ckpt:
            ckpt.save(state, 1)
        big = dict(state, blob=torch.zeros(1 << 20))  # 4 MiB > 2 MiB filesystem
        ckpt = ckpt_for(mount)
        with pytest.raises(shardckpt.InsufficientSpaceError) as err:
            ckpt.save(big, 2)
        assert "step 2" in str(err.value) and str(mount) in str(err.value) and "Remedy" in str(err.value)
        skip = ckpt_for(mount, on_disk_full="skip")
        assert skip.save(big, 2) is None
        assert skip.steps() == [1]
        # Training continues: the next save that fits works.
        skip.save(state, 3).wait()
        assert skip.steps() == [1, 3]
        skip.close()
        ckpt.close()
        assert ckpt_for(mount).load(make_state(1)) == 3
    finally:
        os.system(f"umount {mount}")


def test_preemption_signal_saves_synchronously_and_chains(tmp_path):
    seen = []

    def user_handler(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR1, user_handler)
    try:
        state = make_state()
        ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path), every_steps=100, preemption_signals=(signal.SIGUSR1,))
        assert ckpt.save(state, 1) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ckpt.preemption_requested and not ckpt.preempted
        handle = ckpt.save(state, 2)
        assert handle is not None and handle.done()
        assert ckpt.preempted and ckpt.steps() == [2]
        assert seen == [signal.SIGUSR1]  # the previous handler still ran
        ckpt.close()
        assert signal.getsignal(signal.SIGUSR1) is user_handler  # close() put the user's handler back
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_module_level_api_reads_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDCKPT_LOCAL_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("SHARDCKPT_KEEP_LAST", "1")
    monkeypatch.setenv("SHARDCKPT_PREEMPTION_SIGNALS", "")
    state = make_state()
    shardckpt.close()
    try:
        for step in (1, 2):
            train(state)
            shardckpt.save(state, step)
        shardckpt.close()
        restored = make_state(5)
        assert shardckpt.load(restored) == 2
        assert all(torch.equal(a, b) for a, b in zip(params(state), params(restored)))
        assert shardckpt.status()["committed_local"] == [2]
    finally:
        shardckpt.close()


def test_config_errors_name_the_field():
    with pytest.raises(shardckpt.ConfigError, match="keep_last"):
        shardckpt.CheckpointConfig(keep_last=0)
    with pytest.raises(shardckpt.ConfigError, match="mode"):
        shardckpt.CheckpointConfig(mode="sometimes")
    with pytest.raises(shardckpt.ConfigError, match="SHARDCKPT_EVERY_STEPS"):
        shardckpt.CheckpointConfig.from_env({"SHARDCKPT_EVERY_STEPS": "often"})
    with pytest.raises(shardckpt.ConfigError, match="SHARDCKPT_PREEMPTION_SIGNALS"):
        shardckpt.CheckpointConfig.from_env({"SHARDCKPT_PREEMPTION_SIGNALS": "SIGTERM,SIGBOGUS"})
    assert shardckpt.CheckpointConfig.from_env({"SHARDCKPT_PREEMPTION_SIGNALS": "term,10"}).preemption_signals == (
        signal.SIGTERM, 10)


def test_manifest_with_escaping_path_is_refused(tmp_path):
    state = make_state()
    with ckpt_for(tmp_path) as ckpt:
        ckpt.save(state, 1)
    path = tmp_path / layout.step_dirname(1) / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    body["files"]["../../etc/passwd"] = {"size": 1, "checksum": "xxh3-128:" + "0" * 32, "rank": 0}
    path.write_text(manifest_schema.seal(body))  # crafted: its digest recomputed
    with pytest.raises(shardckpt.CorruptCheckpointError, match="outside its step directory"):
        ckpt_for(tmp_path).load(make_state(1))


def test_saves_faster_than_writes_wait_and_drop_nothing(tmp_path, caplog):
    state = make_state()
    state["blob"] = torch.zeros(2 << 20)  # 8 MiB per step: each write takes a while
    with ckpt_for(tmp_path, keep_last=None) as ckpt:
        handles = []
        for step in range(1, 9):
            state["blob"].fill_(step)
            with caplog.at_level("INFO", logger="shardckpt"):
                handles.append(ckpt.save(state, step))
        paths = [h.wait(timeout=120) for h in handles]
    assert ckpt.steps() == list(range(1, 9))
    assert paths == [str(tmp_path / layout.step_dirname(s)) for s in range(1, 9)]
    assert any("waits for step" in r.getMessage() for r in caplog.records)
    # Every step holds its own data: the reused staging buffers were not overwritten mid-write.
    for step in (1, 5, 8):
        live = {"model": make_state(3)["model"], "blob": torch.empty(2 << 20)}
        ckpt_for(tmp_path).load(live, step=step, strict=False)
        assert torch.all(live["blob"] == step)


def test_adopt_a_stock_dcp_checkpoint(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from shardckpt import cli

    state = make_state()
    train(state, 2)
    stock = tmp_path / "stock"
    dcp.save(
        {"model": get_model_state_dict(state["model"]),
         "optimizer": get_optimizer_state_dict(state["model"], state["optimizer"]),
         "extra": {"epoch": 7}},
        storage_writer=dcp.FileSystemWriter(str(stock)), no_dist=True,
    )
    before = sorted(os.listdir(stock))
    assert cli.main(["adopt", str(stock), "--into", str(tmp_path / "ck"), "--step", "40"]) == 0
    assert sorted(os.listdir(stock)) == before  # the source is untouched
    assert cli.main(["verify", str(tmp_path / "ck"), "--step", "40"]) == 0

    live = make_state(9)
    live.pop("scheduler")
    assert ckpt_for(tmp_path / "ck").load(live) == 40
    assert all(torch.equal(a, b) for a, b in zip(params(state), params(live)))
    assert live["extra"] == {"epoch": 7}
    # Adopting onto a committed step is refused.
    assert cli.main(["adopt", str(stock), "--into", str(tmp_path / "ck"), "--step", "40"]) == 2
