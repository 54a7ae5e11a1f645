"""The peer daemon: retries when the job comes back, a launch meeting a daemon on its way out, strangers'
floods against a daemon in its own process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import torch.nn as nn
from peer_helpers import (
    _cpu_seconds,
    _hello_flood,
    _IdleFlood,
    _start_daemon,
    endpoint,  # noqa: F401 - a fixture
)

import shardckpt
from shardckpt.format import layout, replicas
from shardckpt.node import peer_admission, peer_daemon
from shardckpt.stores import peer_client, tls


def test_a_daemon_retries_at_once_when_the_job_comes_back_with_new_addresses(endpoint):  # noqa: F811 - the endpoint fixture of peer_helpers
    """A holder that died leaves its owner's daemon backing off; the restarted job's peers.json (the
    holder's new address) ends the backoff: the next look replicates. A key file that is missing or
    readable by others stops replication with an error naming the file and the remedy; a relaunch
    without the holder (the job shrank, the tier off) leaves the daemon nothing to retry."""
    from shardckpt.node.node_registry import state_dir

    owner, holder, addr, job = endpoint
    daemon = peer_daemon.PeerDaemon(str(owner), "owner:0", "127.0.0.1")
    me = job.ids["owner"]

    def peers(holder_addr, nodes=("owner", "holder"), replicas_=1):
        listed = [{"node": f"{n}:0", "addr": holder_addr if n == "holder" else "127.0.0.1:1", "domain": None,
                   "cert": job.ids[n].cert_pem} for n in nodes]
        os.makedirs(state_dir(str(owner)), exist_ok=True)
        layout.atomic_write_text(os.path.join(state_dir(str(owner)), peer_daemon.PEERS_NAME),
                                 json.dumps({"nodes": listed, "replicas": replicas_, "keep_last": 2,
                                             "tls": me.to_json()}))

    peers("127.0.0.1:1")  # nobody listens there
    assert daemon.tick() and daemon.tick()  # failed, then waiting out its backoff
    assert daemon._retry_at > time.monotonic() and 1 not in daemon.sent
    assert "127.0.0.1:1" in daemon.last_error
    peers(addr)
    assert not daemon.tick() and daemon.sent[1].holders == ["holder:0"]
    assert daemon.last_error is None
    assert layout.committed_steps(str(holder / replicas.REPLICAS_DIR / "owner_0")) == [1]

    # The key readable by others, then missing: no replication, and an error that says what to do.
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(16, 8)}, 2)
    # (that launch, one process without the tier, told the daemon it has no job to replicate to)
    assert json.loads((owner / ".shardckpt-remote" / peer_daemon.PEERS_NAME).read_text())["nodes"] == []
    assert not daemon.tick() and 2 not in daemon.sent
    peers(addr)
    os.chmod(me.key_path, 0o644)
    assert not daemon.tick() and 2 not in daemon.sent
    assert me.key_path in daemon.last_error and "chmod 600" in daemon.last_error, daemon.last_error
    daemon._write_status("running")
    assert me.key_path in peer_daemon.node_status(str(owner))["last_error"]
    moved = me.key_path + ".away"
    os.chmod(me.key_path, 0o600)
    os.rename(me.key_path, moved)
    assert not daemon.tick() and 2 not in daemon.sent
    assert me.key_path in daemon.last_error and "missing" in daemon.last_error, daemon.last_error
    os.rename(moved, me.key_path)
    assert not daemon.tick() and daemon.sent[2].holders == ["holder:0"] and daemon.last_error is None

    # The job shrank to this node alone (the tier off): nothing to send, nobody retried, the daemon may go.
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(16, 8)}, 3)
    for nodes, count in ((("owner",), 1), ((), 0)):
        peers("127.0.0.1:1", nodes, count)
        assert not daemon.tick() and 3 not in daemon.sent
    daemon.linger_s = 0.0
    assert daemon._idle(False)


def test_strangers_flooding_the_endpoint_neither_stop_replication_nor_take_its_cpu(tmp_path):
    """Two nodes' daemons. Strangers hold 16 idle connections from each of five addresses (127.0.0.1, the
    member's own, and 127.0.0.2-5), each reopened as soon as the holder's endpoint drops it; meanwhile the
    owner saves three steps: each is peer-durable within 60 s. Then a flood of one replayed ClientHello from
    127.0.0.6 (3 s, at most 20000 connections): every request of the member is still answered, the flooding
    address gets its handshake budget and no more, and the endpoint's CPU stays bounded (measured). Pending
    connections cost no thread; refusals are logged at a bounded rate; under umask 022 every replica file
    and folder and every key file is private."""
    from helpers import wait_for

    from shardckpt.node.node_registry import register_trainer, state_dir

    scratch, owner, holder = tmp_path / "scratch", tmp_path / "owner", tmp_path / "holder"
    with shardckpt.Checkpointer(local_dir=str(scratch), keep_last=10, preemption_signals=()) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save({"model": nn.Linear(64, 64)}, step)
    old_umask = os.umask(0o022)
    procs = []
    try:
        ids = {}
        for root, name in ((owner, "owner"), (holder, "holder")):
            os.makedirs(state_dir(str(root)))
            ids[name] = tls.node_identity(state_dir(str(root)), f"{name}:0")
            register_trainer(str(root))  # this process stands for the node's trainer
            procs.append(_start_daemon(root, f"{name}:0", 1024))
        addrs = {}
        for root, name in ((owner, "owner"), (holder, "holder")):
            status = root / ".shardckpt-remote" / peer_daemon.STATUS_NAME
            wait_for(lambda: status.exists() and json.loads(status.read_text()).get("addr"), 30, f"{name}'s daemon")
            addrs[name] = json.loads(status.read_text())["addr"]
        nodes = [{"node": f"{n}:0", "addr": addrs[n], "domain": None, "cert": ids[n].cert_pem} for n in addrs]
        for root, name in ((owner, "owner"), (holder, "holder")):
            layout.atomic_write_text(os.path.join(state_dir(str(root)), peer_daemon.PEERS_NAME), json.dumps(
                {"nodes": nodes, "replicas": 1, "keep_last": 10, "tls": ids[name].to_json(), "written": "w1"}))

        sources = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
        with _IdleFlood(addrs["holder"], sources, 16) as idle:
            # Every stranger's connection dropped at its deadline and reopened at least once: the flood is on.
            wait_for(lambda: idle.reopened >= 80, 30, "the strangers' connections to turn over")
            for step in (1, 2, 3):
                os.rename(scratch / layout.step_dirname(step), owner / layout.step_dirname(step))
                wait_for(lambda: peer_daemon.replicated(str(owner), step), 60,
                         f"step {step} peer-durable through 16 idle connections from each of {sources}")
            # The strangers' pending connections cost the endpoint no thread (its members' do, a few).
            with open(f"/proc/{procs[1].pid}/status") as f:
                threads = int(next(line.split()[1] for line in f if line.startswith("Threads:")))
            assert threads <= 12, f"the holder's daemon runs {threads} threads under 80 strangers' connections"

        # The member, from 127.0.0.1 (its own address), while one address floods ClientHellos.
        member = peer_client.PeerClient(addrs["holder"], tls.client_context(ids["owner"], [ids["holder"].cert_pem]),
                                        expect=ids["holder"].fingerprint, connections=1)
        answered, failed, done = [], [], threading.Event()

        def ask():
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    member.list_steps()
                    member.close()  # each request on a new connection: a new handshake during the flood
                    answered.append(time.monotonic() - t0)
                except peer_client.PeerError as exc:
                    failed.append(str(exc))
                time.sleep(0.05)

        holder_pid = procs[1].pid
        cpu0, t0 = _cpu_seconds(holder_pid), time.monotonic()
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        sent, worked = _hello_flood(addrs["holder"], "127.0.0.6", 3.0, 20000)
        cpu, wall = _cpu_seconds(holder_pid) - cpu0, time.monotonic() - t0
        done.set()
        asker.join(timeout=60)
        print(f"ClientHello flood: {sent} connections in {wall:.1f} s, {worked} given a handshake; the endpoint's "
              f"process used {cpu:.2f} s of CPU "
              f"({cpu / wall:.0%} of a core); member requests: {len(answered)} answered "
              f"(median {sorted(answered)[len(answered) // 2] * 1000:.0f} ms), {len(failed)} failed")
        assert sent >= 500 and not failed and len(answered) >= 10, (sent, failed[:3], len(answered))
        # The flooding address got its budget of handshakes (a burst, then a rate), not one per ClientHello.
        # 20 %: the clock's edges
        budget = 1.2 * (peer_admission.HANDSHAKE_BURST + peer_admission.HANDSHAKES_PER_S * wall)
        assert worked <= budget, (f"the endpoint worked on {worked} of {sent} replayed ClientHellos "
                                  f"(budget {budget:.0f})")
        # Each ClientHello beyond the budget is closed unworked (~0.05 ms here; a handshake costs ~0.35 ms), and
        # the endpoint never spends more than its one loop thread on them, however fast the flood comes.
        assert cpu / sent < 0.2e-3 and cpu / wall < 1.0, f"{cpu:.2f} s of CPU for {sent} ClientHellos in {wall:.1f} s"
        os.rename(scratch / layout.step_dirname(4), owner / layout.step_dirname(4))
        wait_for(lambda: peer_daemon.replicated(str(owner), 4), 60, "step 4 peer-durable after the flood")
        assert all(p.poll() is None for p in procs)  # neither daemon fell over
        log_text = (holder / ".shardckpt-remote" / "peer.log").read_text()
        assert "refused" in log_text and log_text.count("refused") <= 30, log_text[-3000:]

        # Private on disk, whatever the umask: replicas (folders 0700, files 0600) and keys.
        base = holder / replicas.REPLICAS_DIR
        for here, dirs, files in os.walk(base):
            assert os.stat(here).st_mode & 0o077 == 0, here
            for name in files:
                assert os.stat(os.path.join(here, name)).st_mode & 0o077 == 0, os.path.join(here, name)
        assert layout.committed_steps(str(base / "owner_0")) == [1, 2, 3, 4]
        for identity in ids.values():
            assert os.stat(identity.key_path).st_mode & 0o777 == 0o600
    finally:
        os.umask(old_umask)
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_a_launch_meeting_its_nodes_daemon_on_its_way_out_leaves_the_node_served_at_the_same_address(
        tmp_path, monkeypatch, caplog):
    """A launch finds the node's daemon running, but that daemon had already decided to exit (no trainer
    had been left for its linger): the launch starts another once the first is gone; the new one waits
    for the node's lock, which an exiting daemon holds until its endpoint is shut (it did exit at once),
    and serves on the first one's port, the address the other nodes were given (it took a new one)."""
    import fcntl
    import threading

    from shardckpt.node import peer_tier
    from shardckpt.node.node_registry import read_json, register_trainer, state_dir, unregister_trainer
    from shardckpt.options import CheckpointConfig

    monkeypatch.setenv("SHARDCKPT_PEER_HOST", "127.0.0.1")
    monkeypatch.setenv("SHARDCKPT_PEER_LINGER_S", "0")
    root = str(tmp_path / "node")
    os.makedirs(state_dir(root))
    status_path = os.path.join(state_dir(root), peer_daemon.STATUS_NAME)
    tier = peer_tier.PeerTier(CheckpointConfig(local_dir=root), root, registered=True)
    tier._node = "holder:0"
    trainer = register_trainer(root)
    first = tier._spawn_daemon()  # the daemon the launch found running
    tier._served_addr = first["addr"]
    unregister_trainer(trainer)  # its trainers gone: it exits, as the launch below starts
    from helpers import wait_for

    wait_for(lambda: read_json(status_path).get("state") == "exited", 30, "the first daemon's exit")
    lock = os.open(os.path.join(state_dir(root), peer_daemon.LOCK_NAME), os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held, as an exiting daemon holds it while its endpoint shuts
    threading.Timer(1.5, os.close, args=(lock,)).start()
    trainer = register_trainer(root)
    second = None
    try:
        layout.atomic_write_text(os.path.join(state_dir(root), peer_daemon.PEERS_NAME),
                                 json.dumps({"nodes": [], "replicas": 0, "written": "launch-2"}))
        with caplog.at_level("WARNING", logger="shardckpt"):
            tier._await_daemon("launch-2")
        second = tier.daemon_info()
        assert second is not None and second["pid"] != first["pid"], read_json(status_path)
        assert second["peers_loaded"] == "launch-2"
        assert second["addr"] == first["addr"]
        assert "a new one serves" not in caplog.text
    finally:
        unregister_trainer(trainer)
        if second is not None:
            os.kill(second["pid"], signal.SIGTERM)
        wait_for(lambda: read_json(status_path).get("state") != "running", 30, "the second daemon's exit")


def test_check_resume_ends_a_lines_peer_daemon_once_its_runs_are_over(tmp_path, monkeypatch):
    """A node's daemon lingers 60 s after its trainers to serve the job's other nodes. check-resume's settle()
    (run before a line's directory is moved aside, and at the end) leaves the daemon of a live trainer alone and
    ends the daemon of a line whose runs are over at once, by its ordinary stop: no daemon of one line of runs
    is left running while the next line does."""
    from helpers import wait_for

    from shardckpt.check_resume import isolate
    from shardckpt.node import peer_tier
    from shardckpt.node.node_registry import pid_alive, read_json, register_trainer, state_dir, unregister_trainer
    from shardckpt.options import CheckpointConfig

    monkeypatch.setenv("SHARDCKPT_PEER_HOST", "127.0.0.1")
    monkeypatch.delenv("SHARDCKPT_PEER_LINGER_S", raising=False)  # the default linger, 60 s
    where = tmp_path / "ckpt"
    root = str(where / "node-1")
    os.makedirs(state_dir(root))
    tier = peer_tier.PeerTier(CheckpointConfig(local_dir=root), root, registered=True)
    tier._node = "node-1:0"
    cert = tier._identity(tier._node).cert_pem
    # The run's two nodes, as its trainer writes them: the daemon lingers for the other one.
    nodes = [{"node": f"node-{n}:0", "addr": "127.0.0.1:1", "domain": None, "cert": cert} for n in (1, 2)]
    layout.atomic_write_text(os.path.join(state_dir(root), peer_daemon.PEERS_NAME),
                             json.dumps({"nodes": nodes, "replicas": 1, "written": "launch-1"}))
    trainer = register_trainer(root)
    daemon = tier._spawn_daemon()
    try:
        assert isolate.settle(str(where), wait_s=5) == []
        assert tier.daemon_info() is not None  # its trainer runs: left alone
        unregister_trainer(trainer)
        trainer = None
        time.sleep(3)
        assert tier.daemon_info() is not None  # lingering for the other node
        t0 = time.monotonic()
        assert isolate.settle(str(where), wait_s=30) == []  # its ordinary end, nothing to report
        assert not pid_alive(daemon["pid"], daemon.get("pid_start")), read_json(
            os.path.join(state_dir(root), peer_daemon.STATUS_NAME))
        assert time.monotonic() - t0 < 20  # not its 60 s linger
        assert read_json(os.path.join(state_dir(root), peer_daemon.STATUS_NAME)).get("state") == "exited"
    finally:
        if trainer is not None:
            unregister_trainer(trainer)
        if pid_alive(daemon["pid"], daemon.get("pid_start")):
            os.kill(daemon["pid"], signal.SIGTERM)
            wait_for(lambda: not pid_alive(daemon["pid"], daemon.get("pid_start")), 30, "the daemon's exit")
