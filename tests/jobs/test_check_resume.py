"""``shardckpt check-resume`` on real scripts, and the resume matrix of the integrations.

Each test runs the command itself (``python -m shardckpt check-resume ... --
COMMAND``): three real runs of COMMAND (reference, SIGKILLed, resumed; plain
processes or torchrun jobs on gloo), every save() call recorded by every rank.

- A correct plain script resumes exactly (exit 0) and its own ``local_dir`` is
  never created; with every other save light, the kill after a light step
  resumes the full one before it and the verdict names the light one.
- Planted faults, each exit 1 naming the first step after the resume and the
  key that differs there with what it means: a generator not in the state
  (model), a scheduler not in the state (the learning rate), a loop whose epoch
  counter is not saved and resets the sampler's position (data position).
- A resume that takes an older step than the newest committed one: exit 1. A
  script that never calls save(): exit 2. A nondeterministic script under
  ``--reference-twice``: reported as such.
- The resume matrix: DDP and FSDP2 (one job: a model of each), the Hugging
  Face Trainer (one process), an accelerate loop with a StatefulDataLoader,
  torchtitan's manager; each job killed mid-epoch after an epoch boundary and
  compared step by step, bitwise, with an uninterrupted run: exit 0. Lightning
  DDP killed right after the last batch of epoch 0 (its loop counters as in
  the uninterrupted fit; fits killed mid-epoch 1 under DDP and FSDP2 are
  compared step by step in test_lightning.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import PROGRAMS, ROOT, child_env, torchrun_cmd

import shardckpt

SCRIPT = PROGRAMS / "resume_script.py"


def check(workdir, command, *, steps: int = 12, kill: int = 7, options=(), env=None) -> subprocess.CompletedProcess:
    """``shardckpt check-resume`` on ``command``: an epoch is 5 steps, so the kill after step 7 lands in the
    middle of the second epoch."""
    cmd = [sys.executable, "-m", "shardckpt", "check-resume", "--steps", str(steps), "--kill-after", str(kill),
           "--workdir", str(workdir), "--timeout", "400", *options, "--", *map(str, command)]
    return subprocess.run(cmd, env=env or child_env(), capture_output=True, text=True, timeout=900, cwd=str(ROOT))


def said(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr[-4000:]}"


def test_a_correct_script_resumes_exactly_and_its_own_checkpoints_are_untouched(tmp_path):
    own, workdir = tmp_path / "own-checkpoints", tmp_path / "check"
    # Every other save is light (no optimizer state): the kill after step 8 resumes step 7, the newest full one.
    proc = check(workdir, [sys.executable, SCRIPT, own], kill=8, env=child_env(SHARDCKPT_FULL_EVERY="2"))
    assert proc.returncode == 0, said(proc)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("shardckpt check-resume: equal: steps 8..12 on every rank (1 rank, 5 save() calls "
                            "compared; killed after step 8, resumed from step 7)"), said(proc)
    assert "  note: step 8 committed too, light (without optimizer state" in proc.stdout, said(proc)
    # Every user key under its own name (a user's torch.Generator under `rng` too, by its state, not its pickle);
    # the process's generators apart; a NaN placeholder metric equal to itself.
    for key in ("model [model]", "optimizer [optimizer]", "scheduler [LR scheduler]", "sampler [data position]",
                "noise [stateful object]", "process RNG [random generators], rng [random generators]",
                "samples_seen [value]", "the reported loss, val_loss"):
        assert key in proc.stdout, key
    # Progress: each run's timeout, and when its first save() call came.
    assert "shardckpt check-resume: reference run, to step 12, timeout 400 s: " in proc.stderr, said(proc)
    assert "shardckpt check-resume: resumed run: first save() call, step 8, after " in proc.stderr, said(proc)
    assert not own.exists()
    assert os.listdir(workdir) == []  # logs, records and checkpoints removed (no --keep)


def test_under_a_check_every_checkpointer_is_redirected_whatever_the_script_passes(tmp_path, monkeypatch):
    import json

    from shardckpt import CheckpointConfig
    from shardckpt.check_resume import probe as resume_probe

    for key in [k for k in os.environ if k.startswith("SHARDCKPT_")]:
        monkeypatch.delenv(key)
    assert CheckpointConfig(local_dir="runs/a", remote="s3://bucket/a").remote == "s3://bucket/a"  # no check: as given
    root = tmp_path / "check" / "ckpt"
    monkeypatch.setenv(resume_probe.ENV, json.dumps({"ckpt": str(root), "out": str(tmp_path / "records")}))
    monkeypatch.setenv("SHARDCKPT_LOCAL_DIR", "/elsewhere/env")
    a = CheckpointConfig(local_dir="runs/a", remote="s3://bucket/a")
    b = CheckpointConfig(local_dir="runs/b", remote="s3://bucket/b")
    env = CheckpointConfig.from_env()
    for config in (a, b, env):
        assert os.path.dirname(config.local_dir) == str(root), config.local_dir
    assert a.remote.startswith(f"file://{root}/a-") and a.remote.endswith(".remote"), a.remote
    assert len({a.local_dir, b.local_dir, env.local_dir}) == 3 and a.remote != b.remote
    assert env.remote is None
    # The same script in another run of the check gets the same paths; redirecting again changes nothing.
    assert CheckpointConfig(local_dir="runs/a", remote="s3://bucket/a").local_dir == a.local_dir
    again = CheckpointConfig(local_dir=a.local_dir, remote=a.remote)
    assert (again.local_dir, again.remote) == (a.local_dir, a.remote)
    monkeypatch.setenv(resume_probe.ENV, "not json")
    with pytest.raises(shardckpt.ConfigError, match="SHARDCKPT_CHECK_RESUME is set but"):
        CheckpointConfig(local_dir="runs/a")


FAULTS = {
    # A noise generator outside the state starts again from its seed: the model differs at once, while the
    # data position and the random generators the state holds are equal.
    "generator": ("differing: model, optimizer", "model [model]: fc1.bias, fc1.weight",
                  "the model differs while the data position and the random generators are equal: something "
                  "outside the saved state drives the computation: an unregistered generator"),
    # No scheduler in the state: the resumed run's fresh scheduler sets another learning rate after its
    # first step; the weights of that step are still equal.
    "scheduler": ("differing: optimizer", "optimizer [optimizer]: learning rate [0.00833333] (reference "
                  "[0.00384615])", "the learning rate differs: the LR scheduler is not in the state"),
    # The loop's epoch counter starts at 0 again and set_epoch(0) resets the sampler's saved position.
    "data": ("differing: sampler, model, optimizer", "sampler [data position]: consumed 8 (reference 24), epoch 0 "
             "(reference 1)", "the data position differs: the loader did not continue where the killed run stopped"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_fault_is_named_at_the_first_step_after_the_resume(tmp_path, fault):
    keys, detail, meaning = FAULTS[fault]
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", fault])
    assert proc.returncode == 1, said(proc)
    assert proc.stdout.startswith(f"shardckpt check-resume: DIFFERS at step 8, the first step after the resume "
                                  f"(killed after step 7, resumed from step 7); {keys}\n"), said(proc)
    assert f"  rank 0: {detail}" in proc.stdout, said(proc)
    assert f"what it usually means: {meaning}" in proc.stdout, said(proc)


def test_a_resume_that_skips_a_newer_committed_step_fails(tmp_path):
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", "older"])
    assert proc.returncode == 1, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: resume failed: the resumed run restored step 6, but step 7 "
                                  "was committed (a full step) when the job was killed"), said(proc)


def test_a_script_that_never_saves_cannot_be_checked(tmp_path):
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", "nosave"])
    assert proc.returncode == 2, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: not checked: the reference run exited with status 0 "
                                  "without calling save()"), said(proc)


def test_a_nondeterministic_script_is_reported_as_such_and_the_resume_is_not_blamed(tmp_path):
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", "nondeterministic"],
                 options=["--reference-twice", "--keep"])
    assert proc.returncode == 1, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: nondeterministic: two runs from scratch differ at step 1 "
                                  "(no step before it compared): noise, model, optimizer differ."), said(proc)
    assert "the resume is not blamed" in proc.stdout
    # --keep: each run's log and records stay for the user to read.
    kept = sorted(os.listdir(tmp_path / "check"))
    assert {"reference.log", "reference-2.log", "reference", "reference-2"} <= set(kept), kept
    assert any(n.startswith("rank0.") for n in os.listdir(tmp_path / "check" / "reference-2"))


def _installed(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except ImportError:
        return False


def _matrix():
    # (case, command for tmp_path, --steps, --kill-after, the first step compared, ranks, modules it needs)
    # One job for both wrappers: a DDP model and an FSDP2-sharded one, each with its own AdamW (each compared
    # on its own key, at the cost of one job).
    yield "ddp-and-fsdp2", lambda t: torchrun_cmd(2, SCRIPT, t / "own", "--fsdp2"), 12, 7, 8, 2, ()
    # One process (transformers' import is the cost of a rank), 96 samples, 8 a step: an epoch of 12 steps.
    yield ("hf-trainer", lambda t: [sys.executable, PROGRAMS / "hf_trainer.py", "--out", t / "out", "--per-device",
                                    "8", "--max-steps", "1000"], 16, 14, 15, 1, ("transformers",))
    # A StatefulDataLoader with 2 worker processes per rank; 96 samples, 8 a step at 2 ranks: 12 steps an epoch.
    yield ("accelerate", lambda t: torchrun_cmd(2, PROGRAMS / "hf_accelerate.py", "--ckpt", t / "own", "--steps",
                                                 "1000", "--samples", t / "samples"), 16, 14, 15, 2,
           ("accelerate", "torchdata"))
    # 64 samples, 4 a rank and step: an epoch of 8 steps; a save every 2. Killed right after the last batch of
    # epoch 0 (step 8): Lightning's loop counters as the uninterrupted fit's. (DDP and FSDP2 fits killed in the
    # middle of epoch 1 are compared step by step, bitwise, in test_lightning.py.)
    yield ("lightning-ddp-epoch-end",
           lambda t: torchrun_cmd(2, PROGRAMS / "lightning_job.py", t, "run", f"ckpt={t / 'own'}", "strategy=ddp",
                                  "every=2", "steps=1000"), 12, 8, 10, 2, ("lightning", "torchdata"))
    # FSDP2, a save every 3 steps; each rank's data part re-looped every 4 steps.
    yield ("torchtitan", lambda t: torchrun_cmd(2, PROGRAMS / "torchtitan_job.py", t, "run", f"ckpt={t / 'own'}",
                                                 "steps=1000000"), 12, 6, 7, 2, ("torchtitan",))


MATRIX = list(_matrix())


@pytest.mark.slow
@pytest.mark.parametrize("case,command,steps,kill,first,ranks,needs", MATRIX, ids=[m[0] for m in MATRIX])
def test_resume_matrix(tmp_path, case, command, steps, kill, first, ranks, needs):
    if not _installed(*needs):
        pytest.skip(f"{', '.join(needs)} not installed")
    proc = check(tmp_path / "check", command(tmp_path), steps=steps, kill=kill)
    assert proc.returncode == 0, said(proc)
    assert proc.stdout.startswith(f"shardckpt check-resume: equal: steps {first}..{steps} on every rank ({ranks} "
                                  f"rank{'s' if ranks > 1 else ''}, "), said(proc)
    assert f"killed after step {kill}, resumed from step {kill})" in proc.stdout, said(proc)
    if case == "ddp-and-fsdp2":
        assert "  compared: model [model], noise [stateful object], optimizer [optimizer], process RNG [random " \
               "generators], rng [random generators], sampler [data position], samples_seen [value], scheduler [LR " \
               "scheduler], sharded [model], sharded_optimizer [optimizer]" in proc.stdout, said(proc)
