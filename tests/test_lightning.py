"""ShardckptCheckpoint in a Lightning Trainer: real torchrun jobs on CPU (gloo), DDP and FSDP2.

Per strategy: a 2-rank fit saving every 2 steps is SIGKILLed at step 5 (step 4
committed); a crashed save of step 6 (DCP files, no commit record) is left
beside it; a new job resumes with ``fit(ckpt_path="last")`` and must train
steps 5.. bitwise as the killed job did. The resumed FSDP2 job gets SIGTERM on
every rank at step 7 (Lightning's signal handling stops the fit; step 7 is
saved). The resumed DDP job uploads to a moto S3 server; a 1-rank job with an
empty disk then resumes its newest step from there.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import PROGRAMS, child_env, kill_job, run_torchrun, skip_module_unless_installed, start_torchrun, wait_for

skip_module_unless_installed("lightning", "torchdata.stateful_dataloader",
                             reason="bash scripts/setup.sh installs them; or pip install 'shardckpt[lightning]'")

from s3server import BUCKET, S3Server, stop_uploaders  # noqa: E402
from shardckpt.format import layout  # noqa: E402

pytestmark = pytest.mark.slow
JOB = PROGRAMS / "lightning_job.py"
KILL_AT = 5


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


def params(out, tag, step):
    return torch.load(out / f"{tag}-params-{step}.pt")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_then_resume(out, strategy: str, env: dict, remote: str | None = None, sigterm_at: int | None = None) -> dict:
    ckpt = out / strategy
    log = out / f"{strategy}-killed.log"
    proc = start_torchrun(2, JOB, out, ckpt, strategy, f"{strategy}-killed", str(KILL_AT), env=env, log_path=log)
    try:
        wait_for(lambda: (out / f"{strategy}-killed-reached").exists(), 240, f"step {KILL_AT}", proc, log)
    finally:
        kill_job(proc)
    # A save of step 6 that crashed after DCP wrote its files and metadata, before the commit record.
    shutil.copytree(ckpt / layout.step_dirname(4), ckpt / layout.step_dirname(6))
    (ckpt / layout.step_dirname(6) / layout.MANIFEST_NAME).unlink()
    args = [str(out), str(ckpt), strategy, f"{strategy}-resumed", "-", remote or "-", "8",
            "-" if sigterm_at is None else str(sigterm_at)]
    job = run_torchrun(2, JOB, *args, env=env, timeout=300)
    result = json.loads((out / f"{strategy}-resumed-result.json").read_text())
    result["log"] = job.stdout
    return result


@pytest.fixture(scope="module")
def ddp(base, s3):
    return kill_then_resume(base, "ddp", child_env(**s3.env()), remote=f"s3://{BUCKET}/lightning-ddp")


@pytest.fixture(scope="module")
def fsdp2(base):
    return kill_then_resume(base, "fsdp2", child_env(), sigterm_at=7)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_sigkill_then_fit_last_resumes_bitwise(request, base, strategy):
    result = request.getfixturevalue(strategy)
    # "last" is the newest committed step (4), not the crashed step 6 beside it.
    assert result["restored_step"] == 4
    # The LightningModule's own hooks: what on_save_checkpoint added came back to on_load_checkpoint.
    assert result["loaded_extra"] == {"saves": 2, "step": 4}
    restored_from = params(base, f"{strategy}-killed", 4)
    assert not same(restored_from, params(base, f"{strategy}-killed", KILL_AT))
    # Steps the killed job trained after its last save come out bit for bit the same after the resume:
    # weights, optimizer, LR schedule, loops' dataloader position and per-rank RNG (dropout) restored.
    for step in range(5, KILL_AT + 1):
        assert same(params(base, f"{strategy}-killed", step), params(base, f"{strategy}-resumed", step)), step


def test_sigterm_saves_the_step_when_lightning_stops_the_fit(base, fsdp2):
    """SIGTERM on every rank at step 7 (not a multiple of every_n_train_steps=2): Lightning's own handler
    stops the loop on all ranks together; the callback commits step 7 before the process exits."""
    assert fsdp2["global_step"] == 7
    assert (base / "fsdp2" / layout.step_dirname(7) / layout.MANIFEST_NAME).exists()
    assert "SIGTERM: step 7 committed" in fsdp2["log"]


def test_ddp_and_fsdp2_train_the_same_steps(base, ddp, fsdp2):
    """Same model, data and seeds under both strategies: the resumed runs reach the same weights."""
    a, b = params(base, "ddp-resumed", 7), params(base, "fsdp2-resumed", 7)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


def test_one_rank_resumes_the_two_rank_run_from_s3_with_the_elastic_plan(base, s3, ddp):
    keys = s3.keys("lightning-ddp/")
    assert f"lightning-ddp/{layout.step_dirname(8)}/{layout.MANIFEST_NAME}" in keys
    out = base
    run_torchrun(1, JOB, str(out), str(out / "one-rank-empty-disk"), "ddp", "one", "-",
                 f"s3://{BUCKET}/lightning-ddp", "9", env=child_env(**s3.env()), timeout=300)
    result = json.loads((out / "one-result.json").read_text())
    assert result["restored_step"] == 8
    assert result["plan"] == [2, 1]  # saved at world size 2, restored at 1
    assert same(params(out, "ddp-resumed", 8), params(out, "one", "start"))
    assert result["global_step"] == 9  # and it trains on
