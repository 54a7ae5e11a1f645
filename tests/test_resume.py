"""Bit-exact resume after SIGKILL, and crash consistency of an interrupted save."""

import json
import os

import torch

import shardckpt
from helpers import PROGRAMS, kill_job, run_torchrun, start_torchrun, wait_for


def _losses(out_dir, world=2):
    return [json.loads((out_dir / f"losses.rank{r}.json").read_text()) for r in range(world)]


def test_resume_after_sigkill_is_bitwise_equal(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run_torchrun(2, PROGRAMS / "train.py", tmp_path / "ck_a", straight, 20)

    log = tmp_path / "killed.log"
    job = start_torchrun(2, PROGRAMS / "train.py", tmp_path / "ck_b", resumed, 20, "--pause-after", 10, log_path=log)
    try:
        wait_for(lambda: (resumed / "paused").exists(), 240, "step 10 to commit", proc=job, log_path=log)
    finally:
        kill_job(job)  # SIGKILL to torchrun and every rank
    assert shardckpt.Checkpointer(local_dir=str(tmp_path / "ck_b"), preemption_signals=()).steps()[-1] == 10

    run_torchrun(2, PROGRAMS / "train.py", tmp_path / "ck_b", resumed, 20)

    a, b = _losses(straight), _losses(resumed)
    for rank in range(2):
        assert sorted(map(int, b[rank])) == list(range(1, 21))
        for step in range(11, 21):
            assert a[rank][str(step)] == b[rank][str(step)], f"rank {rank} step {step} loss differs"
    wa = torch.load(straight / "final.pt")
    wb = torch.load(resumed / "final.pt")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
