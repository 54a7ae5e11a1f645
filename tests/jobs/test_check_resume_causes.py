"""``shardckpt check-resume`` names the cause, on scripts that resume right or wrong (real runs, as in
tests/test_check_resume.py).

- A user's generator under the key ``rng`` is compared under its own name (the process's generators apart):
  seeded again after ``load()``, it is the one key named.
- The memory tier on: the three runs do not see each other's memory copies (exit 0), and no memory keeper
  and no namespace is left after the check.
- Two ranks, the fault on one of them (rank 1, then rank 0): exit 1 naming that rank alone.
- A diagnosis per cause: the restored step numbered again or skipped, the learning rate set after
  ``load()``, gradients pending at the restored save (and shardckpt's WARNING quoted), a plain number with
  its two values.
- Progress: a run that has not called ``save()`` is said to be waiting, and the timeout named.
- Gradients pending at ``save()``: one WARNING outside any check too.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from helpers import child_env, torchrun_cmd
from test_check_resume import SCRIPT, check, said

import shardckpt


def test_a_user_generator_named_rng_is_compared_under_its_own_name(tmp_path):
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", "rng"])
    assert proc.returncode == 1, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: DIFFERS at step 8, the first step after the resume "
                                  "(killed after step 7, resumed from step 7); differing: rng\n"), said(proc)
    assert "  rank 0: rng [random generators]\n" in proc.stdout, said(proc)
    assert "seeded again after load()" in proc.stdout, said(proc)


def _keepers_of(path) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "memory_keeper" in cmdline and str(path) in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_with_the_memory_tier_each_run_is_apart_and_nothing_is_left(tmp_path):
    shm_dir, workdir = tmp_path / "shm", tmp_path / "check"
    shm_dir.mkdir()
    env = child_env(SHARDCKPT_MEMORY_EVERY_STEPS="1", SHARDCKPT_SHM_DIR=str(shm_dir))
    proc = check(workdir, [sys.executable, SCRIPT, tmp_path / "own"], env=env, options=["--keep"])
    assert proc.returncode == 0, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: equal: steps 8..12 on every rank (1 rank, 5 save() calls "
                                  "compared; killed after step 7, resumed from step 7)"), said(proc)
    # The memory tier was on (each run's keeper logged), and nothing of it is left: no namespace, no keeper.
    logs = [os.path.join(d, ".shardckpt-remote", "memory.log") for d in (workdir / "ckpt.resume").iterdir()]
    assert any(os.path.exists(p) for p in logs), os.listdir(workdir)
    assert os.listdir(shm_dir) == [], os.listdir(shm_dir)
    assert _keepers_of(workdir) == []


@pytest.mark.parametrize("rank", [1, 0])
def test_two_ranks_the_one_that_resumes_wrong_is_named(tmp_path, rank):
    proc = check(tmp_path / "check", torchrun_cmd(2, SCRIPT, tmp_path / "own", "--fault", "rng", "--fault-rank",
                                                  str(rank)))
    assert proc.returncode == 1, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: DIFFERS at step 8, the first step after the resume "
                                  "(killed after step 7, resumed from step 7); differing: rng\n"), said(proc)
    assert f"\n  rank {rank}: rng [random generators]\n" in proc.stdout, said(proc)
    assert f"rank {1 - rank}" not in proc.stdout and "ranks 0, 1" not in proc.stdout, said(proc)


CAUSES = {
    # The loop numbers the restored step again: one step of data shifted from there on.
    "again": ["differing: sampler, ", "what it usually means: the resumed run's first save() call is at step 7, the "
              "step it restored: the loop numbers the restored step again"],
    "skip": ["what it usually means: the resumed run's first save() call is at step 9, after restoring step 7, "
             "where the reference called save() at step 8: the loop skips step 8"],
    # ExponentialLR is chainable: the LR set after load() stays wrong, the scheduler's count is right.
    "lr": ["differing: optimizer, scheduler, model", "optimizer [optimizer]: learning rate [0.009] (reference "
           "[0.00430467])", "what it usually means: the learning rate differs though the LR scheduler 'scheduler' "
           "was restored and stepped as often (last_epoch 8 in both runs): the script sets the learning rate after "
           "load()"],
    # Gradients of two steps, one optimizer step: the save of step 7 holds the first half in .grad only.
    "accum": ["differing: model, optimizer", "what it usually means: gradients were pending at the save() of step "
              "7, the step the resume restored (optimizer 'optimizer': a backward() after its last step()",
              "  shardckpt said in the killed run:\n    shardckpt: step 1: gradients are pending at save() for the "
              "optimizer 'optimizer'"],
    "counter": ["differing: samples_seen\n", "  rank 0: samples_seen [value]: 8 (reference 64)\n"],
}


@pytest.mark.parametrize("fault", sorted(CAUSES))
def test_the_cause_is_named(tmp_path, fault):
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", fault])
    assert proc.returncode == 1, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: DIFFERS at step 8, "), said(proc)
    for text in CAUSES[fault]:
        assert text in proc.stdout, (text, said(proc))


def test_a_run_waiting_for_its_first_save_is_reported(tmp_path):
    proc = check(tmp_path / "check", [sys.executable, SCRIPT, tmp_path / "own", "--fault", "late"],
                 options=["--timeout", "8"])
    assert proc.returncode == 2, said(proc)
    assert "shardckpt check-resume: reference run, to step 12, timeout 8 s: " in proc.stderr, said(proc)
    assert "shardckpt check-resume: reference run: no save() call yet after 4 s; waiting up to --timeout 8 s" \
        in proc.stderr, said(proc)
    assert proc.stdout.startswith("shardckpt check-resume: not checked: the reference run called no save() within "
                                  "--timeout"), said(proc)


def test_gradients_pending_at_save_are_warned_outside_a_check(tmp_path, caplog, monkeypatch):
    for key in [k for k in os.environ if k.startswith("SHARDCKPT_")]:
        monkeypatch.delenv(key)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": optimizer}
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "ckpt"))
    try:
        with caplog.at_level(logging.WARNING, logger="shardckpt"):
            for step in (1, 2):  # a whole step each: backward, step, save (the gradients used)
                model(torch.randn(3, 4)).sum().backward()
                optimizer.step()
                ckpt.save(state, step)
            assert not [r for r in caplog.records if "pending" in r.getMessage()]
            model(torch.randn(3, 4)).sum().backward()  # half of an accumulation window
            ckpt.save(state, 3)
            ckpt.wait()
    finally:
        ckpt.close()
    warned = [r for r in caplog.records if "pending" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, caplog.text
    assert warned[0].getMessage().startswith("shardckpt: step 3: gradients are pending at save() for the optimizer "
                                             "'optimizer'"), warned[0].getMessage()
