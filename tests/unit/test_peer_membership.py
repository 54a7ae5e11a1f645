"""The peer endpoint answers a connection only while its node is one of the job's, request by request.

Membership is checked when a connection is accepted, and again at every
request on it: a relaunch that drops a node (``PeerService.configure``, as the
daemon does from the new ``peers.json``) leaves that node's open keep-alive
connections unanswered from their next request on, while the nodes still in
the job go on being served on theirs. The node dropped is not the first one
of the job's list, and the one kept is listed after it, so neither outcome
follows from an order.
"""

from __future__ import annotations

import http.client
import json

import torch
import torch.nn as nn

import shardckpt
from shardckpt.format import layout
from shardckpt.node import peer_server, peer_service
from shardckpt.stores import peer_client, tls


def _request(conn: http.client.HTTPSConnection, path: str) -> tuple[object, bytes]:
    """One request on an open connection: (status, body), or ("closed", b"") when the server hung up."""
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine, OSError):
        return "closed", b""


def test_a_node_dropped_by_a_relaunch_gets_no_answer_on_its_open_connection(tmp_path):
    owner, holder = tmp_path / "owner", tmp_path / "holder"
    torch.manual_seed(0)
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(16, 8)}, 1)
    holder.mkdir()
    names = ("first", "holder", "owner", "second")  # owner (dropped) is neither first nor last
    ids = {n: tls.node_identity(str(tmp_path / "keys" / n), f"{n}:0") for n in names}
    certs = [i.cert_pem for i in ids.values()]
    members = {ids[n].fingerprint: f"{n}:0" for n in names}
    service = peer_service.PeerService(str(holder), "holder:0", tls.server_context(ids["holder"], certs), members)
    server = peer_server.serve(service, "127.0.0.1")
    host, port = "127.0.0.1", server.server_address[1]
    conns = []
    try:
        step_dir = owner / layout.step_dirname(1)
        manifest = layout.read_manifest(str(step_dir))
        client = peer_client.PeerClient(f"{host}:{port}", tls.client_context(ids["owner"], certs),
                                        expect=ids["holder"].fingerprint)
        client.put_replica("owner:0", str(step_dir), manifest, sorted(manifest.files))
        client.close()
        big = max(manifest.files, key=lambda n: manifest.files[n].size)
        data = (step_dir / big).read_bytes()
        file_path = f"/v1/replica/owner_0/1/{big}"

        def connect(who: str) -> http.client.HTTPSConnection:
            conn = http.client.HTTPSConnection(host, port, timeout=30, context=tls.client_context(ids[who], certs))
            conns.append(conn)
            return conn

        mine, kept = connect("owner"), connect("second")
        for conn in (mine, kept):  # both members: served, and the connections stay open
            status, body = _request(conn, "/v1/steps")
            assert status == 200 and json.loads(body)["replicas"]["owner_0"], (status, body)
            assert _request(conn, file_path) == (200, data)

        # The job is relaunched without the owner's node.
        service.configure(service.context, {ids[n].fingerprint: f"{n}:0" for n in names if n != "owner"})

        for path in ("/v1/steps", file_path):  # its open connection: no more answers, no byte of the file
            status, body = _request(mine, path)
            assert status in (403, "closed") and data not in body and b"owner_0" not in body, (path, status, body)
        assert _request(kept, file_path) == (200, data)  # a node still in the job is served on its own
        status, body = _request(connect("owner"), "/v1/steps")  # a new connection of the dropped node
        assert status in (403, "closed") and b"owner_0" not in body, (status, body)
    finally:
        for conn in conns:
            conn.close()
        server.shutdown()
        server.server_close()
