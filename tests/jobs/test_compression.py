"""Lossless compression of what the uploader sends to the remote (``remote_compression``).

Against real S3 servers over HTTP (moto, and rclone for the round trip): a step
uploaded compressed takes fewer bytes on the remote, restores bitwise (a
need-only restore of a fresh instance reads only the compressed chunks it
needs), is pulled as plain files that stock ``dcp.load`` reads; a damaged
compressed chunk is fetched again, then refused; nothing is decoded unchecked
(bomb frames and a replaced object are refused within two chunks of memory, a
decoder that disagrees with the encoder commits nothing); older stored forms
keep loading. ``auto`` is decided before the first upload by measuring the
link (off on the loopback link, on behind a throttling proxy), kept for a
restarted job; files go up compressed while the save is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from faultproxy import FaultProxy  # noqa: E402
from helpers import PROGRAMS, child_env, free_port, kill_job, run_torchrun, start_torchrun, wait_for  # noqa: E402
from s3server import BUCKET, reset_if_used, stop_uploaders, transfer_options  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt import cli, stores  # noqa: E402
from shardckpt import steps as steps_mod  # noqa: E402
from shardckpt.errors import CorruptCheckpointError  # noqa: E402
from shardckpt.format import codec, layout  # noqa: E402
from shardckpt.node import node_registry, uploader  # noqa: E402
from shardckpt.remote import auto_compress, compressed, early_upload  # noqa: E402
from shardckpt.remote import commit as remote_commit  # noqa: E402

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
    up = uploader.Uploader(str(src), stores.open_store(url, transfer_options(compression=compression)), node="n0",
                           once=True, poll_s=0.05)
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


BOMBS = r"""
import json, struct, sys
import numpy as np
import zstandard
from shardckpt import stores
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import codec, layout
from shardckpt.remote import compressed

CHUNK = 4 << 20


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def stored(width, frames):
    table = struct.pack(f"<{width}I", *map(len, frames))
    return codec.HEADER.pack(codec.MAGIC, codec.ZSTD, width, CHUNK) + table + b"".join(frames)


def form(data, sums):
    return compressed.StoredForm(codec.CODEC, len(data), layout.checksum_bytes(data), [len(data)],
                                 layout.chunk_sum(data) if sums else "")


logical = (np.random.default_rng(0).standard_normal(CHUNK // 4, dtype=np.float32) * 1e-3).tobytes()
good = codec.encode_chunk(logical)
packer = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
zeros = bytes(16 << 20)
gib = b"".join(packer.compress(zeros) for _ in range(64)) + packer.flush()  # ~32 KB declaring 1 GiB
del zeros
tib = b"\x28\xb5\x2f\xfd\xc0\x50" + struct.pack("<Q", 1 << 40) + bytes([41, 0, 0]) + b"hello"  # claims 1 TiB
cases = {  # name: (the object in the bucket, the stored form the manifest gives it)
    "1 GiB frame": (stored(1, [gib]), False),  # a manifest written before stored checksums
    "1 TiB header": (stored(1, [tib]), False),
    "replaced object": (stored(2, [gib, bytes(len(good) - codec.HEADER.size - 8 - len(gib))]), True),
}
store = stores.open_store(sys.argv[1], stores.TransferOptions(max_attempts=2, step_deadline_s=60))
deadline = stores.Deadline(60)
entry = layout.FileEntry(CHUNK, layout.checksum_bytes(logical), 0,
                         f"{layout.CHUNK_ALGO}:{CHUNK}:{layout.chunk_sum(logical)}")
calls = {"get": 0, "decode": 0}
get_range, decode_chunk = store.get_range, codec.decode_chunk


def counted(kind, fn):
    def call(*args):
        calls[kind] += 1
        return fn(*args)
    return call


store.get_range, codec.decode_chunk = counted("get", get_range), counted("decode", decode_chunk)
store.put_bytes("good.szc", good, deadline)
assert compressed.read_range(store, "good.szc", 1, entry, form(good, True), 0, CHUNK, deadline) == logical
out = {}
for name, (data, sums) in cases.items():
    key = name.replace(" ", "-") + ".szc"
    store.put_bytes(key, data, deadline)
    calls.update(get=0, decode=0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    base = status("VmRSS")
    try:
        compressed.read_range(store, key, 1, entry, form(good if name == "replaced object" else data, sums), 0,
                              CHUNK, deadline)
        error = "loaded"
    except CorruptCheckpointError as exc:
        error = str(exc)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    out[name] = {"peak": status("VmHWM") - base, "error": error, "where": store.where(key), **calls}
print(json.dumps(out))
"""


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_bomb_frames_and_a_replaced_object_are_refused_within_two_chunks_of_memory(s3, tmp_path):
    """In a fresh process reading one 4 MiB chunk through the ranged path (the need-only restore's): a
    ~32 KB frame that inflates to 1 GiB and a frame header claiming 1 TiB (a manifest without stored
    checksums: only the decoder stands in the way), and an object replaced in the bucket by one of the
    same length with that frame inside (the manifest's stored checksum refuses it before any decoding)
    are each fetched twice, then refused with a CorruptCheckpointError naming the object and the
    chunk; the peak RSS stays within 2 chunks of what it was before the read."""
    proc = subprocess.run([sys.executable, "-c", BOMBS, f"s3://{BUCKET}/bombs"], env=child_env(**s3.env()),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for name, got in out.items():
        assert got["error"].startswith("step 1: remote object "), (name, got)
        assert got["where"] in got["error"] and "stored chunk 0" in got["error"] and "twice" in got["error"], got
        assert got["get"] == 2, (name, got)  # fetched once more, then refused
        assert got["peak"] < 2 * (4 << 20), (name, got)
    assert "declares 1073741824 bytes" in out["1 GiB frame"]["error"]
    assert "declares 1099511627776 bytes" in out["1 TiB header"]["error"]
    replaced = out["replaced object"]
    assert "fails its stored checksum" in replaced["error"] and replaced["decode"] == 0, replaced


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

    from shardckpt.convert import export
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


def _flip_a_stored_byte(s3, prefix: str, manifest: layout.Manifest) -> tuple[str, str, int]:
    """One byte flipped in the middle of the longest stored chunk of the largest compressed file:
    ``(file name, object key, chunk index)``."""
    name = max(manifest.stored, key=lambda n: manifest.files[n].size)
    form = compressed.StoredForm.from_json(manifest.stored[name])
    key = f"{prefix}/{layout.step_dirname(manifest.step)}/{name}{compressed.SUFFIX}"
    client = s3.client()
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    i = max(range(len(form.lengths)), key=lambda k: form.lengths[k])
    data[form.offsets()[i] + form.lengths[i] // 2] ^= 0x10
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    return name, key, i


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_corrupt_compressed_chunk_is_fetched_again_then_refused(s3, tmp_path, monkeypatch, caplog):
    """A byte flipped inside a stored chunk: the restore fetches it once more, then refuses the step
    naming the object and the chunk, before decoding it (its stored checksum); with
    on_corrupt='fallback' the earlier step loads."""
    monkeypatch.setattr(layout, "CHUNK_BYTES", CHUNK)
    url = f"s3://{BUCKET}/flip"
    saved = _save_and_push(tmp_path, url)
    manifest = _remote_manifest(url, 2)
    assert all(len(f["sums"]) == compressed.SUM_HEX * len(f["lengths"]) for f in manifest.stored.values())
    name, key, i = _flip_a_stored_byte(s3, "flip", manifest)

    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, uploader="off",
                                  preemption_signals=())
    with caplog.at_level(logging.WARNING, logger="shardckpt"), pytest.raises(CorruptCheckpointError) as info:
        ckpt.load(_fresh_state())
    ckpt.close()
    assert f"s3://{BUCKET}/{key}" in str(info.value) and "twice" in str(info.value)
    assert f"stored chunk {i} " in str(info.value) and "fails its stored checksum" in str(info.value)
    assert "fetching it again" in caplog.text
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
def test_a_decoder_that_disagrees_with_the_encoder_is_refused_and_nothing_is_committed(s3, tmp_path, monkeypatch):
    """The stored bytes intact (every stored checksum passes) but decoded wrongly, as a codec bug or a
    version skew would (every stream comes out as zeros of the right length): `pull` refuses the step
    with CorruptCheckpointError and commits nothing locally; a restore refuses it too and loads nothing."""
    monkeypatch.setattr(layout, "CHUNK_BYTES", CHUNK)
    url = f"s3://{BUCKET}/skew"
    _save_and_push(tmp_path, url, steps=(1,))
    monkeypatch.setattr(codec, "_inflate", lambda frame, want, k: bytes(want))
    store = stores.open_store(url, transfer_options())
    try:
        with pytest.raises(CorruptCheckpointError, match="fail their chunk checksum after decoding, twice"):
            steps_mod.fetch_step(store, str(tmp_path / "pulled"), 1)
    finally:
        store.close()
    assert layout.committed_steps(str(tmp_path / "pulled")) == []
    assert not list((tmp_path / "pulled").rglob("*.distcp"))
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), remote=url, uploader="off", preemption_signals=())
    state = _fresh_state()
    with pytest.raises(CorruptCheckpointError, match="fail their chunk checksum"):
        ckpt.load(state)
    ckpt.close()
    assert layout.committed_steps(str(tmp_path / "fresh")) == []


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_uncompressed_and_older_compressed_remote_steps_keep_loading(s3, tmp_path, monkeypatch):
    """A step uploaded with compression off (as by earlier versions) has no stored forms and loads; a
    compressed step whose manifest has no stored checksums (written before them) loads bitwise, and a
    byte flipped in it is still refused (after decoding, by the chunk checksums)."""
    monkeypatch.setattr(layout, "CHUNK_BYTES", CHUNK)
    url = f"s3://{BUCKET}/mixed"
    saved = _save_and_push(tmp_path, url, steps=(1,), compression="off")
    assert _remote_manifest(url, 1).stored == {}
    _restores_bitwise(url, tmp_path / "fresh", 1, saved[1])

    old_url = f"s3://{BUCKET}/older"
    saved = _save_and_push(tmp_path / "older", old_url, steps=(1,))
    manifest = _remote_manifest(old_url, 1)
    for form in manifest.stored.values():
        del form["sums"]  # as written before stored checksums
    s3.client().put_object(Bucket=BUCKET, Key=f"older/{layout.step_dirname(1)}/{layout.MANIFEST_NAME}",
                           Body=manifest.to_json().encode())
    assert all("sums" not in f for f in _remote_manifest(old_url, 1).stored.values())
    _restores_bitwise(old_url, tmp_path / "fresh-older", 1, saved[1])
    _flip_a_stored_byte(s3, "older", manifest)
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "fresh-flipped"), remote=old_url, uploader="off",
                                  preemption_signals=())
    with pytest.raises(CorruptCheckpointError, match="twice"):
        ckpt.load(_fresh_state())
    ckpt.close()


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_auto_decides_when_the_uploader_starts_and_a_restarted_job_decides_at_once(s3, tmp_path, caplog):
    """``auto`` is measured as the uploader starts (one PUT, deleted after), before anything is uploaded:
    behind a proxy capped at 5 MB/s this node compresses. The decision is kept per bucket and endpoint in
    a file only this user reads: a new process decides from it at once, without a request; an entry older
    than ``MAX_AGE_S`` is measured again; the loopback endpoint is a link of its own."""
    root = tmp_path / "local"
    path = auto_compress.links_path(str(root))
    url = f"s3://{BUCKET}/auto"
    proxy = FaultProxy(s3.endpoint)
    proxy.cap_bytes_per_s = 5e6
    probes: list[str] = []

    def opened(endpoint: str) -> stores.Store:
        store = stores.open_store(url, transfer_options(compression="auto", endpoint_url=endpoint))
        put = store.put_bytes
        store.put_bytes = lambda key, data, deadline: (probes.append(key), put(key, data, deadline))[1]
        return store

    auto_compress.forget()
    try:
        with caplog.at_level(logging.INFO, logger="shardckpt"):
            assert uploader.Uploader(str(root), opened(proxy.endpoint), node="n0", once=True, poll_s=0.05).run() == 0
            auto_compress.settle(60)
        assert len(probes) == 1 and "compressing uploads: measured upload" in caplog.text, caplog.text
        assert os.stat(path).st_mode & 0o777 == 0o600
        kept = json.loads(Path(path).read_text())["links"]
        slow = kept[auto_compress.link_of(opened(proxy.endpoint))]
        assert slow["compress"] and slow["upload_mb_s"] < 6 and slow["ratio"] < 0.9, slow
        assert slow["compress_mb_s"] >= auto_compress.HEADROOM * slow["upload_mb_s"]
        assert not [k for k in s3.keys("") if "rate-" in k]  # the probe cleaned up after itself

        auto_compress.forget()  # a new process: decided from the node's file, no request
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardckpt"):
            choose = compressed.chooser(opened(proxy.endpoint), str(root))  # decided at once, not waiting
        assert len(probes) == 1 and "(measured " in caplog.text
        assert choose is not None and choose("__0_0.distcp", 64 << 20) and not choose("__0_0.distcp", 1 << 20)

        kept[auto_compress.link_of(opened(proxy.endpoint))]["measured"] -= auto_compress.MAX_AGE_S + 1
        Path(path).write_text(json.dumps({"format": auto_compress.LINKS_FORMAT, "links": kept}))
        auto_compress.forget()
        assert compressed.chooser(opened(proxy.endpoint), str(root), wait_s=60) is not None
        assert len(probes) == 2  # too old: measured again
        fast = opened(s3.endpoint)
        assert auto_compress.decision(fast, path, wait_s=60) is not None and len(probes) == 3
        assert len(json.loads(Path(path).read_text())["links"]) == 2
    finally:
        auto_compress.forget()
        proxy.stop()


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


def test_bytes_sent_while_the_save_is_written_count_when_its_commit_cuts_the_pass_short(tmp_path):
    """The early pass over two published files, the second renamed away by the local commit before its
    upload opens it: the first file's bytes count as sent by this node (the uploader's log line and
    status read them), and it is recorded as sent (not sent again after the commit)."""
    root, url = tmp_path / "local", f"file://{tmp_path / 'remote'}"
    partial = root / layout.partial_dirname(1, "1-nonce1")
    partial.mkdir(parents=True)
    for name, n in (("__0_0.distcp", 5000), ("__0_1.distcp", 7000)):
        data = bytes([n % 251]) * n
        (partial / name).write_bytes(data)
        early_upload.publish(str(partial), step=1, save_id="nonce1-1", rank=0, name=name, size=n,
                             checksum=layout.checksum_bytes(data))
    store = stores.open_store(url, transfer_options(compression="off"))
    put = store.put_file

    def renamed_by_the_commit(path, key, *args, **kwargs):
        if path.endswith("__0_1.distcp"):
            os.rename(path, path + ".moved")
        return put(path, key, *args, **kwargs)

    store.put_file = renamed_by_the_commit
    early = early_upload.EarlyUploads()
    try:
        assert early.run(store, str(root)) == 5000
    finally:
        store.close()
    assert early.sent_bytes == {1: 5000} and list(early.sent[(1, "nonce1-1")]) == ["__0_0.distcp"]


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_auto_compresses_a_processes_first_save_while_it_is_written(s3, tmp_path, monkeypatch):
    """One save with the default ``auto``, the trainer's uploader behind a proxy capped at 10 MB/s: the
    link is measured as the uploader starts, so the large shard file goes up compressed while the save is
    still being written (before its local commit), the small one as it is; the step commits with the
    stored form, pulls back bitwise, each file was sent once, and the uploader's log line counts the
    bytes sent while the save was written."""
    from shardckpt import _failpoints

    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    local_dir, url = tmp_path / "local", f"s3://{BUCKET}/first"
    prefix = f"first/{layout.step_dirname(1)}/"
    proxy = FaultProxy(s3.endpoint)
    proxy.cap_bytes_per_s = 10e6
    seen: dict[str, object] = {}

    def written() -> None:  # every shard file written, the step not committed locally: time for early uploads
        wait_for(lambda: any(k.endswith(".distcp" + compressed.SUFFIX) for k in s3.keys(prefix)), 60,
                 "a shard file uploaded compressed before the local commit")
        seen["committed"] = (local_dir / layout.step_dirname(1)).exists()

    torch.manual_seed(0)
    model = torch.nn.Linear(1536, 1536)  # 9.4 MB of weights in one file (auto leaves files under 8 MiB plain)
    ckpt = shardckpt.Checkpointer(local_dir=str(local_dir), remote=url, endpoint_url=proxy.endpoint, uploader="auto",
                                  mode="sync", io_threads=2, keep_last=None, preemption_signals=(), drain_timeout_s=120)
    try:
        _failpoints.arm("write.done", written)
        ckpt.save({"model": model}, 1)
    finally:
        _failpoints.arm("write.done", lambda: None, nth=10**9)
        ckpt.close()
        proxy.stop()
    assert seen == {"committed": False}
    manifest = _remote_manifest(url, 1)
    shards = sorted(n for n in manifest.files if n.endswith(".distcp"))
    big = [n for n in shards if manifest.files[n].size >= compressed.AUTO_MIN_FILE_BYTES]
    assert len(shards) == 2 and sorted(manifest.stored) == big and len(big) == 1, (shards, manifest.stored)
    assert compressed.stored_bytes(manifest) < 0.97 * manifest.total_bytes
    store = stores.open_store(url, transfer_options())
    try:
        steps_mod.fetch_step(store, str(tmp_path / "pulled"), 1)
    finally:
        store.close()
    for name in manifest.files:
        assert (tmp_path / "pulled" / layout.step_dirname(1) / name).read_bytes() == \
            (local_dir / layout.step_dirname(1) / name).read_bytes(), name
    state = node_registry.STATE_DIR
    status = json.loads((local_dir / state / "status.json").read_text())
    assert status["uploaded_bytes"] == compressed.stored_bytes(manifest)  # each object sent once
    said = (local_dir / state / "uploader.log").read_text()
    line = next(ln for ln in said.splitlines() if "step 1 committed on" in ln)
    counted = re.search(r"\((\d+\.\d) MiB uploaded by this node, (\d+\.\d) MiB of it while the save was written", line)
    assert counted, line
    total, early = (float(x) for x in counted.groups())
    assert early >= compressed.stored_bytes(manifest) / 2**20 * 0.9 and total >= early, line
