"""The memory tier: a step kept in shared memory survives its trainer and is resumed bitwise.

Four launches on one directory (two 2-rank torchrun jobs, then two single
processes), each crash followed by a real restart: SIGKILL right after save(7)
returned with the disk every 10 steps; a rollback, then a rank killed during its
copy; what `shardckpt ls` / `status` show; a world-size change 2 -> 1 on one
machine; copies of another boot or gone ("a reboot"); a single process killed
right after save(15); a clean close() writing the newest step to disk and
freeing the memory; a copy cut short in the slot of the newest step; a job that
dies without a restart, freed by its node's keeper. Two nodes, each with its own
shared memory: restarted on both, each rank reads its own node's copy; restarted
on one node, the step comes from the disk. Then a state larger than the budget,
a shared-memory directory others could have written (never read nor written),
and the survey's rule on two machines.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import PROGRAMS, child_env, run_nodes, run_torchrun, wait_for

import shardckpt
from shardckpt.format import shm


def _phases(out, rank=0):
    return {int(p.name[5:].split(".")[0]): json.loads(p.read_text())
            for p in out.glob(f"phase*.rank{rank}.json")}


def _gone(path: str | None) -> bool:
    return path is None or not os.path.exists(path)


def test_crashes_restarts_a_rollback_a_world_size_change_and_a_reboot(tmp_path):
    """Two 2-rank launches, then two single-process launches, on one directory."""
    import subprocess
    import sys

    root, torn, other, out = tmp_path / "ck", tmp_path / "torn", tmp_path / "other", tmp_path / "out"
    out.mkdir()
    env = child_env(SHARDCKPT_MEMORY_LINGER_S="60")
    two_ranks = [
        "train=1-7,kill",  # SIGKILL right after save(7) returned (every_steps=10: 7 is in memory only)
        # resumed; a rollback to 10 (12 stays behind on the abandoned branch), then rank 1 dies during its copy
        # of the new branch's 12 (rank 0 right after its save(12) returned)
        "load=7,train=8-12,load@10=10,train=11-11,killcopy=12",
    ]
    one = [
        # 2 ranks -> 1 on this machine: the new branch's 11 (not the abandoned 12, nor the incomplete one); then
        # copies of "another boot" or gone: from disk; SIGKILL right after save(15) returned
        "load=11,reboot,load=10,train=11-15,kill",
        # close() writes 15 to disk and frees the memory. Then memory_keep=1 on another directory, the disk every
        # 3 steps: step 3's disk write stalls (its slot spared meanwhile), 4 goes to the other slot, and the
        # process dies copying 5: into the third slot (neither 4's, the newest returned save, nor 3's, being written)
        f"load=15,close,use={torn}:1:3,stall,train=1-4,killcopy=5",
        # 4, the newest save that returned (3's disk write never finished); close() writes 4 to disk; a job that
        # dies without close(): its node's keeper frees its memory
        f"use={torn}:1:3,load=4,close,other={other}",
    ]
    phases = two_ranks + one
    for _ in two_ranks:
        job = run_torchrun(2, PROGRAMS / "memory_job.py", root, out, *phases, env=env, check=False)
        assert job.returncode == 1, job.stdout[-6000:]
        # Compared by content at each save kept in memory, as at a disk save: one warning per launch.
        warned = [line for line in job.stdout.splitlines() if "'stats' differs across ranks" in line]
        assert len(warned) == 1 and "content digest" in warned[0], job.stdout[-6000:]
    # What the memory holds now, as the command line shows it (no torch, no trainer alive)
    ls = json.loads(subprocess.run([sys.executable, "-m", "shardckpt", "ls", str(root), "--json"], env=env,
                                   capture_output=True, text=True, timeout=60).stdout)
    assert {r["step"]: (r["tiers"], r["abandoned"]) for r in ls["steps"]} == {
        10: (["local"], None), 11: (["memory"], None), 12: (["memory"], "abandoned: rolled back to step 10")}
    status = json.loads(subprocess.run([sys.executable, "-m", "shardckpt", "status", str(root), "--json"], env=env,
                                       capture_output=True, text=True, timeout=60).stdout)
    # both branches' 11 and 12 (the new branch's 12 held by rank 0 alone: rank 1 died during its copy)
    assert [(s["step"], s["ranks"]) for s in status["memory"]["saves"]] == [(11, [0, 1]), (11, [0, 1]), (12, [0, 1]),
                                                                              (12, [0])], status["memory"]
    for _ in one:
        job = subprocess.run([sys.executable, str(PROGRAMS / "memory_job.py"), str(root), str(out), *phases],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        assert job.returncode == -9, job.stdout[-6000:]
    got = [_phases(out, 0), _phases(out, 1)]
    assert sorted(got[0]) == list(range(len(phases))) and sorted(got[1]) == [0, 1], job.stdout[-4000:]
    for rank in (0, 1):
        assert all("error" not in p for p in got[rank].values()), got[rank]
        assert got[rank][0]["tiers"] == {str(s): "memory" for s in range(1, 8)}
    loads = [(load["got"], load["same"], load["from"].split(" ")[0]) for i in range(1, len(phases))
             for load in got[0][i]["loads"]]
    on_disk = str(root / "step_0000000010")
    assert loads == [(7, True, "memory"), (10, True, "memory"), (11, True, "memory"), (10, True, on_disk),
                     (15, True, "memory"), (4, True, "memory")], loads
    assert got[1][1]["loads"] == got[0][1]["loads"]
    # close() wrote 15 (newer in memory than on disk), and the torn job's 4 (3's disk write had stalled)
    assert got[0][3]["steps"] == {"ck": [10, 15]} and got[0][4]["steps"] == {"torn": [4]}, (got[0][3], got[0][4])
    assert _gone(shm.namespace(str(root))) and _gone(shm.namespace(str(torn)))
    # The last job died without close(); its node's keeper frees its memory once no trainer is left.
    wait_for(lambda: _gone(got[0][4]["other"]), 30, "the keeper to free the memory of a job that died")


def test_two_nodes_resume_from_their_own_memory_and_a_job_on_one_node_from_the_disk(tmp_path):
    """Two launchers, each node its own shared memory (as two machines); the local_dir is shared."""
    root, out, nodes = tmp_path / "ck", tmp_path / "out", tmp_path / "shm"
    out.mkdir()
    # A long linger: a slow restart must still find the memory; the keepers exit once it is freed anyway.
    env = child_env(SHARDCKPT_MEMORY_LINGER_S="600", MEMORY_JOB_SHM=str(nodes))
    phases = [
        "train=1-10,wait,train=11-12,kill",  # 10 committed on disk; memory_keep=3: 10, 11, 12 in each node's memory
        # Both nodes again: each rank's copy of 12 is on its own node, rank 1's with rank 0's value of the plain
        # tensor that differs by rank (received at the save), so nothing is read from the other node.
        "load=12,train=13-13,kill",
        # Both ranks on node 0: rank 1's copies are on node 1, so the disk's 10. Its close() keeps the memory: 13
        # is still the newest step of the history, resumable by both nodes together.
        "load=10,close",
        # Each node alone (1 rank) then saves a step of its own: 10 and 11 from the disk; at its first save the
        # node's copies of the 2-rank job go, at close() its own.
        "load=10,train=11-11,close",
        "load=11,train=12-12,close",
    ]
    for _ in range(2):
        outputs = run_nodes(2, 1, PROGRAMS / "memory_job.py", root, out, *phases, env=env, check=False, log_dir=out)
        assert all("]: Traceback" not in o for o in outputs), outputs[0][-4000:] + outputs[1][-4000:]
    job = run_torchrun(2, PROGRAMS / "memory_job.py", root, out, *phases, env=env, check=False)
    assert job.returncode == 0, job.stdout[-6000:]
    for node in (1, 0):
        job = run_torchrun(1, PROGRAMS / "memory_job.py", root, out, *phases, env=dict(env, MEMORY_JOB_NODE=str(node)),
                           check=False)
        assert job.returncode == 0, job.stdout[-6000:]
    got = [_phases(out, 0), _phases(out, 1)]
    assert sorted(got[0]) == [0, 1, 2, 3, 4] and sorted(got[1]) == [0, 1, 2], got
    assert all("error" not in p for rank in (0, 1) for p in got[rank].values()), got
    loads = {rank: [(load["got"], load["same"], load["from"].split(" ")[0]) for i in sorted(got[rank]) if i
                    for load in got[rank][i]["loads"]] for rank in (0, 1)}
    ten, eleven = str(root / "step_0000000010"), str(root / "step_0000000011")
    assert loads[0] == [(12, True, "memory"), (10, True, ten), (10, True, ten), (11, True, eleven)], loads
    assert loads[1] == loads[0][:2], loads
    assert "node0" in got[0][1]["loads"][0]["from"] and "node1" in got[1][1]["loads"][0]["from"]
    # Each node's memory is freed, and its keeper (one per node) exits.
    for node in (0, 1):
        assert _gone(os.path.join(nodes, f"node{node}", os.path.basename(shm.namespace(str(root)))))
    keepers = root / ".shardckpt-remote" / "memory.log"
    wait_for(lambda: keepers.read_text().count("no shared memory held") == 2, 30, "both nodes' keepers to exit")


def test_a_state_larger_than_the_memory_budget_steps_aside_saying_what_it_needs(tmp_path, monkeypatch, caplog):
    """A memory problem never costs a disk step: the tier steps aside with one warning, the saves go on."""
    import logging

    config = shardckpt.CheckpointConfig.from_env(
        {"SHARDCKPT_MEMORY_EVERY_STEPS": "1", "SHARDCKPT_MEMORY_KEEP": "1", "SHARDCKPT_MEMORY_BUDGET": str(6 << 20),
         "SHARDCKPT_EVERY_STEPS": "2"}, local_dir=str(tmp_path / "ck"), preemption_signals=())
    ckpt = shardckpt.Checkpointer(config)
    state = {"weights": torch.zeros(1 << 20)}  # 4 MiB staged: 3 copies (memory_keep=1 and its spare) are 12 MiB
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        for step in (1, 2, 3):
            state["weights"].fill_(step)
            handle = ckpt.save(state, step)  # 2 is due on disk
            assert (handle is not None) == (step == 2)
            if handle is not None:
                handle.wait()
    said = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(said) == 1, said
    assert "needs 12.0 MiB" in said[0] and "memory_budget allows 6.0 MiB" in said[0], said
    assert "Saves go on to disk" in said[0] and "Remedy" in said[0], said
    assert ckpt.steps() == [2] and ckpt.status()["latest_memory"] is None
    assert _gone(shm.namespace(str(tmp_path / "ck")))
    ckpt.close()
    # Shared memory pointed at a directory that does not exist: the same, not an OSError from deep inside.
    monkeypatch.setenv("SHARDCKPT_SHM_DIR", str(tmp_path / "no-such-tmpfs"))
    ckpt = shardckpt.Checkpointer(config)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardckpt"):
        ckpt.save(state, 4, force=True).wait()
    said = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(said) == 1 and f"{tmp_path / 'no-such-tmpfs'} cannot be used" in said[0], said
    assert "SHARDCKPT_SHM_DIR" in said[0] and ckpt.steps() == [2, 4]
    ckpt.close()


@pytest.mark.parametrize("tamper", ["loose mode", "another owner", "a link"])
def test_a_shared_memory_directory_others_could_have_written_is_never_read(tmp_path, tamper, caplog):
    """Anyone may create a directory in /dev/shm: one that is not this user's alone is never trusted."""
    import logging

    root = tmp_path / "ck"
    state = {"weights": torch.zeros(100), "meta": {"at": 0}}
    saver = shardckpt.Checkpointer(local_dir=str(root), every_steps=2, memory_every_steps=1, preemption_signals=())
    for step in (1, 2, 3):
        state["weights"].fill_(step)
        state["meta"]["at"] = step
        saver.save(state, step).wait()  # 2 on disk, 3 in memory only
    ns = shm.namespace(str(root))
    aside = ns + ".aside"
    try:
        if tamper == "loose mode":
            os.chmod(ns, 0o777)
        elif tamper == "another owner":
            if os.geteuid() != 0:
                pytest.skip("changing a directory's owner needs root")
            os.chown(ns, 65534, 65534)
        else:
            os.rename(ns, aside)
            os.symlink(aside, ns)
        fresh = {"weights": torch.zeros(100), "meta": {}}
        with caplog.at_level(logging.WARNING, logger="shardckpt"):
            other = shardckpt.Checkpointer(local_dir=str(root), every_steps=2, memory_every_steps=1,
                                           preemption_signals=())
            assert other.load(fresh) == 2 and fresh["meta"] == {"at": 2}  # from the disk, not the memory's 3
            assert float(fresh["weights"][0]) == 2.0
        said = [r.getMessage() for r in caplog.records if "cannot be trusted" in r.getMessage()]
        assert len(said) == 1 and ns in said[0] and "Remedy" in said[0], said
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardckpt"):
            other.save(state, 4).wait()  # nor written into: the memory tier steps aside, the disk save goes on
        said = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
        assert len(said) == 1 and ns in said[0] and "Remedy" in said[0], said
        assert other.steps() == [2, 4]
        other.close()
    finally:
        if os.path.islink(ns):
            os.unlink(ns)
            os.rename(aside, ns)
        os.chown(ns, os.getuid(), os.getgid())
        os.chmod(ns, 0o700)
    saver.close()
    assert _gone(ns)


def test_which_saves_a_job_can_restore_from_memory():
    """The survey's rule, on the reports of a 2-node job (ranks 0-1 on one machine, 2-3 on the other)."""
    from shardckpt.restoring.memory import usable

    def copies(version, step, world, saved_ranks, created=1.0):
        return [[q, step, version, world, [created, {}, "full", {}, version]] for q in saved_ranks]

    a = copies("id:a", 7, 4, [0, 1]) + copies("id:b", 8, 4, [0, 1], created=2.0)  # machine A
    b = copies("id:a", 7, 4, [2, 3]) + copies("id:b", 8, 4, [2], created=2.0)  # machine B: rank 3 died in its copy
    same = usable([a, a, b, b], 4)
    assert {s: c.version for s, c in same.items()} == {7: "id:a"}  # 8 is incomplete: never used
    # 4 ranks -> 2 on the same two machines: each rank would need the other machine's copies
    assert usable([a, b], 2) == {}
    # 2 ranks -> 1 on one machine that holds every copy of the save
    one = copies("id:c", 9, 2, [0, 1])
    assert {s: c.version for s, c in usable([one], 1).items()} == {9: "id:c"}
