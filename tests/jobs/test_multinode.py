"""Two nodes x two ranks (two torchrun launchers on this machine): the layouts users run.

A shared checkpoint directory (NFS, Lustre, a shared volume) and node-local
directories (NVMe on each node) must both commit every step exactly once,
verify, and restore bitwise; a failure on one rank at any point of the commit
path must give every rank the same outcome and leave the step committed and
verifiable, or absent.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from helpers import PROGRAMS, ROOT, child_env, job_output, run_two_nodes

from shardckpt import cli
from shardckpt.format import layout

PROG = PROGRAMS / "multinode.py"


def outcomes(out, world=4):
    return [json.loads((out / f"outcome.{r}.json").read_text()) for r in range(world)]


def assert_bitwise(saved_path, restored_path):
    saved, restored = torch.load(saved_path), torch.load(restored_path)
    assert restored["step"] == saved["step"]
    assert saved["tensors"].keys() == restored["tensors"].keys()
    for key, value in saved["tensors"].items():
        assert torch.equal(value, restored["tensors"][key]), key


def test_shared_directory_commits_every_step_once_and_restores_at_one_process(tmp_path, capsys):
    ckpt, out = tmp_path / "shared", tmp_path / "out"
    out.mkdir()
    logs = run_two_nodes(2, PROG, "save", ckpt, out, "--layout", "shared", "--steps", "6", log_dir=tmp_path)
    assert all(o["steps"] == [1, 2, 3, 4, 5, 6] for o in outcomes(out)), outcomes(out)
    assert "one directory shared by all 4 rank(s)" in logs[0]
    said = "".join(job_output(log) for log in logs)
    assert "lost its partial" not in said and "Error" not in said, said[-4000:]
    manifest = layout.read_manifest(str(ckpt / layout.step_dirname(6)))
    assert manifest.copies == [[0, 1, 2, 3]] and {e.rank for e in manifest.files.values()} == {0, 1, 2, 3}
    assert cli.main(["verify", str(ckpt), "--all"]) == 0
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".")], list(ckpt.iterdir())  # no leftovers

    # A new instance with one process and no process group restores it bitwise.
    subprocess.run([sys.executable, str(PROG.parent / "single_restore.py"), str(ckpt), str(out / "restored.pt")],
                   env=child_env(), check=True, cwd=str(ROOT), timeout=120)
    assert_bitwise(out / "saved.pt", out / "restored.pt")


def test_node_local_directories_each_hold_their_ranks_and_restore_from_each_other(tmp_path):
    base, out = tmp_path / "nvme", tmp_path / "out"
    out.mkdir()
    env = child_env(SHARDCKPT_PEER_REPLICAS="0")  # the exchange between copies itself (no replicas to use)
    logs = run_two_nodes(2, PROG, "save", base, out, "--layout", "local", "--steps", "6", log_dir=tmp_path, env=env)
    assert "node-local: 2 copies (ranks 0-1, ranks 2-3)" in logs[0]
    for node, ranks in (("node0", {0, 1}), ("node1", {2, 3})):
        step_dir = base / node / layout.step_dirname(6)
        held = {int(n.split("_")[2]) for n in (p.name for p in step_dir.iterdir()) if n.startswith("__")}
        assert held == ranks, (node, held)
        assert (step_dir / ".metadata").exists()  # every copy can be inspected and read
        # verify checks what this copy holds and says where the rest lives
        assert cli.main(["verify", str(base / node), "--all"]) == 0
    # Restart on the same two nodes: each node receives the other's files, checks them, loads.
    # The first load has one bit flipped in transit: the receiving node must refuse that file
    # (every rank raises), keep nothing of it, and the next load receive it again whole.
    out2 = tmp_path / "out2"
    out2.mkdir()
    logs = run_two_nodes(2, PROG, "restore", base, out2, "--layout", "local", "--corrupt-transfer",
                         log_dir=tmp_path, env=env)
    for rank, o in enumerate(outcomes(out2)):
        assert o["restored"] == 6, o
        # The damaged load raised on every rank and kept no damaged byte: every file this node's copy holds
        # after it is the manifest's, and the file damaged on the way is not among them; the next load
        # received what was missing whole from the other node.
        assert o["damaged_transfer"].startswith("CorruptCheckpointError: step 6: "), o
        assert o["bad_after_damage"] == [], o
        manifest = layout.read_manifest(str(base / f"node{rank // 2}" / layout.step_dirname(6)))
        lacking = set(manifest.files) - set(o["held_after_damage"])
        assert lacking and all(manifest.files[n].rank // 2 != rank // 2 for n in lacking), o["held_after_damage"]
        assert o["sources"]["other nodes"] == {"files": len(lacking), "refused": 0,
                                               "bytes": sum(manifest.files[n].size for n in lacking)}, o["sources"]
    assert_bitwise(out / "saved.pt", out2 / "restored.pt")


def test_one_rank_failing_anywhere_in_the_commit_gives_every_rank_the_same_outcome(tmp_path):
    """A shared directory and node-local ones, one after the other in one job (one launch for both)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    # Without replicas: a node keeps its copy of a step another node's newest replica is of, which
    # would make local retention here depend on how far replication got.
    run_two_nodes(2, PROG, "faults", ckpt, out, "--layout", "shared,local", log_dir=tmp_path,
                  env=child_env(SHARDCKPT_PEER_REPLICAS="0"))
    results = outcomes(out)
    assert all(r == results[0] for r in results), results  # one outcome per step, on every rank
    for layout_kind in ("shared", "local"):
        got = results[0][layout_kind]
        late = "2" if layout_kind == "local" else "0"
        assert got["2"] == "failed on rank 1: fault injected at write.done", layout_kind
        assert got["4"] == "failed on rank 3: fault injected at write.hashed", layout_kind
        assert got["6"] == f"failed on rank {late}: fault injected at commit.manifest_written", layout_kind
        assert got["8"] == f"failed on rank {late}: fault injected at commit.renamed", layout_kind
        assert got["10"] == "ok", layout_kind  # retention failed after the commit: a warning, not a failed save
        assert all(got[str(s)] == "ok" for s in (1, 3, 5, 7, 9, 11)), (layout_kind, got)
        assert got["11-again"] == f"failed on rank {late}: fault injected at commit.renamed", layout_kind
        assert got["12"] == "ok", layout_kind  # and saving goes on
        assert got["step11_is_first_save"] is True, layout_kind  # the failed re-save put the first copy back
        assert got["committed"] == [11, 12], layout_kind  # keep_last=2; the failed steps never existed
        base = ckpt / layout_kind
        dirs = [base] if layout_kind == "shared" else [base / "node0", base / "node1"]
        for d in dirs:
            assert layout.committed_steps(str(d)) == [11, 12], d
            assert cli.main(["verify", str(d), "--all"]) == 0
