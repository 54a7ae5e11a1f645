"""Hugging Face integrations: Trainer (through the mixin), a custom accelerate loop, StatefulDataLoader.

Real frameworks (transformers, accelerate, torchdata), tiny models built from
a config, torchrun with gloo on CPU for everything with more than one rank,
moto's S3 server for the remote. The multi-rank tests each run one job
several ways and check several guarantees on it:

- Trainer, 2 ranks: SIGKILL after a save and a relaunch resume bitwise (the
  logged losses and the weights at the step where the job stops equal a run
  never interrupted), an incomplete newer step is never picked, SIGTERM stops
  training at the next step with that step committed in the bucket, and a
  fresh machine with 1 rank and an empty disk resumes from the bucket with
  the accumulation doubled and trains on exactly the samples the 2-rank run
  trained on at each step.
- accelerate loop with a StatefulDataLoader (2 workers per rank): a 2-rank
  run's step resumed by 1 rank continues the global data position (the 2-rank
  SIGKILL and resume, bitwise, is a case of tests/jobs/test_check_resume.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import (  # noqa: E402
    PROGRAMS,
    ROOT,
    assert_plans_checked,
    child_env,
    kill_job,
    run_torchrun,
    skip_module_unless_installed,
    start_torchrun,
    wait_for,
)
from s3server import BUCKET, stop_uploaders  # noqa: E402

import shardckpt  # noqa: E402
from shardckpt.format import layout  # noqa: E402

skip_module_unless_installed("transformers", "accelerate", "torchdata",
                             reason="bash scripts/setup.sh installs them; or pip install 'shardckpt[hf]'")

TRAINER = PROGRAMS / "hf_trainer.py"
ACCELERATE = PROGRAMS / "hf_accelerate.py"
ONE_SERVER = pytest.mark.parametrize("s3", ["moto"], indirect=True)


def losses_by_step(history_path: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in json.loads(history_path.read_text()) if "loss" in row}


def lrs_by_step(history_path: Path) -> dict[int, float]:
    return {row["step"]: row["learning_rate"] for row in json.loads(history_path.read_text()) if "learning_rate" in row}


def samples_by_step(prefix: Path, ranks: int) -> dict[int, list[int]]:
    """Step -> every sample id trained on in that step (all ranks, all micro-batches), sorted."""
    out: dict[int, list[int]] = {}
    for rank in range(ranks):
        for line in Path(f"{prefix}.rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], []).extend(row["idx"])
    return {step: sorted(ids) for step, ids in out.items()}


def committed(path: Path) -> list[int]:
    return layout.committed_steps(str(path))


def printed(output: str, rank: int, word: str) -> str:
    # Two ranks write to one pipe: another process's unfinished line can stand before ours on the same line.
    marker = f"rank {rank}: "
    for line in output.splitlines():
        ours = line.split(marker, 1)[1] if marker in line else ""
        if word in ours:
            return ours.split(word, 1)[1].split()[0]
    raise AssertionError(f"no line 'rank {rank}: ... {word}' in the output:\n{output[-4000:]}")


@pytest.fixture
def bucket(s3, tmp_path):
    s3.reset()
    yield s3
    stop_uploaders(tmp_path, grace_s=30.0)


@ONE_SERVER
def test_trainer_sigkill_resumes_bitwise_sigterm_commits_and_a_fresh_rank_resumes_from_the_bucket(bucket, tmp_path):
    env = child_env(**bucket.env())
    steps = 12
    # The LR rises over 6 warmup steps, then stays: the scheduler's boundary is crossed after every resume below
    # (the kill comes at step 3 or later), and a scheduler not restored would warm up again.
    schedule = ("--lr-schedule", "constant_with_warmup", "--warmup-steps", 6)
    # The reference: never interrupted, 2 ranks, two steps further than the jobs below.
    ref = tmp_path / "ref"
    run_torchrun(2, TRAINER, "--out", ref, "--max-steps", steps + 2, "--history", ref / "history.json",
                 "--weights", ref / "weights.pt", "--every-step-weights", "--samples", ref / "samples", *schedule,
                 env=env, timeout=180)
    want_losses = losses_by_step(ref / "history.json")
    want_lrs = lrs_by_step(ref / "history.json")
    assert_plans_checked(ref)  # the save plan captured what DCP captures, on the Trainer's state, at every save
    assert want_lrs[1] < want_lrs[6] < want_lrs[7] == want_lrs[14]  # warmup, then constant
    want_weights = torch.load(ref / "weights.pt")
    want_samples = samples_by_step(ref / "samples", 2)
    assert sorted(want_losses) == list(range(1, steps + 3))
    epoch_ids = [i for s in range(1, 13) for i in want_samples[s]]  # 12 steps x 8 samples: one epoch
    assert sorted(epoch_ids) == list(range(96))

    # The job, uploading to the bucket: its first launch finds nothing and starts fresh (no error), and is
    # SIGKILLed (launcher and workers) once step 3 is committed.
    url = f"s3://{BUCKET}/hf-trainer"
    run = tmp_path / "run"
    args = ("--out", run, "--remote", url, "--max-steps", steps, "--step-sleep", "0.4", *schedule)
    log1 = tmp_path / "first.log"
    proc = start_torchrun(2, TRAINER, *args, "--samples", run / "first", env=env, log_path=log1)
    try:
        wait_for(lambda: any(s >= 3 for s in committed(run / "ckpt")), 120, "step 3 committed", proc, log1)
    finally:
        kill_job(proc)
    assert "nothing to resume" in log1.read_text()
    killed_at = max(committed(run / "ckpt"))
    # A crashed save of a later step: a directory without a manifest. It must never be picked.
    crashed = run / "ckpt" / layout.step_dirname(killed_at + 50)
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"half a shard")

    # Relaunched: resumes the newest committed step; SIGTERM to the launcher once two more steps are committed.
    log2 = tmp_path / "second.log"
    proc = start_torchrun(2, TRAINER, *args, "--samples", run / "second", "--history", run / "history.json",
                          "--weights", run / "weights.pt", env=env, log_path=log2)
    try:
        wait_for(lambda: max(committed(run / "ckpt")) >= killed_at + 2, 120, "two more steps", proc, log2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        kill_job(proc)
    out2 = log2.read_text()
    resumed = int(printed(out2, 0, "resumed "))
    stopped = int(printed(out2, 0, "global_step "))
    assert resumed == killed_at, out2[-3000:]
    assert printed(out2, 0, "preempted ") == printed(out2, 1, "preempted ") == "True", out2[-3000:]
    assert killed_at + 2 <= stopped < steps, out2[-3000:]
    assert printed(out2, 1, "global_step ") == str(stopped)  # both ranks stopped at the same step
    assert printed(out2, 0, "model ") == "DistributedDataParallel"
    # Bitwise: every logged loss (those restored from the checkpoint's log history included) and the weights.
    got_losses = losses_by_step(run / "history.json")
    assert sorted(got_losses) == list(range(1, stopped + 1))
    assert got_losses == {s: want_losses[s] for s in range(1, stopped + 1)}
    assert lrs_by_step(run / "history.json") == {s: want_lrs[s] for s in range(1, stopped + 1)}
    got_weights = torch.load(run / "weights.pt")[stopped]
    assert all(torch.equal(got_weights[k], want_weights[stopped][k]) for k in want_weights[stopped])
    # The preempted step is committed in the bucket (a machine with an empty disk sees it).
    looked = shardckpt.Checkpointer(local_dir=str(tmp_path / "look"), remote=url, uploader="off").peek()
    assert looked.step == stopped and looked.source.startswith("s3://"), looked

    # A fresh machine: 1 rank, empty disk, from the bucket, on to step 14: accumulation 1 -> 2 keeps the
    # global batch, and each step trains on exactly the samples the 2-rank run did.
    fresh = tmp_path / "fresh"
    out3 = run_torchrun(1, TRAINER, "--out", fresh, "--remote", url, "--max-steps", steps + 2,
                        "--samples", fresh / "samples", "--history", fresh / "history.json", *schedule,
                        env=dict(env, SHARDCKPT_UPLOADER="off"), timeout=180).stdout
    assert printed(out3, 0, "resumed ") == str(stopped), out3[-3000:]
    assert printed(out3, 0, "accum ") == "2"
    assert "gradient_accumulation_steps 1 -> 2 to keep the global batch of 8" in out3
    assert "elastic plan for step" in out3 and "accumulation 1 -> 2, global batch 8 -> 8" in out3
    got = samples_by_step(fresh / "samples", 1)
    assert sorted(got) == list(range(stopped + 1, steps + 3))
    assert got == {s: want_samples[s] for s in got}
    assert sorted(losses_by_step(fresh / "history.json")) == list(range(1, steps + 3))
    assert lrs_by_step(fresh / "history.json") == want_lrs  # past the warmup's end, to the last step


def test_accelerate_loop_a_stateful_loader_continues_2_to_1(tmp_path):
    """A 2-rank run's step 14 resumed by 1 rank with the same 2 workers: the loader state does not fit, the
    sampler's global position does, and each step trains on the samples the 2-rank run did. (That the 2-rank
    job resumes bitwise after a SIGKILL, each rank's own loader state with its workers included, is
    tests/jobs/test_check_resume.py's accelerate case.)"""
    env = child_env()
    steps = 14  # 12 steps per epoch at 2 ranks x 4: the resume is in the second epoch
    ref = tmp_path / "ref"
    run_torchrun(2, ACCELERATE, "--ckpt", ref / "ckpt", "--steps", steps + 2, "--samples", ref / "samples",
                 env=env, timeout=180)
    for later in (steps + 1, steps + 2):  # the run as it was at step 14 (it saves every step)
        shutil.rmtree(ref / "ckpt" / layout.step_dirname(later))
    out1 = run_torchrun(1, ACCELERATE, "--ckpt", ref / "ckpt", "--steps", steps + 2, "--samples", tmp_path / "one",
                        env=env, timeout=180).stdout
    assert printed(out1, 0, "resumed step ") == str(steps), out1[-3000:]
    assert printed(out1, 0, "counter ") == str(steps)  # the object registered with accelerate
    assert printed(out1, 0, "exact loader ") == "False" and printed(out1, 0, "accum ") == "2", out1[-3000:]
    assert "restored the sampler's global position only (epoch 1, sample 16)" in out1
    got1 = samples_by_step(tmp_path / "one", 1)
    want2 = samples_by_step(ref / "samples", 2)
    assert sorted(got1) == [steps + 1, steps + 2]
    assert got1 == {s: want2[s] for s in got1}


# ------------------------------------------------------------ one process, in this one


def test_importing_shardckpt_and_its_integrations_imports_no_framework():
    code = ("import sys, shardckpt, shardckpt.integrations, shardckpt.integrations.hf as hf; "
            "print(sorted(m for m in ('transformers', 'accelerate', 'torchdata') if m in sys.modules)); "
            "hf.ShardckptTrainer; print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True"]


def _trainer_parts(tmp_path: Path, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    sys.path.insert(0, str(PROGRAMS))
    from hf_trainer import Tokens

    options = dict(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=4,
                   learning_rate=3e-3, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                   logging_steps=1, report_to="none", use_cpu=True, seed=0, remove_unused_columns=False,
                   disable_tqdm=True, save_total_limit=2, metric_for_best_model="score", greater_is_better=False,
                   load_best_model_at_end=True)
    options.update(overrides)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    return model, TrainingArguments(**options), Tokens()


def test_trainer_best_metric_retention_and_load_best_at_end_and_mapping_errors(tmp_path, monkeypatch, caplog):
    from transformers import Trainer, TrainerCallback

    from shardckpt.integrations.hf import ShardckptTrainer, ShardckptTrainerMixin

    for key in [k for k in os.environ if k.startswith("SHARDCKPT_")]:
        monkeypatch.delenv(key)
    scores = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 6.0, 6: 7.0}

    class Scored(ShardckptTrainerMixin, Trainer):
        def evaluate(self, *args, **kwargs):  # the metric the test controls: eval_score by step
            metrics = {"eval_score": scores[self.state.global_step]}
            self.log(metrics)
            return metrics

    class Weights(TrainerCallback):
        saved: dict = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.saved[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model, args, data = _trainer_parts(tmp_path)
    weights = Weights()
    trainer = Scored(model=model, args=args, train_dataset=data, eval_dataset=data, callbacks=[weights])
    cfg = trainer.checkpointer.config  # built from the TrainingArguments
    assert (cfg.keep_last, cfg.keep_best, cfg.best_metric, cfg.best_mode) == (2, 1, "eval_score", "min")
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        trainer.train(resume_from_checkpoint=True)  # nothing there: starts fresh, no error
    assert trainer.resumed_step is None and trainer.state.global_step == 6
    trainer.checkpointer.close()
    root = tmp_path / "out" / "shardckpt"
    assert committed(root) == [4, 5, 6]  # the last two and the best (score 1.0 at step 4)
    # The best step as a path, like the stock Trainer's checkpoint folder; loading it at the end logs the two
    # warnings the guide describes (the keys it leaves out on purpose, and the branch a later save would start).
    assert trainer.state.best_model_checkpoint == str(root / layout.step_dirname(4))
    assert os.path.isdir(trainer.state.best_model_checkpoint)
    at_end = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "step 4" in r.getMessage()]
    assert len(at_end) == 2, at_end
    assert "In the checkpoint but not in the state (3): optimizer, sampler, scheduler" in at_end[0]
    assert "rolled back to step 4" in at_end[1]
    guide = " ".join((ROOT / "docs" / "guides" / "huggingface.md").read_text().split())
    assert "In the checkpoint but not in the state" in guide and "rolled back to step N" in guide
    assert all(torch.equal(trainer.model.state_dict()[k], weights.saved[4][k]) for k in weights.saved[4])
    assert not any(torch.equal(weights.saved[6][k], weights.saved[4][k]) for k in ("transformer.wte.weight",))

    # A checkpointer that would purge the best step the arguments ask to load at the end: refused.
    other = shardckpt.Checkpointer(local_dir=str(tmp_path / "other"), keep_last=2)
    with pytest.raises(shardckpt.ConfigError, match="best_metric='eval_score'"):
        Scored(model=model, args=args, train_dataset=data, eval_dataset=data, checkpointer=other)
    model, args3, _ = _trainer_parts(tmp_path, save_total_limit=3)
    with pytest.raises(shardckpt.ConfigError, match=r"save_total_limit=3 .* keep_last=2"):
        Scored(model=model, args=args3, train_dataset=data, eval_dataset=data, checkpointer=other)
    other.close()

    # A later run resumes the newest committed step (not a higher crashed one), then trains on.
    crashed = root / layout.step_dirname(60)
    crashed.mkdir()
    def seven_steps():
        model, args, _ = _trainer_parts(tmp_path, max_steps=7, eval_strategy="no", save_total_limit=None,
                                        metric_for_best_model=None, load_best_model_at_end=False)
        return ShardckptTrainer(model=model, args=args, train_dataset=data,
                                checkpointer=shardckpt.Checkpointer(local_dir=str(root), keep_last=5))

    again = seven_steps()
    with pytest.raises(shardckpt.ConfigError, match="resumes from its checkpointer"):
        again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    again.train(resume_from_checkpoint=True)
    assert again.resumed_step == 6 and again.state.global_step == 7
    assert [row["step"] for row in again.state.log_history if "eval_score" in row] == [1, 2, 3, 4, 5, 6]
    again.checkpointer.close()

    # Back to step 5 while 6 and 7 exist: said at once, at WARNING, before the Trainer saves 6 and 7 again.
    caplog.clear()
    back = seven_steps()
    with caplog.at_level(logging.INFO, logger="shardckpt"):
        back.train(resume_from_checkpoint=5)
    back.checkpointer.close()
    assert back.resumed_step == 5 and back.state.global_step == 7
    lines = [r.getMessage() for r in caplog.records]
    told = next(i for i, m in enumerate(lines) if "rolled back to step 5" in m)
    assert caplog.records[told].levelno == logging.WARNING and "steps [6, 7]" in lines[told]
    assert "replaces it" in lines[told] and "moved aside" in lines[told]
    aside = [i for i, m in enumerate(lines) if "was kept aside" in m]
    assert len(aside) == 2 and told < aside[0], lines  # said before the first save that does it
    assert sorted(p.name.split("-")[1] for p in root.iterdir() if p.name.startswith(".kept-")) == [
        layout.step_dirname(6), layout.step_dirname(7)]


def test_the_trainers_sampler_reports_the_position_it_loaded():
    """Right after load() the sampler says where the loaded step is (epoch 1), not where the loop was before."""
    from shardckpt.integrations.hf import TrainerSampler

    sampler = TrainerSampler(96, batch_size=16, rank=0, world_size=1)
    saved = TrainerSampler(96, batch_size=16, rank=0, world_size=1)
    saved.loop_position = (1, 32)
    sampler.loop_position = (0, 0)  # what the loop's count said before the load
    sampler.load_state_dict(saved.state_dict())
    assert (sampler.state_dict()["epoch"], sampler.state_dict()["consumed"]) == (1, 32)


def test_accelerator_state_holds_what_accelerate_prepared_and_a_loader_resumes_its_position(tmp_path, caplog):
    import functools

    from accelerate import Accelerator
    from torchdata.stateful_dataloader import StatefulDataLoader

    from shardckpt.integrations.hf import LoaderState, accelerator_state

    class Registered:
        def __init__(self) -> None:
            self.value = 0

        def state_dict(self):
            return {"value": self.value}

        def load_state_dict(self, state):
            self.value = state["value"]

    def parts():
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lambda i, k: k, k=1.0))
        plain = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
        model, optimizer, scheduler, plain = accelerator.prepare(model, optimizer, scheduler, plain)
        registered = Registered()
        accelerator.register_for_checkpointing(registered)
        loader = StatefulDataLoader(list(range(16)), batch_size=2, shuffle=True,
                                    generator=torch.Generator().manual_seed(3))
        return accelerator_state(accelerator, loader=loader), model, registered, loader

    state, model, registered, loader = parts()
    assert sorted(state) == ["custom_0", "loader", "model", "optimizer", "scheduler"]
    assert type(state["optimizer"]) is torch.optim.AdamW and isinstance(state["loader"], LoaderState)
    assert "1 prepared DataLoader(s) keep no position" in caplog.text  # the plain one is named, not saved
    batches = iter(loader)
    next(batches), next(batches)
    registered.value = 5
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"))
    ckpt.save(state, 2)
    ckpt.wait()
    expected_next = next(batches).tolist()
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    state2, model2, registered2, loader2 = parts()
    assert ckpt.load(state2) == 2  # the partial-based LambdaLR loads too
    ckpt.close()
    assert registered2.value == 5 and state2["loader"].exact
    assert next(iter(loader2)).tolist() == expected_next  # the batch after the last one drawn before the save
    assert all(torch.equal(model2.state_dict()[k], weights[k]) for k in weights)


def test_trainer_saves_by_the_checkpointers_own_policy_and_stops_on_sigterm_with_the_step_committed(tmp_path):
    from transformers import TrainerCallback

    from shardckpt.integrations.hf import ShardckptTrainer

    class Preempt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                os.kill(os.getpid(), signal.SIGTERM)  # the spot notice, to this process

    model, args, data = _trainer_parts(tmp_path, save_strategy="no", eval_strategy="no", save_total_limit=None,
                                       metric_for_best_model=None, load_best_model_at_end=False, max_steps=9)
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "policy"), every_steps=3, keep_last=5)
    trainer = ShardckptTrainer(model=model, args=args, train_dataset=data, checkpointer=ckpt, callbacks=[Preempt()])
    trainer.train(resume_from_checkpoint=True)
    assert trainer.preempted and trainer.state.global_step == 4  # stopped at the step the signal came in
    assert committed(tmp_path / "policy") == [3, 4]  # every_steps=3, then the preemption save, committed
    with pytest.raises(shardckpt.ConfigError, match="closed"):  # train() closed it: uploads drained
        ckpt.save({}, 5)
