"""Checkpoint policies at 2 ranks (gloo under torchrun), on the local tier and the test S3 server.

Two launches in all: the local-tier jobs share one, the S3 jobs another.

Best-by-metric retention and load(step="best"); light and full steps, and a
preemption save full where the schedule says light; the run config recorded
and a changed one warned about; every_seconds, fixed and "auto", agreed
across the ranks; trainable-only saves of adapters on a frozen base (loaded
at 2 ranks and at 1); remote_every with a preemption save uploaded out of
turn; the auto interval from measured cost.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import PROGRAMS, child_env, run_torchrun  # noqa: E402
from s3server import BUCKET, stop_uploaders  # noqa: E402

from shardckpt import Checkpointer, cli, stores  # noqa: E402
from shardckpt.options import CheckpointConfig  # noqa: E402
from shardckpt.remote import listing as remote_listing
from shardckpt.saving import policy

PROG = PROGRAMS / "policies.py"


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """One 2-rank launch for the local-tier jobs: best-light-config, then trainable.

    name -> (its checkpoint root, its OUT directory)."""
    base = tmp_path_factory.mktemp("policies")
    dirs = {name: (base / name / "ckpt", base / name / "out") for name in ("best-light-config", "trainable")}
    args = []
    for name, (root, out) in dirs.items():
        out.mkdir(parents=True)
        args += (["+"] if args else []) + [name, root, out]
    run_torchrun(2, PROG, *args, timeout=300)
    return dirs


def results(out, world=2):
    got = [json.loads((out / f"result.{r}.json").read_text()) for r in range(world)]
    assert got[0] == got[1], got  # every rank saw the same
    return got[0]


def remote_steps(url: str) -> list[int]:
    store = stores.open_store(url)
    try:
        return remote_listing.remote_steps(store, stores.Deadline(60))
    finally:
        store.close()


def test_best_light_full_and_run_config(local_runs, capsys):
    root, out = local_runs["best-light-config"]
    got = results(out)
    # val_loss 5, 3, 4, 1, 6, 7 with keep_last=2, keep_best=1: steps 4, 5, 6 remain; the best is 4
    assert got["best_steps"] == [4, 5, 6]
    assert got["best_loaded"] == 4 and got["best_params_equal"] is True
    # every third save full: kinds 1 F, 2 L, 3 L, 4 F, 5 L, 6 L, 7 F, 8 L; keep_last=2 of each kind
    assert got["light_steps"] == [4, 6, 7, 8]
    assert got["default_loaded"] == 7 and got["default_params_equal"] and got["default_has_optimizer_state"]
    assert got["light_loaded"] == 8 and got["light_params_equal"] and got["light_left_optimizer_empty"]
    warnings = (out / "warnings.log").read_text()
    assert ("run_config differs from the one step 4 was saved with (2 key(s)): extra: '(absent)' -> 1; "
            "lr: 0.1 -> 0.2" in warnings), warnings
    assert "step 8 is a light step (no optimizer state): optimizer keep(s) the state they have" in warnings
    # ls marks the best step and the kinds; inspect shows the run
    assert cli.main(["ls", str(root / "best"), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert [s for s, r in rows.items() if r["best"]] == [4] and rows[4]["metrics"] == {"val_loss": 1.0}
    assert cli.main(["ls", str(root / "light")]) == 0
    listing = capsys.readouterr().out
    assert [line.split()[5] for line in listing.splitlines()[2:]] == ["full", "light", "full", "light"]
    assert cli.main(["inspect", str(root / "best"), "--step", "4"]) == 0
    shown = capsys.readouterr().out
    assert 'run config: {"lr": 0.1, "model": {"width": 8}}' in shown and "on 2 x cpu" in shown
    assert "policies.py best-light-config" in shown

    # A preemption save is full: save 3 is light by full_every=3, but the signal made it the last one.
    assert got["preempt_light"] == {"saved": [1, 2, 3], "preempted": True,
                                    "kinds": {"1": "full", "2": "light", "3": "full"}}

    # every_seconds: every rank saved at the same calls (the vote), never sooner than the interval
    # after the previous save on rank 0's clock, and the first save came at the second call (the
    # first call's vote is acted on by the next).
    for key, interval in (("every_fixed", 0.6), ("every_auto", None)):
        every = got[key]
        interval = interval or every["rank0_interval"]
        assert every["saved"][0] == 2 and len(every["saved"]) >= 2, every
        assert all(gap >= interval for gap in every["rank0_gaps"]), (key, every)
    assert got["every_auto"]["rank0_interval"] >= policy.AUTO_MIN_S
    info = (out / "info.log").read_text()
    assert "every_seconds=auto: saving every " in info and "1 s between failures" in info, info


# Policies, not the S3 protocol, are under test here: one server is enough (the remote-tier tests run on both).
ONE_SERVER = pytest.mark.parametrize("s3", ["moto"], indirect=True)


@pytest.fixture(scope="module")
def remote_runs(s3, tmp_path_factory):
    """One 2-rank launch for the S3 jobs, each under its own prefix: best-remote, then remote-every.

    name -> (its checkpoint root, its OUT directory, its remote URL)."""
    s3.reset()
    base = tmp_path_factory.mktemp("policies-s3")
    runs = {name: (base / name / "ckpt", base / name / "out", f"s3://{BUCKET}/{prefix}")
            for name, prefix in (("best-remote", "best"), ("remote-every", "every"))}
    args = []
    for name, (root, out, url) in runs.items():
        out.mkdir(parents=True)
        args += (["+"] if args else []) + [name, root, url, out]
    try:
        run_torchrun(2, PROG, *args, env=child_env(**s3.env()), timeout=300)
    finally:
        stop_uploaders(base, grace_s=30.0)
    return runs


@ONE_SERVER
def test_best_by_metric_on_the_s3_server(remote_runs):
    _, out, url = remote_runs["best-remote"]
    got = results(out)
    assert got["local_steps"] == [4, 5, 6]
    assert remote_steps(url) == [4, 5, 6]  # remote_keep_last=2 and keep_best=1 there too
    assert got["best_from_remote"] == 4 and got["params_equal"] is True


@ONE_SERVER
def test_remote_every_uploads_every_third_step_and_the_preemption_save(remote_runs, capsys):
    root, out, url = remote_runs["remote-every"]
    got = results(out)
    # rank 1's signal after save 4 is agreed by the vote started at save 5: save 6 is the preemption save
    assert got["saved"] == [1, 2, 3, 4, 5, 6] and got["preempted_at"] == 6
    # the first save, then every third (1, 4, 7, ...), and the preemption save 6 out of turn
    assert remote_steps(url) == [1, 4, 6]
    assert got["local_steps"] == [5, 6]  # keep_last=2: a step kept local only rotates out freely
    assert cli.main(["ls", str(root / "node")]) == 0
    listing = capsys.readouterr().out
    assert "not for upload (remote_every)" in next(line for line in listing.splitlines() if line.split()[0] == "5")
    assert "local+remote" in next(line for line in listing.splitlines() if line.split()[0] == "6")


def test_trainable_only_saves_the_adapters_and_checks_the_base(local_runs, caplog):
    root, out = local_runs["trainable"]
    got = results(out)
    assert got["sizes"]["adapters"] <= 0.05 * got["sizes"]["full"], got["sizes"]
    assert got["frozen_keys"] == sorted([f"base.{i}.{w}" for i in range(4) for w in ("weight", "bias")]
                                        + ["norm.weight", "norm.bias"])
    # optim_restored: every optimizer state tensor equal to the one saved, value by value
    assert got["loaded"] == 2 and got["bitwise"] and got["buffers_equal"] and got["optim_restored"]
    warnings = (out / "warnings.log").read_text()
    assert warnings.count("frozen base was left out") == 1, warnings  # the other base only
    assert "values differ: model.base.0.bias, model.base.0.weight" in warnings

    # Saved at 2 ranks, loaded at 1 (this process, no process group): the base fingerprint does not
    # depend on the world size, so the same base loads without a warning, another one with.
    sys.path.insert(0, str(PROGRAMS))
    import policies as prog

    saved = torch.load(out / "trainable.pt")
    for base_seed, warned in ((0, False), (1, True)):
        model = prog.Adapted(base_seed)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardckpt"):
            with Checkpointer(local_dir=str(root / "adapters"), preemption_signals=()) as ckpt:
                assert ckpt.load({"model": model, "optimizer": optim}) == 2
        assert ("frozen base was left out" in caplog.text) == warned, caplog.text
        params = dict(model.named_parameters())
        assert all(torch.equal(params[n], v) for n, v in saved["params"].items())
        assert prog.optimizer_states_equal(optim.state_dict(), saved["optimizer"])


def test_auto_interval_from_measured_cost(caplog):
    config = CheckpointConfig(local_dir="unused", every_seconds="auto", mtbf_s=3600, preemption_signals=())
    chooser = policy.SavePolicy(config, groups=None)
    assert chooser.interval_s() is None  # nothing measured yet: the first call saves
    with caplog.at_level("INFO", logger="shardckpt"):
        for blocked in (0.4, 0.5, 0.6):
            chooser.record_blocked(blocked)
        chooser.record_committed(2.0)
    assert chooser.interval_s() == pytest.approx((2 * 0.5 * 3600) ** 0.5)  # 60 s: sqrt(2 x median x MTBF)
    # logged when first chosen, and again only when it moves by more than 20 %
    assert "every_seconds=auto: saving every 54 s = sqrt(2 x 0.400 s blocked per save x 3600 s" in caplog.text
    assert "saving every 60 s" not in caplog.text
    chooser.record_blocked(8.0)
    chooser.record_blocked(8.0)  # the cost grew: the interval follows (median of the last five)
    assert chooser.interval_s() == pytest.approx((2 * 0.6 * 3600) ** 0.5)
    chooser.record_blocked(8.0)
    assert chooser.interval_s() == pytest.approx((2 * 8.0 * 3600) ** 0.5)
    assert "saving every 66 s" in caplog.text and "saving every 240 s" in caplog.text
    assert "plus 2.0 s until a save is committed" in caplog.text
    assert policy.auto_interval(0.0, 3600) == policy.AUTO_MIN_S
    with pytest.raises(Exception, match="every_seconds='auto' needs mtbf_s"):
        CheckpointConfig(every_seconds="auto")
