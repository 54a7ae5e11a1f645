"""Elastic plan, LR application and the global-position sampler, in one process."""

from __future__ import annotations

import math

import pytest
import torch

import shardckpt
from shardckpt.restoring import elastic
from shardckpt.restoring.elastic import ElasticPolicy, apply_lr_factor, compute_plan
from shardckpt.state.sampler import ResumableSampler, rank_slice


def _plan(policy=None, **kw):
    args = dict(step=10, saved_world_size=8, world_size=4, saved_micro_batch=2, saved_accum_steps=1)
    args.update(kw)
    return compute_plan(policy or ElasticPolicy(), **args)


# ------------------------------------------------------------------ plans


def test_keep_global_batch_recomputes_accumulation():
    plan = _plan()
    assert (plan.accum_steps, plan.global_batch, plan.lr_factor, plan.exact) == (2, 16, 1.0, True)
    assert _plan(world_size=1).accum_steps == 8
    assert _plan(world_size=16, saved_accum_steps=4).accum_steps == 2  # 64 = 16 x 2 x 2
    assert _plan(world_size=4, micro_batch=4).accum_steps == 1
    assert _plan(world_size=8).accum_steps == 1 and not _plan(world_size=8).resharded


def test_inexact_global_batch_errors_by_default_and_names_the_remedy():
    with pytest.raises(shardckpt.ConfigError) as info:
        _plan(world_size=3)
    text = str(info.value)
    assert "step 10" in text and "16" in text and "on_inexact='nearest'" in text


def test_inexact_nearest_rounds_and_says_so():
    plan = _plan(ElasticPolicy(on_inexact="nearest"), world_size=3)  # 16 / 6 = 2.67 -> 3
    assert (plan.accum_steps, plan.global_batch, plan.exact, plan.lr_factor) == (3, 18, False, 1.0)
    assert "not exact" in plan.summary()
    assert _plan(ElasticPolicy(on_inexact="nearest"), world_size=40).accum_steps == 1  # never 0


@pytest.mark.parametrize("rule, expect", [("linear", 6 / 16), ("sqrt", math.sqrt(6 / 16))])
def test_scale_lr_rules(rule, expect):
    plan = _plan(ElasticPolicy(batch="scale_lr", lr_rule=rule), world_size=3)
    assert (plan.accum_steps, plan.global_batch, plan.lr_factor) == (1, 6, expect)
    same = _plan(ElasticPolicy(batch="scale_lr", lr_rule=rule, accum_steps=2), world_size=4)
    assert (same.global_batch, same.lr_factor) == (16, 1.0)


def test_unknown_shape_plan_is_never_exact_and_says_what_to_set(caplog):
    plan = _plan(saved_micro_batch=None)  # 8 -> 4 ranks: the global batch halves unless something else changes
    assert plan.global_batch is None and plan.lr_factor == 1.0 and not plan.exact
    text = plan.summary()
    assert "batch shape unknown: the global batch becomes x0.5" in text and "set micro_batch_size" in text
    same_world = _plan(saved_micro_batch=None, world_size=8)
    assert not same_world.exact and "batch shape unknown" in same_world.summary()
    # load() logs the first at WARNING (another world size), the second at INFO (nothing changed by itself).
    for p, level in ((plan, "WARNING"), (same_world, "INFO")):
        caplog.clear()
        with caplog.at_level("INFO", logger="shardckpt"):
            elastic.after_restore({}, step=10, saved_world_size=8, world_size=p.world_size, manifest_metadata={},
                                  policy=None, config=None, log_plan=True)
        assert [r.levelname for r in caplog.records if "elastic plan" in r.getMessage()] == [level]
    with pytest.raises(shardckpt.ConfigError, match="micro_batch_size"):
        _plan(ElasticPolicy(require_shape=True), saved_micro_batch=None)
    with pytest.raises(shardckpt.ConfigError, match="micro_batch_size"):
        _plan(ElasticPolicy(require_shape=True), saved_micro_batch=None)


def test_summary_is_one_line_and_names_rng_behaviour():
    down = _plan(epoch=0, samples_consumed=160).summary()
    assert "\n" not in down and "world 8 -> 4" in down and "epoch 0 sample 160" in down
    assert "RNG of saved ranks 4..7 dropped" in down
    up = _plan(saved_world_size=4, world_size=8, saved_accum_steps=2).summary()
    assert "ranks 4..7 seeded from (step, rank)" in up


def test_policy_and_config_validation_name_the_field():
    with pytest.raises(shardckpt.ConfigError, match="ElasticPolicy.batch"):
        ElasticPolicy(batch="keep")
    with pytest.raises(shardckpt.ConfigError, match="ElasticPolicy.lr_rule"):
        ElasticPolicy(lr_rule="cubic")
    with pytest.raises(shardckpt.ConfigError, match="ElasticPolicy.micro_batch"):
        ElasticPolicy(micro_batch=0)
    with pytest.raises(shardckpt.ConfigError, match="micro_batch_size"):
        shardckpt.CheckpointConfig(micro_batch_size=0)
    with pytest.raises(shardckpt.ConfigError, match="grad_accum_steps"):
        shardckpt.CheckpointConfig(micro_batch_size=2, grad_accum_steps=0)
    config = shardckpt.CheckpointConfig(micro_batch_size=2, grad_accum_steps=3, metadata={"run": "a"})
    assert config.metadata == {"run": "a", elastic.MICRO_BATCH_KEY: 2, elastic.ACCUM_KEY: 3}
    env = shardckpt.CheckpointConfig.from_env({"SHARDCKPT_MICRO_BATCH_SIZE": "4", "SHARDCKPT_GRAD_ACCUM_STEPS": "2"})
    assert (env.micro_batch_size, env.grad_accum_steps) == (4, 2)


# ------------------------------------------------------------------ LR


def _opt():
    model = torch.nn.Linear(3, 2)
    return torch.optim.AdamW(model.parameters(), lr=0.1)


def test_apply_lr_factor_to_lambda_and_step_schedulers():
    opt = _opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        opt.step()
        sched.step()
    apply_lr_factor(0.5, [opt], [sched])
    assert opt.param_groups[0]["lr"] == 0.1 / 4 * 0.5
    assert opt.param_groups[0]["initial_lr"] == 0.05 and sched.base_lrs == [0.05]
    opt.step()
    sched.step()
    assert math.isclose(opt.param_groups[0]["lr"], 0.05 / 5, rel_tol=1e-15)

    opt2 = _opt()
    step = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.1)
    for _ in range(2):
        opt2.step()
        step.step()
    apply_lr_factor(2.0, [opt2], [step])
    assert math.isclose(opt2.param_groups[0]["lr"], 0.1 * 0.1 * 2.0, rel_tol=1e-15)
    for _ in range(2):
        opt2.step()
        step.step()
    assert math.isclose(opt2.param_groups[0]["lr"], 0.1 * 0.01 * 2.0, rel_tol=1e-12)


def test_apply_lr_factor_recurses_into_sequential_and_scales_eta_min():
    opt = _opt()
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)
    seq = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
    apply_lr_factor(3.0, [opt], [seq])
    assert math.isclose(cos.eta_min, 0.03) and all(math.isclose(x, 0.3) for x in cos.base_lrs)
    assert math.isclose(opt.param_groups[0]["initial_lr"], 0.3)


def test_apply_lr_factor_one_is_a_no_op():
    opt = _opt()
    apply_lr_factor(1.0, [opt], [])
    assert opt.param_groups[0]["lr"] == 0.1


# ------------------------------------------------------------------ sampler


def _consume(samplers, steps, accum):
    """Drive one sampler per rank for ``steps`` optimizer steps; returns the ids per step."""
    out = []
    iters = [iter(s) for s in samplers]
    b = samplers[0].batch_size
    for _ in range(steps):
        ids = []
        for _ in range(accum):
            for it in iters:
                ids += [next(it) for _ in range(b)]
        out.append(sorted(ids))
    return out


def _ranks(world, b, accum=1, n=200):
    return [ResumableSampler(n, batch_size=b, rank=r, world_size=world, seed=5, accum_steps=accum)
            for r in range(world)]


@pytest.mark.parametrize("world, b", [(4, 2), (2, 4), (16, 1), (1, 16)])
def test_same_samples_per_step_at_any_world_size_that_keeps_the_global_batch(world, b):
    straight = _consume(_ranks(8, 2), 12, 1)
    first = _ranks(8, 2)
    head = _consume(first, 5, 1)
    state = first[0].state_dict()
    resumed = _ranks(world, b, accum=16 // (world * b))
    for s in resumed:
        s.load_state_dict(state)
    assert resumed[0].saved_layout == {"world_size": 8, "batch_size": 2, "accum_steps": 1}
    tail = _consume(resumed, 7, 16 // (world * b))
    assert head + tail == straight
    seen = [i for step in straight for i in step]
    assert len(seen) == len(set(seen)) == 192


def test_uneven_world_continues_without_skips_or_repeats():
    first = _ranks(8, 2)
    head = [i for step in _consume(first, 10, 1) for i in step]
    resumed = _ranks(3, 2)
    for s in resumed:
        s.load_state_dict(first[0].state_dict())
    rest = [i for step in _consume(resumed, 6, 1) for i in step]  # 160 + 36 = 196 <= 198
    assert len(head + rest) == len(set(head + rest)) == 196


def test_epoch_ends_on_a_whole_optimizer_step():
    s = ResumableSampler(104, batch_size=2, rank=0, world_size=4, accum_steps=2)
    assert s.step_samples == 16 and s.epoch_end == 96 and len(s) == 12 * 2
    assert len(list(s)) == 24 and s.epoch == 1 and s.consumed == 0


def test_rank_slice_and_indices_at_cover_a_round_exactly():
    order = ResumableSampler(50, batch_size=3, rank=0, world_size=4, seed=1).order()
    parts = []
    for r in range(4):
        sl = rank_slice(7, rank=r, world_size=4, micro_batch=3)
        parts += order[sl].tolist()
        s = ResumableSampler(50, batch_size=3, rank=r, world_size=4, seed=1)
        assert s.indices_at(7) == order[sl].tolist()
    assert parts == order[7:19].tolist()
    with pytest.raises(shardckpt.ConfigError):
        rank_slice(0, rank=4, world_size=4, micro_batch=1)


def test_sampler_loads_old_state_dicts_and_validates():
    s = ResumableSampler(64, batch_size=2, rank=1, world_size=2)
    s.load_state_dict({"epoch": 2, "consumed": 8, "seed": 0, "shuffle": True, "dataset_len": 64, "global_batch": 4})
    assert (s.epoch, s.consumed, s.saved_layout) == (2, 8, None)
    with pytest.raises(shardckpt.ConfigError, match="accum_steps"):
        s.accum_steps = 0
    with pytest.raises(shardckpt.ConfigError, match="smaller than one global batch"):
        ResumableSampler(10, batch_size=2, rank=0, world_size=2, accum_steps=3)


def test_single_process_load_exposes_plan_and_applies_lr(tmp_path):
    """Same world size (1 -> 1) with a changed micro-batch: scale_lr applies the rule."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    sampler = ResumableSampler(64, batch_size=4)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler}
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path), mode="sync", preemption_signals=())
    assert ckpt.load(state) is None and ckpt.last_plan is None
    list(zip(range(4), iter(sampler)))
    ckpt.save(state, 3)
    ckpt.close()

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5)
    sampler2 = ResumableSampler(64, batch_size=8)
    state2 = {"model": model2, "optimizer": opt2, "scheduler": sched2, "sampler": sampler2}
    ckpt2 = shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=())
    policy = ElasticPolicy(batch="scale_lr", lr_rule="linear")
    assert ckpt2.load(state2, elastic=policy) == 3
    plan = ckpt2.last_plan
    assert (plan.saved_global_batch, plan.global_batch, plan.lr_factor) == (4, 8, 2.0)
    assert opt2.param_groups[0]["lr"] == 0.1 * 2.0 and sched2.base_lrs == [0.4]
    assert (plan.epoch, plan.samples_consumed) == (0, 4) and sampler2.consumed == 4
    assert ckpt2.config.metadata[elastic.MICRO_BATCH_KEY] == 8  # later saves record the new shape
    ckpt2.close()


def _single_process_state(batch_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    return {"model": model, "optimizer": opt, "sampler": ResumableSampler(64, batch_size=batch_size)}


def test_inexact_batch_warns_without_a_policy_and_errors_with_an_explicit_one(tmp_path, caplog):
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path), mode="sync", preemption_signals=())
    ckpt.save(_single_process_state(3), 1)
    ckpt.close()
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path), preemption_signals=())
    with caplog.at_level("WARNING", logger="shardckpt"):
        assert ckpt.load(_single_process_state(2)) == 1  # global batch 3 -> 4 (nearest)
    plan = ckpt.last_plan
    assert (plan.accum_steps, plan.global_batch, plan.exact) == (2, 4, False)  # 3 / 2 rounds up
    assert any("not exact" in r.getMessage() for r in caplog.records)
    with pytest.raises(shardckpt.ConfigError, match="step 1: the global batch 3") as info:
        ckpt.load(_single_process_state(2), elastic=ElasticPolicy())
    assert "already restored" in str(info.value)
    ckpt.close()


def test_module_level_load_exposes_the_plan(tmp_path):
    shardckpt.init(local_dir=str(tmp_path), mode="sync", preemption_signals=())
    try:
        state = _single_process_state(4)
        shardckpt.save(state, 2)
        assert shardckpt.load(_single_process_state(4), elastic=ElasticPolicy()) == 2
        plan = shardckpt.last_plan()
        assert (plan.step, plan.world_size, plan.accum_steps, plan.lr_factor) == (2, 1, 1, 1.0)
    finally:
        shardckpt.close()
    assert shardckpt.last_plan() is None


def test_per_rank_keys_and_fresh_ranks():
    saved = {f"rank{r}": {"n": r} for r in range(4)}
    kept = shardckpt.PerRank({"n": -5}, rank=2)
    assert kept.state_dict() == {"rank2": {"n": -5}}
    kept.load_state_dict(saved)
    assert (kept.value, kept.restored, kept.saved_world_size) == ({"n": 2}, True, 4)
    new = shardckpt.PerRank({"n": -5}, rank=6, fresh=lambda r: {"n": 100 + r})
    new.load_state_dict(saved)
    assert (new.value, new.restored) == ({"n": 106}, False)
    plain = shardckpt.PerRank(7, rank=5)
    plain.load_state_dict(saved)
    assert plain.value == 7 and not plain.restored
