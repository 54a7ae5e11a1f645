"""Lossless compression of what the uploader sends to the remote (``remote_compression``).

Against real S3 servers over HTTP (moto, and rclone for the round trip): a step
uploaded compressed takes fewer bytes on the remote, restores bitwise (a
need-only restore of a fresh instance reads only the compressed chunks it
needs), is pulled as plain files that stock ``dcp.load`` reads, and a damaged
compressed chunk is fetched again, then refused. ``auto`` is decided by
measuring the link: off on the loopback link, on behind a throttling proxy.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shardckpt  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from helpers import PROGRAMS, child_env, free_port, kill_job, run_torchrun, start_torchrun  # noqa: E402
from s3server import BUCKET, reset_if_used, stop_uploaders, transfer_options  # noqa: E402
from shardckpt import cli, stores  # noqa: E402
from shardckpt.errors import CorruptCheckpointError  # noqa: E402
from shardckpt.format import codec, layout  # noqa: E402
from shardckpt.node import uploader  # noqa: E402
from shardckpt.tiers import compressed, remote_commit  # noqa: E402
from shardckpt.tiers import steps as steps_mod  # noqa: E402

MiB = 1 << 20
CHUNK = 64 << 10  # small chunks: many chunk edges in a small step


@pytest.fixture(autouse=True)
def fresh_bucket(request, tmp_path):
    reset_if_used(request)
    yield
    stop_uploaders(tmp_path, grace_s=30.0)


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype a state holds; odd sizes, an empty tensor, one that spans many chunks."""
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(300, 257, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(1001, generator=g).to(torch.float16),
        "fp32": torch.randn(40_000, generator=g) * 1e-3,
        "fp64": torch.randn(777, generator=g, dtype=torch.float64),
        "int64": torch.arange(12_345, dtype=torch.int64),
        "int8": torch.randint(-128, 127, (999,), generator=g, dtype=torch.int8),
        "bool": torch.rand(4097, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "one": torch.tensor([3.5]),
    }


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)).to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 256, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optim.step()
    return {"model": model, "optimizer": optim, "extra": _tensors()}


def _snapshot(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for pid, s in state["optimizer"].state_dict()["state"].items():
        out.update({f"optim.{pid}.{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    out.update({f"extra.{k}": v.clone() for k, v in state["extra"].items()})
    return out


def _fresh_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)).to(torch.bfloat16)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
            "extra": {k: torch.zeros_like(v) for k, v in _tensors().items()}}


def _restores_bitwise(url: str, local_dir, step: int, saved: dict[str, torch.Tensor]) -> None:
    """A fresh instance on an empty disk loads ``step`` from ``url``, bitwise equal to what was saved."""
    state = _fresh_state()
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, uploader="off", preemption_signals=())
    assert ckpt.load(state) == step
    ckpt.close()
    _same(saved, _snapshot(state))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k], 
                           b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def _save_and_push(tmp_path: Path, url: str, steps=(1, 2), compression: str = "bytegroup-zstd") -> dict[int, dict]:
    state = _state()
    src = tmp_path / "src"
    ckpt = shardckpt.Checkpointer(local_dir=str(src), keep_last=None, preemption_signals=())
    saved = {}
    for step in steps:
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(0.125)
        ckpt.save(state, step).wait()
        saved[step] = _snapshot(state)
    ckpt.close()
    up = uploader.Uploader(str(src), stores.open_store(url, transfer_options(compression=compression)), node="n0", once=True,
                           poll_s=0.05)
    assert up.run() == 0
    return saved


def _remote_manifest(url: str, step: int) -> layout.Manifest:
    store = stores.open_store(url, transfer_options())
    try:
        return remote_commit.remote_manifest(store, step, stores.Deadline(60))
    finally:
        store.close()


# ---------------------------------------------------------------- the codec


@pytest.mark.parametrize("name", sorted(_tensors()))
def test_every_dtype_round_trips_bitwise_through_the_codec(name):
    """Each dtype's bytes, alone, behind a pickle-like prefix of odd length (values off their alignment),
    and cut at odd lengths, decode to exactly the bytes encoded; floats that compress come out smaller."""
    t = _tensors()[name]
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    for data in (raw, b"\x80\x02PK" + raw[:-3], raw[: len(raw) // 2 + 1]):
        stored = codec.encode_chunk(data)
        assert codec.decode_chunk(stored, len(data)) == data
        for width in codec.WIDTHS:
            assert codec.ungroup(codec.group(data, width), width) == data
    if name in ("bf16", "fp32"):
        assert len(codec.encode_chunk(raw)) < 0.9 * len(raw)
    random_bytes = np.random.default_rng(0).bytes(100_000)
    assert len(codec.encode_chunk(random_bytes)) == codec.HEADER.size + len(random_bytes)  # stored raw


def test_a_damaged_stored_chunk_raises_codec_error():
    data = _tensors()["bf16"].view(-1).view(torch.uint8).numpy().tobytes()
    stored = bytearray(codec.encode_chunk(data))
    assert stored[2] == codec.ZSTD
    for where in (0, 3, 5, len(stored) // 2, len(stored) - 1):
        bad = bytearray(stored)
        bad[where] ^= 0x41
        try:
            out = codec.decode_chunk(bytes(bad), len(data))
        except codec.CodecError:
            continue
        assert out != data  # a flip zstd cannot see is left to the chunk checksum
    with pytest.raises(codec.CodecError):
        codec.decode_chunk(bytes(stored[:-7]), len(data))


# ---------------------------------------------------------------- the remote


def test_compressed_step_is_smaller_restores_bitwise_and_pulls_as_plain_dcp(s3, tmp_path, monkeypatch, capsys):
    """Uploaded compressed: every shard file is a .szc object, the remote holds fewer bytes than the step,
    checksums in the manifest are of the plain bytes; a fresh instance restores it bitwise (need-only,
    from a sparse copy); `pull` writes plain files that stock dcp.load reads; `ls` shows both sizes."""
    monkeypatch.setattr(layout, "CHUNK_BYTES", CHUNK)
    url = f"s3://{BUCKET}/zc"
    saved = _save_and_push(tmp_path, url)
    manifest = _remote_manifest(url, 2)
    shards = [n for n in manifest.files if n.endswith(".distcp")]
    assert shards and sorted(manifest.stored) == sorted(shards)
    keys = s3.keys(f"zc/{layout.step_dirname(2)}/")
    for name in shards:
        assert f"zc/{layout.step_dirname(2)}/{name}{compressed.SUFFIX}" in keys
        assert f"zc/{layout.step_dirname(2)}/{name}" not in keys
    logical = sum(e.size for e in manifest.files.values())
    assert compressed.stored_bytes(manifest) < 0.9 * logical
    local = layout.read_manifest(str(tmp_path / "src" / layout.step_dirname(2)))
    assert layout.files_digest(local) == layout.files_digest(manifest)  # the same step, the same identity
    assert local.stored == {}  # the local tier holds the files as written

    _restores_bitwise(url, tmp_path / "fresh", 2, saved[2])

    out = tmp_path / "pulled"
    store = stores.open_store(url, transfer_options())
    steps_mod.fetch_step(store, str(out), 1)
    store.close()
    step_dir = out / layout.step_dirname(1)
    pulled = layout.read_manifest(str(step_dir))
    assert pulled.stored == {}
    layout.verify_files(str(step_dir), pulled)
    plain = {"model": {k: torch.zeros_like(v) for k, v in _fresh_state()["model"].state_dict().items()}}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(step_dir)), no_dist=True)
    for k, v in plain["model"].items():
        assert torch.equal(v, saved[1][f"model.{k}"]), k

    # `export` from the remote writes the full tensors (the model's, bf16) to a plain safetensors file.
    from safetensors.torch import load_file

    from shardckpt import export
    export.export_step(url, str(tmp_path / "m.safetensors"), step=2, key="model", transfer=transfer_options())
    got = load_file(str(tmp_path / "m.safetensors"))
    for k, v in got.items():
        assert torch.equal(v, saved[2][f"model.{k}"]), k
    assert len(got) == len(_fresh_state()["model"].state_dict())

    capsys.readouterr()
    assert cli.main(["ls", url]) == 0 and cli.main(["inspect", url, "--step", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("stored compressed: ") == 3, out  # two steps in ls, one in inspect
    assert f"({compressed.stored_bytes(manifest) / logical:.2f}x)" in out


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_corrupt_compressed_chunk_is_fetched_again_then_refused(s3, tmp_path, monkeypatch, caplog):
    """A byte flipped inside a stored chunk: the restore fetches it once more, then refuses the step
    naming the object (nothing unverified loads); with on_corrupt='fallback' the earlier step loads."""
    monkeypatch.setattr(layout, "CHUNK_BYTES", CHUNK)
    url = f"s3://{BUCKET}/flip"
    saved = _save_and_push(tmp_path, url)
    manifest = _remote_manifest(url, 2)
    name = max(manifest.stored, key=lambda n: manifest.files[n].size)
    form = compressed.StoredForm.from_json(manifest.stored[name])
    key = f"flip/{layout.step_dirname(2)}/{name}{compressed.SUFFIX}"
    client = s3.client()
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    offsets = form.offsets()
    i = max(range(len(form.lengths)), key=lambda k: form.lengths[k])
    data[offsets[i] + form.lengths[i] // 2] ^= 0x10
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))

    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, uploader="off",
                                  preemption_signals=())
    with caplog.at_level(logging.WARNING, logger="shardckpt"), pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(_fresh_state())
    ckpt.close()
    assert f"s3://{BUCKET}/{key}" in str(info.value) and "twice" in str(info.value)
    assert "fetching them again" in caplog.text
    assert layout.committed_steps(str(tmp_path / "fresh")) == []

    # A whole-file fetch (`pull`) refuses it too, and `verify` names the object.
    store = stores.open_store(url, transfer_options())
    with pytest.raises(CorruptCheckpointError):
        steps_mod.fetch_step(store, str(tmp_path / "pulled"), 2)
    report = steps_mod.StepView(store, manifest).check()
    assert [n for n, _p in report.problems] == [name]
    # `push` checks the remote copy and uploads the damaged object again: the step restores.
    result = remote_commit.push_step(store, str(tmp_path / "src"), 2, node="n0", policy=None, verify_remote=True)
    assert name in result.detail
    store.close()

    _restores_bitwise(url, tmp_path / "fresh2", 2, saved[2])


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_uncompressed_remote_steps_and_mixed_ones_keep_loading(s3, tmp_path, monkeypatch):
    """A step uploaded with compression off (as by earlier versions) has no stored forms and loads; a
    compressed step after it loads too."""
    monkeypatch.setattr(layout, "CHUNK_BYTES", CHUNK)
    url = f"s3://{BUCKET}/mixed"
    saved = _save_and_push(tmp_path, url, steps=(1,), compression="off")
    assert _remote_manifest(url, 1).stored == {}
    _restores_bitwise(url, tmp_path / "fresh", 1, saved[1])


def _sample_file(tmp_path: Path) -> str:
    """fp32 values of a narrow range, like Adam moments: compressible, but not by much."""
    path = tmp_path / "sample.bin"
    rng = np.random.default_rng(0)
    path.write_bytes((rng.standard_normal(4 * MiB) * 1e-3).astype(np.float32).tobytes())
    return str(path)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_auto_compresses_behind_a_slow_link_and_not_on_a_fast_one(s3, tmp_path, monkeypatch, caplog):
    """``auto`` measures the upload rate and this node's compression: the loopback link to the server is
    faster than compressing could gain (off); the same server behind a proxy capped at 4 MB/s is not
    (on). The decision is logged once per remote."""
    monkeypatch.setattr(compressed, "_decided", {})
    sample = _sample_file(tmp_path)
    big = compressed.AUTO_MIN_BYTES
    url = f"s3://{BUCKET}/auto"
    fast = stores.open_store(url, transfer_options(compression="auto"))
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        assert not compressed.wanted(fast, sample, big, stores.Deadline(60))
        assert not compressed.wanted(fast, sample, big, stores.Deadline(60))
        assert not compressed.wanted(fast, sample, big - 1, stores.Deadline(60))
    assert caplog.text.count("remote_compression=auto") == 1 and "not compressing" in caplog.text
    proxy = FaultProxy(s3.endpoint)
    proxy.cap_bytes_per_s = 4e6
    try:
        slow = stores.open_store(url, transfer_options(compression="auto", endpoint_url=proxy.endpoint))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardckpt"):
            assert compressed.wanted(slow, sample, big, stores.Deadline(60))
        assert "compressing uploads" in caplog.text
        assert not compressed.wanted(slow, sample, big - 1, stores.Deadline(60))  # too small to pay
        slow.close()
    finally:
        proxy.stop()
    fast.close()
    assert not [k for k in s3.keys("") if "rate-" in k]  # the probe cleaned up after itself


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_need_only_restore_at_another_world_size_reads_only_the_compressed_chunks_it_needs(s3, tmp_path):
    """One rank saves an FSDP2 model + AdamW under torchrun; its uploader compresses (the option from
    SHARDCKPT_REMOTE_COMPRESSION). Two new nodes x 1 rank restore it (world size 1 -> 2), each through a
    byte-counting proxy: bitwise; every byte they GET of a shard file is of its compressed object; each
    node got about half of the stored shard bytes (a whole-file fetch would be all of them, per node)."""
    url = f"s3://{BUCKET}/needonly"
    knobs = {"RT_WIDTH": "4096", "RT_CHUNK": str(16 << 10)}
    prog = PROGRAMS / "remote_train.py"
    run_torchrun(1, prog, "save", tmp_path / "job1", url, tmp_path / "saved.pt", "2",
                 env=child_env(**s3.env(), **knobs, SHARDCKPT_REMOTE_COMPRESSION="bytegroup-zstd"))
    manifest = _remote_manifest(url, 2)
    shards = [n for n in manifest.files if n.endswith(".distcp")]
    assert shards and sorted(manifest.stored) == sorted(shards)
    stored = sum(int(manifest.stored[n]["size"]) for n in shards)
    assert stored < 0.95 * sum(manifest.files[n].size for n in shards)

    proxies = [FaultProxy(s3.endpoint) for _ in range(2)]
    logs = [tmp_path / f"restore{i}.log" for i in range(2)]
    port = free_port()
    procs = [
        start_torchrun(1, prog, "restore", tmp_path / "job2", url, tmp_path / "restored.pt", nnodes=2, node_rank=i,
                       port=port, log_path=logs[i],
                       env=child_env(**{**s3.env(), "AWS_ENDPOINT_URL": proxies[i].endpoint}, **knobs))
        for i in range(2)
    ]
    try:
        for proc, log_path in zip(procs, logs):
            assert proc.wait(timeout=300) == 0, Path(log_path).read_text()[-5000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_job(proc)
        for proxy in proxies:
            proxy.stop()
    saved, restored = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "restored.pt")
    assert restored["step"] == 2 and saved["tensors"].keys() == restored["tensors"].keys()
    for key, value in saved["tensors"].items():
        assert torch.equal(value, restored["tensors"][key]), key
    where = f"/{layout.step_dirname(2)}/"
    shard_gets = [(path, n) for p in proxies for path, n in p.got if where in path and ".distcp" in path]
    assert shard_gets and all(path.endswith(".distcp" + compressed.SUFFIX) for path, _n in shard_gets), shard_gets
    fetched = [sum(n for path, n in p.got if where in path and path.endswith(compressed.SUFFIX)) for p in proxies]
    for node, got in enumerate(fetched):
        assert 0.3 * stored < got < 0.75 * stored, (node, got, stored, fetched)


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_with_compression_on_files_wait_for_the_local_commit_and_go_up_compressed(s3, tmp_path, monkeypatch):
    """A trainer's uploader (``uploader="auto"``) sends shard files while the save is written, as they
    are; with the codec asked for it sends none early, and after the local commit every shard file goes
    up compressed (an early plain copy would have been skipped as sent, and stayed plain)."""
    from shardckpt import _failpoints

    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/early"
    prefix = f"early/{layout.step_dirname(1)}/"
    seen: dict[str, list[str]] = {}

    def written() -> None:  # every shard file written, the step not committed locally: time for early uploads
        time.sleep(3)
        seen["early"] = [k for k in s3.keys(prefix) if k.rsplit("/", 1)[1].startswith("__")]

    model = torch.nn.Linear(256, 256)
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, uploader="auto", mode="sync", io_threads=2,
                                  keep_last=None, preemption_signals=(), drain_timeout_s=60,
                                  remote_compression="bytegroup-zstd")
    try:
        _failpoints.arm("write.done", written)
        ckpt.save({"model": model}, 1)
    finally:
        _failpoints.arm("write.done", lambda: None, nth=10**9)
        ckpt.close()
    assert seen["early"] == []
    manifest = _remote_manifest(url, 1)
    shards = sorted(n for n in manifest.files if n.endswith(".distcp"))
    assert len(shards) == 2 and sorted(manifest.stored) == shards
    assert not [k for k in s3.keys(prefix) if k.endswith(".distcp")]
