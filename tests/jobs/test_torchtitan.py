"""shardckpt as torchtitan's checkpoint manager: real torchtitan containers, 2 ranks (FSDP2, gloo) then 1.

The job (tests/programs/torchtitan_job.py) trains 12 steps, 4 per epoch of its
data, saving every 3. One 2-rank launch runs the uninterrupted reference (its
last step saved model-only, ``last_save_model_only=True``), then the same run
SIGKILLed at step 7 (step 6 committed: in epoch 1, after the boundary at 4). A
second launch resumes the killed run to step 12 and then reruns the finished
reference in its own directory. A 1-rank job then resumes the newest step of
the resumed run and trains on. Each test below checks one guarantee on those
runs (and one test builds managers in its own process: the batch shape read
from torchtitan's config).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import PROGRAMS, assert_plans_checked, child_env, kill_job, run_torchrun, start_torchrun, wait_for

from shardckpt.format import layout

JOB = PROGRAMS / "torchtitan_job.py"
STEPS = 12
LIGHT_WARNING = "resumed step 9, not the newer step(s) 12: they were saved without optimizer state"


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
    ref, ckpt = out / "ref", out / "ckpt"
    log = out / "first.log"
    proc = start_torchrun(2, JOB, str(out), "ref", f"ckpt={ref}", "model_only=1", "fence=3",
                          "+", "killed", f"ckpt={ckpt}", "kill=7", log_path=log)
    try:
        wait_for(lambda: (out / "killed-reached").exists(), 300, "step 7", proc, log)
    finally:
        kill_job(proc)
    two = run_torchrun(2, JOB, str(out), "resumed", f"ckpt={ckpt}", "+", "again", f"ckpt={ref}", "model_only=1")
    # A crashed save of step 15: DCP's files and metadata are there, the commit record is not.
    shutil.copytree(ckpt / layout.step_dirname(12), ckpt / layout.step_dirname(15))
    (ckpt / layout.step_dirname(15) / layout.MANIFEST_NAME).unlink()
    one = run_torchrun(1, JOB, str(out), "one", f"ckpt={ckpt}", "shard=0", "steps=14")
    return {"out": out, "ref": ref, "ckpt": ckpt, "first": log.read_text(), "two": two.stdout, "one": one.stdout}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def steps(out, tag: str, rank: int) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / f"{tag}-rank{rank}.jsonl").read_text().splitlines())}


def snap(out, name: str) -> dict:
    return torch.load(out / f"{name}.pt")


def kept_aside(ckpt) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith(".kept-"))


@pytest.mark.slow
@pytest.mark.parametrize("tag, restored", [("resumed", 6), ("again", 9)])
def test_a_resume_mid_epoch_trains_every_later_step_as_the_uninterrupted_run(runs, tag, restored):
    """After a SIGKILL in epoch 1 (step 6 restored) and after a rerun of the finished reference (step 9: its
    step 12 holds no optimizer state), every later step on every rank — loss, learning rate (warmup + linear
    decay: a new value every step), the batch and its epoch, across the boundary at 8 — and the final state are
    those of the uninterrupted run, bit for bit."""
    out = runs["out"]
    start = snap(out, f"{tag}-start")
    assert (start["loaded_step"], start["step"], start["dataloader_restored"]) == (restored, restored, True)
    for rank in (0, 1):
        ref, again = steps(out, "ref", rank), steps(out, tag, rank)
        assert sorted(again) == list(range(restored + 1, STEPS + 1))
        diverged = [s for s in again if again[s] != ref[s]]
        assert not diverged, (rank, [(ref[s], again[s]) for s in diverged[:2]])
    assert {tuple(steps(out, "resumed", 0)[s]["epoch"]) for s in range(7, 13)} == {(1, 1), (2, 2)}
    first, final = snap(out, "ref-final"), snap(out, f"{tag}-final")
    assert same(first["params"], final["params"]) and same(first["optim"], final["optim"])
    assert (first["step"], first["ntokens_seen"], first["last_epoch"], first["lr"]) == (
        final["step"], final["ntokens_seen"], final["last_epoch"], final["lr"])


@pytest.mark.slow
def test_the_save_plan_captures_what_dcp_captures(runs):
    """Every save that a save plan answered, on 2 FSDP2 ranks and on 1, is what DCP's own capture of the
    manager's state gives at that moment (tests/programs/plan_check.py)."""
    assert_plans_checked(runs["out"])


@pytest.mark.slow
def test_the_last_step_is_saved_in_full_and_a_resume_takes_it(runs):
    """With this manager's default (last_save_model_only=False) the run's last step 12 holds the optimizer
    state: the next run resumes it, not step 9, and no earlier save is ever kept aside."""
    manifest = layout.read_manifest(str(runs["ckpt"] / layout.step_dirname(STEPS)))
    assert manifest.kind == "full"
    assert snap(runs["out"], "one-start")["loaded_step"] == STEPS
    assert kept_aside(runs["ckpt"]) == []
    assert LIGHT_WARNING not in runs["one"]


@pytest.mark.slow
def test_a_model_only_last_step_is_named_when_a_resume_passes_it_over(runs):
    """last_save_model_only=True: the reference's step 12 is light; the rerun resumes step 9 (above) and says
    which step it passed over and why, and that the earlier save of 12 is kept aside when 12 is saved again."""
    assert layout.read_manifest(str(runs["ref"] / layout.step_dirname(STEPS))).kind == "light"
    assert runs["two"].count(LIGHT_WARNING) == 1
    # One WARNING says it all: the new branch from step 9 the restorer announces is in it, not in one of its own.
    warned = [line for line in runs["two"].splitlines() if "WARNING" in line and "shardckpt:" in line]
    assert len(warned) == 1, warned
    assert ("and a resume needs it. The next save starts a new branch from step 9: step(s) 12 are kept but no "
            "longer resumed by default, nor counted by retention. Steps 10..12 are trained again") in warned[0]
    assert "torchtitan: checkpoint.last_save_model_only=False, its manager's default" in warned[0]
    assert len(kept_aside(runs["ref"])) == 1 and "12" in kept_aside(runs["ref"])[0]


@pytest.mark.slow
def test_nothing_to_resume_is_said_once_per_fresh_start(runs):
    assert runs["first"].count("nothing to resume") == 2  # the reference and the killed run, on rank 0 only


@pytest.mark.slow
def test_one_rank_restores_the_newest_committed_step_bitwise_never_the_incomplete_one(runs):
    two, one = snap(runs["out"], "resumed-final"), snap(runs["out"], "one-start")
    assert one["step"] == STEPS  # step 15 has DCP metadata but no commit record: never picked
    assert one["ntokens_seen"] == two["ntokens_seen"] and one["last_epoch"] == two["last_epoch"]
    assert one["lr"] == two["lr"] and one["lr"] > 0
    assert same(two["params"], one["params"])  # FSDP2 shards of 2 ranks into one plain module
    assert same(two["optim"], one["optim"])
    assert "world_size=1" in one["plan"] and "saved_world_size=2" in one["plan"]
    assert snap(runs["out"], "one-final")["step"] == 14  # and it trains on


@pytest.mark.slow
def test_a_resume_at_another_world_size_knows_the_batch_shape_from_torchtitans_config(runs):
    """Every manifest records training.local_batch_size (2) and the accumulation steps (1) of the job's config; the
    1-rank resume's plan keeps the saved global batch of 4 (2 ranks x 2) with 2 accumulation steps, and since
    torchtitan takes its accumulation from its config (1 here), a WARNING says the global batch it trains with and
    the config that keeps it."""
    metadata = layout.read_manifest(str(runs["ckpt"] / layout.step_dirname(STEPS))).metadata
    assert (metadata["shardckpt.micro_batch_size"], metadata["shardckpt.grad_accum_steps"]) == (2, 1)
    plan = snap(runs["out"], "one-start")["plan"]
    for field in ("saved_world_size=2", "world_size=1", "saved_micro_batch=2", "micro_batch=2", "accum_steps=2",
                  "saved_global_batch=4", "global_batch=4", "exact=True"):
        assert f" {field}," in plan, (field, plan)
    assert "batch shape unknown" not in runs["one"]
    assert ("step 12 was saved with a global batch of 4 (2 rank(s) x training.local_batch_size 2 x 1 accumulation "
            "steps); this job trains with 2 (1 rank(s) x 2 x 1): torchtitan takes its accumulation steps from its "
            "config, not from the elastic plan. Remedy: training.global_batch_size=4 keeps the saved global batch."
            ) in runs["one"]
    # Later saves record the shape the job trains with, not the plan's.
    metadata = layout.read_manifest(str(runs["ckpt"] / layout.step_dirname(14))).metadata
    assert (metadata["shardckpt.micro_batch_size"], metadata["shardckpt.grad_accum_steps"]) == (2, 1)


def test_the_batch_shape_read_from_the_config_is_the_one_torchtitans_trainer_computes(tmp_path):
    """In one process (world size 1): the accumulation steps as torchtitan's Trainer computes them from
    training.global_batch_size when the state does not carry them; extra= wins over the config; nothing is
    recorded without a config in the states, nor when the data-parallel degree is not the world size (tensor or
    pipeline parallel: the plan would count a false global batch)."""
    pytest.importorskip("torchtitan.components.checkpointer.base")
    import types

    import torch.nn as nn
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.config.configs import TrainingConfig

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    def shape(states, dp_world_size=1, **extra):
        model = nn.Linear(4, 2)
        config = ShardckptCheckpointManager.Config(enable=True, folder=str(tmp_path / "ckpt"), extra=extra)
        manager = config.build(dataloader=None, model_parts=[model], optimizers=default_adamw().build(
            model_parts=[model]), lr_schedulers=None, states=states, base_folder="", dp_rank=0,
            dp_world_size=dp_world_size)
        try:
            meta = manager.ckpt.config.metadata
            return meta.get("shardckpt.micro_batch_size"), meta.get("shardckpt.grad_accum_steps")
        finally:
            manager.close()

    trainer = types.SimpleNamespace(config=types.SimpleNamespace(
        training=TrainingConfig(local_batch_size=3, global_batch_size=12)))
    assert shape({"train_state": trainer}) == (3, 4)  # 12 // (3 x 1 data-parallel rank)
    trainer.gradient_accumulation_steps = 2  # the Trainer's own count, when it has one
    assert shape({"train_state": trainer}) == (3, 2)
    assert shape({"train_state": trainer}, micro_batch_size=5, grad_accum_steps=1) == (5, 1)
    assert shape({"train_state": trainer}, dp_world_size=2) == (None, None)
    assert shape({"train_state": types.SimpleNamespace(step=0)}) == (None, None)


@pytest.mark.slow
def test_dataloader_state_is_dropped_with_a_warning_when_the_data_parallel_degree_changes(runs):
    assert snap(runs["out"], "one-start")["dataloader_restored"] is False
    assert "saved at data-parallel degree 2 and this run has 1" in runs["one"]
    assert "starts again from the beginning of its shard" in runs["one"]


@pytest.mark.slow
def test_staging_is_fenced_before_the_optimizer_step(runs):
    """The optimizer step of step 4 ran right after save(3) returned, while step 3 was being written:
    the committed step 3 holds the parameters as they were at the save."""
    import torch.distributed.checkpoint as dcp

    at_save = torch.load(runs["out"] / "params-at-save-3.pt")
    target = {"model": {k: torch.empty_like(v) for k, v in at_save.items()}}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(runs["ref"] / layout.step_dirname(3))))
    assert same(at_save, target["model"])
    final = snap(runs["out"], "ref-final")["params"]
    assert not same(at_save, final)  # training did move the parameters after the save
