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
