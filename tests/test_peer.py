"""The peer tier: the per-node endpoint (authentication, bounds, paths), replication, restore after a node loss."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import threading
import time

import pytest
import torch
import torch.nn as nn

import shardckpt
from shardckpt import cli
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.format import replicas
from shardckpt.node import peer_admission, peer_daemon, peer_server, peer_service
from shardckpt.restoring import views
from shardckpt.stores import admission, peer_client, tls

class Job:
    """The TLS identities of a few simulated nodes (each its own key pair) and what pins them."""

    def __init__(self, base, names=("owner", "holder", "second")):
        self.ids = {n: tls.node_identity(str(base / "keys" / n), f"{n}:0") for n in names}
        self.certs = [i.cert_pem for i in self.ids.values()]
        self.members = {i.fingerprint: f"{n}:0" for n, i in self.ids.items()}

    def client(self, who, addr, expect=None):
        ctx = tls.client_context(self.ids[who], self.certs)
        return peer_client.PeerClient(addr, ctx, expect=self.ids[expect].fingerprint if expect else None)

    def serve(self, who, root):
        service = peer_service.PeerService(str(root), f"{who}:0", tls.server_context(self.ids[who], self.certs),
                                           self.members)
        server = peer_server.serve(service, "127.0.0.1")
        return server, f"127.0.0.1:{server.server_address[1]}"


def _tree(root):
    """Every path under ``root`` with its size and mtime: what a refused request must leave as it was."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = "dir" if name in dirs else (st.st_size, st.st_mtime_ns)
    return out


def _raw(addr, method, path, body=b"", headers=None, context=None):
    """One request over TLS with ``context`` (a job member's, unless a test gives a stranger's)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (ConnectionResetError, BrokenPipeError):
        return "reset", b""  # refused while the body was still being sent
    finally:
        conn.close()


def _tier(job, me, nodes):
    """What a restore's peer views read of a node's peer tier: this node's name and TLS context, and the
    job's nodes as ``(name, address, whose certificate is pinned there)``."""
    import types

    return types.SimpleNamespace(
        on=True, committer=True, node_name=f"{me}:0", client_context=tls.client_context(job.ids[me], job.certs),
        admission=admission.load(job.ids[me], job.certs),
        nodes=[{"node": f"{n}:0", "addr": a, "cert": job.ids[c].cert_pem} for n, a, c in nodes])


def _routes(step, name, owner, tag):
    """Every route of the endpoint, as (method, path)."""
    return [("GET", "/v1/steps"), ("GET", f"/v1/local/{step}/{name}"), ("GET", f"/v1/local/{step}/"),
            ("GET", f"/v1/replica/{owner}/{step}/{name}"), ("GET", f"/v1/replica/{owner}/{step}/"),
            ("POST", f"/v1/replica/{owner}/{step}/{tag}/begin"), ("PUT", f"/v1/replica/{owner}/{step}/{tag}/f/{name}"),
            ("POST", f"/v1/replica/{owner}/{step}/{tag}/commit")]


def _answer_or_closed(addr, method, path, context, secret):
    """One request with ``context``: ``None`` when the connection was refused or closed before any answer,
    else the status (403 expected); fails when any bytes of ``secret`` (a file's content) came back."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=context)
    try:
        conn.request(method, path, body=b"{}" if method != "GET" else None)
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    assert secret[:64] not in body and resp.status != 200, (method, path, resp.status, body[:200])
    return resp.status


def _quiet(fn):
    def run():
        try:
            fn()
        except (OSError, ValueError):
            pass
    return run


@pytest.fixture
def endpoint(tmp_path):
    """A committed step of an owner node, and a holder node's endpoint on 127.0.0.1 (a free port)."""
    owner = tmp_path / "owner"
    torch.manual_seed(0)
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(16, 8), "extra": {"epoch": 1}}, 1)
    holder = tmp_path / "holder"
    holder.mkdir()
    job = Job(tmp_path)
    server, addr = job.serve("holder", holder)
    yield owner, holder, addr, job
    server.shutdown()
    server.server_close()


def test_endpoint_serves_and_accepts_replicas_only_to_the_job(endpoint, tmp_path):
    owner, holder, addr, job = endpoint
    step_dir = owner / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    names = sorted(manifest.files)
    client = job.client("owner", addr, expect="holder")
    member = tls.client_context(job.ids["owner"], job.certs)

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
    with pytest.raises(CorruptCheckpointError, match="not the manifest.s"):
        client.get_file(1, big, str(tmp_path / "refused"), wrong_entry, owner="owner:0")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("refused")]
    # peer_bandwidth: a replica of N bytes at R bytes/s takes at least N / R seconds to send.
    total, rate = sum(e.size for e in manifest.files.values()), 40_000
    t0 = time.monotonic()
    assert job.client("second", addr).put_replica("second:0", str(step_dir), manifest, names, bandwidth=rate) == total
    assert time.monotonic() - t0 >= 0.9 * total / rate
    before = _tree(holder)

    # Nobody else gets in (a key pair the job did not pin, or no TLS at all), and nothing changes on disk.
    stranger = Job(tmp_path / "stranger", names=("evil",))
    wrong = peer_client.PeerClient(addr, tls.client_context(stranger.ids["evil"], job.certs))
    for call in (wrong.list_steps, lambda: wrong.get(1, big, owner="owner:0"),
                 lambda: wrong.put_replica("evil:0", str(step_dir), manifest, names)):
        with pytest.raises(peer_client.PeerError, match=f"peer {addr}: .*(SSL|TLS|reset|EOF)"):
            call()
    plain = http.client.HTTPConnection("127.0.0.1", int(addr.rsplit(":", 1)[1]), timeout=30)
    with pytest.raises((OSError, http.client.HTTPException)):
        plain.request("GET", "/v1/steps")
        plain.getresponse().read()
    plain.close()
    # A TLS client presenting no certificate at all: the handshake itself is refused (the endpoint's TLS
    # requires one), so no route answers it, and no byte of any file reaches it.
    bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    bare.check_hostname = False
    bare.load_verify_locations(cadata=job.ids["holder"].cert_pem)
    tag = replicas.version_tag(manifest)
    for method, path in _routes(1, big, "owner_0", tag):
        assert _answer_or_closed(addr, method, path, bare, data) is None, (method, path)
    a, b = socket.socketpair()
    with a, b:
        server_side = tls.server_context(job.ids["holder"], job.certs).wrap_socket(
            a, server_side=True, do_handshake_on_connect=False)
        client_side = bare.wrap_socket(b, do_handshake_on_connect=False)
        threading.Thread(target=_quiet(client_side.do_handshake), daemon=True).start()
        with pytest.raises(ssl.SSLError):
            server_side.settimeout(10)
            server_side.do_handshake()
    # A job member writes its own replicas only: not another node's, not an owner named "..".
    begin = f"/v1/replica/second_0/1/{replicas.version_tag(manifest)}/begin"
    assert _raw(addr, "POST", begin, manifest.to_json().encode(), context=member)[0] == 403
    for owner_name in ("..", "%2E%2E", ".", "owner_0%2F.."):
        path = f"/v1/replica/{owner_name}/1/{replicas.version_tag(manifest)}/begin"
        assert _raw(addr, "POST", path, manifest.to_json().encode(), context=member)[0] in (400, 403, 404)
    assert not (tmp_path / "1").exists() and not (holder / "1").exists()
    # A member's read of another directory through an owner named "../..": 400, and no byte of it.
    for path in (f"/v1/replica/..%2F..%2F{owner.name}/1/{big}", f"/v1/replica/..%2F..%2F{owner.name}/1/",
                 f"/v1/replica/..%2F..%2F{owner.name}%2F.shardckpt-replicas%2F..%2F/1/{big}"):
        status, body = _raw(addr, "GET", path, context=member)
        assert status == 400 and data[:64] not in body, (path, status, body[:200])
    # Paths out of the replica and step directories, from a job member.
    for path in ("/v1/local/1/..%2F..%2Fholder%2F.shardckpt-remote%2Fpeer-key.pem",
                 "/v1/replica/../1/" + big, "/v1/replica/owner_0/1/..", "/v1/local/1/%2Fetc%2Fpasswd",
                 f"/v1/replica/owner_0/1/{replicas.version_tag(manifest)}/f/..%2F..%2Fx"):
        for method in ("GET", "PUT"):
            status, body = _raw(addr, method, path, b"z", context=member)
            assert status in (400, 403, 404), (method, path, status, body)
    assert _tree(holder) == before
    # A file of the step swapped for a symbolic link to a file outside is not followed.
    secret_file = tmp_path / "private"
    secret_file.write_text("x")
    os.symlink(secret_file, replica / "link")
    os.replace(replica / "link", replica / big)
    before = _tree(holder)
    with pytest.raises(peer_client.PeerError, match="403"):
        client.get(1, big, owner="owner:0")
    # Bodies larger than their bound: a replica file beyond its manifest size, a manifest beyond 16 MiB.
    tag = replicas.version_tag(manifest)
    path = f"/v1/replica/owner_0/7/{tag}/begin"
    seven = dataclasses.replace(manifest, step=7)  # sealed again with its own digest by to_json()
    assert seven.step == 7
    tag7 = replicas.version_tag(seven)
    assert _raw(addr, "POST", f"/v1/replica/owner_0/7/{tag7}/begin", seven.to_json().encode(), context=member)[0] == 200
    before = _tree(holder)
    body = data + b"!"
    path = f"/v1/replica/owner_0/7/{tag7}/f/{big}"
    assert _raw(addr, "PUT", path, body, context=member)[0] in (413, "reset")
    path = f"/v1/replica/owner_0/7/{tag7}/begin"
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), timeout=30, context=member)
    conn.putrequest("POST", path)
    conn.putheader("Content-Length", str(peer_service.MAX_SMALL_BODY + 1))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    # A file whose bytes do not match the owner's checksum is not kept.
    bad = bytes([data[0] ^ 1]) + data[1:]
    path = f"/v1/replica/owner_0/7/{tag7}/f/{big}"
    assert _raw(addr, "PUT", path, bad, context=member)[0] == 422
    assert _tree(holder) == before


def test_answers_come_only_from_the_node_pinned_for_the_address(endpoint, tmp_path):
    """Whatever answers at a holder's address (another job member, a TLS server with its own certificate,
    a plain HTTP server bound to the port after the holder's daemon went) gives a replacement node
    nothing: the connection is refused before any byte is read, and the next holder is used."""
    import http.server
    import socket
    import ssl
    import threading

    owner, holder, addr, job = endpoint
    step_dir = owner / layout.step_dirname(1)
    manifest = layout.read_manifest(str(step_dir))
    names = layout.copy_files(str(step_dir), manifest)[0]
    job.client("owner", addr, expect="holder").put_replica("owner:0", str(step_dir), manifest, names)
    # Another job member's endpoint at the address where the holder is expected: refused.
    with pytest.raises(peer_client.PeerError, match="not the one of the node expected"):
        job.client("owner", addr, expect="second").list_steps()

    forged_root = tmp_path / "forged"
    forged = Job(tmp_path / "forger", names=("forger",))
    served = []

    class Forged(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            served.append(self.path)
            body = json.dumps({"node": "x", "local": {}, "replicas": {"owner_0": {"9": "id:forged"}}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    for mode in ("tls", "plain"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forged)
        if mode == "tls":
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(forged.ids["forger"].cert_path, forged.ids["forger"].key_path)
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            fake = f"127.0.0.1:{server.server_address[1]}"
            # The node expected at the fake address is the holder; the real holder is listed after it.
            tier = _tier(job, "owner", [("holder", fake, "holder"), ("second", addr, "holder")])
            fresh = tmp_path / f"replacement-{mode}"
            fresh.mkdir()
            # The forged answer is never read; the real holder (second in the list) gives step 1, checked.
            peers = views.Peers(lambda: tier)
            offered = peers.views(1, layout.version_of(manifest))
            assert [v.name for v in offered] == ["peer second:0 (its replica of owner_0)"]
            copy = views.CopyFill(str(fresh), 1, layout.version_of(manifest), stale=False)
            copy.fill(offered)
            copy.commit()
            peers.close()
            assert copy.report == {"peer": {"files": len(names), "bytes": sum(manifest.files[n].size for n in names),
                                            "refused": 0}}
            layout.verify_files(str(fresh / layout.step_dirname(1)),
                                layout.read_manifest(str(fresh / layout.step_dirname(1))), names)
            with pytest.raises(peer_client.PeerError):
                job.client("owner", fake, expect="holder").list_steps()
        finally:
            server.shutdown()
            server.server_close()
    assert served == [] and not forged_root.exists()
    del socket


def test_a_holder_never_trades_a_newer_save_for_an_older_one_unless_the_owner_rolled_back(endpoint):
    """Two saves of step 1 (same number, other save ids): the holder keeps the one saved last; a late or
    replayed transfer of the older save is refused, never answered "committed"; when the owner's live
    lineage abandons the newer save (a rollback), the older one is taken."""
    from shardckpt.format import lineage

    owner, holder, addr, job = endpoint
    client = job.client("owner", addr, expect="holder")
    step_dir = owner / layout.step_dirname(1)
    base = layout.read_manifest(str(step_dir))
    names = layout.copy_files(str(step_dir), base)[0]
    older = dataclasses.replace(base, save_id="aaaa-older", created=base.created, lineage={"branch": "", "forks": []})
    newer = dataclasses.replace(base, save_id="bbbb-newer", created=base.created + 5,
                                lineage={"branch": "b1", "forks": [[0, "b1"]]})
    replica = holder / replicas.REPLICAS_DIR / "owner_0" / layout.step_dirname(1)
    held = lambda: layout.version_of(layout.read_manifest(str(replica)))  # noqa: E731

    client.put_replica("owner:0", str(step_dir), older, names)
    assert held() == layout.version_of(older)
    assert client.put_replica("owner:0", str(step_dir), newer, names) > 0  # another save: sent, not "held"
    assert held() == layout.version_of(newer)
    # The older save again (a replay, or a late retry), with or without the newer one's lineage: refused.
    for live in (None, lineage.Lineage.from_json(newer.lineage).to_json()):
        with pytest.raises(peer_client.PeerError, match="409"):
            client.put_replica("owner:0", str(step_dir), older, names, live=live)
        assert held() == layout.version_of(newer)
    # The owner's live lineage leaves branch b1 (a rollback past it): the older save is its live one.
    client.put_replica("owner:0", str(step_dir), older, names, live=lineage.Lineage().to_json())
    assert held() == layout.version_of(older)
    assert {p.name for p in replica.iterdir()} == set(names) | {layout.MANIFEST_NAME}


def _job_dirs(tmp_path):
    """A node job's directories: its nodes' local_dirs under ``nvme``, and the outputs of its two launches."""
    base, out, out2 = tmp_path / "nvme", tmp_path / "out", tmp_path / "out2"
    out.mkdir()
    out2.mkdir()
    return base, out, out2


def _end_daemon(info):
    """SIGKILL a node's daemon (a lost node), unless it has already ended by itself (its job over)."""
    from helpers import wait_for
    from shardckpt.node.node_registry import pid_alive

    if info.get("state") == "running" and pid_alive(info["pid"], info.get("pid_start")):
        os.kill(info["pid"], signal.SIGKILL)
        # Gone before the caller removes its directory (else a daemon still exiting writes its status there).
        wait_for(lambda: not pid_alive(info["pid"], info.get("pid_start")), 30, "the SIGKILLed peer daemon to end")


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
            held = sorted(p.name for p in (replica / layout.step_dirname(3)).iterdir() if p.name != layout.MANIFEST_NAME)
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


def _private_files(root):
    """Every path of the tier's directories under ``root`` whose mode lets anyone but its owner in."""
    loose = []
    for top in (root / ".shardckpt-remote", root / replicas.REPLICAS_DIR):
        for here, dirs, files in os.walk(top):
            for path, want in [(here, 0o700)] + [(os.path.join(here, f), 0o600) for f in files]:
                mode = os.stat(path).st_mode & 0o777
                if mode != want:
                    loose.append(f"{path}: {mode:o}")
    return loose


def test_after_a_rollback_the_live_branch_is_replicated_and_survives_a_node_loss(tmp_path):
    """2 nodes x 1 rank save 10, 20, 30, roll back to 10 and save 11, 12 (30 is the highest number, 12 the
    live head). close() returns once 12 is peer-durable; node 1 is then lost (daemon and disk) and node 0
    alone resumes step 12 bitwise from its own files and node 1's replica. Node 0's daemon, told by that
    launch that the tier is off, retries nobody and exits after its linger. Under umask 022 every directory
    of the tier is 0700 and every file in it 0600 (the state directory, peers.json, status files, logs,
    lock, keys, replicas)."""
    import shutil
    import socket

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
        assert layout.read_manifest(str(held / layout.step_dirname(12))) is not None, \
            f"close() returned before node 1's step 12 was peer-durable: node 0 holds {layout.committed_steps(str(held))}"
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


def test_a_replacement_node_takes_its_files_from_the_peers_views_of_the_chosen_save(endpoint, tmp_path):
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
        peers = views.Peers(lambda: _tier(job, "owner", [("owner", "127.0.0.1:9", "owner"), ("holder", addr, "holder"),
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
        layout.verify_files(str(fresh / layout.step_dirname(1)), layout.read_manifest(str(fresh / layout.step_dirname(1))), names)
        assert [p.name for p in fresh.iterdir()] == [layout.step_dirname(1)]  # no partial directory left
    finally:
        server.shutdown()
        server.server_close()


def test_a_daemon_retries_at_once_when_the_job_comes_back_with_new_addresses(endpoint):
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


def _start_daemon(root, node, fd_limit):
    """A node's peer daemon in its own process (as a trainer starts it), at an open-file limit of ``fd_limit``."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    log_file = open(root / ".shardckpt-remote" / "peer.log", "ab")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from shardckpt.node.peer_daemon import peer_main; "
                             "sys.exit(peer_main(sys.argv[1:]))", "--local", str(root), "--node", node,
                             "--host", "127.0.0.1", "--poll", "0.2", "--linger", "2"],
                            env={**os.environ, "PYTHONPATH": src}, stdout=log_file, stderr=subprocess.STDOUT,
                            preexec_fn=limit)
    log_file.close()
    return proc


class _IdleFlood:
    """Strangers holding TCP connections open without a byte of TLS: ``per_source`` of them from each source
    address, each opened again as soon as the endpoint closes it (one thread, a selector; bounded by stop())."""

    def __init__(self, addr, sources, per_source):
        import selectors

        self.target = (addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1]))
        self.sources, self.per_source = sources, per_source
        self.sel = selectors.DefaultSelector()
        self.reopened = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, source):
        try:
            sock = socket.create_connection(self.target, timeout=5, source_address=(source, 0))
        except OSError:
            return
        sock.setblocking(False)
        self.sel.register(sock, 1, source)  # EVENT_READ: the endpoint closed it

    def _run(self):
        for source in self.sources:
            for _ in range(self.per_source):
                self._open(source)
        while not self.stopped.is_set():
            for key, _mask in self.sel.select(0.1):
                try:
                    gone = not key.fileobj.recv(1)
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.reopened += 1
                    self._open(key.data)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join(timeout=30)


def _client_hello():
    """The first flight of a TLS 1.3 client (stdlib ssl through memory buffers), to replay as is."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _hello_flood(addr, source, seconds, most, in_flight=32):
    """Replay one ClientHello on new connections from ``source`` (``in_flight`` at a time) for ``seconds`` or
    ``most`` connections; each closes once the endpoint answered or closed. Returns how many were sent and how
    many the endpoint answered with a ServerHello (a handshake it worked on)."""
    import selectors

    hello = _client_hello()
    target = (addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1]))
    sel = selectors.DefaultSelector()
    sent = worked = 0
    end = time.monotonic() + seconds

    def start():
        nonlocal sent
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        sock.connect_ex(target)
        sel.register(sock, selectors.EVENT_WRITE, "connecting")
        sent += 1

    for _ in range(in_flight):
        start()
    while time.monotonic() < end and sel.get_map():
        for key, _mask in sel.select(0.1):
            sock = key.fileobj
            if key.data == "connecting":
                try:
                    sock.send(hello)
                    sel.modify(sock, selectors.EVENT_READ, "sent")
                    continue
                except OSError:
                    pass
            else:
                try:
                    worked += bool(sock.recv(65536))
                except OSError:
                    pass
            sel.unregister(sock)
            sock.close()
            if sent < most and time.monotonic() < end:
                start()
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return sent, worked


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        budget = 1.2 * (peer_admission.HANDSHAKE_BURST + peer_admission.HANDSHAKES_PER_S * wall)  # 20 %: the clock's edges
        assert worked <= budget, f"the endpoint worked on {worked} of {sent} replayed ClientHellos (budget {budget:.0f})"
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


def test_an_operators_ca_replaces_the_nodes_own_keys(endpoint, tmp_path, monkeypatch):
    """peer_tls_ca/_cert/_key (SHARDCKPT_PEER_TLS_*): a peer is trusted when its certificate chains to the
    operator's CA (no pinning through the rendezvous), a self-made key pair is not, and the three go
    together (a clear error naming them otherwise)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from shardckpt.node.peer_tier import PeerTier

    owner, _holder, _addr, job = endpoint
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    pki = tmp_path / "pki"
    pki.mkdir()
    (pki / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(name):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)).sign(ca_key, hashes.SHA256()))
        (pki / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path = pki / f"{name}.key"
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        return tls.load_identity(str(pki / f"{name}.pem"), str(key_path), str(pki / "ca.pem"))

    holder_id, owner_id, outsider_id = issue("holder"), issue("owner"), issue("outsider")
    (tmp_path / "ca-holder").mkdir()
    shutil.copytree(owner / layout.step_dirname(1), tmp_path / "ca-holder" / layout.step_dirname(1))  # its own step
    service = peer_service.PeerService(str(tmp_path / "ca-holder"), "holder:0", tls.server_context(holder_id, []),
                                       {owner_id.fingerprint: "owner:0"})
    server = peer_server.serve(service, "127.0.0.1")
    addr = f"127.0.0.1:{server.server_address[1]}"
    try:
        step_dir = owner / layout.step_dirname(1)
        manifest = layout.read_manifest(str(step_dir))
        names = layout.copy_files(str(step_dir), manifest)[0]
        client = peer_client.PeerClient(addr, tls.client_context(owner_id, []))
        assert client.put_replica("owner:0", str(step_dir), manifest, names) > 0
        assert client.list_steps()["replicas"] == {"owner_0": {"1": layout.version_of(manifest)}}
        # A node's own self-signed pair (what the job pins without a CA) is not the CA's: refused both ways.
        mine = tls.client_context(job.ids["owner"], [holder_id.cert_pem])
        with pytest.raises(peer_client.PeerError):
            peer_client.PeerClient(addr, mine).list_steps()
        # A certificate the CA signed for something that is not a node of this job: every route, reads as
        # writes, is refused (the connection closed, or 403), and no byte of any file reaches it.
        big = max(names, key=lambda n: manifest.files[n].size)
        secret = (step_dir / big).read_bytes()
        before = _tree(tmp_path / "ca-holder")
        outsider = tls.client_context(outsider_id, [])
        for method, path in _routes(1, big, "owner_0", replicas.version_tag(manifest)):
            assert _answer_or_closed(addr, method, path, outsider, secret) in (None, 403), (method, path)
        with pytest.raises(peer_client.PeerError):
            peer_client.PeerClient(addr, outsider).list_steps()
        assert _tree(tmp_path / "ca-holder") == before
    finally:
        server.shutdown()
        server.server_close()
    config = shardckpt.CheckpointConfig.from_env({"SHARDCKPT_PEER_TLS_CA": str(pki / "ca.pem"),
                                                  "SHARDCKPT_PEER_TLS_CERT": owner_id.cert_path,
                                                  "SHARDCKPT_PEER_TLS_KEY": owner_id.key_path}, local_dir=str(owner))
    tier = PeerTier(config, str(owner), registered=True)
    assert tier._identity("owner:0").ca_path == str(pki / "ca.pem")
    half = shardckpt.CheckpointConfig(local_dir=str(owner), peer_tls_ca=str(pki / "ca.pem"))
    with pytest.raises(tls.PeerTLSError, match="peer_tls_cert, peer_tls_key and peer_tls_ca"):
        PeerTier(half, str(owner), registered=True)._identity("owner:0")
    # A key file that others can read, and one of mode 0600 that belongs to another user: each message
    # names its own problem (a mode to tighten, an owner to change), never the other's.
    (pki / "owner.key").chmod(0o640)
    with pytest.raises(tls.PeerTLSError, match="readable by other users \\(mode 640\\).*Remedy: chmod 600") as info:
        tier._identity("owner:0")
    assert "another user" not in str(info.value)
    (pki / "owner.key").chmod(0o600)
    if os.getuid() == 0:  # only root can give a file to another user
        os.chown(pki / "owner.key", 65534, -1)
        with pytest.raises(tls.PeerTLSError, match="belongs to another user \\(owner uid 65534.*Remedy: chown") as info:
            tier._identity("owner:0")
        assert "readable by other users" not in str(info.value)
    else:
        from helpers import UNCHECKED

        UNCHECKED.append("a key owned by another user is named as such (needs root to chown)")


def _newest_complete(base, survivors, lost):
    """The newest step the ``survivors`` (node directories under ``base``) can rebuild without node ``lost``:
    the same save committed in each survivor's directory and the lost node's replica of it on a survivor."""
    here = [base / n for n in survivors]
    for step in sorted(layout.committed_steps(str(here[0])), reverse=True):
        versions = {layout.version_of(m) if m else None
                    for m in (replicas.manifest_or_none(str(d / layout.step_dirname(step))) for d in here)}
        held = [replicas.manifest_or_none(str(d / replicas.REPLICAS_DIR / replicas.owner_dirname(lost)
                                               / layout.step_dirname(step))) for d in here]
        if len(versions) == 1 and None not in versions and any(m and layout.version_of(m) in versions for m in held):
            return step
    return None


def test_three_nodes_a_lagging_replica_and_a_node_loss_cost_only_what_was_not_peer_durable(tmp_path):
    """3 nodes x 1 rank, keep_last=1: step 1 becomes peer-durable on every node, then node 2's daemon stalls
    (node 1's later files never reach it, node 2's never leave) while steps 2 and 3 are saved. Every node
    decides retention from the facts all nodes exchanged at the save, so all of them keep step 1, the
    newest step complete across any single node's loss. Node 2 is then lost (daemon and disk): the
    survivors resume the newest step they can rebuild (step 1), bitwise. At that launch node 1's key is
    readable by others: its trainer's log names the file and the remedy."""
    import socket

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
