"""The save plan (``saving/plan.py``): made once, checked at every save, rebuilt when the state changed.

Every test changes the state's structure between two saves the way a training script can, saves again
(kept in memory, and on disk), restores into fresh objects of the changed shape and compares bitwise; each
fails when the check that notices its change is removed from ``SavePlan.holds``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from helpers import PROGRAMS, run_torchrun

import shardckpt
from shardckpt.saving.plan import SavePlan
from shardckpt.state import capture as state_mod


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.relu(self.a(x))))


def train(model: nn.Module, optim: torch.optim.Optimizer | None, seed: int, width: int = 8) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, width, generator=g, dtype=next(model.parameters()).dtype)
    loss = model(x).square().mean()
    if optim is not None:
        optim.zero_grad()
    loss.backward()
    if optim is not None:
        optim.step()


def open_ckpt(root, memory: bool) -> shardckpt.Checkpointer:
    options = dict(every_steps=10**9, memory_every_steps=1) if memory else dict(every_steps=1)
    return shardckpt.Checkpointer(local_dir=str(root), keep_last=2, preemption_signals=(), **options)


def same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    assert len(a.param_groups) == len(b.param_groups)
    for ga, gb in zip(a.param_groups, b.param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
        for pa, pb in zip(ga["params"], gb["params"]):
            sa, sb = a.state.get(pa, {}), b.state.get(pb, {})
            assert set(sa) == set(sb)
            for k in sa:
                assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


def save_twice_and_restore(tmp_path, memory: bool, state: dict, change, fresh) -> tuple[dict, shardckpt.Checkpointer]:
    """Save ``state`` (steps 1, 2), ``change()`` it, save step 3; restore step 3 into ``fresh()``."""
    ckpt = open_ckpt(tmp_path / "ckpt", memory)
    try:
        for step in (1, 2):
            train(state["model"], state.get("optimizer"), step, state["model"].a.in_features)
            ckpt.save(state, step)
        built = ckpt._saver.plans_built
        change()
        ckpt.save(state, 3)
        assert ckpt._saver.plans_built == built + 1  # the change was noticed: a new plan
        ckpt.wait()
    finally:
        ckpt.close()
    other = fresh()
    restorer = shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), preemption_signals=())
    try:
        assert restorer.load(other) == 3
    finally:
        restorer.close()
    return other, ckpt


def test_a_steady_state_builds_one_plan_and_resumes_bitwise(tmp_path):
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim, "meta": {"iter": 0}}
    ckpt = open_ckpt(tmp_path / "ckpt", memory=True)
    try:
        for step in range(1, 6):
            train(model, optim, step)
            state["meta"]["iter"] = step
            for group in optim.param_groups:
                group["lr"] = 1e-2 / step  # a scheduler's work: read anew at every save
            ckpt.save(state, step)
        assert ckpt._saver.plans_built == 1
    finally:
        ckpt.close()
    model2 = Net()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    state2 = {"model": model2, "optimizer": optim2, "meta": {}}
    restorer = shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), preemption_signals=())
    try:
        assert restorer.load(state2) == 5
    finally:
        restorer.close()
    same_tensors(model.state_dict(), model2.state_dict())
    same_optimizer(optim, optim2)
    assert state2["meta"] == {"iter": 5} and optim2.param_groups[0]["lr"] == 1e-2 / 5


def test_the_rng_state_of_every_save_is_the_one_at_that_save(tmp_path):
    """The plan keeps its RNG tensors and writes each save's state into them: the step restored has the state
    of its own save, not the first save's (each generator drawn from between saves, numpy's cached gaussian
    left pending at an odd save and consumed at the next)."""
    import random

    import numpy as np

    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    model = Net()
    state = {"model": model}
    ckpt = open_ckpt(tmp_path / "ckpt", memory=True)
    try:
        for step in range(1, 6):
            torch.rand(3)
            random.gauss(0.0, 1.0)
            np.random.standard_normal()  # one of a pair: the other is cached (has_gauss) at odd steps
            ckpt.save(state, step)
            if step == 4:
                at_4 = state_mod.get_rng_state()
        assert ckpt._saver.plans_built == 1
        torch.rand(5), random.random(), np.random.standard_normal()  # moved on after the last save
        ckpt.load(state, step=4)
    finally:
        ckpt.close()
    restored = state_mod.get_rng_state()
    assert list(restored) == list(at_4)
    for name, value in at_4.items():
        assert torch.equal(restored[name], value), name


def test_the_plan_captures_what_dcp_captures(tmp_path):
    """The same FQNs, the same tensors (the same memory), the same values as DCP's own capture, step after step."""
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    state = {"model": model, "optimizer": optim, "sched": sched, "meta": {"iter": 0}}
    plan = SavePlan(state, 0, True, light=False, trainable_only=False)
    plan.capture(state)
    rng = None
    for step in range(3):
        train(model, optim, step)
        sched.step()
        torch.rand(2)
        assert plan.holds(state) and plan.refresh()
        got, kinds, _frozen = plan.capture(state)
        want, want_kinds, _f = state_mod.capture(state, 0, True)
        assert kinds == want_kinds and list(got) == list(want)
        assert list(got["model"]) == list(want["model"])
        for fqn, t in want["model"].items():
            assert got["model"][fqn].data_ptr() == t.data_ptr() and torch.equal(got["model"][fqn], t)
        assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
        assert list(got["optimizer"]["state"]) == list(want["optimizer"]["state"])
        for fqn, entry in want["optimizer"]["state"].items():
            for k, v in entry.items():
                assert got["optimizer"]["state"][fqn][k] is v
        assert got["sched"] == want["sched"]
        mine, theirs = got["_shardckpt"]["rng"]["rank0"], want["_shardckpt"]["rng"]["rank0"]
        assert list(mine) == list(theirs) and all(torch.equal(mine[k], v) for k, v in theirs.items())
        assert rng is None or all(mine[k] is t for k, t in rng.items())  # the plan's own tensors, refreshed
        rng = dict(mine)


def test_a_stale_plan_would_have_saved_the_old_tensor(tmp_path):
    torch.manual_seed(0)
    model = Net()
    state = {"model": model}
    plan = SavePlan(state, 0, False, light=False, trainable_only=False)
    plan.capture(state)
    old = model.a.weight.detach().clone()
    model.a.weight.data = torch.full_like(model.a.weight, 7.0)  # the same Parameter object, new memory
    assert not plan.holds(state)
    stale, _k, _f = plan.capture(state)
    assert torch.equal(stale["model"]["a.weight"], old)  # what the stale plan would have copied
    fresh = SavePlan(state, 0, False, light=False, trainable_only=False)
    assert torch.equal(fresh.capture(state)[0]["model"]["a.weight"], torch.full_like(old, 7.0))


BOTH = pytest.mark.parametrize("memory", [True, False], ids=["memory", "disk"])


@BOTH
def test_a_replaced_parameter(tmp_path, memory):
    torch.manual_seed(0)
    model = Net()
    state = {"model": model}

    def change():
        model.a.weight = nn.Parameter(model.a.weight.detach() + 1.0)

    other, _c = save_twice_and_restore(tmp_path, memory, state, change, lambda: {"model": Net()})
    same_tensors(model.state_dict(), other["model"].state_dict())


@BOTH
def test_optimizer_state_that_appears_after_the_first_step(tmp_path, memory):
    """Saved between backward and step, the optimizer has no state yet (DCP does not make one then)."""
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim}
    ckpt = open_ckpt(tmp_path / "ckpt", memory)
    try:
        train(model, None, 1)  # gradients, no step
        ckpt.save(state, 1)
        assert not optim.state
        optim.step()
        ckpt.save(state, 2)
        assert ckpt._saver.plans_built == 2
        ckpt.wait()
    finally:
        ckpt.close()
    model2 = Net()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    restorer = shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"), preemption_signals=())
    try:
        assert restorer.load({"model": model2, "optimizer": optim2}) == 2
    finally:
        restorer.close()
    same_tensors(model.state_dict(), model2.state_dict())
    same_optimizer(optim, optim2)
    assert len(optim2.state) == len(list(model.parameters()))


@BOTH
def test_a_param_group_added(tmp_path, memory):
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.AdamW(model.a.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optim}

    def change():
        optim.add_param_group({"params": list(model.b.parameters()) + list(model.norm.parameters()), "lr": 0.5})
        train(model, optim, 7)

    def fresh():
        m = Net()
        o = torch.optim.AdamW(m.a.parameters(), lr=1e-2)
        o.add_param_group({"params": list(m.b.parameters()) + list(m.norm.parameters()), "lr": 0.1})
        return {"model": m, "optimizer": o}

    other, _c = save_twice_and_restore(tmp_path, memory, state, change, fresh)
    same_tensors(model.state_dict(), other["model"].state_dict())
    same_optimizer(optim, other["optimizer"])


@BOTH
def test_a_module_added(tmp_path, memory):
    torch.manual_seed(0)
    model = Net()
    state = {"model": model}

    def change():
        model.extra = nn.Linear(3, 3)
        with torch.no_grad():
            model.extra.weight.fill_(0.25)

    def fresh():
        m = Net()
        m.extra = nn.Linear(3, 3)
        return {"model": m}

    other, _c = save_twice_and_restore(tmp_path, memory, state, change, fresh)
    same_tensors(model.state_dict(), other["model"].state_dict())


@BOTH
@pytest.mark.parametrize("how", ["dtype", "shape"])
def test_a_tensor_that_changes_dtype_or_shape(tmp_path, memory, how):
    torch.manual_seed(0)
    model = Net()
    state = {"model": model}

    def convert(m: Net) -> None:  # the same Parameter object, its data replaced
        if how == "dtype":
            m.a.bias.data = m.a.bias.detach().double()
        else:
            m.a.bias.data = torch.arange(8.0).repeat(2)  # 16 elements

    def change():
        convert(model)
        with torch.no_grad():
            model.a.bias.add_(1.0)  # new values in the new memory (a stale plan copies the old memory)

    def fresh():
        m = Net()
        convert(m)
        return {"model": m}

    other, _c = save_twice_and_restore(tmp_path, memory, state, change, fresh)
    same_tensors(model.state_dict(), other["model"].state_dict())


class Counter:
    """A stateful object (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


@BOTH
def test_a_plain_value_that_changes_type(tmp_path, memory):
    """``None`` at first, then a stateful object: saved as its ``state_dict()``, restored through
    ``load_state_dict``."""
    torch.manual_seed(0)
    model = Net()
    state = {"model": model, "counter": None}

    def change():
        state["counter"] = Counter(41)

    other, _c = save_twice_and_restore(tmp_path, memory, state, change,
                                       lambda: {"model": Net(), "counter": Counter()})
    assert isinstance(other["counter"], Counter) and other["counter"].n == 41
    same_tensors(model.state_dict(), other["model"].state_dict())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_ranks_capture_what_dcp_captures_and_an_fsdp2_shard_that_moves(tmp_path, mode):
    """DDP and FSDP2 on 2 ranks: the plan's capture is DCP's; with FSDP2 an unshard/reshard cycle keeps the
    plan, a local shard moved to new memory makes a new one, and the step saved after it resumes bitwise."""
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(2, PROGRAMS / "save_plan_job.py", mode, tmp_path / "ck", out)
    for rank in (0, 1):
        assert json.loads((out / f"equal.rank{rank}.json").read_text()) == []
        result = json.loads((out / f"result.rank{rank}.json").read_text())
        assert result["loaded"] == result["last"] and result["same"], result
        assert result["plans"] == ([1, 1, 2] if mode == "fsdp2" else [1]), result
