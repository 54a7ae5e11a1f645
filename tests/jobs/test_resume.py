"""Crash consistency of an interrupted save, and SIGTERM to torchrun.

(Bit-exact resume after a SIGKILL, DDP at 2 ranks with dropout, a shuffled sampler, AdamW and an LR
schedule, compared step by step with an uninterrupted run: tests/jobs/test_check_resume.py.)"""

import json
import os

import torch
from helpers import PROGRAMS, kill_job, start_torchrun, wait_for

import shardckpt


def test_kill_during_save_leaves_previous_step_loadable(tmp_path):
    import subprocess
    import sys
    import time

    from helpers import child_env

    ckpt_dir, marker = tmp_path / "ck", tmp_path / "started"
    proc = subprocess.Popen([sys.executable, str(PROGRAMS / "slow_save.py"), str(ckpt_dir), str(marker)],
                            env=child_env(), start_new_session=True)
    try:
        wait_for(lambda: marker.exists(), 120, "step 2 to start", proc=proc)

        def writing_step2():
            partial = [p for p in ckpt_dir.iterdir() if p.name.startswith(".partial-step_0000000002")]
            return bool(partial) and any(f.suffix == ".distcp" for f in partial[0].iterdir())

        deadline = time.monotonic() + 60
        while not writing_step2():
            if time.monotonic() > deadline or (ckpt_dir / "step_0000000002").exists():
                raise AssertionError("step 2 was never seen mid-write")
            time.sleep(0.002)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert not (ckpt_dir / "step_0000000002").exists(), "the kill came after the commit; enlarge the state"

    ckpt = shardckpt.Checkpointer(local_dir=str(ckpt_dir), preemption_signals=())
    assert ckpt.steps() == [1]  # the partial step is invisible
    state = {"weights": [torch.zeros(8 << 20) for _ in range(6)]}
    assert ckpt.load(state) == 1
    expected = torch.load(str(marker) + ".expected")
    assert all(torch.equal(a, b) for a, b in zip(expected, state["weights"]))
    assert state["step_note"] == 1
    ckpt.save(state, 3).wait()  # the next save cleans the leftover up
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".partial")]
    ckpt.close()


def test_sigterm_to_torchrun_saves_and_exits(tmp_path):
    import signal

    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "job.log"
    job = start_torchrun(2, PROGRAMS / "train.py", tmp_path / "ck", out, 100000, "--every", 1000,
                         "--step-sleep", 0.05, log_path=log)
    try:
        def trained_a_while():
            path = out / "losses.rank0.json"
            try:
                return len(json.loads(path.read_text())) >= 5
            except (OSError, ValueError):
                return False

        wait_for(trained_a_while, 240, "five training steps", proc=job, log_path=log)
        os.kill(job.pid, signal.SIGTERM)  # what a spot reclaim does to the launcher
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            kill_job(job)
    assert (out / "preempted").exists(), log.read_text()[-3000:]
    step = int((out / "preempted").read_text())
    ckpt = shardckpt.Checkpointer(local_dir=str(tmp_path / "ck"), preemption_signals=())
    assert ckpt.steps() == [step]  # no regular save happened (every 1000 steps)
    assert step >= 5
