"""The peer endpoint: mutual TLS with the job's members only, paths and bodies bounded, answers from the
node pinned, an operator's CA."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import shutil
import socket
import ssl
import threading
import time

import pytest
from peer_helpers import (
    Job,
    _answer_or_closed,
    _client_hello,
    _quiet,
    _raw,
    _routes,
    _tier,
    _tree,
    endpoint,  # noqa: F401 - a fixture
)

import shardckpt
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout, replicas
from shardckpt.node import peer_server, peer_service
from shardckpt.restoring import views
from shardckpt.stores import admission, peer_client, tls


def test_endpoint_serves_and_accepts_replicas_only_to_the_job(endpoint, tmp_path):  # noqa: F811 - the endpoint fixture of peer_helpers
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


def test_answers_come_only_from_the_node_pinned_for_the_address(endpoint, tmp_path):  # noqa: F811 - the endpoint fixture of peer_helpers
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
            peers = views.Peers(tier)
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


def test_a_holder_never_trades_a_newer_save_for_an_older_one_unless_the_owner_rolled_back(endpoint):  # noqa: F811 - the endpoint fixture of peer_helpers
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


def test_an_operators_ca_replaces_the_nodes_own_keys(endpoint, tmp_path, monkeypatch):  # noqa: F811 - the endpoint fixture of peer_helpers
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


def test_numbers_beyond_any_step_or_offset_are_refused_with_400(endpoint):  # noqa: F811 - the endpoint fixture of peer_helpers
    """A step, a Range or a Content-Length of 5,000 digits (more than Python converts) is a client's error:
    400 naming the number, never a 500; a step of non-ASCII digits is no step either. Nothing is written."""
    owner, holder, addr, job = endpoint
    shutil.copytree(owner / layout.step_dirname(1), holder / layout.step_dirname(1))
    manifest = layout.read_manifest(str(holder / layout.step_dirname(1)))
    name = sorted(manifest.files)[0]
    member = tls.client_context(job.ids["owner"], job.certs)
    huge = "9" * 5000
    before = _tree(holder)
    for method, path, headers in [
            ("GET", f"/v1/local/{huge}/{name}", {}), ("GET", f"/v1/local/{huge}/", {}),
            ("GET", f"/v1/replica/owner_0/{huge}/{name}", {}),
            ("POST", f"/v1/replica/owner_0/{huge}/tag/begin", {}),
            ("PUT", f"/v1/replica/owner_0/{huge}/tag/f/{name}", {}),
            ("GET", f"/v1/local/1/{name}", {"Range": f"bytes={huge}-"}),
            ("GET", f"/v1/local/1/{name}", {"Range": f"bytes=0-{huge}"}),
            ("POST", "/v1/replica/owner_0/2/tag/begin", {"Content-Length": huge})]:
        status, body = _raw(addr, method, path, b"" if "Content-Length" in headers else b"{}", headers, member)
        assert status == 400 and b"digits" in body, (method, path[:60], headers.keys(), status, body[:200])
    status, body = _raw(addr, "GET", f"/v1/local/%C2%B2/{name}", context=member)  # '²': a digit, not ASCII
    assert status == 400, (status, body[:200])
    assert _tree(holder) == before
    assert _raw(addr, "GET", f"/v1/local/1/{name}", headers={"Range": "bytes=0-9"}, context=member)[0] == 206


def test_a_member_at_its_connection_limit_is_refused_another_is_served(endpoint):  # noqa: F811 - the endpoint fixture of peer_helpers
    """A member holding MAX_PER_MEMBER connections open gets its next one closed (no answer), while another
    member is served at once; once one of the first member's connections closes, it is served again."""
    _owner, _holder, addr, job = endpoint
    host, port = addr.rsplit(":", 1)
    owner_ctx = tls.client_context(job.ids["owner"], job.certs)

    def ask(context):
        conn = http.client.HTTPSConnection(host, int(port), timeout=10, context=context)
        try:
            conn.request("GET", "/v1/steps")
            resp = conn.getresponse()
            resp.read()
            return conn, resp.status
        except (OSError, http.client.HTTPException):
            conn.close()
            return None, None

    held = []
    try:
        for _ in range(peer_server.MAX_PER_MEMBER):
            conn, status = ask(owner_ctx)
            assert status == 200
            held.append(conn)  # kept open: each holds its place (and a thread) on the endpoint
        conn, status = ask(owner_ctx)
        assert status is None, f"member's connection {peer_server.MAX_PER_MEMBER + 1} was served"
        other, status = ask(tls.client_context(job.ids["second"], job.certs))
        assert status == 200
        other.close()
        held.pop().close()
        deadline = time.monotonic() + 10
        while (status := ask(owner_ctx)[1]) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the endpoint sees the close when its thread wakes
        assert status == 200
    finally:
        for conn in held:
            conn.close()


def test_an_admission_token_is_the_members_own_used_once_and_fresh(endpoint, tmp_path):  # noqa: F811 - the endpoint fixture of peer_helpers
    """A member's token (HMAC with the key of that client and that server, from their own ECDH secret) puts
    its connection in the member's queue once: the same bytes replayed, a token for another server, one
    signed with a stranger's key or one out of the window are not a member's (a replay is closed unworked,
    the others wait with strangers); a member whose token is checked is served over it."""
    _owner, _holder, addr, job = endpoint
    owner_keys = admission.load(job.ids["owner"], job.certs)
    holder_keys = admission.load(job.ids["holder"], job.certs)
    holder_fp = job.ids["holder"].fingerprint
    token = owner_keys.preamble(holder_fp)
    assert holder_keys.check(token) is not None
    flipped = token[:-1] + bytes([token[-1] ^ 1])
    stranger = tls.node_identity(str(tmp_path / "stranger"), "stranger:0")  # a key pair no member pinned
    forged = admission.load(stranger, job.certs + [stranger.cert_pem]).preamble(holder_fp)
    for bad in (flipped, owner_keys.preamble(job.ids["second"].fingerprint), forged,
                owner_keys.preamble(holder_fp, now=time.time() - 2 * admission.WINDOW_S)):
        assert holder_keys.check(bad) is None
    assert owner_keys.preamble(tls.fingerprint(stranger.cert_pem)) is None  # no key with a non-member

    # Over the wire: the first use of a captured token gets a handshake (ServerHello), its replay none.
    hello = _client_hello()
    host, port = addr.rsplit(":", 1)

    def send(first):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(first + hello)
            try:
                return sock.recv(65536)
            except OSError:
                return b""

    fresh = owner_keys.preamble(holder_fp)
    assert send(fresh)[:1] == b"\x16", "a member's first token got no handshake"
    assert send(fresh) == b"", "a replayed token was worked on"
    assert send(flipped)[:1] == b"\x16"  # a stranger's ClientHello: its address's budget, not the member's
    member = peer_client.PeerClient(addr, tls.client_context(job.ids["owner"], job.certs), expect=holder_fp,
                                    admission=owner_keys)
    assert member.list_steps()["node"] == "holder:0"
    member.close()
