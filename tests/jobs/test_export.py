"""shardckpt export: one committed step -> one file of full tensors (safetensors or torch).

On real checkpoints written by Checkpointer: a 2-rank FSDP2 job under torchrun,
single-process saves, a file:// remote and moto's S3 server over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import PROGRAMS, run_torchrun  # noqa: E402
from programs.common import TinyNet  # noqa: E402  (benchmarks/ has a module named common too)
from s3server import BUCKET  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import cli, stores
from shardckpt.convert import export, export_plan
from shardckpt.dcp import planner as local
from shardckpt.errors import (  # noqa: E402
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ExportError,
    ExportIOError,
    ShardckptError,
)
from shardckpt.format import layout
from shardckpt.node import uploader  # noqa: E402


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def save_steps(local_dir: Path, states: dict[int, dict]) -> None:
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=()) as ckpt:
        for step, state in states.items():
            ckpt.save(state, step).wait()


def model_files(step_dir: Path, step: int, key: str) -> set[str]:
    """The files holding any item of ``key``, from the step's metadata."""
    metadata = local.read_metadata(str(step_dir), step)
    return {info.relative_path for idx, info in metadata.storage_data.items() if idx.fqn.startswith(key + ".")}


def flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x20
    path.write_bytes(bytes(data))


def transfer() -> stores.TransferOptions:
    return stores.TransferOptions(concurrency=4, request_timeout_s=5.0, max_attempts=3, backoff_base_s=0.02,
                                  backoff_max_s=0.2, step_deadline_s=60)


# ------------------------------------------------------------ FSDP2, 2 ranks


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    ckpt, full = base / "ckpt", base / "full.pt"
    run_torchrun(2, PROGRAMS / "export_job.py", str(ckpt), str(full), timeout=240)
    return ckpt, torch.load(full, weights_only=True)


def test_fsdp2_checkpoint_exports_full_tensors_bitwise_in_both_formats(fsdp_run, tmp_path):
    ckpt, full = fsdp_run
    step = full["step"]
    manifest = layout.read_manifest(str(ckpt / layout.step_dirname(step)))
    assert manifest.world_size == 2
    metadata = local.read_metadata(str(ckpt / layout.step_dirname(step)), step)
    assert len(metadata.state_dict_metadata["model.fc1.weight"].chunks) == 2, "the weights were not sharded"
    names = list(TinyNet().state_dict().keys())

    st = export.export_step(str(ckpt), str(tmp_path / "m.safetensors"), optimizer=True)
    pt = export.export_step(str(ckpt), str(tmp_path / "m.pt"), fmt="torch", optimizer=True)
    got_st = load_file(str(tmp_path / "m.safetensors"))
    got_pt = torch.load(str(tmp_path / "m.pt"), weights_only=True)
    assert st.step == pt.step == step and st.module_key == "model" and st.optimizer_key == "optimizer"

    assert sorted(k for k in got_st if not k.startswith("optimizer.")) == sorted(names)
    assert [k for k in got_pt if not k.startswith("optimizer")] == names  # the module's own order
    for name in names:
        assert same_bits(got_st[name], full["model"][name]), name
        assert same_bits(got_pt[name], full["model"][name]), name

    expected_opt = {f"optimizer.{k}" for k in full["optimizer"]}
    assert set(st.optimizer_keys) == set(pt.optimizer_keys) == expected_opt
    assert st.tensors == len(names) + len(expected_opt) == len(got_st)
    for name in ("optimizer.state.fc1.weight.exp_avg", "optimizer.state.fc3.bias.exp_avg_sq",
                 "optimizer.state.fc2.weight.step"):
        assert same_bits(got_st[name], full["optimizer"][name[len("optimizer."):]]), name
        assert same_bits(got_pt[name], got_st[name]), name

    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        header = f.metadata()
    groups = json.loads(header["optimizer"])["param_groups"]
    saved = full["param_groups"][0]
    assert groups[0]["lr"] == saved["lr"] and groups[0]["betas"] == list(saved["betas"])
    assert groups[0]["params"] == names
    assert header["shardckpt.step"] == str(step) and header["shardckpt.module_key"] == "model"
    assert got_pt["optimizer"]["param_groups"][0]["betas"] == saved["betas"]

    # Model only: loads strictly into the plain, unwrapped module.
    only = export.export_step(str(ckpt), str(tmp_path / "model.safetensors"), step=1)
    assert only.step == 1 and only.optimizer_keys == [] and only.tensors == len(names)
    TinyNet(width=10).load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)


# ------------------------------------------------------------ dtypes and the streaming writer


class Mixed(nn.Module):
    """Parameters and buffers of every dtype the safetensors writer maps."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3).to(torch.bfloat16)
        self.register_buffer("f16", torch.randn(5).half())
        self.register_buffer("f64", torch.randn(2, 2, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(7, dtype=torch.int64))  # 0-dim
        self.register_buffer("ids", torch.arange(6, dtype=torch.int32).reshape(2, 3))
        self.register_buffer("shorts", torch.tensor([-300, 7], dtype=torch.int16))
        self.register_buffer("small", torch.tensor([-3, 4], dtype=torch.int8))
        self.register_buffer("raw", torch.tensor([250, 1, 0], dtype=torch.uint8))
        self.register_buffer("mask", torch.tensor([True, False, True]))


def test_every_dtype_round_trips_bitwise_and_keeps_its_safetensors_name(tmp_path):
    torch.manual_seed(1)
    net = Mixed()
    save_steps(tmp_path / "ckpt", {5: {"net": net}})
    expected = net.state_dict()
    export.export_step(str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"), batch_bytes=8)
    export.export_step(str(tmp_path / "ckpt"), str(tmp_path / "m.pt"), fmt="torch")
    for got in (load_file(str(tmp_path / "m.safetensors")), torch.load(str(tmp_path / "m.pt"), weights_only=True)):
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert same_bits(got[name], value), name
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        kinds = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert kinds == {"lin.weight": "BF16", "lin.bias": "BF16", "f16": "F16", "f64": "F64", "count": "I64",
                     "ids": "I32", "shorts": "I16", "small": "I8", "raw": "U8", "mask": "BOOL"}


def test_safetensors_are_read_and_written_one_bounded_batch_at_a_time(tmp_path, monkeypatch):
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 32))
    save_steps(tmp_path / "ckpt", {1: {"model": net}})
    reads: list[int] = []
    real_read = export_plan.read_items

    def spy(step_dir, metadata, items, trust):
        reads.append(sum(i.nbytes for i in items))
        return real_read(step_dir, metadata, items, trust)

    monkeypatch.setattr(export_plan, "read_items", spy)
    limit = 20 * 1024  # one 64x64 fp32 weight is 16 KiB
    result = export.export_step(str(tmp_path / "ckpt"), str(tmp_path / "m.safetensors"), batch_bytes=limit)
    assert len(reads) >= 3 and max(reads) <= limit, reads
    assert sum(reads) == sum(v.numel() * v.element_size() for v in net.state_dict().values())
    got = load_file(result.path)
    assert all(same_bits(got[k], v) for k, v in net.state_dict().items())


# ------------------------------------------------------------ remote sources: only the files needed


def big_step(local_dir: Path, steps=(1, 2)) -> dict[int, dict]:
    """Steps holding a small model and, under another key, a 2 MiB tensor (in a shard file of its own)."""
    net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    saved = {}
    for step in steps:
        with torch.no_grad():
            net[0].weight.add_(float(step))
        saved[step] = {k: v.clone() for k, v in net.state_dict().items()}
        save_steps(local_dir, {step: {"model": net, "big": torch.randn(512, 1024)}})
    return saved


def test_export_from_a_file_remote_fetches_only_the_files_holding_the_module(tmp_path, monkeypatch):
    check_export_from_remote(f"file://{tmp_path}/remote", tmp_path, monkeypatch)


def test_export_from_s3_fetches_only_the_files_holding_the_module(s3, tmp_path, monkeypatch):
    s3.reset()
    check_export_from_remote(f"s3://{BUCKET}/export", tmp_path, monkeypatch)


def check_export_from_remote(remote_url, tmp_path, monkeypatch):
    local_dir = tmp_path / "local"
    saved = big_step(local_dir)
    assert uploader.Uploader(str(local_dir), stores.open_store(remote_url, transfer()), node="n0", once=True,
                             poll_s=0.05).run() == 0
    step_dir = local_dir / layout.step_dirname(2)
    manifest = layout.read_manifest(str(step_dir))
    needed = model_files(step_dir, 2, "model")
    others = set(manifest.files) - needed - {layout.METADATA_NAME}
    assert others, f"the 2 MiB tensor shares a file with the model: {sorted(manifest.files)}"

    fetched: list[str] = []
    for cls in (stores.S3Store, stores.FsspecStore):
        def spy(self, key, path, *args, _real=cls.get_file, **kw):
            fetched.append(key.rsplit("/", 1)[-1])
            return _real(self, key, path, *args, **kw)

        monkeypatch.setattr(cls, "get_file", spy)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    moved: list[int] = []
    result = export.export_step(remote_url, str(out_dir / "m.safetensors"), transfer=transfer(), progress=moved.append)

    assert result.step == 2  # the newest live step
    assert sorted(fetched) == sorted(needed | {layout.METADATA_NAME})
    assert not others & set(fetched)
    assert result.fetched_files == len(fetched) and result.step_files == len(manifest.files)
    assert result.fetched_bytes == sum(manifest.files[n].size for n in fetched)
    assert result.fetched_bytes < result.step_bytes / 10, (result.fetched_bytes, result.step_bytes)
    assert sum(moved) >= result.fetched_bytes
    assert sorted(os.listdir(out_dir)) == ["m.safetensors"]  # the temporary files are gone
    got = load_file(str(out_dir / "m.safetensors"))
    assert set(got) == set(saved[2]) and all(same_bits(got[k], v) for k, v in saved[2].items())

    older = export.export_step(remote_url, str(out_dir / "m1.pt"), step=1, fmt="torch", transfer=transfer())
    got = torch.load(older.path, weights_only=True)
    assert older.step == 1 and all(same_bits(got[k], v) for k, v in saved[1].items())
    with pytest.raises(CheckpointNotFoundError, match=r"step 7 is not committed .*committed: \[1, 2\]"):
        export.export_step(remote_url, str(out_dir / "x.pt"), step=7, transfer=transfer())


def test_a_corrupt_remote_object_fails_the_export_naming_it(tmp_path):
    local_dir, url = tmp_path / "local", f"file://{tmp_path}/remote"
    big_step(local_dir, steps=(1,))
    assert uploader.Uploader(str(local_dir), stores.open_store(url, transfer()), node="n0", once=True,
                             poll_s=0.05).run() == 0
    name = sorted(model_files(local_dir / layout.step_dirname(1), 1, "model"))[0]
    flip(tmp_path / "remote" / layout.step_dirname(1) / name)
    with pytest.raises(CorruptCheckpointError, match=re.escape(name)) as info:
        export.export_step(url, str(tmp_path / "m.safetensors"), transfer=transfer())
    assert "Remedy" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["local", "remote"]  # no output, no temporary directory left


# ------------------------------------------------------------ verification and errors


def test_a_corrupt_local_shard_fails_the_export_naming_it(tmp_path):
    local_dir = tmp_path / "ckpt"
    big_step(local_dir, steps=(1,))
    step_dir = local_dir / layout.step_dirname(1)
    needed = model_files(step_dir, 1, "model")
    other = sorted(set(layout.read_manifest(str(step_dir)).files) - needed - {layout.METADATA_NAME})[0]
    flip(step_dir / other)  # holds only the other key: not read, so not in the way
    export.export_step(str(local_dir), str(tmp_path / "ok.safetensors"))

    shard = sorted(needed)[0]
    flip(step_dir / shard)
    out = tmp_path / "m.safetensors"
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(step_dir / shard))) as info:
        export.export_step(str(local_dir), str(out))
    assert "step 1" in str(info.value) and "--step" in str(info.value)
    assert not out.exists()


def test_errors_name_the_step_the_path_and_the_remedy(tmp_path, monkeypatch):
    local_dir = tmp_path / "ckpt"
    a, b = nn.Linear(3, 2), nn.Linear(2, 5, bias=False)
    save_steps(local_dir, {1: {"w": torch.ones(3)},
                           2: {"a": a, "b": b, "opt": torch.optim.SGD(a.parameters(), lr=0.1)}})
    out = str(tmp_path / "m.safetensors")
    src = str(local_dir)
    cases = [
        (dict(step=1), ExportError, r"step 1 in .*ckpt holds no module \(saved keys: w \(value\)\).*Remedy"),
        (dict(step=2), ExportError, r"step 2 in .*ckpt holds several modules \(a, b\).*--key"),
        (dict(step=2, key="opt"), ExportError, r"--key 'opt' is a saved optimizer, not a module.*Remedy"),
        (dict(step=2, key="b", optimizer=True), ExportError, r"no optimizer state for module 'b'"),
        (dict(step=3), CheckpointNotFoundError, r"step 3 is not committed in .*ckpt; committed: \[1, 2\].*Remedy"),
        (dict(fmt="onnx"), ConfigError, r"unknown export format 'onnx'.*safetensors, torch"),
    ]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match=message):
            export.export_step(src, out, **kwargs)
    with pytest.raises(ConfigError, match=r"directory .*nowhere does not exist.*Remedy"):
        export.export_step(src, str(tmp_path / "nowhere" / "m.pt"), step=2, key="a")
    assert all(issubclass(k, ShardckptError) for _, k, _ in cases)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    full_dir = tmp_path / "full"
    full_dir.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", disk_full)
        with pytest.raises(ExportIOError, match=r"export of step 2 of .*ckpt to .*full/m.pt failed.*No space.*Remedy"):
            export.export_step(src, str(full_dir / "m.pt"), step=2, key="a")
    assert os.listdir(full_dir) == []  # no partial output left behind

    result = export.export_step(src, out, key="b")
    assert result.step == 2 and set(load_file(out)) == {"weight"}
    result = export.export_step(str(local_dir / layout.step_dirname(2)), out, key="a", optimizer=True)
    assert result.optimizer_key == "opt" and result.optimizer_keys == []  # SGD without momentum: no tensors
    with safe_open(out, framework="pt") as f:
        assert json.loads(f.metadata()["optimizer"])["param_groups"][0]["lr"] == 0.1


def test_the_default_step_is_the_newest_live_one_not_an_abandoned_one(tmp_path):
    local_dir = tmp_path / "ckpt"
    net = nn.Linear(2, 2)
    save_steps(local_dir, {s: {"model": net} for s in (1, 2, 3)})
    with shardckpt.Checkpointer(local_dir=str(local_dir), keep_last=None, preemption_signals=()) as ckpt:
        assert ckpt.load({"model": net}, step=1) == 1
        with torch.no_grad():
            net.weight.fill_(42.0)
        ckpt.save({"model": net}, 2).wait()  # rollback: step 3 is now abandoned
    assert layout.committed_steps(str(local_dir)) == [1, 2, 3]
    result = export.export_step(str(local_dir), str(tmp_path / "m.safetensors"))
    assert result.step == 2
    assert torch.equal(load_file(result.path)["weight"], torch.full((2, 2), 42.0))


# ------------------------------------------------------------ command-line entry point


def test_export_command_prints_what_it_wrote_and_returns_0(tmp_path, capsys):
    local_dir = tmp_path / "ckpt"
    net = nn.Sequential(nn.Linear(4, 4))
    save_steps(local_dir, {3: {"model": net, "optimizer": torch.optim.AdamW(net.parameters())}})
    out = tmp_path / "m.pt"
    assert cli.main(["export", str(local_dir), str(out), "--format", "torch", "--optimizer"]) == 0
    line = capsys.readouterr().out
    assert line.count("\n") == 1
    # get_optimizer_state_dict initialised AdamW's state at the save: 3 tensors per parameter.
    assert f"exported step 3 of {local_dir} (module 'model'): 8 tensors (6 of optimizer 'optimizer')" in line, line
    assert f"torch -> {out}" in line, line
    got = torch.load(str(out), weights_only=True)
    assert {"0.weight", "0.bias", "optimizer", "optimizer.state.0.bias.exp_avg"} <= set(got) and len(got) == 9
