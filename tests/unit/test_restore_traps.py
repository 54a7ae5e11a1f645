"""The traps at the restore's matching step, in one process.

* a model (and its optimizer) still on the meta device is refused before
  anything is claimed restored, every meta entry named, ``to_empty()`` as the remedy;
* the run-config warning leaves out the keys the user names and lists the
  differences that can change shapes first;
* a damaged manifest is a CorruptCheckpointError naming step, file and remedy
  (binary bytes appended, a field of the wrong type); an edited kinds table
  never leaves a saved key at the live object's values.
(FSDP2 and DDP on meta: tests/programs/roundtrip.py, in test_roundtrip.py.)
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt.format import layout, manifest_schema


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))


def _trained(tmp_path, **kw) -> dict:
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 6)).sum().backward()
    optim.step()
    state = {"model": model, "optimizer": optim, "meta": {"epoch": 3, "best": 0.5}}
    with shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=(), **kw) as ckpt:
        ckpt.save(state, 20).wait()
    return state


def _ckpt(tmp_path, **kw) -> shardckpt.Checkpointer:
    return shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=(), **kw)


# ------------------------------------------------------------ the meta device


def test_a_model_on_the_meta_device_is_refused_naming_every_entry_then_loads_after_to_empty(tmp_path, caplog):
    saved = _trained(tmp_path)
    with torch.device("meta"):
        model = _model(1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim, "meta": {"epoch": 0, "best": 9.0}}
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        with pytest.raises(shardckpt.MetaDeviceError) as err:
            _ckpt(tmp_path).load(state)
    message = str(err.value)
    params = [name for name, _p in model.named_parameters()]
    for name in params:  # every parameter named, and its optimizer state
        assert f"model.{name}" in message, name
        assert f"optimizer.state.{name}.exp_avg" in message, name
    assert "step 20" in message and "to_empty" in message and "Nothing was loaded" in message
    assert isinstance(err.value, shardckpt.StateMismatchError)
    assert "restored step" not in caplog.text  # nothing claimed restored
    assert state["meta"] == {"epoch": 0, "best": 9.0}  # nor any value applied
    assert all(p.is_meta for p in model.parameters())

    # The remedy as the message says it: materialize, a fresh optimizer, load.
    model.to_empty(device="cpu")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim, "meta": {}}
    assert _ckpt(tmp_path).load(state) == 20
    for (name, want), got in zip(saved["model"].state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    want_state = saved["optimizer"].state_dict()["state"]
    for i, entry in optim.state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"], want_state[i]["exp_avg"]), i
    assert state["meta"] == {"epoch": 3, "best": 0.5}


def test_an_optimizer_built_before_to_empty_is_refused_naming_meta_and_to_empty(tmp_path):
    """The guide's own order, broken: the optimizer holds the meta parameters that to_empty() replaced."""
    _trained(tmp_path)
    with torch.device("meta"):
        model = _model(1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.to_empty(device="cpu")
    with pytest.raises(shardckpt.MetaDeviceError) as err:
        _ckpt(tmp_path).load({"model": model, "optimizer": optim, "meta": {}})
    message = str(err.value)
    assert "step 20" in message and str(tmp_path) in message and "'optimizer'" in message
    assert "meta device" in message and "created before `to_empty()`" in message
    assert "then create the optimizer" in message


def test_a_plain_tensor_value_on_meta_is_refused(tmp_path):
    _trained(tmp_path)
    state = {"model": _model(1), "meta": {"epoch": 0, "best": torch.empty(3, device="meta")}}
    with pytest.raises(shardckpt.MetaDeviceError, match=r"meta\.best"):
        _ckpt(tmp_path, strict=False).load(state)


# ------------------------------------------------------------ the run-config warning


def test_run_config_warning_leaves_out_ignored_keys_and_lists_integer_changes_first(tmp_path, caplog):
    config = {"out_dir": "/runs/a", "data": {"path": "/data/a", "shards": 4}, "a_note": "x", "n_layer": 2, "lr": 0.1}
    _trained(tmp_path, run_config=config)
    changed = dict(config, out_dir="/runs/b", data={"path": "/data/b", "shards": 4}, a_note="y", n_layer=3)

    def warning(**kw) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardckpt"):
            state = {"model": _model(1), "optimizer": None}
            state["optimizer"] = torch.optim.AdamW(state["model"].parameters())
            assert _ckpt(tmp_path, run_config=changed, **kw).load(state) == 20
        return "\n".join(r.getMessage() for r in caplog.records if "run_config differs" in r.getMessage())

    text = warning()
    assert "(4 key(s))" in text
    # The integer change first, before the alphabetically earlier string changes.
    assert text.index("n_layer: 2 -> 3") < text.index("a_note") < text.index("data.path")
    text = warning(run_config_ignore=["out_dir", "data", "a_*"])
    assert "(1 key(s)): n_layer: 2 -> 3" in text and "out_dir" not in text and "data.path" not in text
    assert warning(run_config_ignore=("out_dir", "data", "a_note", "n_layer")) == ""
    with pytest.raises(shardckpt.ConfigError, match="run_config_ignore"):
        shardckpt.CheckpointConfig(run_config_ignore=[3])
    assert shardckpt.CheckpointConfig.from_env(
        {"SHARDCKPT_RUN_CONFIG_IGNORE": "out_dir, data.*"}).run_config_ignore == ("out_dir", "data.*")


def test_a_shape_change_names_the_config_change_that_caused_it_first(tmp_path):
    config = {"out_dir": "/runs/a", "data_path": "/data/a", "dropout": 0.1, "n_layer": 2, "n_embd": 12}
    for i in range(12):  # many path-like entries that differ too: they must not bury the cause
        config[f"a_file_{i}"] = f"/tmp/{i}"
    _trained(tmp_path, run_config=config)
    changed = {k: (v + "-b" if isinstance(v, str) else v) for k, v in config.items()}
    changed.update(n_embd=16, n_layer=3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    with pytest.raises(shardckpt.StateMismatchError) as err:
        _ckpt(tmp_path, run_config=changed).load({"model": model})
    text = str(err.value)
    first = text.split("run_config differs from the one it was saved with: ", 1)[1]
    assert first.startswith("n_embd: 12 -> 16; n_layer: 2 -> 3; "), first


# ------------------------------------------------------------ damaged manifests


def _edit_manifest(tmp_path, edit, *, digest: str = "keep") -> str:
    path = tmp_path / layout.step_dirname(20) / layout.MANIFEST_NAME
    body = json.loads(path.read_text())
    edit(body)
    if digest == "drop":  # as versions before the digest wrote it
        body.pop(manifest_schema.DIGEST_FIELD)
    path.write_text(json.dumps(body))
    return str(path)


def _fresh_state() -> dict:
    model = _model(1)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "meta": {"epoch": 0, "best": 9.0}}


@pytest.mark.parametrize("damage", ["binary-appended", "copies-int", "files-list", "keys-list", "step-string"])
def test_a_damaged_manifest_is_a_corrupt_checkpoint_error_naming_step_file_and_remedy(tmp_path, damage):
    _trained(tmp_path)
    path = tmp_path / layout.step_dirname(20) / layout.MANIFEST_NAME
    if damage == "binary-appended":
        path.write_bytes(path.read_bytes() + b"\xff\xfe\x00\x81")
    else:
        field, value = {"copies-int": ("copies", 5), "files-list": ("files", []), "keys-list": ("keys", [1]),
                        "step-string": ("world_size", "2")}[damage]
        _edit_manifest(tmp_path, lambda b: b.__setitem__(field, value), digest="drop")
    state = _fresh_state()
    with pytest.raises(shardckpt.CorruptCheckpointError) as err:
        _ckpt(tmp_path).load(state)
    message = str(err.value)
    assert str(path) in message and "Remedy" in message, message
    assert "step 20" in message, message
    assert state["meta"] == {"epoch": 0, "best": 9.0}


def test_an_edited_manifest_fails_its_digest(tmp_path):
    _trained(tmp_path)
    path = _edit_manifest(tmp_path, lambda b: b["keys"].__setitem__("meta", "module"))
    with pytest.raises(shardckpt.CorruptCheckpointError, match="does not match its own digest") as err:
        _ckpt(tmp_path).load(_fresh_state())
    assert path in str(err.value) and "step 20" in str(err.value)


@pytest.mark.parametrize("kind", [[], None, "x", "module", "optimizer", "stateful", "(removed)"])
def test_an_edited_kinds_table_never_leaves_a_key_at_its_live_values(tmp_path, kind):
    # Without a digest (a manifest as older versions wrote it, edited): the schema refuses an
    # unknown kind; a valid kind that reads "meta" into nothing raises instead of skipping it;
    # one that reads it back all the same is harmless.
    _trained(tmp_path)

    def edit(body):
        if kind == "(removed)":
            del body["keys"]["meta"]
        else:
            body["keys"]["meta"] = kind

    _edit_manifest(tmp_path, edit, digest="drop")
    state = _fresh_state()
    if kind == "stateful":  # read back like a value (both are rebuilt from their entries): harmless
        assert _ckpt(tmp_path).load(state) == 20
        assert state["meta"] == {"epoch": 3, "best": 0.5}
        return
    expected = shardckpt.CorruptCheckpointError if kind in ([], None, "x") else shardckpt.StateMismatchError
    with pytest.raises(expected) as err:
        _ckpt(tmp_path).load(state)
    assert "meta" in str(err.value) and "Remedy" in str(err.value), str(err.value)
    assert state["meta"] == {"epoch": 0, "best": 9.0}
