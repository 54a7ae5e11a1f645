"""DDP and FSDP2 at 2 ranks under torchrun: every tensor bitwise equal after restore."""

import json

import pytest

from helpers import PROGRAMS, run_torchrun


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_roundtrip_bitwise(tmp_path, mode):
    out = tmp_path / "result.json"
    run_torchrun(2, PROGRAMS / "roundtrip.py", mode, tmp_path / "ckpt", out)
    result = json.loads(out.read_text())
    assert result["restored_step"] == 3
    # Three linear layers: weights and biases; AdamW keeps step, exp_avg, exp_avg_sq for each.
    assert result["model_tensors"] == 6
    assert len(result["optim_state_keys"]) == 18
    assert result["mismatched"] == []
    assert result["scheduler_equal"] is True
    assert result["extra"] == {"note": "rt", "epoch": 2}
    # keep_last=2: only the two newest steps remain, and no leftovers.
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step_0000000002", "step_0000000003"]


def test_corruption_seen_by_one_rank_stops_or_falls_back_on_all(tmp_path):
    # Ranks split the checksum work: with two files of DCP shards, rank 0
    # checks __1_0.distcp and rank 1 __0_0.distcp. A flipped byte that only
    # rank 0 sees must make both ranks raise (or both fall back), never load
    # apart or wait on each other.
    ckpt_dir = tmp_path / "ckpt"
    run_torchrun(2, PROGRAMS / "roundtrip.py", "ddp", ckpt_dir, tmp_path / "saved.json")
    shard = ckpt_dir / "step_0000000003" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    run_torchrun(2, PROGRAMS / "corrupt_load.py", "ddp", ckpt_dir, tmp_path / "raise", "error")
    for rank in (0, 1):
        got = json.loads((tmp_path / f"raise.{rank}.json").read_text())
        assert got.get("error") == "CorruptCheckpointError", got
        assert str(shard) in got["message"] and "step 3" in got["message"], got

    run_torchrun(2, PROGRAMS / "corrupt_load.py", "ddp", ckpt_dir, tmp_path / "fallback", "fallback")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"fallback.{rank}.json").read_text()) == {"restored": 2}
