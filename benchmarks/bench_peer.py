"""The peer tier: a replica transfer against a raw socket copy, and a node's restore from a peer, S3, its disk.

    python benchmarks/bench_peer.py --gib 0.25 --repeats 3 [--dir DIR] [--json FILE]

One process; the peer endpoint (``shardckpt.node.peer_service``) of a holder directory
serves on 127.0.0.1 in a thread, moto's S3 server runs in its own process. A
state of ``--gib`` fp32 is saved once by shardckpt (the owner node's step).

Group ``replica`` (time to peer-durable: what the owner's daemon spends on one
step, a SIGTERM step included):

  raw socket copy (floor)   every file of the step over one plain TCP connection on loopback, written
                            and fsynced on the receiving side (no hashing, no HTTP, no encryption)
  raw TLS socket copy       the same over one mutual TLS 1.3 connection (the nodes' P-256 certificates,
                            pinned): what the encryption alone costs
  shardckpt replica (TLS)   ``PeerClient.put_replica``: HTTPS requests on kept mutual TLS 1.3 connections,
                            one per file in flight (up to 4), the owner's xxh3 checksum checked on the
                            holder, fsynced, committed manifest last
  xxh3 of the bytes         the manifest checksum alone, once

Group ``restore`` (a node lost, its replacement restores at the same world size):

  local disk (floor)        ``Checkpointer(local_dir=owner).load``: the node kept its disk
  from a peer               an empty ``local_dir``: its files taken from the holder's replica over the
                            endpoint through the restore's own step view (``restoring/views.py``:
                            ``PeerStore``, one connection per file in flight, each file checked), then
                            ``load``
  from S3 (moto)            an empty ``local_dir`` restoring from ``remote=s3://...``

Every restore loads into zeroed parameters and is compared with the saved state.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import struct
import sys
import threading
import time

import torch

import common  # noqa: E402  (puts src/ on sys.path)
import shardckpt  # noqa: E402
from shardckpt.format import layout
from shardckpt.format import replicas  # noqa: E402
from shardckpt.node import peer_server, peer_service  # noqa: E402
from shardckpt.restoring import views  # noqa: E402
from shardckpt.stores import peer_client, tls  # noqa: E402
from shardckpt.stores.peer import PeerStore  # noqa: E402
from shardckpt.tiers.steps import StepView  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

CHUNK = 1 << 20


class RawSink:
    """A TCP (or TLS) receiver on loopback: (name length, name, size, bytes)* then a zero length per
    connection, each file fsynced, answered by one byte."""

    def __init__(self, dest: str, server_ctx=None, client_ctx=None) -> None:
        self.dest = dest
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server_ctx, self.client_ctx = server_ctx, client_ctx
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
                if self.server_ctx is not None:
                    conn = self.server_ctx.wrap_socket(conn, server_side=True)
            except OSError:
                return
            with conn, conn.makefile("rb") as r:
                while (head := r.read(4)) and struct.unpack("!I", head)[0]:  # a zero length ends the batch
                    name = r.read(struct.unpack("!I", head)[0]).decode()
                    left = struct.unpack("!Q", r.read(8))[0]
                    with open(os.path.join(self.dest, name), "wb") as f:
                        while left:
                            chunk = r.read(min(CHUNK, left))
                            f.write(chunk)
                            left -= len(chunk)
                        f.flush()
                        os.fsync(f.fileno())
                conn.sendall(b"k")

    def send(self, step_dir: str, names: list[str]) -> None:
        s = socket.create_connection(("127.0.0.1", self.port))
        if self.client_ctx is not None:
            s = self.client_ctx.wrap_socket(s)
        with s:
            for name in names:
                path = os.path.join(step_dir, name)
                s.sendall(struct.pack("!I", len(name)) + name.encode() + struct.pack("!Q", os.path.getsize(path)))
                with open(path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        s.sendall(chunk)
            s.sendall(struct.pack("!I", 0))
            if s.recv(1) != b"k":
                raise RuntimeError("the sink did not confirm the files")

    def close(self) -> None:
        self.sock.close()


def hash_files(step_dir: str, names: list[str], make) -> None:
    for name in names:
        h = make()
        with open(os.path.join(step_dir, name), "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)


def main() -> None:
    args = common.sized_args(__doc__, "timed runs per tool (default 3)")
    common.require_memory(3 * args.gib * common.GIB, f"a {args.gib} GiB state, moto's copy and a restore")
    from s3server import BUCKET, apply_env, restore_env, start_server

    from shardckpt import stores
    from shardckpt.node import uploader

    model, state, nbytes = common.sized_state(args.gib)
    saved = common.fingerprint(model)
    result = common.new_result("peer", nbytes, repeats=args.repeats)
    server = start_server("moto")
    server.reset()
    previous = apply_env(server)
    with common.scratch("peer", args.dir) as tmp:
        owner, holder = str(tmp / "owner"), str(tmp / "holder")
        with shardckpt.Checkpointer(local_dir=owner, preemption_signals=()) as ckpt:
            ckpt.save(state, 1)
        step_dir = os.path.join(owner, layout.step_dirname(1))
        manifest = layout.read_manifest(step_dir)
        names = layout.copy_files(step_dir, manifest)[0]
        os.makedirs(holder)
        ids = {n: tls.node_identity(str(tmp / "keys" / n), f"{n}:0") for n in ("owner", "holder")}
        certs = [i.cert_pem for i in ids.values()]
        server_ctx = tls.server_context(ids["holder"], certs)
        client_ctx = tls.client_context(ids["owner"], certs)
        members = {ids["owner"].fingerprint: "bench:0", ids["holder"].fingerprint: "holder:0"}
        service = peer_service.PeerService(holder, "holder:0", server_ctx, members)
        endpoint = peer_server.serve(service, "127.0.0.1")
        client = peer_client.PeerClient(f"127.0.0.1:{endpoint.server_address[1]}", client_ctx,
                                        expect=ids["holder"].fingerprint)
        sink_dir = str(tmp / "sink")
        sink = RawSink(sink_dir)
        tls_sink = RawSink(sink_dir, server_ctx, client_ctx)
        url = f"s3://{BUCKET}/benchpeer"
        store = stores.open_store(url, shardckpt.CheckpointConfig(local_dir=owner).transfer_options())
        assert uploader.Uploader(owner, store, node="owner:0", once=True, poll_s=0.05).run() == 0
        store.close()
        service.members[ids["owner"].fingerprint] = "owner:0"  # the owner writes its replica, which a
        client.put_replica("owner:0", step_dir, manifest, names)  # replacement node reads back below
        service.members[ids["owner"].fingerprint] = "bench:0"  # then the timed transfers, as node bench:0
        try:
            fresh_replica = lambda: shutil.rmtree(os.path.join(replicas.replicas_root(holder), "bench_0"),  # noqa: E731
                                                  ignore_errors=True)
            rows = common.compare(result, [
                common.Tool("raw socket copy (floor)", lambda: sink.send(step_dir, names),
                            before=lambda: common.fresh_dir(sink_dir), floor=True),
                common.Tool("raw TLS socket copy", lambda: tls_sink.send(step_dir, names),
                            before=lambda: common.fresh_dir(sink_dir)),
                common.Tool("shardckpt replica (TLS)", lambda: client.put_replica("bench:0", step_dir, manifest, names),
                            before=fresh_replica),
                common.Tool("xxh3 of the bytes", lambda: hash_files(
                    step_dir, names, lambda: layout.Checksum.like(manifest.files[names[0]].checksum))),
            ], args.repeats, group="replica")
            for row in rows:
                row["extra"]["s_per_gib"] = common.GIB / nbytes * statistics.median(row["values"])
            common.add_rate(rows, nbytes)

            def zero() -> None:
                with torch.no_grad():
                    for p in model.parameters():
                        p.zero_()

            def check() -> None:
                if common.fingerprint(model) != saved:
                    raise RuntimeError("the restored state differs from the saved one")

            target = str(tmp / "replacement")

            def empty() -> None:
                zero()
                common.fresh_dir(target)

            version = layout.version_of(manifest)

            def from_peer() -> None:
                store = PeerStore(peer_client.PeerClient(client.addr, client_ctx, expect=client.expect), "owner:0")
                offered = views.manifest_on(store, 1, version, where="the holder's replica")
                copy = views.CopyFill(target, 1, version, stale=False)
                copy.fill([views.View("peer", "the holder's replica", StepView(store, offered))])
                copy.commit()
                store.close()
                with shardckpt.Checkpointer(local_dir=target, preemption_signals=()) as c:
                    c.load(state)

            def from_s3() -> None:
                with shardckpt.Checkpointer(local_dir=target, remote=url, uploader="off", preemption_signals=()) as c:
                    c.load(state)

            def from_disk() -> None:
                with shardckpt.Checkpointer(local_dir=owner, preemption_signals=()) as c:
                    c.load(state)

            rows = common.compare(result, [
                common.Tool("local disk (floor)", from_disk, before=zero, after=check, floor=True),
                common.Tool("from a peer", from_peer, before=empty, after=check),
                common.Tool("from S3 (moto)", from_s3, before=empty, after=check),
            ], args.repeats, group="restore")
            for row in rows:
                row["extra"]["s_per_gib"] = common.GIB / nbytes * statistics.median(row["values"])
        finally:
            sink.close()
            tls_sink.close()
            endpoint.shutdown()
            endpoint.server_close()
            restore_env(previous)
            server.stop()
    result["notes"].append("The page cache is warm in every run (the step's files were just written); 2 shared "
                           "cores: see the spread.")
    common.emit(result, args.json)


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"({time.monotonic() - started:.0f} s)")
