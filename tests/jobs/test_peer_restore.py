"""The peer tier in jobs: replication round the ring, restore after a node loss from the survivors'
replicas, the retention point."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket

import pytest
import torch
import torch.nn as nn
from peer_helpers import (
    Job,
    _end_daemon,
    _job_dirs,
    _kill_daemons,
    _newest_complete,
    _private_files,
    _tier,
    _tree,
    endpoint,  # noqa: F401 - a fixture
)

import shardckpt
from shardckpt import cli
from shardckpt.format import layout, replicas
from shardckpt.node import peer_daemon
from shardckpt.restoring import views
from shardckpt.stores import tls


def test_node_lost_the_job_continues_on_the_survivors_from_peer_replicas(tmp_path, capsys):
    """3 nodes x 2 ranks save (FSDP2, node-local directories, no remote), every trainer SIGKILLed right
    after the last local commit; node 2 is then lost (its daemon and its disk) and the job continues on
    2 nodes x 2 ranks, bitwise, with the elastic plan, from the survivors' files and node 2's replica."""

    from helpers import PROGRAMS, run_nodes, wait_for
    from test_multinode import assert_bitwise

    prog = PROGRAMS / "peer_job.py"
    base, out, out2 = _job_dirs(tmp_path)
    host = socket.gethostname()
    try:
        saving = run_nodes(3, 2, prog, "save", base, out, "--steps", "3", "--kill", check=False, log_dir=tmp_path)
        assert all((out / f"killed.{r}").exists() for r in range(6)), "\n".join(saving)
        # Every trainer is dead and nothing of step 3 was replicated (the daemons were paused before
        # its save); resumed now, the daemons replicate it on their own.
        assert not list(base.glob(f"node*/{replicas.REPLICAS_DIR}/*/{layout.step_dirname(3)}"))
        _kill_daemons(base, signal.SIGCONT)
        for r in range(6):  # step 2 was peer-durable before step 3 (status() says so on every rank)
            status = json.loads((out / f"outcome.{r}.json").read_text())["status"]
            assert status["peer_replicas"] == 1 and status["latest_peer"] == 2, status
            assert len(status["peer"]["nodes"]) == 3, status
        for g in range(3):  # the ring: node g's files are held by node g+1
            owner_dir = base / f"node{g}" / layout.step_dirname(3)
            replica = base / f"node{(g + 1) % 3}" / replicas.REPLICAS_DIR / replicas.owner_dirname(f"{host}:{g}")
            wait_for(lambda: (replica / layout.step_dirname(3) / layout.MANIFEST_NAME).exists(), 60,
                     f"node {g}'s step 3 replica on node {(g + 1) % 3}")
            manifest = layout.read_manifest(str(replica / layout.step_dirname(3)))
            assert layout.version_of(manifest) == layout.version_of(layout.read_manifest(str(owner_dir)))
            held = sorted(p.name for p in (replica / layout.step_dirname(3)).iterdir()
                          if p.name != layout.MANIFEST_NAME)
            assert held == layout.copy_files(str(owner_dir), manifest)[0], held
            assert {manifest.files[n].rank for n in held if n != layout.METADATA_NAME} == {2 * g, 2 * g + 1}
            layout.verify_files(str(replica / layout.step_dirname(3)), manifest, held)
            # keep_last=2 replicas per owner: the holder's retention follows the replica's commit (and the
            # agreed point its daemon reads on its next pass), so step 1 goes a moment later.
            wait_for(lambda: layout.committed_steps(str(replica)) == [2, 3], 30,
                     f"node {g}'s replicas on node {(g + 1) % 3} down to steps 2 and 3")
        # `shardckpt status` shows the peer durability of the node's newest step and what it holds.
        wait_for(lambda: (peer_daemon.node_status(str(base / "node0")) or {}).get("latest_peer") == 3, 30, "status")
        assert cli.main(["status", str(base / "node0"), "--json"]) == 1  # 1: no remote here
        shown = json.loads(capsys.readouterr().out)
        assert shown["latest_local"] == shown["latest_peer"] == 3, shown
        shown = shown["peer"]
        assert shown["holders"] == [f"{host}:1"] and shown["holding"] == {replicas.owner_dirname(f"{host}:2"): [2, 3]}
        assert cli.main(["ls", str(base / "node0"), "--json"]) == 0  # the durability levels, a column
        assert {r["step"]: r["tiers"] for r in json.loads(capsys.readouterr().out)["steps"]} == \
            {2: ["local", "peer"], 3: ["local", "peer"]}

        # Node 2 is lost: its daemon and its disk. The survivors resume at 4 ranks, with no remote.
        import shutil

        info = json.loads((base / "node2" / ".shardckpt-remote" / peer_daemon.STATUS_NAME).read_text())
        _end_daemon(info)

        shutil.rmtree(base / "node2")
        logs = run_nodes(2, 2, prog, "restore", base, out2, "--then-replace", log_dir=tmp_path)
        lost_files = {n for n, e in layout.read_manifest(str(base / "node0" / layout.step_dirname(3))).files.items()
                      if e.rank in (4, 5)}
        for r in range(4):
            o = json.loads((out2 / f"outcome.{r}.json").read_text())
            assert o["restored"] == 3, o
            # Each survivor kept its own files and took the other two nodes' from the replicas it holds (node 0
            # holds node 2's: the ring) and the other survivor's daemon (its copy, its replicas), never over
            # the process group; nothing refused.
            taken = o["sources"]
            assert all(v["refused"] == 0 for v in taken.values()) and "other nodes" not in taken, taken
            assert taken["own disk"]["files"] == len(lost_files) + 1, taken  # its two ranks' files, .metadata
            got = sum(taken.get(kind, {}).get("files", 0) for kind in ("replicas here", "peer"))
            assert got == 2 * len(lost_files), taken
            if r < 2:
                assert taken["replicas here"]["files"] >= len(lost_files), taken
            plan = o["plan"]
            assert (plan["saved_world_size"], plan["world_size"]) == (6, 4), plan
            assert (plan["saved_accum_steps"], plan["accum_steps"], plan["global_batch"]) == (2, 3, 24), plan
        assert_bitwise(out / "saved.pt", out2 / "restored.pt")

        # SIGTERM: the emergency save (step 5: the ranks agree on the signal at the save after it
        # arrived) returns (``preempted``) only once each node's files of it are committed in the other
        # node's replica directory.
        for g in range(2):
            said = json.loads((out2 / f"sigterm.{g}.json").read_text())
            assert said["step"] == 5 and said["preempted"] and said["replica_committed"], said
            assert said["status"]["latest_peer"] == 5, said["status"]
        # The save's log line gives each level once known: step 2's peer level by step 3's save,
        # step 5's by close().
        for step, said in ((2, saving[0]), (5, logs[0])):
            assert re.search(rf"shardckpt: step {step}: local \d+\.\d s, peer \d+\.\d s$", said, re.M), said[-3000:]
        # Node 1 replaced by one with an empty disk, at the same world size: every file of step 5 comes to
        # it over the peer endpoint from node 0 (its own files from node 0's replica of them; no remote is
        # configured), bitwise.
        step5 = layout.read_manifest(str(base / "node0" / layout.step_dirname(5)))
        for r in range(4):
            o = json.loads((out2 / f"replaced.{r}.json").read_text())
            assert o["restored"] == 5 and o["plan"]["saved_world_size"] == 4, o
            if r >= 2:
                size = sum(e.size for e in step5.files.values())
                assert o["sources"] == {"peer": {"files": len(step5.files), "bytes": size, "refused": 0}}, o["sources"]
        assert_bitwise(out2 / "saved2.pt", out2 / "restored2.pt")
        assert layout.committed_steps(str(base / "node1")) == [5]
    finally:
        _kill_daemons(base)


def test_after_a_rollback_the_live_branch_is_replicated_and_survives_a_node_loss(tmp_path):
    """2 nodes x 1 rank save 10, 20, 30, roll back to 10 and save 11, 12 (30 is the highest number, 12 the
    live head). close() returns once 12 is peer-durable; node 1 is then lost (daemon and disk) and node 0
    alone resumes step 12 bitwise from its own files and node 1's replica. Node 0's daemon, told by that
    launch that the tier is off, retries nobody and exits after its linger. Under umask 022 every directory
    of the tier is 0700 and every file in it 0600 (the state directory, peers.json, status files, logs,
    lock, keys, replicas)."""
    import shutil

    from helpers import PROGRAMS, run_nodes
    from test_multinode import assert_bitwise

    prog = PROGRAMS / "peer_rollback.py"
    base, out, out2 = _job_dirs(tmp_path)
    host = socket.gethostname()
    old_umask = os.umask(0o022)
    try:
        run_nodes(2, 1, prog, "save", base, out, log_dir=tmp_path)
        os.umask(old_umask)
        for node in ("node0", "node1"):
            assert (base / node / ".shardckpt-remote" / peer_daemon.PEERS_NAME).exists()
            assert _private_files(base / node) == [], node
        held = base / "node0" / replicas.REPLICAS_DIR / replicas.owner_dirname(f"{host}:1")
        mine = layout.read_manifest(str(base / "node1" / layout.step_dirname(12)))
        assert layout.read_manifest(str(held / layout.step_dirname(12))) is not None, (
            f"close() returned before node 1's step 12 was peer-durable: "
            f"node 0 holds {layout.committed_steps(str(held))}")
        assert layout.version_of(layout.read_manifest(str(held / layout.step_dirname(12)))) == layout.version_of(mine)
        assert not (held / layout.step_dirname(30)).exists()  # the abandoned step is not what is kept
        for r in range(2):
            status = json.loads((out / f"outcome.{r}.json").read_text())["status"]
            assert status["latest_peer"] == 12, status  # never the abandoned 30
        assert peer_daemon.node_status(str(base / "node1"))["latest_peer"] == 12

        info = json.loads((base / "node1" / ".shardckpt-remote" / peer_daemon.STATUS_NAME).read_text())
        _end_daemon(info)
        shutil.rmtree(base / "node1")
        run_nodes(1, 1, prog, "alone", base, out2, log_dir=tmp_path)
        assert json.loads((out2 / "alone.json").read_text()) == {"restored": 12, "world": 1}
        assert_bitwise(out / "saved.pt", out2 / "restored.pt")
        peers = json.loads((base / "node0" / ".shardckpt-remote" / peer_daemon.PEERS_NAME).read_text())
        assert peers["nodes"] == [] and peers["replicas"] == 0  # node 0's daemon: no node left to send to
        from helpers import wait_for

        status = base / "node0" / ".shardckpt-remote" / peer_daemon.STATUS_NAME
        wait_for(lambda: json.loads(status.read_text()).get("state") == "exited", 30,
                 "node 0's daemon to end by itself, its job over")
    finally:
        os.umask(old_umask)
        _kill_daemons(base)


def test_replicas_go_round_the_ring_and_off_the_owners_failure_domain():
    nodes = [{"node": f"n{i}", "addr": f"h{i}:1", "domain": d} for i, d in enumerate(["a", "a", "b", "b"])]
    plain = [dict(n, domain=None) for n in nodes]
    assert [h["node"] for h in replicas.placement(plain, "n0", 1)] == ["n1"]
    assert [h["node"] for h in replicas.placement(plain, "n3", 2)] == ["n0", "n1"]
    # n0 and n1 share rack a: n0's replica goes to the next node of another rack
    assert [h["node"] for h in replicas.placement(nodes, "n0", 1)] == ["n2"]
    assert [h["node"] for h in replicas.placement(nodes, "n2", 1)] == ["n0"]
    # more replicas than nodes outside the rack: its own rack fills the rest, never the owner itself
    assert [h["node"] for h in replicas.placement(nodes, "n0", 3)] == ["n2", "n3", "n1"]
    assert replicas.placement(nodes, "n0", 0) == [] and replicas.placement(nodes, "elsewhere", 1) == []
    for bad in ({"peer_replicas": -1}, {"peer_replicas": True}, {"peer_bandwidth": 0}):
        with pytest.raises(shardckpt.ConfigError, match=next(iter(bad))):
            shardckpt.CheckpointConfig(local_dir="x", **bad)
    assert shardckpt.CheckpointConfig.from_env({"SHARDCKPT_PEER_REPLICAS": "0"}, local_dir="x").peer_replicas == 0


@pytest.mark.parametrize("s3", ["moto"], indirect=True)
def test_a_replica_of_another_save_is_never_used_and_a_rotten_one_gives_way_to_the_remote(s3, tmp_path):
    """A holder's copy of step 1 (save Y) holds only ``.metadata``; it holds the owner's two shard files of Y
    as a replica (one of them rotten on its disk) and another node's replica of *another save* X of step 1.
    The restore takes the good replica file (a link, no copy), the rotten one from the remote where Y is
    committed, and nothing of X: the restored state is Y's, X's replica is left as it was."""
    from s3server import BUCKET

    from shardckpt import stores
    from shardckpt.node import uploader

    s3.reset()
    owner, other, holder = tmp_path / "owner", tmp_path / "other", tmp_path / "holder"
    url = f"s3://{BUCKET}/peerfall"
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": model}, 1)
    with shardckpt.Checkpointer(local_dir=str(other), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(64, 64)}, 1)  # save X: the same step number, other bytes
    store = stores.open_store(url, shardckpt.CheckpointConfig(local_dir=str(owner)).transfer_options())
    assert uploader.Uploader(str(owner), store, node="owner:0", once=True, poll_s=0.05).run() == 0
    step_dir, x_dir = owner / layout.step_dirname(1), other / layout.step_dirname(1)
    manifest, x_manifest = layout.read_manifest(str(step_dir)), layout.read_manifest(str(x_dir))
    assert layout.version_of(manifest) != layout.version_of(x_manifest)
    shards = sorted(n for n in manifest.files if n.startswith("__"))
    assert len(shards) == 2 and sorted(n for n in x_manifest.files if n.startswith("__")) == shards
    mine = holder / layout.step_dirname(1)
    mine.mkdir(parents=True)
    for name in (layout.METADATA_NAME, layout.MANIFEST_NAME):  # the holder's copy: all but the shard files
        shutil.copy2(step_dir / name, mine / name)
    job = Job(tmp_path)
    server, addr = job.serve("holder", holder)
    try:
        job.client("owner", addr, expect="holder").put_replica("owner:0", str(step_dir), manifest, shards)
        job.client("second", addr, expect="holder").put_replica("second:0", str(x_dir), x_manifest, shards)
    finally:
        server.shutdown()
        server.server_close()
    held = holder / replicas.REPLICAS_DIR / "owner_0" / layout.step_dirname(1)
    rotten = held / shards[0]
    data = bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 0x20
    rotten.write_bytes(bytes(data))
    x_held = holder / replicas.REPLICAS_DIR / "second_0"
    x_before = _tree(x_held)
    metadata_inode = os.stat(mine / layout.METADATA_NAME).st_ino

    fresh = nn.Linear(64, 64)
    with shardckpt.Checkpointer(local_dir=str(holder), remote=url, uploader="off", preemption_signals=()) as ckpt:
        assert ckpt.load({"model": fresh}) == 1
        used = ckpt.last_sources
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key
    size = {n: manifest.files[n].size for n in shards}
    assert used == {"own disk": {"files": 1, "bytes": manifest.files[layout.METADATA_NAME].size, "refused": 0},
                    "replicas here": {"files": 1, "bytes": size[shards[1]], "refused": 1},
                    "remote": {"files": 1, "bytes": size[shards[0]], "refused": 0}}, used
    layout.verify_files(str(mine), manifest)  # the holder's step: Y's files, the rotten one from the remote
    assert os.stat(mine / shards[1]).st_ino == os.stat(held / shards[1]).st_ino  # linked, not copied
    assert os.stat(mine / layout.METADATA_NAME).st_ino == metadata_inode  # its own file was not fetched
    assert _tree(x_held) == x_before  # the replica of the other save, left alone


def test_a_replacement_node_takes_its_files_from_the_peers_views_of_the_chosen_save(endpoint, tmp_path):  # noqa: F811 - the endpoint fixture of peer_helpers
    """A node with an empty disk completes the save the survey chose from its peers' views: each file checked
    against the manifest as it arrives (a rotten replica file gives way to the next holder's), committed
    manifest last with no partial directory left; a peer's own copy of another save of that step number is
    never offered, while its replica of the chosen save is."""
    owner, holder, addr, job = endpoint
    step_dir = owner / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    version = layout.version_of(manifest)
    names = layout.copy_files(str(step_dir), manifest)[0]
    second = tmp_path / "second"
    second.mkdir()
    server, second_addr = job.serve("second", second)
    try:
        for where, who in ((addr, "holder"), (second_addr, "second")):
            job.client("owner", where, expect=who).put_replica("owner:0", str(step_dir), manifest, names)
        big = max(names, key=lambda n: manifest.files[n].size)
        rotten = holder / replicas.REPLICAS_DIR / "owner_0" / layout.step_dirname(1) / big
        data = bytearray(rotten.read_bytes())
        data[len(data) // 2] ^= 1
        rotten.write_bytes(bytes(data))
        # The holder's local retention keeps its own copies while no step is agreed complete across a loss.
        from shardckpt.node.peer_tier import PeerTier

        tier = PeerTier(shardckpt.CheckpointConfig(local_dir=str(holder)), str(holder), registered=True)
        assert not tier.protects(1)  # the tier is off
        tier.replicas = 1
        assert tier.protects(1) and tier.protects(2)
        # The second holder's own step 1 is another save of that number.
        with shardckpt.Checkpointer(local_dir=str(second), preemption_signals=()) as ckpt:
            ckpt.save({"model": nn.Linear(16, 8)}, 1)
        peers = views.Peers(_tier(job, "owner", [("owner", "127.0.0.1:9", "owner"), ("holder", addr, "holder"),
                                          ("second", second_addr, "second")]))
        offered = peers.views(1, version)
        assert [v.name for v in offered] == ["peer holder:0 (its replica of owner_0)",
                                             "peer second:0 (its replica of owner_0)"]
        fresh = tmp_path / "replacement"
        fresh.mkdir()
        copy = views.CopyFill(str(fresh), 1, version, stale=False)
        copy.fill(offered)
        copy.commit()
        peers.close()
        assert copy.report["peer"]["files"] == len(names) and copy.report["peer"]["refused"] == 1, copy.report
        layout.verify_files(str(fresh / layout.step_dirname(1)),
                            layout.read_manifest(str(fresh / layout.step_dirname(1))), names)
        assert [p.name for p in fresh.iterdir()] == [layout.step_dirname(1)]  # no partial directory left
    finally:
        server.shutdown()
        server.server_close()


def test_three_nodes_a_lagging_replica_and_a_node_loss_cost_only_what_was_not_peer_durable(tmp_path):
    """3 nodes x 1 rank, keep_last=1: step 1 becomes peer-durable on every node, then node 2's daemon stalls
    (node 1's later files never reach it, node 2's never leave) while steps 2 and 3 are saved. Every node
    decides retention from the facts all nodes exchanged at the save, so all of them keep step 1, the
    newest step complete across any single node's loss. Node 2 is then lost (daemon and disk): the
    survivors resume the newest step they can rebuild (step 1), bitwise. At that launch node 1's key is
    readable by others: its trainer's log names the file and the remedy."""

    from helpers import PROGRAMS, run_nodes
    from test_multinode import assert_bitwise

    prog = PROGRAMS / "peer_lag.py"
    base, out, out2 = _job_dirs(tmp_path)
    host = socket.gethostname()
    try:
        run_nodes(3, 1, prog, "save", base, out, log_dir=tmp_path)
        kept = [json.loads((out / f"kept.{r}.json").read_text()) for r in range(3)]
        assert kept == [[1, 2, 3]] * 3, f"the nodes did not all keep step 1 (and what is newer): {kept}"
        for g in range(3):
            agreed = json.loads((base / f"node{g}" / ".shardckpt-remote" / peer_daemon.AGREED_NAME).read_text())
            assert agreed["step"] == 1, (g, agreed)
        # Node 1 holds node 0's replicas of steps 1, 2 and 3 (keep_last=1): it keeps all three, from the
        # agreed step on, so that step 1 also survives node 0's loss.
        held = base / "node1" / replicas.REPLICAS_DIR / replicas.owner_dirname(f"{host}:0")
        assert layout.committed_steps(str(held)) == [1, 2, 3]
        _end_daemon(json.loads((base / "node2" / ".shardckpt-remote" / peer_daemon.STATUS_NAME).read_text()))
        shutil.rmtree(base / "node2")
        newest = _newest_complete(base, ("node0", "node1"), f"{host}:2")
        assert newest == 1, f"step 1 was peer-durable on every node and is not complete across the survivors: {newest}"
        # Node 1's key has become readable by others: its trainer's log says so at launch, naming the file
        # and the remedy, and the restore goes on from the disks (the tier is off without a second node).
        key = base / "node1" / ".shardckpt-remote" / tls.KEY_NAME
        key.chmod(0o644)
        logs = run_nodes(2, 1, prog, "restore", base, out2, log_dir=tmp_path)
        said = re.search(r"^.*the peer tier of .* cannot start on this node: .*$", logs[1], re.M)
        assert said and str(key) in said.group(0) and "chmod 600" in said.group(0), logs[1][-3000:]
        assert json.loads((out2 / "restored.json").read_text()) == {"restored": newest}
        assert_bitwise(out / f"saved.{newest}.pt", out2 / "restored.pt")
    finally:
        _kill_daemons(base)


def test_the_retention_point_is_the_newest_step_every_node_reports_held_by_another(tmp_path):
    """The point below which retention may delete, computed alike on every node from the reports of a
    save's commit exchange: the newest step every node reported of one save, each with a holder other
    than itself; then a node's own retention keeps every step from it on (all of them while none is
    agreed, or when the agreed save is not this node's live one)."""
    from shardckpt.node.peer_tier import PeerTier

    members = ["a:0", "b:0", "c:0"]

    def report(node, **steps):
        return {"node": node, "steps": {int(s[1:]): v for s, v in steps.items()}}

    reports = [report("a:0", s1=["id:1", ["b:0"]], s2=["id:2", ["b:0"]], s3=["id:3", []]),
               report("b:0", s1=["id:1", ["c:0"]], s2=["id:2", []], s3=["id:3", []]),
               report("c:0", s1=["id:1", ["a:0"]], s2=["id:2", ["a:0"]], s3=["id:3", []]),
               None]  # a rank that commits no copy reports nothing
    assert replicas.complete_across_any_loss(reports, members) == (1, "id:1")
    reports[1]["steps"][2][1] = ["c:0"]
    assert replicas.complete_across_any_loss(reports, members) == (2, "id:2")
    reports[1]["steps"][2][0] = "id:other"  # another save of that number on one node
    assert replicas.complete_across_any_loss(reports, members) == (1, "id:1")
    reports[0]["steps"][1][1] = ["a:0"]  # held only by its owner: gone with it
    assert replicas.complete_across_any_loss(reports, members) is None
    assert replicas.complete_across_any_loss(reports[1:], members) is None  # a member that did not report

    holder = tmp_path / "holder"
    with shardckpt.Checkpointer(local_dir=str(holder), keep_last=10, preemption_signals=()) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save({"model": nn.Linear(16, 8)}, step)
    tier = PeerTier(shardckpt.CheckpointConfig(local_dir=str(holder)), str(holder), registered=True)
    tier.replicas, tier.committer = 1, True
    tier.nodes = [{"node": "me:0"}, {"node": "b:0"}]
    assert tier.agreed is None and all(tier.protects(s) for s in (1, 2, 3, 4))
    mine = {s: layout.version_of(layout.read_manifest(str(holder / layout.step_dirname(s)))) for s in (1, 2, 3, 4)}
    tier.agree([{"node": "me:0", "steps": {s: [mine[s], ["b:0"]] for s in (1, 2)}},
                {"node": "b:0", "steps": {s: [mine[s], ["me:0"]] for s in (1, 2, 3)}}])
    assert tier.agreed == (2, mine[2])
    assert [s for s in (1, 2, 3, 4) if tier.protects(s)] == [2, 3, 4]
    shown = json.loads((holder / ".shardckpt-remote" / peer_daemon.AGREED_NAME).read_text())
    assert shown == {"step": 2, "version": mine[2]}  # what the node's daemon applies to the replicas it holds
    tier.agreed = (2, "id:another-branch")
    assert all(tier.protects(s) for s in (1, 2, 3, 4))
