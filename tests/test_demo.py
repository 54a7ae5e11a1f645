"""The demo's story as a test (the steps of scripts/demo.sh, not the script).

A real S3 server (`rclone serve s3`); examples/train_ddp.py on 2 ranks saving
locally and to the bucket; SIGTERM to the launcher once a step is in the
bucket; `shardckpt ls` and `verify` on the bucket; the node's disk gone; a
new instance on 1 rank restoring from the bucket with its elastic plan, and
finishing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import ROOT, child_env, kill_job, wait_for  # noqa: E402
from s3server import RcloneS3Server, stop_uploaders  # noqa: E402

LAUNCH = ROOT / "deploy" / "torchrun" / "launch.sh"
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def launch(nproc: int, ckpt: Path, env: dict, log: Path) -> subprocess.Popen:
    env = dict(env, NPROC_PER_NODE=str(nproc), CKPT_DIR=str(ckpt), PYTHON=sys.executable, MAX_RESTARTS="0")
    return subprocess.Popen(["bash", str(LAUNCH), str(EXAMPLE), "--steps", "40", "--every", "5", "--step-sleep", "0.05"],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=str(ROOT),
                            start_new_session=True)


def test_preempted_on_two_ranks_resumed_from_the_bucket_on_one(tmp_path):
    server = RcloneS3Server()
    try:
        server.client().create_bucket(Bucket="demo-bucket")
        url = "s3://demo-bucket/run1"
        env = child_env(**server.env(), REMOTE=url, SHARDCKPT_REMOTE_KEEP_LAST="4", SHARDCKPT_LOG_LEVEL="INFO")
        node_a, node_b = tmp_path / "node-a" / "ckpt", tmp_path / "node-b" / "ckpt"

        # 1. two ranks train; the instance is reclaimed once step 10 is committed in the bucket
        log_a = tmp_path / "node-a.log"
        job = launch(2, node_a, env, log_a)
        try:
            wait_for(lambda: (node_a / "step_0000000010" / ".shardckpt-uploaded.json").exists(), 240,
                     "step 10 committed in the bucket", proc=job, log_path=log_a)
            os.kill(job.pid, signal.SIGTERM)  # to the launcher (it exec'ed torchrun), as the cloud does
            job.wait(timeout=180)  # torchrun forwards it, waits for the workers, then exits non-zero itself
        finally:
            if job.poll() is None:
                kill_job(job)
        first = log_a.read_text()
        assert "preempted: step" in first, first[-3000:]
        preempted = int(first.split("preempted: step ")[1].split()[0])

        # 2. what is durable in the bucket
        cli = [sys.executable, "-m", "shardckpt"]
        listed = subprocess.run(cli + ["ls", url, "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        steps = [r["step"] for r in json.loads(listed.stdout)["steps"]]
        assert steps[-1] == preempted and all(r["world_size"] == 2 for r in json.loads(listed.stdout)["steps"])
        verified = subprocess.run(cli + ["verify", url, "--all"], env=env, capture_output=True, text=True, timeout=120)
        assert verified.returncode == 0 and verified.stdout.count("ok   step") == len(steps), verified.stdout

        # 3. the node is gone with its disk; 4. a new instance with 1 rank resumes from the bucket
        stop_uploaders(tmp_path, grace_s=30.0)
        shutil.rmtree(tmp_path / "node-a")
        log_b = tmp_path / "node-b.log"
        job = launch(1, node_b, env, log_b)
        try:
            assert job.wait(timeout=300) == 0, log_b.read_text()[-3000:]
        finally:
            if job.poll() is None:
                kill_job(job)
        second = log_b.read_text()
        assert f"resuming from step {preempted} with 1 rank(s), 2 micro-batch(es) per step" in second, second[-3000:]
        assert f"restored step {preempted} from" in second and "world size 2 -> 1" in second
        assert "accumulation 1 -> 2, global batch 64 -> 64" in second
        assert "finished 40 steps" in second
    finally:
        stop_uploaders(tmp_path, grace_s=10.0)
        server.stop()
