"""The peer tier: the per-node endpoint (authentication, bounds, paths), replication, restore after a node loss."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import signal
import time

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt import cli
from shardckpt.format import layout
from shardckpt.format import replicas
from shardckpt.node import peer_daemon, peer_service
from shardckpt.stores import peer_client

SECRET = b"job-secret-" + b"x" * 53


def _tree(root):
    """Every path under ``root`` with its size and mtime: what a refused request must leave as it was."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = "dir" if name in dirs else (st.st_size, st.st_mtime_ns)
    return out


def _raw(addr, method, path, body=b"", headers=None):
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (ConnectionResetError, BrokenPipeError):
        return "reset", b""  # refused while the body was still being sent
    finally:
        conn.close()


@pytest.fixture
def endpoint(tmp_path):
    """A committed step of an owner node, and a holder node's endpoint on 127.0.0.1 (a free port)."""
    owner = tmp_path / "owner"
    torch.manual_seed(0)
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(16, 8), "extra": {"epoch": 1}}, 1)
    holder = tmp_path / "holder"
    holder.mkdir()
    secret_file = peer_service.write_secret(str(holder), SECRET.decode())
    assert os.stat(secret_file).st_mode & 0o777 == 0o600
    service = peer_service.PeerService(str(holder), "holder:0")
    server = peer_service.serve(service, "127.0.0.1")
    addr = f"127.0.0.1:{server.server_address[1]}"
    yield owner, holder, addr
    server.shutdown()
    server.server_close()


def test_endpoint_serves_and_accepts_replicas_only_to_the_job(endpoint, tmp_path):
    owner, holder, addr = endpoint
    step_dir = owner / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    names = sorted(manifest.files)
    client = peer_client.PeerClient(addr, SECRET)

    # The job's own node: a replica is committed (manifest last), listed, read whole and by range.
    assert client.put_replica("owner:0", str(step_dir), manifest, names) == sum(e.size for e in manifest.files.values())
    replica = holder / replicas.REPLICAS_DIR / "owner_0" / layout.step_dirname(1)
    layout.verify_files(str(replica), layout.read_manifest(str(replica)))
    listed = client.list_steps()
    assert listed["replicas"] == {"owner_0": {"1": layout.version_of(manifest)}}, listed
    big = max(names, key=lambda n: manifest.files[n].size)
    data = (step_dir / big).read_bytes()
    assert client.get(1, big, owner="owner:0") == data
    assert client.get(1, big, owner="owner:0", start=5, end=50) == data[5:50]
    assert client.put_replica("owner:0", str(step_dir), manifest, names) == 0  # held already: nothing sent
    got = tmp_path / "fetched"
    client.get_file(1, big, str(got), manifest.files[big], owner="owner:0")  # checked on the way
    assert got.read_bytes() == data
    wrong_entry = layout.FileEntry(manifest.files[big].size, layout.checksum_bytes(b"other"), 0)
    with pytest.raises(peer_client.PeerError, match="not the manifest's"):
        client.get_file(1, big, str(tmp_path / "refused"), wrong_entry, owner="owner:0")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("refused")]
    # peer_bandwidth: a replica of N bytes at R bytes/s takes at least N / R seconds to send.
    total, rate = sum(e.size for e in manifest.files.values()), 40_000
    t0 = time.monotonic()
    assert client.put_replica("capped:0", str(step_dir), manifest, names, bandwidth=rate) == total
    assert time.monotonic() - t0 >= 0.9 * total / rate
    before = _tree(holder)

    # Nobody else gets in, and nothing they send changes the holder's disk.
    wrong = peer_client.PeerClient(addr, b"another-job-secret-" + b"y" * 45)
    for call in (wrong.list_steps, lambda: wrong.get(1, big, owner="owner:0"),
                 lambda: wrong.put_replica("evil", str(step_dir), manifest, names)):
        with pytest.raises(peer_client.PeerError, match="401"):
            call()
    begin = f"/v1/replica/evil/1/{replicas.version_tag(manifest)}/begin"
    status, _ = _raw(addr, "POST", begin, manifest.to_json().encode())  # no signature at all
    assert status == 401
    status, _ = _raw(addr, "GET", "/v1/steps")
    assert status == 401
    now = str(int(time.time()))
    assert _raw(addr, "GET", "/v1/steps", headers={peer_client.AUTH_HEADER: now + ":\xe9t\xe9", peer_client.BODY_HEADER: "\xff"})[0] == 401
    # A request signed for one body carrying another (a tampered replica file) is not kept.
    sig = peer_client.auth_headers(SECRET, "POST", begin, hashlib.sha256(b"{}").hexdigest())
    assert _raw(addr, "POST", begin, manifest.to_json().encode(), sig)[0] == 401
    # Paths out of the replica and step directories, signed with the right secret.
    for path in ("/v1/local/1/..%2F..%2Fholder%2F.shardckpt-remote%2Fpeer.secret",
                 "/v1/replica/../1/" + big, "/v1/replica/owner_0/1/..", "/v1/local/1/%2Fetc%2Fpasswd",
                 f"/v1/replica/owner_0/1/{replicas.version_tag(manifest)}/f/..%2F..%2Fx"):
        for method in ("GET", "PUT"):
            status, body = _raw(addr, method, path, b"z", peer_client.auth_headers(SECRET, method, path,
                                                                             hashlib.sha256(b"z").hexdigest()))
            assert status in (400, 403, 404), (method, path, status, body)
    assert _tree(holder) == before
    # A file of the step swapped for a symbolic link to a file outside is not followed.
    os.symlink(os.path.join(holder, ".shardckpt-remote", peer_service.SECRET_NAME), replica / "link")
    os.replace(replica / "link", replica / big)
    before = _tree(holder)
    with pytest.raises(peer_client.PeerError, match="403"):
        client.get(1, big, owner="owner:0")
    # Bodies larger than their bound: a replica file beyond its manifest size, a manifest beyond 16 MiB.
    client.put_replica("owner:0", str(step_dir), manifest, [])  # begins (and commits nothing new)
    tag = replicas.version_tag(manifest)
    path = f"/v1/replica/other/1/{tag}/begin"
    status, _ = _raw(addr, "POST", path, manifest.to_json().encode(), peer_client.auth_headers(
        SECRET, "POST", path, hashlib.sha256(manifest.to_json().encode()).hexdigest()))
    assert status == 200
    before = _tree(holder)
    body = data + b"!"
    path = f"/v1/replica/other/1/{tag}/f/{big}"
    assert _raw(addr, "PUT", path, body, peer_client.auth_headers(SECRET, "PUT", path, hashlib.sha256(body).hexdigest()))[0] \
        in (413, "reset")
    path = f"/v1/replica/other/1/{tag}/begin"
    headers = {**peer_client.auth_headers(SECRET, "POST", path), "Content-Length": str(peer_service.MAX_SMALL_BODY + 1)}
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", path)
    for k, v in headers.items():
        conn.putheader(k, v)
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    # A file whose bytes do not match the owner's checksum (signed as it is) is not kept either.
    bad = bytes([data[0] ^ 1]) + data[1:]
    path = f"/v1/replica/other/1/{tag}/f/{big}"
    assert _raw(addr, "PUT", path, bad, peer_client.auth_headers(SECRET, "PUT", path, hashlib.sha256(bad).hexdigest()))[0] == 422
    # Bound by the manifest's checksum instead (what replication sends): the same bytes are refused,
    # and so is a request signed for a checksum other than the manifest's.
    bound = peer_client.manifest_digest(manifest.files[big])
    assert _raw(addr, "PUT", path, bad, peer_client.auth_headers(SECRET, "PUT", path, bound))[0] == 422
    other_sum = peer_client.MANIFEST_DIGEST + layout.checksum_bytes(bad, like=manifest.files[big].checksum)
    assert _raw(addr, "PUT", path, bad, peer_client.auth_headers(SECRET, "PUT", path, other_sum))[0] in (401, "reset")
    assert _tree(holder) == before
    # Without a job secret (or with one others can read) the endpoint answers nobody.
    os.chmod(holder / ".shardckpt-remote" / peer_service.SECRET_NAME, 0o644)
    with pytest.raises(peer_client.PeerError, match="503"):
        client.list_steps()


def _kill_daemons(base, signum=signal.SIGKILL):
    """Signal (by default: end) the peer daemons the jobs under ``base`` started (they outlive their trainers by design)."""
    from shardckpt.node.node_registry import pid_alive, read_json, state_dir

    for node in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        info = read_json(os.path.join(state_dir(os.path.join(base, node)), peer_daemon.STATUS_NAME))
        pid = info.get("pid")
        if isinstance(pid, int) and info.get("state") == "running" and pid_alive(pid, info.get("pid_start")):
            os.kill(pid, signum)


def test_node_lost_the_job_continues_on_the_survivors_from_peer_replicas(tmp_path, capsys):
    """3 nodes x 2 ranks save (FSDP2, node-local directories, no remote), every trainer SIGKILLed right
    after the last local commit; node 2 is then lost (its daemon and its disk) and the job continues on
    2 nodes x 2 ranks, bitwise, with the elastic plan, from the survivors' files and node 2's replica."""
    import socket

    from helpers import PROGRAMS, run_nodes, wait_for
    from test_multinode import assert_bitwise

    prog = PROGRAMS / "peer_job.py"
    base, out, out2 = tmp_path / "nvme", tmp_path / "out", tmp_path / "out2"
    out.mkdir()
    out2.mkdir()
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
            held = sorted(p.name for p in (replica / layout.step_dirname(3)).iterdir() if p.name != layout.MANIFEST_NAME)
            assert held == layout.copy_files(str(owner_dir), manifest)[0], held
            assert {manifest.files[n].rank for n in held if n != layout.METADATA_NAME} == {2 * g, 2 * g + 1}
            layout.verify_files(str(replica / layout.step_dirname(3)), manifest, held)
            assert layout.committed_steps(str(replica)) == [2, 3]  # keep_last=2 replicas per owner
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
        os.kill(info["pid"], signal.SIGKILL)

        shutil.rmtree(base / "node2")
        logs = run_nodes(2, 2, prog, "restore", base, out2, "--then-replace", log_dir=tmp_path)
        assert "using the replicas of other nodes' files" in "".join(logs), logs[0][-3000:]
        for r in range(4):
            o = json.loads((out2 / f"outcome.{r}.json").read_text())
            assert o["restored"] == 3, o
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
        # Node 1 replaced by one with an empty disk, at the same world size: its files of step 5 come
        # from node 0's replica over the peer endpoint (no remote is configured), bitwise.
        assert "fetched from the replica on" in logs[1], logs[1][-3000:]
        for r in range(4):
            o = json.loads((out2 / f"replaced.{r}.json").read_text())
            assert o["restored"] == 5 and o["plan"]["saved_world_size"] == 4, o
        assert_bitwise(out2 / "saved2.pt", out2 / "restored2.pt")
        assert layout.committed_steps(str(base / "node1")) == [5]
    finally:
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
def test_a_corrupt_replica_file_falls_through_to_the_remote_for_that_file_only(s3, tmp_path, caplog):
    """A holder's copy of a step lacks the owner's shard file, which it holds as a replica (sent through
    the endpoint); the replica rots on the holder's disk. The restore takes the other files as they
    are and fetches that one file from the remote, where the step is committed."""
    import logging
    import shutil

    from s3server import BUCKET
    from shardckpt import stores
    from shardckpt.node import uploader

    s3.reset()
    owner, holder, url = tmp_path / "owner", tmp_path / "holder", f"s3://{BUCKET}/peerfall"
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": model}, 1)
    store = stores.open_store(url, shardckpt.CheckpointConfig(local_dir=str(owner)).transfer_options())
    assert uploader.Uploader(str(owner), store, node="owner:0", once=True, poll_s=0.05).run() == 0
    step_dir = owner / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    mine = holder / layout.step_dirname(1)
    mine.mkdir(parents=True)
    for name in (layout.METADATA_NAME, layout.MANIFEST_NAME):  # the holder's copy: all but the shard file
        shutil.copy2(step_dir / name, mine / name)
    peer_service.write_secret(str(holder), SECRET.decode())
    server = peer_service.serve(peer_service.PeerService(str(holder), "holder:0"), "127.0.0.1")
    try:
        peer_client.PeerClient(f"127.0.0.1:{server.server_address[1]}", SECRET).put_replica(
            "owner:0", str(step_dir), manifest, ["__0_0.distcp"])
    finally:
        server.shutdown()
        server.server_close()
    rotten = holder / replicas.REPLICAS_DIR / "owner_0" / layout.step_dirname(1) / "__0_0.distcp"
    data = bytearray(rotten.read_bytes())
    data[len(data) // 2] ^= 0x20
    rotten.write_bytes(bytes(data))
    metadata_inode = os.stat(mine / layout.METADATA_NAME).st_ino

    fresh = nn.Linear(64, 64)
    caplog.set_level(logging.INFO, logger="shardckpt")
    with shardckpt.Checkpointer(local_dir=str(holder), remote=url, uploader="off", preemption_signals=()) as ckpt:
        assert ckpt.load({"model": fresh}) == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key
    said = caplog.text
    assert "using the replicas of other nodes' files" in said and "step 1: 1 file(s)" in said, said
    assert "replaced 1 file(s)" in said and "(__0_0.distcp)" in said, said
    layout.verify_files(str(mine), manifest)  # the holder's step now holds the remote's good copy
    assert os.stat(mine / layout.METADATA_NAME).st_ino == metadata_inode  # the other file was not fetched


def test_a_replacement_node_takes_its_replica_from_a_good_holder_of_the_same_version(endpoint, tmp_path):
    """fetch_own_replica: each file is checked against the manifest (a rotten replica gives way to the
    next holder); a replica is not brought back when a peer's own copy of that step is another save."""
    owner, holder, addr = endpoint
    step_dir = owner / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    names = layout.copy_files(str(step_dir), manifest)[0]
    second = tmp_path / "second"
    second.mkdir()
    peer_service.write_secret(str(second), SECRET.decode())
    server = peer_service.serve(peer_service.PeerService(str(second), "second:0"), "127.0.0.1")
    try:
        clients = [("holder:0", peer_client.PeerClient(addr, SECRET)),
                   ("second:0", peer_client.PeerClient(f"127.0.0.1:{server.server_address[1]}", SECRET))]
        for _name, client in clients:
            client.put_replica("owner:0", str(step_dir), manifest, names)
        big = max(names, key=lambda n: manifest.files[n].size)
        rotten = holder / replicas.REPLICAS_DIR / "owner_0" / layout.step_dirname(1) / big
        data = bytearray(rotten.read_bytes())
        data[len(data) // 2] ^= 1
        rotten.write_bytes(bytes(data))
        # The holder's local retention keeps its own copy of the step it holds an owner's newest replica of.
        from shardckpt.node.peer_tier import PeerTier

        tier = PeerTier(shardckpt.CheckpointConfig(local_dir=str(holder)), str(holder), registered=True)
        assert not tier.protects(1)  # the tier is off
        tier.replicas = 1
        assert tier.protects(1) and not tier.protects(2)
        fresh = tmp_path / "replacement"
        fresh.mkdir()
        assert peer_client.fetch_own_replica(str(fresh), "owner:0", clients) == (1, ["holder:0", "second:0"])
        layout.verify_files(str(fresh / layout.step_dirname(1)), layout.read_manifest(str(fresh / layout.step_dirname(1))), names)
        assert [p.name for p in fresh.iterdir()] == [layout.step_dirname(1)]  # no partial directory left
        # The second holder's own step 1 is another save of that number: the replica is not taken.
        with shardckpt.Checkpointer(local_dir=str(second), preemption_signals=()) as ckpt:
            ckpt.save({"model": nn.Linear(16, 8)}, 1)
        other = tmp_path / "replacement2"
        other.mkdir()
        assert peer_client.fetch_own_replica(str(other), "owner:0", clients) is None
        assert layout.committed_steps(str(other)) == []
    finally:
        server.shutdown()
        server.server_close()


def test_a_daemon_retries_at_once_when_the_job_comes_back_with_new_addresses(endpoint):
    """A holder that died leaves its owner's daemon backing off; the restarted job's peers.json (the
    holder's new address) ends the backoff: the next look replicates."""
    from shardckpt.node.node_registry import state_dir

    owner, holder, addr = endpoint
    peer_service.write_secret(str(owner), SECRET.decode())
    daemon = peer_daemon.PeerDaemon(str(owner), "owner:0", "127.0.0.1")

    def peers(holder_addr):
        nodes = [{"node": "owner:0", "addr": "127.0.0.1:1", "domain": None},
                 {"node": "holder:0", "addr": holder_addr, "domain": None}]
        layout.atomic_write_text(os.path.join(state_dir(str(owner)), peer_daemon.PEERS_NAME),
                                 json.dumps({"nodes": nodes, "replicas": 1, "keep_last": 2}))

    peers("127.0.0.1:1")  # nobody listens there
    assert daemon.tick() and daemon.tick()  # failed, then waiting out its backoff
    assert daemon._retry_at > time.monotonic() and 1 not in daemon.sent
    peers(addr)
    assert not daemon.tick() and daemon.sent[1].holders == ["holder:0"]
    assert layout.committed_steps(str(holder / replicas.REPLICAS_DIR / "owner_0")) == [1]
