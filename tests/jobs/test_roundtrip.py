"""DDP and FSDP2 at 2 ranks under torchrun: every tensor bitwise equal after restore.

One launch runs both round trips (DDP, then FSDP2, each in its own directory);
the corruption test damages a copy of the DDP checkpoint and loads it twice in
one more launch (``on_corrupt="error"``, then ``"fallback"``).
"""

import json
import shutil

import pytest
from helpers import PROGRAMS, run_torchrun

from shardckpt.dcp import planner as local
from shardckpt.dcp.record_layout import stored_tensor

MODES = ("ddp", "fsdp2")


@pytest.fixture(scope="module")
def roundtrips(tmp_path_factory):
    """mode -> (its checkpoint directory, its result), from one 2-rank launch."""
    base = tmp_path_factory.mktemp("roundtrip")
    args = []
    for mode in MODES:
        args += ["+"] if args else []
        args += [mode, base / f"ckpt-{mode}", base / f"result-{mode}.json"]
    run_torchrun(2, PROGRAMS / "roundtrip.py", *args)
    return {mode: (base / f"ckpt-{mode}", json.loads((base / f"result-{mode}.json").read_text())) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_roundtrip_bitwise(roundtrips, mode):
    ckpt_dir, result = roundtrips[mode]
    assert result["restored_step"] == 3
    # Three linear layers: weights and biases; AdamW keeps step, exp_avg, exp_avg_sq for each.
    assert result["model_tensors"] == 6
    assert len(result["optim_state_keys"]) == 18
    assert result["mismatched"] == []
    assert result["scheduler_equal"] is True
    assert result["extra"] == {"note": "rt", "epoch": 2}
    # A model still on the meta device: refused, naming every parameter and its optimizer state.
    meta = result["meta"]
    assert meta["error"] == "MetaDeviceError" and meta["still_meta"], meta
    assert len(meta["params"]) == 6 and "to_empty" in meta["message"], meta
    for name in meta["params"]:
        assert f"model.{name}" in meta["message"] and f"optimizer.state.{name}.exp_avg" in meta["message"], name
    for other in meta["other_ranks"]:  # printed once per job: the other ranks point at rank 0's list
        assert "meta device" in other and "rank 0's error lists them" in other and "to_empty" in other, other
        assert len(other) < 400 and not any(name in other for name in meta["params"]), other
    # keep_last=2: only the two newest steps remain, and no leftovers.
    names = sorted(p.name for p in ckpt_dir.iterdir())
    assert names == ["step_0000000002", "step_0000000003"]


def test_corruption_seen_by_one_rank_stops_or_falls_back_on_all(roundtrips, tmp_path):
    # Ranks split the checksum work: each file is checked by one rank of the
    # copy (DDP: both ranks read every file; the coordinator gives each file
    # to one of them). A flipped bit inside a tensor's raw bytes in
    # __1_0.distcp is therefore seen by one rank only (the other reads the
    # bytes into its tensor unchecked), and its failure must reach the other
    # rank in the exchange after the read: both raise the same error, naming
    # the file once (two ranks checking it would report it twice: "(1
    # more)"), or both fall back; never load apart or wait on each other.
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(roundtrips["ddp"][0], ckpt_dir)  # the round trip's own directory stays intact
    step_dir = ckpt_dir / "step_0000000003"
    shard = step_dir / "__1_0.distcp"
    records = [i for i in local.read_metadata(str(step_dir), 3).storage_data.values() if i.relative_path == shard.name]
    with open(shard, "r+b") as f:
        where = stored_tensor(f, *max((i.offset, i.length) for i in records if stored_tensor(f, i.offset, i.length)))
        f.seek(where.data_offset + where.nbytes // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x10]))

    # One launch, two loads in turn: on_corrupt="error", then "fallback" (fresh objects each time).
    run_torchrun(2, PROGRAMS / "corrupt_load.py", "ddp", ckpt_dir, tmp_path / "raise", "error",
                 tmp_path / "fallback", "fallback")
    got = [json.loads((tmp_path / f"raise.{rank}.json").read_text()) for rank in (0, 1)]
    assert got[0] == got[1], got  # the same error on both ranks
    assert got[0].get("error") == "CorruptCheckpointError", got
    assert str(shard) in got[0]["message"] and "step 3" in got[0]["message"], got
    assert "more)" not in got[0]["message"], got  # one failure: one rank checked the file

    for rank in (0, 1):
        assert json.loads((tmp_path / f"fallback.{rank}.json").read_text()) == {"restored": 2}
