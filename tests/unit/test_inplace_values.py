"""Plain values and stateful objects are read straight into the caller's own tensors, checksums still checked."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.nn as nn
from helpers import flip_byte_in_tensor

import shardckpt
from shardckpt.dcp import planner as local


class Counter:
    """A stateful object holding tensors of its own."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(40, 24, generator=gen)
        self.seen = torch.randint(0, 1000, (300,), generator=gen)
        self.calls = seed

    def state_dict(self) -> dict:
        return {"table": self.table, "seen": self.seen, "calls": self.calls}

    def load_state_dict(self, sd: dict) -> None:
        self.table.copy_(sd["table"])
        self.seen.copy_(sd["seen"])
        self.calls = sd["calls"]


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))
    model[1].to(torch.bfloat16)
    model.register_buffer("counts", torch.arange(100, dtype=torch.int64) * seed)
    return {
        "weights": model.state_dict(),  # {"weights": model.state_dict()}: a plain dict of tensors
        "meta": {"epoch": seed, 3: {"ema": torch.randn(16, 16)}, "#tagged": [torch.randn(50), torch.randn(7)]},
        "counter": Counter(seed),
    }


def _live_tensors(state: dict) -> dict[str, torch.Tensor]:
    return {
        **{f"weights.{k}": v for k, v in state["weights"].items()},
        "meta.3.ema": state["meta"][3]["ema"],
        "meta.#tagged.0": state["meta"]["#tagged"][0],
        "meta.#tagged.1": state["meta"]["#tagged"][1],
        "counter.table": state["counter"].table,
        "counter.seen": state["counter"].seen,
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ckpt(path, **kw):
    kw.setdefault("preemption_signals", ())
    return shardckpt.Checkpointer(local_dir=str(path), **kw)


def _record_reads(monkeypatch) -> list[tuple[int, int]]:
    """(address, bytes) of every buffer the reader's ``preadv`` filled."""
    filled: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd, buffers, offset, *rest):
        got = real(fd, buffers, offset, *rest)
        left = got
        for buf in buffers:
            view = memoryview(buf).cast("B")
            n = min(left, view.nbytes)
            if n:
                filled.append((ctypes.addressof(ctypes.c_char.from_buffer(view)), n))
            left -= n
        return got

    monkeypatch.setattr(os, "preadv", preadv)
    return filled


def _read_into(filled: list[tuple[int, int]], t: torch.Tensor) -> int:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return sum(n for addr, n in filled if start <= addr and addr + n <= end)


def test_plain_values_and_stateful_objects_are_read_into_the_callers_tensors(tmp_path, monkeypatch):
    saved = _state(1)
    with _ckpt(tmp_path, mode="sync") as c:
        c.save(saved, 1)
        step_dir = c.save(_state(2), 2).wait()
    expected = {k: v.clone() for k, v in _live_tensors(saved).items()}

    live = _state(5)
    mine = _live_tensors(live)
    ptrs = {k: v.data_ptr() for k, v in mine.items()}
    filled = _record_reads(monkeypatch)
    with _ckpt(tmp_path) as c:
        assert c.load(live, step=1) == 1
    monkeypatch.undo()
    after = _live_tensors(live)
    for k, t in mine.items():
        assert after[k] is t, k  # the caller's own tensor objects, in the caller's own containers
        assert t.data_ptr() == ptrs[k], k
        assert torch.equal(_bytes(t), _bytes(expected[k])), k  # bitwise
        # Read from the file straight into its memory, not into a new tensor copied afterwards.
        assert _read_into(filled, t) == t.numel() * t.element_size(), k
    assert live["meta"]["epoch"] == 1 and live["counter"].calls == 1

    # A flipped byte inside a dict entry's data is still caught while reading in place.
    metadata = local.read_metadata(step_dir, 2)
    info = next(i for idx, i in metadata.storage_data.items() if idx.fqn == "weights.0.weight")
    flip_byte_in_tensor(os.path.join(step_dir, info.relative_path), info, 0x10)
    with _ckpt(tmp_path) as c, pytest.raises(shardckpt.CorruptCheckpointError) as err:
        c.load(live, step=2)
    assert info.relative_path in str(err.value) and "step 2" in str(err.value) and "checksum" in str(err.value)

    # The fallback reads step 1 over it, into the same tensors.
    with _ckpt(tmp_path, on_corrupt="fallback") as c:
        assert c.load(live) == 1
    for k, t in mine.items():
        assert _live_tensors(live)[k] is t and torch.equal(_bytes(t), _bytes(expected[k])), k


def test_a_live_tensor_of_another_shape_is_replaced_not_read_into(tmp_path):
    with _ckpt(tmp_path, mode="sync") as c:
        c.save({"meta": {"ema": torch.arange(12.0)}}, 1)
    other = torch.zeros(5)
    live = {"meta": {"ema": other}}
    with _ckpt(tmp_path) as c:
        assert c.load(live) == 1
    assert torch.equal(live["meta"]["ema"], torch.arange(12.0)) and torch.equal(other, torch.zeros(5))


def test_an_error_in_a_stateful_state_dict_at_load_is_the_callers_not_a_read_failure(tmp_path):
    counter = Counter(1)
    with _ckpt(tmp_path, mode="sync") as c:
        c.save({"counter": counter}, 1)

    class Broken(Counter):
        def state_dict(self) -> dict:
            raise LookupError("not ready")

    with _ckpt(tmp_path) as c, pytest.raises(LookupError, match="not ready"):
        c.load({"counter": Broken(2)})
