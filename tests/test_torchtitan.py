"""shardckpt as torchtitan's checkpoint manager: real torchtitan containers, 2 ranks (FSDP2, gloo) then 1.

One 2-rank job (tests/programs/torchtitan_job.py) trains 8 steps with saves at
3 and 6, then resumes fresh objects from step 6 and trains to 8 again, saving
step 8; one 1-rank job then resumes the newest step. Each test below checks
one guarantee on those two runs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from helpers import PROGRAMS, child_env, run_torchrun
from shardckpt.format import layout

JOB = PROGRAMS / "torchtitan_job.py"


def test_importing_shardckpt_and_its_integrations_package_imports_no_framework():
    code = ("import sys, shardckpt, shardckpt.integrations; shardckpt.Checkpointer; "
            "print(sorted(m for m in ('lightning', 'torchtitan', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip(
        "torchtitan.components.checkpointer.base",
        reason="torchtitan >= 0.3 is not installed (bash scripts/setup.sh installs it; or pip install "
               "'shardckpt[torchtitan]')",
    )
    out = tmp_path_factory.mktemp("torchtitan")
    ckpt = out / "ckpt"
    two = run_torchrun(2, JOB, "train", str(out), str(ckpt))
    # A crashed save of step 9: DCP's files and metadata are there, the commit record is not.
    shutil.copytree(ckpt / layout.step_dirname(8), ckpt / layout.step_dirname(9))
    (ckpt / layout.step_dirname(9) / layout.MANIFEST_NAME).unlink()
    one = run_torchrun(1, JOB, "resume", str(out), str(ckpt))
    return {
        "out": out,
        "ckpt": ckpt,
        "log2": two.stdout,
        "log1": one.stdout,
        "uninterrupted": torch.load(out / "final-uninterrupted.pt"),
        "resumed": torch.load(out / "final-resumed.pt"),
        "one": torch.load(out / "resumed-1-rank.pt"),
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resume_at_two_ranks_is_bitwise_equal_to_the_uninterrupted_run(runs):
    first, again = runs["uninterrupted"], runs["resumed"]
    assert again["start"] == 6  # resumed from the newest committed step
    assert again["dataloader_restored"] is True
    assert same(first["params"], again["params"])
    assert same(first["optim"], again["optim"])
    assert (first["step"], first["ntokens_seen"], first["last_epoch"], first["lr"]) == (
        again["step"], again["ntokens_seen"], again["last_epoch"], again["lr"])


@pytest.mark.slow
def test_one_rank_restores_the_newest_committed_step_bitwise_never_the_incomplete_one(runs):
    two, one = runs["resumed"], runs["one"]
    assert one["step"] == 8  # step 9 has DCP metadata but no commit record: never picked
    assert one["ntokens_seen"] == two["ntokens_seen"] and one["last_epoch"] == two["last_epoch"]
    assert one["lr"] == two["lr"] and one["lr"] > 0
    assert same(two["params"], one["params"])  # FSDP2 shards of 2 ranks into one plain module
    assert same(two["optim"], one["optim"])
    assert "world_size=1" in one["plan"] and "saved_world_size=2" in one["plan"]


@pytest.mark.slow
def test_dataloader_state_is_dropped_with_a_warning_when_the_data_parallel_degree_changes(runs):
    assert runs["one"]["dataloader_restored"] is False
    assert "saved at data-parallel degree 2 and this run has 1" in runs["log1"]
    assert "starts again from the beginning of its shard" in runs["log1"]


@pytest.mark.slow
def test_staging_is_fenced_before_the_optimizer_step(runs):
    """The optimizer step of step 4 ran right after save(3) returned, while step 3 was being written:
    the committed step 3 holds the parameters as they were at the save."""
    import torch.distributed.checkpoint as dcp

    at_save = torch.load(runs["out"] / "params-at-save-3.pt")
    target = {"model": {k: torch.empty_like(v) for k, v in at_save.items()}}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(runs["ckpt"] / layout.step_dirname(3))))
    assert same(at_save, target["model"])
    final = runs["uninterrupted"]["params"]
    assert not same(at_save, final)  # training did move the parameters after the save
