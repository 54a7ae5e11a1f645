"""A save kept in memory describes its staged state the way DCP flattens it (``dcp/memory._flatten``): the same
fully qualified names, paths and leaf objects in the same order, at the first save and when parts of the state
are the same objects as at the last one. The restore builds DCP's metadata from these names and paths. What
``describe`` reuses of a subtree that is the same object as at the last save gives what a description made
afresh gives, at every save."""

from __future__ import annotations

import collections

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from shardckpt.dcp.memory import _describe_flat, _flatten, describe


def merged(chunks):
    flat, paths = {}, {}
    for f, m, _memo in chunks:
        flat.update(f)
        paths.update(m)
    return flat, paths


def staged_state():
    model = {"a.weight": torch.ones(2), "b": torch.zeros(3), 3: torch.ones(1)}
    optimizer = {"state": {"a.weight": {"step": torch.tensor(1.0), "exp_avg": torch.ones(2)}},
                 "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a.weight", "b"], "foreach": None},
                                  {"lr": 1, "params": []}]}
    state = {
        "model": model, "optimizer": optimizer, "x": torch.ones(4), "v": 5, "list": [torch.ones(1), 2], "empty": {},
        "mixed": {"t": torch.ones(1), "n": 3, "deep": {"x": [1, {"y": 2}], "z": [[1], [2]],
                                                       "o": collections.OrderedDict(a=1), "el": [], "ed": {}}},
        "vocab": {"itos": {0: "a", 1: "b"}}, "dicts": [{}, {"a": 1}], "tuple": ({"a": torch.ones(1)}, 2),
        "nested": [[torch.ones(1)]], 7: "an int key",
    }
    return state, model, optimizer


def test_the_flattening_of_a_staged_state_is_dcps():
    state, model, optimizer = staged_state()
    cache: dict = {}
    for save in range(4):
        if save == 2:
            state["model"] = dict(model)  # a new container of the same tensors
            optimizer["param_groups"][0]["lr"] = 0.05
        flat, paths = merged(_flatten(state, cache))
        expected, expected_paths = flatten_state_dict(state)
        assert list(flat) == list(expected) and paths == expected_paths, save
        assert all(flat[k] is expected[k] for k in expected), save


def test_a_description_reusing_the_last_saves_is_the_one_made_afresh():
    state, model, optimizer = staged_state()
    offsets: dict[int, int] = {}

    def offset_of(t):
        return offsets.setdefault(id(t), 64 * len(offsets))

    cache: dict = {}
    reused = 0
    for save in range(5):
        if save == 2:
            state["model"] = dict(model)  # a new container of the same tensors
            optimizer["param_groups"][0]["lr"] = 0.05
        if save == 3:
            state["v"] = 6
            state["model"] = {**state["model"], "c": torch.ones(5)}  # a tensor added
        described = {id(e) for e in cache.get(("flat", 0), {}).values() if e[3] is not None}
        got = describe(state, offset_of, cache)
        assert got == _describe_flat(state, offset_of), save
        reused += sum(1 for e in cache[("flat", 0)].values() if id(e) in described)
    assert reused > 0  # the later saves took parts of their description from the last save's


def test_a_plain_value_is_stored_as_bytes_torch_load_reads_back_exactly():
    """Plain values (what changes at every save: a step counter, a learning rate) are written in torch.save's
    stream format made by pickle, not by a torch.save zip per value; torch.load (weights_only, as a restore
    reads) gives each back with its type, and anything else still goes through torch.save."""
    import io

    from shardckpt.dcp.memory import _pickled, _stream_format

    assert _stream_format() is not None  # this torch writes the format the frame was derived from
    for value in (0, -1, 2**70, 1.5, -0.0, float("inf"), "é\n", "", None, True, False, b"\x00x", (1, "a", 2.0),
                  [1, 2.5], [], ()):
        data = _pickled(value)
        assert not data.startswith(b"PK")  # not a zip archive
        back = torch.load(io.BytesIO(data), weights_only=True)
        assert type(back) is type(value) and repr(back) == repr(value), value
        legacy = io.BytesIO()
        torch.save(value, legacy, _use_new_zipfile_serialization=False)
        assert data == legacy.getvalue()
    nested = {"t": torch.arange(3), "n": [1, {"x": 2}]}
    data = _pickled(nested)
    assert data.startswith(b"PK")  # torch.save's own
    back = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(back["t"], nested["t"]) and back["n"] == nested["n"]


def test_two_leaves_of_one_name_are_refused_as_dcp_refuses_them_never_described_as_one():
    """A key holding a '.' beside a nested one, or 1 beside "1", flatten to one name: the description falls to
    DCP's flattening, which names the key (it used to keep one of the two tensors silently)."""
    import pytest

    for entry in ({"b.c": torch.ones(2), "b": {"c": torch.zeros(2)}}, {1: torch.ones(1), "1": torch.zeros(1)},
                  {"b.c": torch.ones(2), "b": {"c": torch.zeros(2)}, "n": 3}):
        staged = {"model": {"w": torch.ones(1)}, "meta": entry}
        for cache in ({}, None):  # a first save, and one after a save of another state
            if cache is None:
                cache = {}
                describe({"model": staged["model"], "meta": {"x": torch.ones(1)}}, lambda t: 0, cache)
            with pytest.raises(ValueError, match="duplicated flatten key meta"):
                describe(staged, lambda t: 0, cache)
