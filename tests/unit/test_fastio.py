"""The save and restore I/O paths: checksums taken while writing, reads straight into the live tensors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import flip_byte_in_tensor

import shardckpt
from shardckpt.convert import adopt as adopt_mod
from shardckpt.dcp import planner as local
from shardckpt.dcp import writer as dcp_writer
from shardckpt.dcp.record_layout import stored_tensor
from shardckpt.format import layout


class Mixed(nn.Module):
    """Tensors of several dtypes and layouts: the in-place path and the torch.load path both run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 48)
        self.bf16 = nn.Parameter(torch.randn(33, 17).to(torch.bfloat16))
        self.register_buffer("counts", torch.arange(100, dtype=torch.int64))
        self.register_buffer("flags", torch.tensor([True, False, True]))
        self.register_buffer("scalar", torch.tensor(3.5))
        self.register_buffer("empty", torch.zeros(0, 4))
        # A transposed (non-contiguous) buffer: its stored record is not one plain run of bytes.
        self.register_buffer("transposed", torch.randn(8, 5).t())


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = Mixed()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model, "optimizer": opt, "meta": {"epoch": 7, "name": "run"}}


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone() for k, v in state["model"].state_dict().items()}
    for i, s in enumerate(state["optimizer"].state_dict()["state"].values()):
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _ckpt(path, **kw):
    kw.setdefault("preemption_signals", ())
    return shardckpt.Checkpointer(local_dir=str(path), **kw)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bytes(a[k]), _bytes(b[k])), k


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as raw bytes (bitwise comparison: -0.0 vs 0.0 and NaNs count)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() and t.dtype != torch.bool else t


def _counting_torch_load(monkeypatch) -> list:
    """The tensors torch.load returns: the reader's fallback path (the in-place path never calls it;
    plain values, pickled, always go through it)."""
    tensors = []
    real = torch.load

    def counting(*args, **kwargs):
        value = real(*args, **kwargs)
        if isinstance(value, torch.Tensor):
            tensors.append(tuple(value.shape))
        return value

    monkeypatch.setattr(torch, "load", counting)
    return tensors


@pytest.mark.parametrize("verify", [True, False])
def test_restore_is_bitwise_through_both_read_paths(tmp_path, verify, monkeypatch):
    saved = _state(0)
    with _ckpt(tmp_path, mode="sync") as c:
        c.save(saved, 5)
    live = _state(1)
    before = {k: v.data_ptr() for k, v in live["model"].state_dict().items() if v.numel()}
    loads = _counting_torch_load(monkeypatch)
    with _ckpt(tmp_path, verify_on_load=verify) as c:
        assert c.load(live) == 5
    _assert_bitwise(_tensors(saved), _tensors(live))
    assert live["meta"] == {"epoch": 7, "name": "run"}
    # Read straight into the live tensors: no tensor went through torch.load (a copy_ from a
    # loaded tensor would also keep data_ptr, so the count is what tells).
    assert loads == [], f"tensors of shapes {loads} read through torch.load"
    # Loaded in place: the live tensors keep their memory.
    assert {k: v.data_ptr() for k, v in live["model"].state_dict().items() if v.numel()} == before

    # A live tensor of another dtype than the stored one takes the other path: torch.load, then
    # copy_ (which converts); everything else is still read in place.
    live = _state(1)
    live["model"].scalar = torch.tensor(0.0, dtype=torch.float64)
    with _ckpt(tmp_path, verify_on_load=verify) as c:
        assert c.load(live) == 5
    assert loads == [()]
    assert live["model"].scalar.dtype == torch.float64 and live["model"].scalar.item() == 3.5
    _assert_bitwise({k: v for k, v in _tensors(saved).items() if k != "m.scalar"},
                    {k: v for k, v in _tensors(live).items() if k != "m.scalar"})


def test_stored_records_are_found_in_place(tmp_path):
    # Every contiguous tensor of a step is located by its layout, not by torch.load.
    saved = _state(0)
    with _ckpt(tmp_path, mode="sync") as c:
        step_dir = c.save(saved, 1).wait()
    metadata = local.read_metadata(step_dir, 1)
    found = unusual = 0
    for index, info in metadata.storage_data.items():
        with open(os.path.join(step_dir, info.relative_path), "rb") as f:
            where = stored_tensor(f, info.offset, info.length)
            md = metadata.state_dict_metadata[index.fqn]
            if not hasattr(md, "size"):
                assert where is None  # plain values are pickled bytes
                continue
            if where is None:
                unusual += 1
                continue
            found += 1
            f.seek(where.data_offset)
            raw = f.read(where.nbytes)
            expected = torch.load(
                _slice(os.path.join(step_dir, info.relative_path), info.offset, info.length), weights_only=True
            )
            assert where.dtype == expected.dtype and where.size == tuple(expected.shape)
            assert raw == expected.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert found >= 8
    # DCP writes every tensor as one contiguous storage of its own (the transposed buffer too: it
    # is copied before it is written), so every record is found in place.
    assert unusual == 0


def _slice(path: str, offset: int, length: int):
    import io

    with open(path, "rb") as f:
        f.seek(offset)
        return io.BytesIO(f.read(length))


def test_files_of_stock_dcp_save_are_read(tmp_path):
    # The reader reads what stock DCP writes (adopted), and stock DCP reads what we write.
    saved = _state(0)
    stock = tmp_path / "stock"
    dcp.save({"model": saved["model"].state_dict()}, checkpoint_id=str(stock))
    adopt_mod.adopt(str(stock), str(tmp_path / "ckpt"), 3)
    live = _state(1)
    with _ckpt(tmp_path / "ckpt", strict=False) as c:
        assert c.load({"model": live["model"]}) == 3
    _assert_bitwise({k: v for k, v in _tensors(saved).items() if k.startswith("m.")},
                    {k: v for k, v in _tensors(live).items() if k.startswith("m.")})

    ours = tmp_path / "ours"
    with _ckpt(ours, mode="sync") as c:
        step_dir = c.save({"model": saved["model"]}, 1).wait()
    back = {"model": _state(2)["model"].state_dict()}
    dcp.load(back, checkpoint_id=step_dir)
    for k, v in saved["model"].state_dict().items():
        assert torch.equal(back["model"][k], v), k


def _data_file(step_dir: str) -> str:
    return max((os.path.join(step_dir, n) for n in os.listdir(step_dir) if n.endswith(".distcp")), key=os.path.getsize)


def test_flipped_byte_inside_tensor_data_is_caught(tmp_path):
    saved = _state(0)
    with _ckpt(tmp_path, mode="sync") as c:
        c.save(saved, 1)
        step_dir = c.save(_state(3), 2).wait()
    path = _data_file(step_dir)
    metadata = local.read_metadata(step_dir, 2)
    info = max((i for i in metadata.storage_data.values() if i.relative_path == os.path.basename(path)),
               key=lambda i: i.length)
    flip_byte_in_tensor(path, info)

    with _ckpt(tmp_path) as c, pytest.raises(shardckpt.CorruptCheckpointError) as err:
        c.load(_state(1), step=2)
    assert path in str(err.value) and "step 2" in str(err.value) and "checksum" in str(err.value)
    assert "load another step" in str(err.value)

    # With fallback, step 1 is read over whatever step 2 left in the state.
    live = _state(1)
    with _ckpt(tmp_path, on_corrupt="fallback") as c:
        assert c.load(live) == 1
    _assert_bitwise(_tensors(saved), _tensors(live))


def test_truncated_file_is_refused_before_anything_is_read(tmp_path):
    with _ckpt(tmp_path, mode="sync") as c:
        step_dir = c.save(_state(0), 1).wait()
    path = _data_file(step_dir)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    live = _state(1)
    before = _tensors(live)
    with _ckpt(tmp_path) as c, pytest.raises(shardckpt.CorruptCheckpointError) as err:
        c.load(live)
    assert path in str(err.value) and "truncated" in str(err.value)
    _assert_bitwise(before, _tensors(live))  # the live state is untouched


def test_save_takes_checksums_while_writing(tmp_path, monkeypatch):
    # The commit does not read the step back to hash it; the checksums match the files.
    reads = []
    real = layout.checksum_file
    monkeypatch.setattr(layout, "checksum_file", lambda path, like=None: reads.append(path) or real(path, like))
    with _ckpt(tmp_path, mode="sync") as c:
        step_dir = c.save(_state(0), 1).wait()
    assert reads == []
    monkeypatch.setattr(layout, "checksum_file", real)
    layout.verify_files(step_dir, layout.read_manifest(step_dir))


def test_a_stream_that_seeks_is_hashed_from_disk(tmp_path):
    fs = dcp_writer._HashingFileSystem()
    path = str(tmp_path / "f")
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"hello world")
        stream.seek(0)
        stream.write(b"J")
    assert "f" not in fs.written
    with fs.create_stream(path, "wb") as stream:
        stream.write(b"plain")
    assert fs.written["f"] == layout.file_sums(path)


def _tamper_records(step_dir: str, step: int, how: str) -> tuple[str, str]:
    """Rewrite the step's .metadata (a pickle, as DCP writes it) so that one record runs into the next.

    ``overlap``: a tensor record's length covers the next record too; ``bytes``:
    the same for a record of plain values; ``shifted``: a tensor record grows
    into the next one and the next one starts that much later (no two records
    overlap, but neither fills its archive). Returns the data file and the
    record's item name.
    """
    import dataclasses
    import pickle

    metadata = local.read_metadata(step_dir, step)
    records = sorted(
        ((info.relative_path, info.offset, index) for index, info in metadata.storage_data.items()),
        key=lambda r: (r[0], r[1]),
    )
    is_tensor = lambda r: hasattr(metadata.state_dict_metadata[r[2].fqn], "size")  # noqa: E731
    (name, _, a), (_, _, b) = next(
        (x, y) for x, y in zip(records, records[1:]) if x[0] == y[0] and is_tensor(x) == (how != "bytes")
    )
    rec_a, rec_b = metadata.storage_data[a], metadata.storage_data[b]
    assert rec_a.offset + rec_a.length == rec_b.offset  # DCP wrote them one after the other
    if how in ("overlap", "bytes"):
        metadata.storage_data[a] = dataclasses.replace(rec_a, length=rec_b.offset + rec_b.length - rec_a.offset)
    else:
        metadata.storage_data[a] = dataclasses.replace(rec_a, length=rec_a.length + 64)
        metadata.storage_data[b] = dataclasses.replace(rec_b, offset=rec_b.offset + 64, length=rec_b.length - 64)
    with open(os.path.join(step_dir, layout.METADATA_NAME), "wb") as f:
        pickle.dump(metadata, f)
    return os.path.join(step_dir, name), a.fqn


@pytest.mark.parametrize("how", ["overlap", "bytes", "shifted"])
def test_a_record_that_does_not_fill_its_archive_is_refused(tmp_path, how):
    # The in-place reader would otherwise find the next record's archive at the
    # end of the window and load the next tensor's bytes, without a checksum to tell.
    with _ckpt(tmp_path, mode="sync") as c:
        step_dir = c.save(_state(0), 1).wait()
    path, fqn = _tamper_records(step_dir, 1, how)
    with _ckpt(tmp_path, verify_on_load=False) as c, pytest.raises(shardckpt.CorruptCheckpointError) as err:
        c.load(_state(1))
    message = str(err.value)
    assert "step 1" in message and path in message and repr(fqn) in message and "Remedy" in message
