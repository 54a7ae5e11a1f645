"""ShardckptCheckpoint in a Lightning Trainer: real torchrun jobs on CPU (gloo), DDP and FSDP2.

Per strategy, one 2-rank launch runs an uninterrupted 20-step fit (8 steps per
epoch, saved every 4 steps, a ``StepLR`` stepping the LR at steps 6, 12, 18)
and then the same fit, saved every 3 steps, SIGKILLed at step 11, in epoch 1
(step 9 committed; a crashed save of step 12, DCP files without a commit
record, is left beside it). A second launch resumes a copy of its directory
with ``fit(ckpt_path="last")`` and must train every step after the restore,
across the LR steps at 12 and 18 and the epoch boundary at 16, as the uninterrupted fit
did: loss, LR and the batch on every rank, and the final weights, bit for bit.
The guide's two recipes: DDP shuffles each rank's part with torchdata's
``RandomSampler`` and a generator that differs by rank (its state is saved per
rank), FSDP2 uses torch's ``DistributedSampler`` (its order is a function of
the epoch). The first DDP launch also runs two samplers that resume in another
order (their warnings): a 6-step fit with Lightning's sampler wrapper, which the
second launch resumes from its step 4 (epoch 0: the next step's batches differ,
as its warning says), and one step of the other; the resumed DDP fit uploads to a
moto S3 server, and a 1-rank job with an empty disk then resumes its last step
from there. The second FSDP2 launch also resumes the uninterrupted fit's step
16, saved after the last batch of epoch 1, and starts the resumed fit again to
stop it by SIGTERM on every rank.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    PROGRAMS,
    assert_plans_checked,
    child_env,
    kill_job,
    run_torchrun,
    skip_module_unless_installed,
    start_torchrun,
    wait_for,
)

skip_module_unless_installed("lightning", "torchdata.stateful_dataloader",
                             reason="bash scripts/setup.sh installs them; or pip install 'shardckpt[lightning]'")

from s3server import BUCKET, S3Server, stop_uploaders  # noqa: E402

from shardckpt.format import layout  # noqa: E402

pytestmark = pytest.mark.slow
JOB = PROGRAMS / "lightning_job.py"
STEPS = 20
KILLED_AT, RESTORED = 11, 9  # in epoch 1 (steps 9..16); saves every 3 steps
AUTO_STEPS, AUTO_RESTORED = 6, 4  # Lightning's sampler wrapper: a resume in epoch 0 (8 steps per epoch)
SAMPLER_WARNINGS = ("Lightning replaced the training dataloader's sampler (",
                    "the training dataloader's RandomSampler draws from the loader's own generator")


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lightning")
    yield path
    stop_uploaders(path, grace_s=30.0)


def steps(out, tag: str, rank: int) -> dict[int, dict]:
    lines = (out / f"{tag}-rank{rank}.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


def params(out, tag, when):
    return torch.load(out / f"{tag}-params-{when}.pt")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def result(out, tag: str) -> dict:
    return json.loads((out / f"{tag}-result.json").read_text())


def committed(ckpt, step: int) -> bool:
    return (ckpt / layout.step_dirname(step) / layout.MANIFEST_NAME).exists()


def kill_then_resume(out, strategy: str, first: list[str], resumed: list[str], env: dict, between=None) -> dict:
    """One launch: the uninterrupted fit (saved every 4 steps), ``first`` jobs, then the fit SIGKILLed at step 11
    (saved every 3: step 9 committed); a crashed save of step 12 is left beside it. ``between()`` runs next. A
    second launch resumes a copy of its directory, then runs ``resumed`` jobs."""
    common = [f"strategy={strategy}", "sampler=" + ("rank" if strategy == "ddp" else "dist")]
    ckpt = out / f"{strategy}-killed"
    log = out / f"{strategy}-first.log"
    proc = start_torchrun(2, JOB, str(out), f"{strategy}-ref", f"ckpt={out / f'{strategy}-ref'}", "every=4", *common,
                          "+", *first, f"{strategy}-killed", f"ckpt={ckpt}", f"kill={KILLED_AT}", *common,
                          env=env, log_path=log)
    try:
        wait_for(lambda: (out / f"{strategy}-killed-reached").exists(), 300, f"step {KILLED_AT}", proc, log)
    finally:
        kill_job(proc)
    # A save of step 12 that crashed after DCP wrote its files and metadata, before the commit record.
    shutil.copytree(ckpt / layout.step_dirname(RESTORED), ckpt / layout.step_dirname(12))
    (ckpt / layout.step_dirname(12) / layout.MANIFEST_NAME).unlink()
    copied = out / f"{strategy}-copied"  # resumed from a copy: nothing in a step may depend on where it was written
    shutil.copytree(ckpt, copied)
    # The uninterrupted fit's steps up to 16, saved after the last batch of epoch 1.
    shutil.copytree(out / f"{strategy}-ref", out / f"{strategy}-edge")
    shutil.rmtree(out / f"{strategy}-edge" / layout.step_dirname(STEPS))
    if between is not None:
        between()
    job = run_torchrun(2, JOB, str(out), f"{strategy}-resumed", f"ckpt={copied}", *common, *resumed, env=env,
                       timeout=300)
    return {"first": log.read_text(), "resumed": job.stdout}


@pytest.fixture(scope="module")
def ddp(base, s3):
    """Also: the two samplers that resume in another order (their warnings): Lightning's wrapper in a fit of
    AUTO_STEPS steps (saved every 2), resumed in the second launch from its step AUTO_RESTORED (epoch 0), and one
    step of the other; the resumed run uploads to the S3 server."""
    out = base
    first = ["ddp-auto", f"ckpt={out / 'ddp-auto'}", "sampler=auto", f"steps={AUTO_STEPS}", "every=2", "+",
             "ddp-shared", f"ckpt={out / 'ddp-shared'}", "sampler=shared", "steps=1", "+"]

    def newest_auto_step_lost() -> None:
        shutil.copytree(out / "ddp-auto", out / "ddp-auto-again")
        shutil.rmtree(out / "ddp-auto-again" / layout.step_dirname(AUTO_STEPS))

    resumed = [f"remote=s3://{BUCKET}/lightning-ddp", "+", "ddp-auto-again", f"ckpt={out / 'ddp-auto-again'}",
               "sampler=auto", f"steps={AUTO_STEPS}", "every=2"]
    return kill_then_resume(out, "ddp", first, resumed, child_env(**s3.env()), between=newest_auto_step_lost)


@pytest.fixture(scope="module")
def fsdp2(base):
    """Also: a fit resumed from the uninterrupted fit's step 16 (saved after the last batch of epoch 1), and the
    resumed fit started again to 24 steps, getting SIGTERM on every rank at step 22."""
    out = base
    common = ["strategy=fsdp2", "sampler=dist"]
    more = ["+", "fsdp2-edge", f"ckpt={out / 'fsdp2-edge'}", "every=4", *common,
            "+", "fsdp2-term", f"ckpt={out / 'fsdp2-copied'}", "steps=24", "sigterm=22", *common]
    return kill_then_resume(out, "fsdp2", [], more, child_env())


@pytest.mark.parametrize("strategy, tag, restored, epochs", [
    ("ddp", "resumed", RESTORED, {1, 2}), ("fsdp2", "resumed", RESTORED, {1, 2}), ("fsdp2", "edge", 16, {2})])
def test_a_resume_after_an_epoch_boundary_trains_every_later_step_as_the_uninterrupted_fit(
        request, base, strategy, tag, restored, epochs):
    """Killed in epoch 1 (step 9 restored, mid-epoch) and resumed from the step saved after the last batch of
    epoch 1 (16): every later step, across the LR step(s) at 12 and 18 and the epoch boundary at 16, on every rank
    (neither restored step is a multiple of the StepLR's 6 steps: a scheduler that was not restored steps elsewhere)."""
    request.getfixturevalue(strategy)
    resumed = result(base, f"{strategy}-{tag}")
    # "last" is the newest committed step, never the crashed step 12 beside it.
    assert resumed["restored_step"] == restored
    # The LightningModule's own hooks: what on_save_checkpoint added came back to on_load_checkpoint.
    assert resumed["loaded_extra"] == {"saves": restored // (3 if tag == "resumed" else 4), "step": restored}
    assert resumed["global_step"] == STEPS
    for rank in (0, 1):
        ref, again = steps(base, f"{strategy}-ref", rank), steps(base, f"{strategy}-{tag}", rank)
        after = list(range(restored + 1, STEPS + 1))
        assert sorted(again) == after
        assert {again[s]["epoch"] for s in after} == epochs
        assert len({again[s]["lr"] for s in after}) >= 2
        diverged = [s for s in after if again[s] != ref[s]]
        assert not diverged, (rank, diverged[:3], [(ref[s], again[s]) for s in diverged[:1]])
    assert same(params(base, f"{strategy}-ref", "end"), params(base, f"{strategy}-{tag}", "end"))


def test_the_save_plan_captures_what_dcp_captures_on_every_strategy(base, ddp, fsdp2):
    """Every save that a save plan answered (DDP and FSDP2 fits) is what DCP's own capture of the callback's
    state gives at that moment: the same keys, tensors and values (tests/programs/plan_check.py)."""
    assert_plans_checked(base)


def test_a_fit_that_ends_at_max_steps_commits_its_final_step(base, ddp, fsdp2):
    """20 steps saved every 3: the last save due by the interval is 18, and step 20 is committed too."""
    for ckpt in (base / "ddp-copied", base / "fsdp2-copied", base / "ddp-auto", base / "ddp-shared"):
        final = {"ddp-auto": AUTO_STEPS, "ddp-shared": 1}.get(ckpt.name, STEPS)
        assert committed(ckpt, final), ckpt
    assert committed(base / "ddp-killed", RESTORED) and not committed(base / "ddp-killed", 12)


def test_sigterm_saves_the_step_when_lightning_stops_the_fit(base, fsdp2):
    """SIGTERM on every rank at step 22 (not a multiple of every_n_train_steps=3): Lightning's own handler
    stops the loop on all ranks together; the callback commits step 22 before the process exits."""
    term = result(base, "fsdp2-term")
    assert (term["restored_step"], term["global_step"]) == (STEPS, 22)
    assert committed(base / "fsdp2-copied", 22) and not committed(base / "fsdp2-copied", 23)
    assert "SIGTERM: step 22 committed" in fsdp2["resumed"]


def test_a_run_resumed_from_a_copied_directory_finds_its_callback_state(ddp):
    """The callback keeps no path in its state: Lightning does not ask for a callback keyed by the old path."""
    assert "Please add the following callbacks" not in ddp["resumed"]
    assert "ShardckptCheckpoint{" not in ddp["resumed"]


def test_samplers_whose_order_no_checkpoint_restores_are_named_with_the_remedy(ddp, fsdp2):
    """Two setups seen to resume in another order: Lightning's own sampler wrapper, and torchdata's RandomSampler
    drawing from the loader's generator. Each fit that uses one gets its warning once (the wrapper's: its first fit
    and its resumed one); the setups the guide recommends (the runs compared above) get none."""
    wrapper, shared = SAMPLER_WARNINGS
    for warning in SAMPLER_WARNINGS:
        assert ddp["first"].count(warning) == 1, warning
        assert warning not in fsdp2["first"] + fsdp2["resumed"]
    assert ddp["resumed"].count(wrapper) == 1 and shared not in ddp["resumed"]
    assert ddp["first"].count("Remedy: a sampler whose order a checkpoint restores") == 2


def test_the_sampler_wrapper_warning_says_what_a_resume_in_epoch_0_does(base, ddp):
    """Lightning's DistributedSamplerWrapper (over torchdata's RandomSampler of StatefulDataLoader(shuffle=True)):
    the fit resumed from step 4, in epoch 0, trains step 5 on other batches than the uninterrupted fit on some rank
    (steps 1..4 were the same run): the order differs from the first step after the restored one in epoch 0 too, as
    the warning says, with the wrapped sampler named."""
    again = result(base, "ddp-auto-again")
    assert (again["restored_step"], again["global_step"]) == (AUTO_RESTORED, AUTO_STEPS)
    first = AUTO_RESTORED + 1
    batches = [(steps(base, "ddp-auto", r)[first], steps(base, "ddp-auto-again", r)[first]) for r in (0, 1)]
    assert all(ref["epoch"] == resumed["epoch"] == 0 for ref, resumed in batches)
    assert any(ref["batch"] != resumed["batch"] for ref, resumed in batches), batches
    said = ("shardckpt: Lightning replaced the training dataloader's sampler (RandomSampler) with its "
            "DistributedSamplerWrapper (use_distributed_sampler=True): a resume in any epoch, epoch 0 included, "
            "differs from the saved run from the first step after the restored one (the rest of that epoch sees "
            "some samples twice and skips others), and every later epoch is in another order too. The wrapper draws "
            "the wrapped sampler's order anew each time the loader makes an iterator")
    when = "the restored position counts samples into that new order. Remedy: a sampler whose order a checkpoint"
    for log in (ddp["first"], ddp["resumed"]):
        assert said in log and when in log


def test_one_rank_resumes_the_two_rank_run_from_s3_keeping_the_global_batch(base, s3, ddp):
    """The DDP run's final step 20 (epoch 2, 4 of 8 batches in) from the bucket, at 1 rank, trained on to the end
    of max_epochs=3: accumulate_grad_batches 1 -> 2 keeps the global batch of 8, a warning says the data
    position of another split is applied, and the fit's last step (max_epochs) is committed."""
    keys = s3.keys("lightning-ddp/")
    assert f"lightning-ddp/{layout.step_dirname(STEPS)}/{layout.MANIFEST_NAME}" in keys
    out = base
    job = run_torchrun(1, JOB, str(out), "one", f"ckpt={out / 'one-rank-empty-disk'}",
                       f"remote=s3://{BUCKET}/lightning-ddp", "steps=-1", "epochs=3",
                       env=child_env(**s3.env()), timeout=300)
    one = result(out, "one")
    assert one["restored_step"] == STEPS
    assert same(params(out, "ddp-resumed", "end"), params(out, "one", "start"))
    plan = one["plan"]
    assert (plan["saved_world_size"], plan["world_size"], plan["saved_global_batch"], plan["global_batch"],
            plan["accum_steps"], plan["exact"]) == (2, 1, 8, 8, 2, True)
    assert one["accumulate_grad_batches"] == 2
    assert "saved by 2 ranks and resumes at 1" in job.stdout and "resume at 2 ranks" in job.stdout
    # The 1-rank loader holds 16 batches per epoch; 4 were consumed by the saved position: 12 left, 2 per step.
    trained = steps(out, "one", 0)
    assert sorted(trained) == list(range(STEPS + 1, STEPS + 7)) and one["global_step"] == STEPS + 6
    assert all(trained[s]["epoch"] == 2 for s in trained)
    assert committed(out / "one-rank-empty-disk", STEPS + 6)
