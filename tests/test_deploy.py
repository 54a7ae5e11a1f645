"""The deploy/ recipes do what they promise.

deploy/torchrun/launch.sh runs examples/train_ddp.py under torchrun; a worker
SIGKILLed mid-run makes torchrun restart the group, which resumes from the
newest committed step and ends bitwise equal to an uninterrupted run; SIGTERM
to the launcher reaches every worker and the job saves and exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers import ROOT, child_env, descendants, free_port, kill_job, wait_for

DEPLOY = ROOT / "deploy"
LAUNCH = DEPLOY / "torchrun" / "launch.sh"
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def step_manifest(step: int) -> str:
    """Where a committed step's manifest sits, relative to its tier's root."""
    return f"step_{step:010d}/shardckpt.json"


# --------------------------------------------------------------- the launch script


def launch_env(ckpt_dir: Path, **extra: str) -> dict[str, str]:
    return child_env(PYTHON=sys.executable, NPROC_PER_NODE="2", CKPT_DIR=str(ckpt_dir), **extra)


def start_launch(log: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """launch.sh in its own session (so the whole job can be killed), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen([str(LAUNCH), *map(str, args)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=str(ROOT), start_new_session=True)


def proc_stat(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, ppid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def worker_pid(launcher: int, rank: int) -> int:
    """The worker of ``rank`` that torchrun (the launcher, after exec) started, found by its environment."""
    for pid in descendants(launcher):
        try:
            if int(proc_stat(pid)[1]) != launcher:
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


def exited(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] in ("Z", "X")
    except OSError:
        return True


def dry_run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAUNCH), "train.py", "--lr", "1"], env={**child_env(DRY_RUN="1"), **env},
                          capture_output=True, text=True, timeout=30)


def test_launch_script_builds_torchrun_commands_and_documents_its_variables():
    text = LAUNCH.read_text()
    help_text = subprocess.run([str(LAUNCH), "--help"], capture_output=True, text=True, timeout=30, check=True).stdout
    for name in set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", text)):
        assert name in help_text, f"launch.sh reads ${name} but --help does not mention it"
    assert text.rstrip().splitlines()[-1].startswith('exec "$PYTHON" -m torch.distributed.run')

    single = dry_run().stdout
    assert "--standalone" in single and "--nproc-per-node=1" in single and single.rstrip().endswith("train.py --lr 1")
    multi = dry_run(NNODES="2:4", NPROC_PER_NODE="8", RDZV_ENDPOINT="node0:29400", RDZV_ID="run1").stdout
    for flag in ("--nnodes=2:4", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400",
                 "--rdzv-id=run1", "--max-restarts=3"):
        assert flag in multi
    # The Kubeflow operator's MASTER_ADDR / MASTER_PORT serve as the endpoint.
    operator = dry_run(NNODES="2", MASTER_ADDR="train-run1-master-0", MASTER_PORT="29400").stdout
    assert "--rdzv-endpoint=train-run1-master-0:29400" in operator

    missing = dry_run(NNODES="2")
    assert missing.returncode == 2 and "RDZV_ENDPOINT" in missing.stderr
    bad = dry_run(NNODES="two")
    assert bad.returncode == 2 and "NNODES" in bad.stderr


def test_killed_worker_restarts_the_group_and_ends_bitwise_equal(tmp_path):
    """SIGKILL one worker after step 10 committed: torchrun restarts, the job resumes, same weights."""
    args = (EXAMPLE, "--steps", 40, "--every", 5, "--step-sleep", 0.1)
    ref_env = launch_env(tmp_path / "ref" / "ckpt")
    env = launch_env(tmp_path / "job" / "ckpt", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", MAX_RESTARTS="1")
    ref_log, log = tmp_path / "ref.log", tmp_path / "job.log"
    reference = start_launch(ref_log, ref_env, *args)
    job = start_launch(log, env, *args)
    try:
        wait_for(lambda: "torch.distributed.run" in Path(f"/proc/{job.pid}/cmdline").read_text(), 10,
                 "launch.sh to exec torchrun", proc=job, log_path=log)
        wait_for(lambda: (tmp_path / "job" / "ckpt" / step_manifest(10)).exists(), 180, "step 10 to commit",
                 proc=job, log_path=log)
        survivor = worker_pid(job.pid, rank=0)
        os.kill(worker_pid(job.pid, rank=1), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: exited(survivor), 60, "the surviving worker to exit", proc=job, log_path=log)
        survivor_s = time.monotonic() - killed_at
        wait_for(lambda: "resuming from step" in log.read_text(), 120, "the restarted group to resume",
                 proc=job, log_path=log)
        restart_s = time.monotonic() - killed_at
        assert job.wait(timeout=180) == 0, log.read_text()[-4000:]
        assert reference.wait(timeout=180) == 0, ref_log.read_text()[-4000:]
    finally:
        for proc in (job, reference):
            if proc.poll() is None:
                kill_job(proc)

    text = log.read_text()
    resumed = int(re.search(r"resuming from step (\d+)", text).group(1))
    assert 10 <= resumed < 40, f"resumed from step {resumed}: the kill did not land mid-run"
    assert text.count("[train_ddp] starting fresh") == 1 and "finished 40 steps" in text
    # torchrun SIGTERMs the surviving worker and SIGKILLs it only 30 s later: it must not hang that long
    # (it leaves at once: its collective fails when the peer is gone).
    assert survivor_s < 20, f"the surviving worker took {survivor_s:.1f} s to exit"
    print(f"after the kill: survivor gone in {survivor_s:.1f} s, group resumed in {restart_s:.1f} s")
    expected = torch.load(tmp_path / "ref" / "final.pt")
    actual = torch.load(tmp_path / "job" / "final.pt")
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


def test_sigterm_to_the_launcher_saves_once_more_and_exits(tmp_path):
    """What a spot reclaim or `kubectl delete` does: SIGTERM to launch.sh's pid."""
    log = tmp_path / "job.log"
    job = start_launch(log, launch_env(tmp_path / "ckpt"), EXAMPLE, "--steps", 100000, "--every", 1000,
                       "--step-sleep", 0.05)
    try:
        wait_for(lambda: "step    5" in log.read_text(), 180, "five training steps", proc=job, log_path=log)
        os.kill(job.pid, signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            kill_job(job)
    found = re.search(r"preempted: step (\d+) is committed", log.read_text())
    assert found, log.read_text()[-4000:]
    step = int(found.group(1))
    assert step >= 5 and step % 1000, "the save came from the signal, not the interval"
    assert (tmp_path / "ckpt" / step_manifest(step)).exists()
