"""Elastic restore through real torchrun launches (gloo on CPU).

One 8-rank FSDP2 run trains a tiny model (layers of 10 and 30 rows: uneven
shards at 8 and 3 ranks) to step 20, saving at step 10. From that step:

* 4 ranks, keep-global-batch: accumulation 1 -> 2, trains on to step 20;
* 3 ranks, scale_lr/sqrt (global batch 16 -> 6);
* 1 process without a process group, keep-global-batch (accumulation 8),
  then again with scale_lr/linear;
* an 8-rank DDP run (in the 8-rank FSDP2 run's launch) saving at step 10,
  restored on 4 ranks (in the 4-rank run's launch).

And growing: a 4-rank FSDP2 run (accumulation 2, the first launch) saves at
step 10, restored on 8 ranks (4 -> 8, in the 8-rank launch: one 8-rank
launch, not two).

Every module and optimizer tensor after a restore must be bitwise equal to
the saving run's full state at the saved step.

Continuation tolerance: the resumed 4-rank run consumes exactly the same
sample ids and uses exactly the same LR at every step, but its loss is only
equal to ``LOSS_RTOL`` (relative). The gradient of a step is the same
mathematical mean over the same 16 samples, summed in another order (4 ranks
x 2 accumulated micro-batches instead of 8 ranks x 1, so another reduction
tree in float32): the updates differ in the last bits and AdamW carries that
into later steps. Measured: <= 2e-8 relative over steps 11..20 (float32
epsilon is 1.2e-7); 1e-5 leaves room for other BLAS/reduction orders.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import helpers
import pytest
import torch
from helpers import PROGRAMS, ROOT, run_torchrun

pytestmark = pytest.mark.slow

PROGRAM = PROGRAMS / "elastic_train.py"
LOSS_RTOL = 1e-5


def _plain(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(PROGRAM), *map(str, args)],
        env=helpers.child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    if proc.returncode != 0:
        raise AssertionError(f"{PROGRAM} {args} failed with {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


def _by_job(log: str) -> dict[str, str]:
    """A launch's output split by job (elastic_train.py prints ``== job TAG`` where each one starts)."""
    parts = {}
    for chunk in log.split("== job ")[1:]:
        tag, _, rest = chunk.partition("\n")
        parts[tag.strip()] = rest
    return parts


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # Four launches and one plain process: jobs that run at the same world size share a launch (one
    # process group, one start), and the 4-rank source of the 4 -> 8 restore runs before the 8-rank launch.
    out = tmp_path_factory.mktemp("elastic")
    fsdp, ddp, grow = out / "ck_fsdp", out / "ck_ddp", out / "ck_grow"
    logs = {}
    logs.update(_by_job(run_torchrun(
        4, PROGRAM, out, grow, "--tag", "g4", "--accum", 2, "--save-at", 10, "--total", 10,
    ).stdout))
    logs.update(_by_job(run_torchrun(
        8, PROGRAM, out, fsdp, "--tag", "f8", "--save-at", 10,
        "+", out, ddp, "--kind", "ddp", "--tag", "d8", "--save-at", 10, "--total", 10, "--shape-in-config",
        "+", out, grow, "--tag", "g8", "--load-step", 10, "--total", 10,
    ).stdout))
    logs.update(_by_job(run_torchrun(
        4, PROGRAM, out, fsdp, "--tag", "f4", "--load-step", 10, "--save-at", 20,
        "+", out, ddp, "--kind", "ddp", "--tag", "d4", "--load-step", 10, "--total", 10, "--shape-in-config",
    ).stdout))
    logs["f3"] = run_torchrun(
        3, PROGRAM, out, fsdp, "--tag", "f3", "--load-step", 10, "--policy", "sqrt", "--total", 12
    ).stdout
    logs["p1"] = _plain(
        out, fsdp, "--kind", "plain", "--tag", "p1", "--load-step", 10, "--total", 10,
        "+", out, fsdp, "--kind", "plain", "--tag", "p1lin", "--load-step", 10, "--policy", "linear",
        "--total", 10,
    )
    assert {"g4", "f8", "d8", "g8", "f4", "d4"} <= logs.keys(), sorted(logs)
    return out, logs


def _load(out, name):
    return torch.load(out / name, weights_only=False)


def _plan(out, tag):
    return json.loads((out / f"{tag}.plan.json").read_text())


def _records(out, tag):
    return {int(k): v for k, v in json.loads((out / f"{tag}.records.json").read_text()).items()}


def _assert_bitwise(saved, loaded, what):
    for part in ("model", "optim"):
        assert saved[part].keys() == loaded[part].keys(), f"{what}: {part} keys differ"
        assert saved[part], f"{what}: no {part} tensors"
        for name, tensor in saved[part].items():
            other = loaded[part][name]
            assert tensor.dtype == other.dtype and tensor.shape == other.shape, f"{what}: {part}.{name}"
            assert torch.equal(tensor, other), f"{what}: {part}.{name} is not bitwise equal"


@pytest.mark.parametrize("tag", ["f4", "f3", "p1", "p1lin"])
def test_fsdp2_8_ranks_restore_bitwise(runs, tag):
    out, _ = runs
    _assert_bitwise(_load(out, "f8.saved.pt"), _load(out, f"{tag}.loaded.pt"), f"8 -> {tag}")


def test_fsdp2_4_to_8_bitwise(runs):
    out, _ = runs
    _assert_bitwise(_load(out, "g4.saved.pt"), _load(out, "g8.loaded.pt"), "4 -> 8")
    plan = _plan(out, "g8")
    assert (plan["saved_world_size"], plan["world_size"]) == (4, 8)
    assert (plan["saved_accum_steps"], plan["accum_steps"], plan["global_batch"]) == (2, 1, 16)


def test_ddp_8_to_4_bitwise(runs):
    out, _ = runs
    _assert_bitwise(_load(out, "d8.saved.pt"), _load(out, "d4.loaded.pt"), "DDP 8 -> 4")
    plan = _plan(out, "d4")  # the shape came from CheckpointConfig.micro_batch_size
    assert (plan["saved_world_size"], plan["world_size"], plan["accum_steps"]) == (8, 4, 2)


def test_keep_global_batch_plan_and_log(runs):
    out, logs = runs
    plan = _plan(out, "f4")
    assert plan == {
        "step": 10, "policy": "keep_global_batch", "saved_world_size": 8, "world_size": 4,
        "saved_micro_batch": 2, "micro_batch": 2, "saved_accum_steps": 1, "accum_steps": 2,
        "saved_global_batch": 16, "global_batch": 16, "lr_factor": 1.0, "exact": True,
        "epoch": 0, "samples_consumed": 160, "rng": True,
    }
    lines = [line for line in logs["f4"].splitlines() if "elastic plan for step 10" in line]
    assert len(lines) == 1, logs["f4"][-3000:]  # one line, from rank 0 only
    assert "world 8 -> 4" in lines[0] and "accumulation 1 -> 2" in lines[0]
    assert "RNG of saved ranks 4..7 dropped" in lines[0]
    p1 = _plan(out, "p1")
    assert (p1["world_size"], p1["accum_steps"], p1["global_batch"]) == (1, 8, 16)


def test_continuation_8_vs_4_ranks(runs):
    out, _ = runs
    straight, resumed = _records(out, "f8"), _records(out, "f4")
    assert sorted(resumed) == list(range(11, 21))
    for step in range(11, 21):
        a, b = straight[step], resumed[step]
        assert a["ids"] == b["ids"], f"step {step}: different samples"
        assert len(b["ids"]) == 16
        assert a["lr"] == b["lr"], f"step {step}: LR {a['lr']} != {b['lr']}"
        assert (a["epoch"], a["consumed"]) == (b["epoch"], b["consumed"]), f"step {step}: data position"
        assert math.isclose(a["loss"], b["loss"], rel_tol=LOSS_RTOL), f"step {step}: loss {a['loss']} vs {b['loss']}"
    # Over epoch 0 (steps 1..12: 192 of 200 samples) no sample is seen twice or skipped.
    epoch0 = [i for s in range(1, 11) for i in straight[s]["ids"]] + [i for s in (11, 12) for i in resumed[s]["ids"]]
    assert len(epoch0) == len(set(epoch0)) == 192
    assert resumed[13]["epoch"] == 1  # the resumed run crossed into the next epoch


def _lambda(step: int) -> float:
    sys.path.insert(0, str(PROGRAMS))
    import elastic_train

    return elastic_train.lr_lambda(step)


def test_scale_lr_rules(runs):
    out, _ = runs
    saved = _load(out, "f8.saved.pt")
    for tag, rule, world in (("f3", "sqrt", 3), ("p1lin", "linear", 1)):
        ratio = (world * 2) / 16
        factor = math.sqrt(ratio) if rule == "sqrt" else ratio
        plan = _plan(out, tag)
        assert plan["policy"] == f"scale_lr/{rule}"
        assert (plan["global_batch"], plan["accum_steps"]) == (world * 2, 1)
        assert plan["lr_factor"] == factor
        loaded = _load(out, f"{tag}.loaded.pt")
        assert loaded["group_lr"] == [lr * factor for lr in saved["group_lr"]]
        assert loaded["group_initial_lr"] == [lr * factor for lr in saved["group_initial_lr"]]
        assert loaded["base_lrs"] == [lr * factor for lr in saved["base_lrs"]]
        assert loaded["last_lr"] == [lr * factor for lr in saved["last_lr"]]
        assert loaded["last_epoch"] == saved["last_epoch"] == 10
    # The schedule goes on at the right step on the new scale.
    records = _records(out, "f3")
    assert records[11]["lr"] == saved["group_lr"][0] * math.sqrt(6 / 16)
    assert math.isclose(records[12]["lr"], saved["base_lrs"][0] * math.sqrt(6 / 16) * _lambda(11), rel_tol=1e-12)


def test_per_rank_state_when_the_world_size_changes(runs):
    out, _ = runs
    saved8 = _load(out, "f8.saved.pt")["per_rank"]
    assert [v["id"] for v, _ in saved8] == list(range(8)) and all(v["samples"] == 20 for v, _ in saved8)
    # 8 -> 4 and 8 -> 1: rank r gets saved rank r's value, ranks >= W' are dropped.
    assert _load(out, "f4.loaded.pt")["per_rank"] == saved8[:4]
    assert _load(out, "p1.loaded.pt")["per_rank"] == saved8[:1]
    # 4 -> 8: ranks 0..3 restored, ranks 4..7 get fresh(rank).
    saved4 = _load(out, "g4.saved.pt")["per_rank"]
    assert [v for v, _ in saved4] == [{"id": r, "samples": 10 * 2 * 2} for r in range(4)]  # 10 steps of 2 x 2
    loaded8 = _load(out, "g8.loaded.pt")["per_rank"]
    assert loaded8[:4] == saved4
    assert loaded8[4:] == [[{"id": -1, "samples": 0}, False]] * 4
