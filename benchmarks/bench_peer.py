"""The peer tier: a replica transfer against a raw socket copy, and a node's restore from a peer, S3, its disk.

    python benchmarks/bench_peer.py --gib 0.25 --repeats 3 [--dir DIR] [--json FILE]

The receiving side runs in a process of its own, as a holder's daemon does:
the peer endpoint (``shardckpt.node.peer_server``) serving a holder
directory, and the raw sinks the transfers are compared with; moto's S3
server runs in its own process too. A state of ``--gib`` fp32 is saved once
by shardckpt (the owner node's step).

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
The CPU seconds of the receiving process (``cpu_s``) and of the sending one (``cpu_here_s``; for a
restore, the one restoring) are reported per tool: what the work costs whatever else shares the cores.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import common  # noqa: E402  (puts src/ on sys.path)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

CHUNK = 1 << 20


class RawSink:
    """A TCP (or TLS) receiver on loopback: (name length, name, size, bytes)* then a zero length per
    connection, each file fsynced, answered by one byte."""

    def __init__(self, dest: str, server_ctx=None) -> None:
        self.dest = dest
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server_ctx = server_ctx
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


def send_raw(port: int, step_dir: str, names: list[str], client_ctx=None) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    if client_ctx is not None:
        s = client_ctx.wrap_socket(s)
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


def hash_files(step_dir: str, names: list[str], make) -> None:
    for name in names:
        h = make()
        with open(os.path.join(step_dir, name), "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)


def receiver_main(spec_path: str) -> None:
    """The receiving process: the holder's endpoint and the two raw sinks; writes their ports, answers
    ``cpu`` on stdin with its CPU seconds so far."""
    from shardckpt.node import peer_server, peer_service
    from shardckpt.stores import tls

    with open(spec_path) as f:
        spec = json.load(f)
    holder = tls.load_identity(spec["cert"], spec["key"])
    server_ctx = tls.server_context(holder, spec["trusted"])
    service = peer_service.PeerService(spec["holder"], "holder:0", server_ctx, spec["members"])
    endpoint = peer_server.serve(service, "127.0.0.1")
    plain, secure = RawSink(spec["sink"]), RawSink(spec["sink"], server_ctx)
    print(json.dumps({"endpoint": endpoint.server_address[1], "raw": plain.port, "tls": secure.port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            t = os.times()
            print(json.dumps({"cpu": t.user + t.system}), flush=True)
        else:
            break
    endpoint.shutdown()


class Receiver:
    """The receiving process, started once for the run."""

    def __init__(self, spec: dict, tmp) -> None:
        path = os.path.join(str(tmp), "receiver.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receiver", path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ports = json.loads(self.proc.stdout.readline())

    def cpu(self) -> float:
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["cpu"]

    def close(self) -> None:
        try:
            self.proc.stdin.write("end\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def with_cpu(receiver: Receiver, fn):
    """``fn`` timed, with the CPU seconds of the receiving process (``cpu_s``) and of this one (``cpu_here_s``)
    during it: what the work costs whatever else the shared cores run."""
    def run() -> common.Measured:
        c0, h0 = receiver.cpu(), os.times()
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        h1 = os.times()
        return common.Measured(took, {"cpu_s": receiver.cpu() - c0,
                                      "cpu_here_s": h1.user + h1.system - h0.user - h0.system})

    return run


def main() -> None:
    import torch

    import shardckpt
    from shardckpt.format import layout, replicas
    from shardckpt.restoring import views
    from shardckpt.steps import StepView
    from shardckpt.stores import peer_client, tls
    from shardckpt.stores.peer import PeerStore

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
        version = layout.version_of(manifest)
        names = layout.copy_files(step_dir, manifest)[0]
        os.makedirs(holder)
        ids = {n: tls.node_identity(str(tmp / "keys" / n), f"{n}:0") for n in ("owner", "bench", "holder")}
        certs = [i.cert_pem for i in ids.values()]
        owner_ctx = tls.client_context(ids["owner"], certs)
        bench_ctx = tls.client_context(ids["bench"], certs)
        sink_dir = str(tmp / "sink")
        os.makedirs(sink_dir)
        receiver = Receiver({"holder": holder, "sink": sink_dir, "cert": ids["holder"].cert_path,
                             "key": ids["holder"].key_path, "trusted": certs,
                             "members": {ids["owner"].fingerprint: "owner:0", ids["bench"].fingerprint: "bench:0"}},
                            tmp)
        addr = f"127.0.0.1:{receiver.ports['endpoint']}"
        url = f"s3://{BUCKET}/benchpeer"
        store = stores.open_store(url, shardckpt.CheckpointConfig(local_dir=owner).transfer_options())
        assert uploader.Uploader(owner, store, node="owner:0", once=True, poll_s=0.05).run() == 0
        store.close()
        expect = ids["holder"].fingerprint
        # The owner's replica, which a replacement node reads back below; the timed transfers go as node bench:0.
        peer_client.PeerClient(addr, owner_ctx, expect=expect).put_replica("owner:0", step_dir, manifest, names)
        client = peer_client.PeerClient(addr, bench_ctx, expect=expect)
        try:
            fresh_replica = lambda: shutil.rmtree(os.path.join(replicas.replicas_root(holder), "bench_0"),  # noqa: E731
                                                  ignore_errors=True)
            rows = common.compare(result, [
                common.Tool("raw socket copy (floor)",
                            with_cpu(receiver, lambda: send_raw(receiver.ports["raw"], step_dir, names)),
                            before=lambda: common.fresh_dir(sink_dir), floor=True),
                common.Tool("raw TLS socket copy",
                            with_cpu(receiver, lambda: send_raw(receiver.ports["tls"], step_dir, names, bench_ctx)),
                            before=lambda: common.fresh_dir(sink_dir)),
                common.Tool("shardckpt replica (TLS)",
                            with_cpu(receiver, lambda: client.put_replica("bench:0", step_dir, manifest, names)),
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

            def from_peer() -> None:
                peer = PeerStore(peer_client.PeerClient(addr, owner_ctx, expect=expect), "owner:0")
                copy = views.CopyFill(target, 1, version, stale=False)
                copy.fill([views.View("peer", "the holder's replica",
                                      StepView(peer, views.manifest_on(peer, 1, version, where="the replica")))])
                copy.commit()
                peer.close()
                with shardckpt.Checkpointer(local_dir=target, preemption_signals=()) as c:
                    c.load(state)

            def from_s3() -> None:
                with shardckpt.Checkpointer(local_dir=target, remote=url, uploader="off", preemption_signals=()) as c:
                    c.load(state)

            def from_disk() -> None:
                with shardckpt.Checkpointer(local_dir=owner, preemption_signals=()) as c:
                    c.load(state)

            rows = common.compare(result, [
                common.Tool("local disk (floor)", with_cpu(receiver, from_disk), before=zero, after=check, floor=True),
                common.Tool("from a peer", with_cpu(receiver, from_peer), before=empty, after=check),
                common.Tool("from S3 (moto)", with_cpu(receiver, from_s3), before=empty, after=check),
            ], args.repeats, group="restore")
            for row in rows:
                row["extra"]["s_per_gib"] = common.GIB / nbytes * statistics.median(row["values"])
        finally:
            client.close()
            receiver.close()
            restore_env(previous)
            server.stop()
    result["notes"].append("The page cache is warm in every run (the step's files were just written); the "
                           "receiving side (endpoint, sinks) runs in a process of its own, cpu_s its CPU seconds; "
                           "2 shared cores: see the spread.")
    common.emit(result, args.json)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--receiver":
        receiver_main(sys.argv[2])
        sys.exit(0)
    started = time.monotonic()
    main()
    print(f"({time.monotonic() - started:.0f} s)")
