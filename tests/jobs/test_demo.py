"""The README's first command, `bash scripts/demo.sh`, run as it is.

A real S3 server (`rclone serve s3`); examples/train_ddp.py on 2 ranks saving
locally and to the bucket; SIGTERM to the launcher once step 20 is in the
bucket; `shardckpt ls` and `verify` on the bucket; the node's disk gone; a
new instance on 1 rank restoring from the bucket with its elastic plan, and
finishing. Checked by state: the training state the 1-rank instance resumed
with is the one the 2-rank job had when it was preempted (a digest of model,
optimizer, scheduler state and data position that the example writes), and the
bucket holds that step and the final one.

Then the peer tier, with no remote: two launchers (`--nnodes 2 --node-rank i`)
with node-local directories train 10 steps; node 1's directory is deleted; node
0 alone (world size 1) resumes from its own files and node 1's replica, with the
elastic plan, and finishes. Checked by state as well: the digests at the resume
are those the 2-node job recorded when it finished.

Then the memory tier: a 1-rank job keeping every step in memory dies during its
copy of step 8 (the disk holds step 6); torchrun restarts it and it resumes
step 7 from shared memory, finishes, and leaves no shared memory behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import ROOT, child_env  # noqa: E402
from s3server import stop_peer_daemons, stop_uploaders  # noqa: E402

from shardckpt.format import shm  # noqa: E402


def test_demo_script_preempts_on_two_ranks_and_resumes_from_the_bucket_on_one_then_from_a_peer(tmp_path):
    run, digests = tmp_path / "demo-run", tmp_path / "digests.txt"
    # This environment's interpreter (its venv, set up already: setup.sh only checks it).
    env = child_env(SHARDCKPT_VENV=sys.prefix, DEMO_RUN=str(run), TRAIN_DIGESTS=str(digests))
    try:
        demo = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh")], env=env, cwd=str(ROOT),
                              capture_output=True, text=True, timeout=600)
    finally:
        stop_uploaders(tmp_path, grace_s=10.0)
        # Node 0's daemon outlives the demo: it keeps retrying to replicate the last step to node 1, whose
        # directory the demo removed, so it never becomes idle and exits by itself.
        stop_peer_daemons(tmp_path)
    assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
    out = demo.stdout
    assert "rclone serve s3 on http://127.0.0.1:" in out, out  # the real server, not the file:// stand-in
    assert "== demo OK: 2 ranks preempted at step" in out, out[-3000:]

    events = [line.split() for line in digests.read_text().splitlines()]
    assert [e[0] for e in events] == ["preempted", "resumed", "finished"], events
    (_, preempted, *at_preemption), (_, resumed, *at_resume), (_, finished, *_) = events
    assert int(preempted) >= 20 and resumed == preempted and finished == "60", events
    # the 1-rank instance resumed with the 2-rank job's model, optimizer, scheduler and data position
    assert [d.split("=")[0] for d in at_resume] == ["model", "optimizer", "scheduler", "data"], at_resume
    assert at_resume == at_preemption

    # What the bucket holds: the preemption step (saved by 2 ranks) and the final one (by 1), verified.
    bucket = [r for r in (run / "s3" / "demo-bucket" / "run1").iterdir()]
    assert bucket, "nothing in the bucket"
    listing = out.split("== 2. what is durable in the bucket")[1].split("== 3.")[0]
    assert f" {int(preempted)} " in f" {listing} " and "ok   step" in listing, listing
    final = subprocess.run([sys.executable, "-m", "shardckpt", "ls", str(run / "node-b" / "ckpt"), "--json"],
                           env=env, capture_output=True, text=True, timeout=120)
    rows = json.loads(final.stdout)["steps"]
    assert rows[-1]["step"] == 60 and rows[-1]["world_size"] == 1 and "remote" in rows[-1]["tiers"], rows[-1]

    # The peer scene: node 1 lost, node 0 alone resumed the 2-node job's last step from node 1's replica.
    scene = out.split("== 6.")[1]
    # node 0's copy was completed from node 1's replica held on node 0 (the line counts the files each source gave)
    assert (re.search(r"this node's copy from .*replicas here: [1-9]\d* file", scene)
            and "world size 2 -> 1" in scene), scene
    assert "elastic plan for step 10" in scene and "accumulation 1 -> 2" in scene, scene
    assert not (run / "peer" / "node1").exists()
    peer_events = [line.split() for line in (run / "peer" / "digests.txt").read_text().splitlines()]
    assert [e[:2] for e in peer_events] == [["finished", "10"], ["resumed", "10"], ["finished", "15"]], peer_events
    assert peer_events[1][2:] == peer_events[0][2:], peer_events  # model, optimizer, scheduler, data: bitwise
    assert "node 0 resumed step 10 from its peer replica" in out, out[-2000:]

    # The memory tier: a trainer killed during its copy of step 8 (the disk held 6), restarted by torchrun,
    # resumed step 7 from shared memory; the clean end freed the memory.
    scene = out.split("== 7.")[1]
    assert "restored step 7 from memory" in scene and "finished 9 steps" in scene, scene
    events = [line.split()[:2] for line in (run / "memory" / "digests.txt").read_text().splitlines()]
    assert events == [["resumed", "7"], ["finished", "9"]], events
    assert not os.path.exists(shm.namespace(str(run / "memory" / "ckpt")))
