"""The peer endpoint under floods, and what a member's fresh connection costs with its admission token.

    python benchmarks/bench_peer_flood.py [--seconds 3] [--baseline e80985a] [--floods-on this|baseline]
                                          [--only TEXT] [--cost-only] [--json FILE]

A holder's endpoint runs in a process of its own (``shardckpt.node.peer_server``
with the members' admission keys); strangers flood it from processes of their
own (``tests/programs/peer_flood.py``, loopback addresses 127.0.0.0/8) while
a member (the owner node, from 127.0.0.1) works over fresh connections:
``put_replica`` of its step 8 times and 40 listings, each on new connections
(``PeerClient``, its token sent first), and 40 bare fresh connections (TCP,
token, TLS handshake, one request; no retry).

Floods (each for ``--seconds`` after a 0.5 s head start; the rate asked and
the rate reached are printed: the flood processes share the machine):

  idle 1 address 1000/s, 3000/s    TCP connections that send nothing, from the member's own address
  idle 4 addresses 6000/s          the same round 127.0.0.1-4
  ClientHello replay x1, x8        one captured ClientHello replayed from the member's own address
                                   (1 and 8 flood processes, 8 connections in flight each)
  handshakes from 64 addresses     a ClientHello replayed round 127.0.1.1-64 (4 processes, 64 in
                                   flight each), at 20/s from each address (1,280/s in all), then in a
                                   closed loop (a new connection as soon as the endpoint closed one: as
                                   fast as the endpoint answers)

The endpoint process's share of a core is measured twice per flood: over 2 s
while only the flood runs, then while the member works (its own replicas are
work the endpoint is there for). ``--only TEXT`` runs the floods whose name
contains TEXT.

Cost of a member's fresh connection (``fresh connection``): TCP connect, the
token, the mutual TLS 1.3 handshake and one listing, 200 times in a row, with
the token (this endpoint) against the same on the endpoint of ``--baseline``
(a commit of this repository, checked out with ``git archive`` into a
temporary directory: the endpoint as it was; without a token when that
commit had none, e80985a, with its token otherwise), ``--connections`` of
each in turn — in the same run, as ratios: of the median wall time per
connection, and of the endpoint's CPU per connection. ``--floods-on
baseline`` floods the baseline's endpoint instead (members with their tokens
when it takes them): the figures before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOOD = REPO / "tests" / "programs" / "peer_flood.py"
SERVE = """
import sys
from shardckpt.node import peer_server, peer_service
from shardckpt.stores import tls
base, root, names, tokens = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4] == "1"
ids = {n: tls.node_identity(f"{base}/keys/{n}", f"{n}:0") for n in names}
certs = [i.cert_pem for i in ids.values()]
service = peer_service.PeerService(root, "holder:0", tls.server_context(ids["holder"], certs),
                                   {i.fingerprint: f"{n}:0" for n, i in ids.items()})
if tokens:
    from shardckpt.stores import admission
    service.admission = admission.load(ids["holder"], certs)
server = peer_server.serve(service, "127.0.0.1")
print(server.server_address[1], flush=True)
sys.stdin.read()
"""


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Endpoint:
    def __init__(self, src: Path, base: Path, root: Path, tokens: bool) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, str(base), str(root), "owner,holder,second",
                                      "1" if tokens else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "PYTHONPATH": str(src)})
        self.addr = f"127.0.0.1:{int(self.proc.stdout.readline())}"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()


class Flood:
    def __init__(self, kind: str, addr: str, sources: list[str], amount: float, processes: int = 1,
                 rate: float | None = None) -> None:
        command = [sys.executable, str(FLOOD), kind, addr, ",".join(sources), str(amount), "120"]
        command += [] if rate is None else [str(rate / processes)]
        self.procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for _ in range(processes)]

    def stop(self) -> dict:
        results = []
        for proc in self.procs:
            proc.stdin.close()
        for proc in self.procs:
            results.append(json.loads(proc.stdout.readline() or "{}"))
            proc.wait()
        opened = sum(r.get("opened", 0) for r in results)
        seconds = max(r.get("seconds", 1e-3) for r in results)
        return {"opened": opened, "rate": round(opened / seconds), "worked": sum(r.get("worked", 0) for r in results)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cost-only", action="store_true", help="the connection cost only, no flood")
    parser.add_argument("--baseline", default="e80985a",
                        help="commit whose endpoint the connection cost is compared with")
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--floods-on", choices=("this", "baseline"), default="this",
                        help="flood this endpoint (members with tokens) or the baseline's (the figures before)")
    parser.add_argument("--only", help="the floods whose name contains this text only")
    parser.add_argument("--json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "tests"))
    import torch.nn as nn
    from peer_helpers import Job

    import shardckpt
    from shardckpt.format import layout, replicas
    from shardckpt.stores import admission, peer_client, tls

    work = Path(tempfile.mkdtemp(prefix="bench-peer-flood-"))
    figures: dict = {"commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                              capture_output=True, text=True).stdout.strip(), "floods": []}
    endpoints = []
    try:
        job = Job(work)
        owner, root = work / "owner", work / "holder"
        with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
            ckpt.save({"model": nn.Linear(64, 64), "b": nn.Linear(64, 32)}, 1)
        root.mkdir()
        step_dir = str(owner / layout.step_dirname(1))
        manifest = layout.read_manifest(step_dir)
        names, _ = layout.copy_files(step_dir, manifest)
        keys = admission.load(job.ids["owner"], job.certs)
        holder_fp = job.ids["holder"].fingerprint
        context = tls.client_context(job.ids["owner"], job.certs)

        def client(addr, tokens=True):
            return peer_client.PeerClient(addr, context, expect=holder_fp, admission=keys if tokens else None,
                                          timeout_s=10)

        def bare(addr, tokens=True):
            """One fresh connection, no retry: TCP, token, TLS, one listing."""
            import http.client
            host, port = addr.rsplit(":", 1)
            conn = peer_client._PinnedConnection(host, int(port), timeout=10, context=context)
            conn.pinned, conn.admission = holder_fp, keys if tokens else None
            try:
                conn.request("GET", "/v1/steps")
                resp = conn.getresponse()
                resp.read()
                return resp.status == 200
            except (OSError, http.client.HTTPException, peer_client.PeerError):
                return False
            finally:
                conn.close()

        def member(addr, tokens=True):
            puts = requests = fresh = 0
            for i in range(40):
                if i < 8:
                    shutil.rmtree(root / replicas.REPLICAS_DIR, ignore_errors=True)
                    c = client(addr, tokens)
                    try:
                        c.put_replica("owner:0", step_dir, manifest, names)
                        puts += 1
                    except (peer_client.PeerError, OSError):
                        pass
                    c.close()
                c = client(addr, tokens)
                try:
                    c.list_steps()
                    requests += 1
                except (peer_client.PeerError, OSError):
                    pass
                c.close()
                fresh += bare(addr, tokens)
                time.sleep(args.seconds / 40)
            return {"put_replica": f"{puts}/8", "requests": f"{requests}/40", "bare fresh connections": f"{fresh}/40"}

        print(f"figures at {figures['commit']} (endpoint in its own process; floods in their own processes)")
        # A member's fresh connection: with its token here, without one on the baseline's endpoint.
        old_src = work / "baseline"
        old_src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "src"], capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(old_src)], input=archive.stdout, check=True)
        # A baseline with admission tokens (a commit from the tokens on) takes its members' tokens, as here.
        old_tokens = (old_src / "src" / "shardckpt" / "stores" / "admission.py").exists()
        old = Endpoint(old_src / "src", work, root, old_tokens)
        endpoints.append(old)
        holder = Endpoint(REPO / "src", work, root, True)
        endpoints.append(holder)
        # One connection of each in turn (the machine's load drifts alike for both), the median of each kept;
        # the endpoints' CPU over the whole run, per connection.
        walls: dict = {"baseline": [], "token": []}
        cpu0 = {"baseline": cpu_seconds(old.proc.pid), "token": cpu_seconds(holder.proc.pid)}
        for _ in range(args.connections):
            for label, addr, tokens in (("baseline", old.addr, old_tokens), ("token", holder.addr, True)):
                t0 = time.monotonic()
                if bare(addr, tokens):
                    walls[label].append(time.monotonic() - t0)
        cpu = {"baseline": cpu_seconds(old.proc.pid) - cpu0["baseline"],
               "token": cpu_seconds(holder.proc.pid) - cpu0["token"]}
        median = {k: sorted(v)[len(v) // 2] for k, v in walls.items()}
        per = {k: cpu[k] / max(1, len(walls[k])) for k in walls}
        ratio_wall, ratio_cpu = median["token"] / median["baseline"], per["token"] / max(1e-9, per["baseline"])
        figures["fresh_connection"] = {
            "baseline": args.baseline, "connections": {k: len(v) for k, v in walls.items()},
            "ms_baseline": round(median["baseline"] * 1e3, 2), "ms_token": round(median["token"] * 1e3, 2),
            "ratio_wall": round(ratio_wall, 3), "endpoint_cpu_ms_baseline": round(per["baseline"] * 1e3, 3),
            "endpoint_cpu_ms_token": round(per["token"] * 1e3, 3), "ratio_endpoint_cpu": round(ratio_cpu, 3)}
        f = figures["fresh_connection"]
        print(f"  a member's fresh connection (TCP, token, TLS 1.3, one listing; {args.connections} of each in turn, "
              f"medians): "
              f"{f['ms_token']} ms with its token vs {f['ms_baseline']} ms on {args.baseline}'s endpoint "
              f"({ratio_wall:.2f}x wall); endpoint CPU {f['endpoint_cpu_ms_token']} vs "
              f"{f['endpoint_cpu_ms_baseline']} ms ({ratio_cpu:.2f}x)")
        for endpoint in (holder, old):
            endpoint.close()
            endpoints.remove(endpoint)
        # A fresh endpoint (no budget spent before the floods): this one, or the baseline's (``--floods-on``).
        tokens = args.floods_on == "this" or old_tokens
        holder = Endpoint(REPO / "src" if args.floods_on == "this" else old_src / "src", work, root, tokens)
        endpoints.append(holder)
        figures["floods_on"] = "this endpoint" if args.floods_on == "this" else \
            f"{args.baseline}'s endpoint (members {'with their tokens' if tokens else 'send no token'})"
        print(f"floods on {figures['floods_on']}:")
        cases = [("idle, 1 address, 1000/s", "idle", ["127.0.0.1"], 1000, 1),
                 ("idle, 1 address, 3000/s", "idle", ["127.0.0.1"], 3000, 1),
                 ("idle, 4 addresses, 6000/s", "idle", [f"127.0.0.{i}" for i in range(1, 5)], 6000, 1),
                 ("ClientHello replay from the member's address, x1", "hello", ["127.0.0.1"], 8, 1),
                 ("ClientHello replay from the member's address, x8", "hello", ["127.0.0.1"], 8, 8),
                 ("handshakes from 64 addresses, 20/s each", "hello", [f"127.0.1.{i}" for i in range(1, 65)], 64, 4,
                  1280),
                 ("handshakes from 64 addresses, closed loop", "hello", [f"127.0.1.{i}" for i in range(1, 65)], 64,
                  4)]
        for name, kind, sources, amount, processes, *rate in [] if args.cost_only else cases:
            if args.only and args.only not in name:
                continue
            flood = Flood(kind, holder.addr, sources, amount, processes, *rate)
            time.sleep(0.5)
            # The endpoint's share of a core while only the flood runs (the members' work is the endpoint's job).
            cpu0, t0 = cpu_seconds(holder.proc.pid), time.monotonic()
            time.sleep(2.0)
            alone = (cpu_seconds(holder.proc.pid) - cpu0) / (time.monotonic() - t0)
            cpu0, t0 = cpu_seconds(holder.proc.pid), time.monotonic()
            done = member(holder.addr, tokens)
            cpu, wall = cpu_seconds(holder.proc.pid) - cpu0, time.monotonic() - t0
            result = flood.stop()
            row = {"flood": name, **done, "flood_rate_reached": result["rate"], "worked_on": result["worked"],
                   "endpoint_cpu_share_flood_only": round(alone, 3), "endpoint_cpu_share": round(cpu / wall, 3),
                   "seconds": round(wall, 1)}
            figures["floods"].append(row)
            print(f"  {name:52s} put_replica {done['put_replica']}, requests {done['requests']}, bare fresh "
                  f"connections {done['bare fresh connections']}; flood reached {result['rate']}/s; endpoint "
                  f"{alone:.0%} of a core with the flood alone, {cpu / wall:.0%} with the member over {wall:.1f} s")
            time.sleep(1.0)

    finally:
        for endpoint in endpoints:
            endpoint.close()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
