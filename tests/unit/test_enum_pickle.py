"""A checkpoint written by CPython 3.11.0-3.11.4 loads under the allow-list; nothing else is opened up.

Those interpreters pickle an Enum member as ``getattr(cls, name)`` (Debian 12's
``python3`` is 3.11.2); DCP's ``.metadata`` holds such members. The pickle of
that interpreter is emulated here byte for byte: a pickler whose reduction of
an Enum member is the one ``Enum.__reduce_ex__`` returns there.
"""

from __future__ import annotations

import enum
import io
import json
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, Metadata

import shardckpt
from shardckpt.format import layout, manifest_schema
from shardckpt.format.safe_pickle import safe_load_metadata


class _Py3112Pickler(pickle.Pickler):
    """Pickles as CPython 3.11.0-3.11.4 do: ``Enum.__reduce_ex__`` returns ``getattr, (cls, name)``."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Py3112Pickler(buf).dump(obj)
    return buf.getvalue()


def _rewrite(step_dir, name, data: bytes) -> None:
    """Replace one file of the step and keep the manifest consistent with it (as that interpreter wrote it)."""
    (step_dir / name).write_bytes(data)
    path = step_dir / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    for file in body["files"]:
        size, digest = layout.checksum_file(str(step_dir / file))
        body["files"][file].update(size=size, checksum=digest)
    path.write_text(manifest_schema.seal(body))


def test_metadata_pickled_by_a_python_that_reduces_enums_through_getattr_loads(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()) as ckpt:
        ckpt.save({"model": model}, 1)
    step_dir = tmp_path / layout.step_dirname(1)
    md = safe_load_metadata((step_dir / layout.METADATA_NAME).read_bytes(), "the step")
    data = _dumps(md)
    assert b"getattr" in data and b"_MEM_FORMAT_ENCODING" in data  # the 3.11.2 reduction, not the member by value
    back = safe_load_metadata(data, "a 3.11.2 pickle")
    assert isinstance(back, Metadata)
    formats = {p.properties.memory_format for p in back.state_dict_metadata.values() if hasattr(p, "properties")}
    assert formats == {torch.contiguous_format}  # the member the getattr named, turned back into the format
    # The whole step, its metadata rewritten as that interpreter writes it, loads bitwise.
    _rewrite(step_dir, layout.METADATA_NAME, data)
    fresh = nn.Linear(4, 3)
    with shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=()) as ckpt:
        assert ckpt.load({"model": fresh}) == 1
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


class _Call:
    """A reduction planted by hand: ``func(*args)`` at load."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args

    def __call__(self, *args):  # pickle takes only a callable as a reduction's function
        raise AssertionError("never called here")


@pytest.mark.parametrize("planted", [
    (_MEM_FORMAT_ENCODING, "__class__"),  # an allow-listed Enum's attribute that is not a member
    (_MEM_FORMAT_ENCODING, "_missing_"),
    (_MEM_FORMAT_ENCODING, "__init_subclass__"),
    (Metadata, "__init__"),  # an allow-listed class that is not an Enum
    (torch.Size, "__new__"),
    (_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, "__reduce_ex__"),  # a member's attribute
])
def test_getattr_of_anything_but_an_allow_listed_enum_member_is_refused(planted):
    data = pickle.dumps(_Call(getattr, *planted))
    with pytest.raises(shardckpt.UntrustedCheckpointError) as error:
        safe_load_metadata(data, "a planted pickle")
    assert "builtins.getattr" in str(error.value), str(error.value)


def test_an_allowed_member_obtained_through_getattr_runs_nothing(tmp_path):
    """The member is the only thing getattr hands out; calling it (as a planted reduction would) runs nothing."""
    member = _Call(getattr, _MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
    data = pickle.dumps(_Call(member, f"touch {tmp_path / 'ran'}"))
    with pytest.raises((shardckpt.UntrustedCheckpointError, shardckpt.CorruptCheckpointError)):
        safe_load_metadata(data, "a planted pickle")
    assert not (tmp_path / "ran").exists()
