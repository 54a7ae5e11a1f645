"""Floods against the peer endpoint (loopback only): idle connections and replayed ClientHellos, from one
address, several, or the member's own, never keep a member from its replicas nor take the endpoint's CPU.

The endpoint runs in a process of its own (its CPU is measured there), the floods in others
(tests/programs/peer_flood.py), each for a few seconds, at the rates they can make on a busy machine (each
test prints the rate reached and checks a floor). A member's requests and ``put_replica`` calls go over
fresh connections throughout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch.nn as nn
from helpers import PROGRAMS
from peer_helpers import Job, _cpu_seconds

import shardckpt
from shardckpt.format import layout, replicas
from shardckpt.stores import admission, peer_client, tls

SERVE = """
import sys, time
from shardckpt.node import peer_server, peer_service
from shardckpt.stores import admission, tls
base, root, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
ids = {n: tls.node_identity(f"{base}/keys/{n}", f"{n}:0") for n in names}
certs = [i.cert_pem for i in ids.values()]
service = peer_service.PeerService(root, "holder:0", tls.server_context(ids["holder"], certs),
                                   {i.fingerprint: f"{n}:0" for n, i in ids.items()})
service.admission = admission.load(ids["holder"], certs)
server = peer_server.serve(service, "127.0.0.1")
print(server.server_address[1], flush=True)
sys.stdin.read()
"""
FLOOD_S = 3.0
"""Seconds each flood lasts (the member's work runs inside it)."""


@pytest.fixture(scope="module")
def holder(tmp_path_factory):
    """A holder's endpoint in its own process; the owner's committed step and the job's identities."""
    base = tmp_path_factory.mktemp("flood")
    job = Job(base)
    owner, root = base / "owner", base / "holder"
    with shardckpt.Checkpointer(local_dir=str(owner), preemption_signals=()) as ckpt:
        ckpt.save({"model": nn.Linear(64, 64), "b": nn.Linear(64, 32)}, 1)
    root.mkdir()
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(base), str(root), "owner,holder,second"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": src})
    try:
        port = int(proc.stdout.readline())
        yield job, owner, root, f"127.0.0.1:{port}", proc.pid
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait(timeout=30)


def _member(job, addr, who="owner"):
    return peer_client.PeerClient(addr, tls.client_context(job.ids[who], job.certs),
                                  expect=job.ids["holder"].fingerprint,
                                  admission=admission.load(job.ids[who], job.certs), timeout_s=10)


class _Member:
    """The owner's work during a flood: ``put_replica`` of its step and listings, each on fresh connections."""

    def __init__(self, job, owner, root, addr):
        self.job, self.root, self.addr = job, root, addr
        self.step_dir = str(owner / layout.step_dirname(1))
        self.manifest = layout.read_manifest(self.step_dir)
        self.names, _elsewhere = layout.copy_files(self.step_dir, self.manifest)
        self.puts, self.requests, self.errors = [0, 0], [0, 0], []

    def put(self):
        shutil.rmtree(self.root / replicas.REPLICAS_DIR, ignore_errors=True)  # sent whole again
        client = _member(self.job, self.addr)
        try:
            client.put_replica("owner:0", self.step_dir, self.manifest, self.names)
            self.puts[0] += 1
        except (peer_client.PeerError, OSError) as exc:
            self.errors.append(f"put_replica: {exc}")
        finally:
            self.puts[1] += 1
            client.close()

    def ask(self):
        client = _member(self.job, self.addr)
        try:
            client.list_steps()
            self.requests[0] += 1
        except (peer_client.PeerError, OSError) as exc:
            self.errors.append(f"list_steps: {exc}")
        finally:
            self.requests[1] += 1
            client.close()

    def work(self, puts=8, requests=20):
        """``puts`` put_replica and ``requests`` listings, spread over :data:`FLOOD_S`."""
        end = time.monotonic() + FLOOD_S
        for i in range(max(puts, requests)):
            if i < puts:
                self.put()
            if i < requests:
                self.ask()
            time.sleep(max(0.0, min(0.05, (end - time.monotonic()) / max(1, requests - i))))

    def check(self, what):
        print(f"{what}: put_replica {self.puts[0]}/{self.puts[1]}, requests {self.requests[0]}/{self.requests[1]}",
              self.errors[:2])
        assert self.puts[0] * 8 >= self.puts[1] * 7, (what, self.puts, self.errors[:3])
        assert self.requests[0] >= 0.95 * self.requests[1], (what, self.requests, self.errors[:3])


class _Flood:
    """Strangers flooding the endpoint from a process of their own (tests/programs/peer_flood.py), until the
    block ends (at most 60 s); ``result`` then holds what it did, ``rate`` its connections per second."""

    def __init__(self, kind, addr, sources, amount, rate=None):
        self.args = [sys.executable, str(PROGRAMS / "peer_flood.py"), kind, addr, ",".join(sources), str(amount), "60"]
        self.args += [] if rate is None else [str(rate)]

    def __enter__(self):
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.result = json.loads(self.proc.stdout.readline() or "{}")
        self.proc.wait(timeout=30)
        self.rate = self.result.get("opened", 0) / max(1e-3, self.result.get("seconds", 0))


@pytest.mark.parametrize("sources,rate,floor", [
    (["127.0.0.1"], 1000, 500),
    (["127.0.0.1"], 2000, 800),
    (["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"], 3000, 800),
], ids=["1-address-1000-per-s", "1-address-2000-per-s", "4-addresses-3000-per-s"])
def test_idle_connections_from_the_members_address_keep_no_member_out(holder, sources, rate, floor):
    """Strangers open connections that send nothing, from the member's own address (a local user of its
    host) and others, as fast as asked (at least ``floor`` per second reached; the rates are what a busy
    2-core machine makes beside the endpoint, the benchmark asks more): the member's put_replica over
    fresh connections succeeds ≥ 7/8 and its fresh requests ≥ 95 %."""
    job, owner, root, addr, _pid = holder
    member = _Member(job, owner, root, addr)
    with _Flood("idle", addr, sources, rate) as flood:
        time.sleep(0.5)  # the strangers' places taken first
        member.work()
    print(f"idle flood from {len(sources)} address(es): {flood.result}, {flood.rate:.0f}/s")
    assert flood.rate >= floor, f"the flood reached {flood.rate:.0f} connections/s only"
    member.check(f"idle flood {flood.rate:.0f}/s from {sources}")


@pytest.mark.parametrize("floods", [1, 8])
def test_clienthellos_replayed_from_the_members_address_keep_no_member_out(holder, floods):
    """One captured ClientHello replayed in a loop from the member's own address (1 and 8 floods at once):
    that address's handshake budget is the strangers', not the member's, whose work goes on as without it."""
    job, owner, root, addr, _pid = holder
    member = _Member(job, owner, root, addr)
    running = [_Flood("hello", addr, ["127.0.0.1"], 8) for _ in range(floods)]
    for flood in running:
        flood.__enter__()
    try:
        time.sleep(0.5)
        member.work()
    finally:
        for flood in running:
            flood.__exit__()
    sent, worked = sum(f.result["opened"] for f in running), sum(f.result["worked"] for f in running)
    print(f"{floods} flood(s) replaying a ClientHello: {sent} ({sum(f.rate for f in running):.0f}/s), "
          f"{worked} worked on")
    assert sent >= 300
    member.check(f"ClientHello replay, {floods} flood(s)")


WINDOW_S = 4.0
"""The floods' CPU share is measured over this window: the budget lends ahead a fifth of a second's share and
what a round overran is paid back (the loop stops while the share is spent), so over 4 s the endpoint takes at
most 0.25 * (4 + 0.2) s, 26 % of a core, and one round's overrun. (Over 2.5 s, with a second's worth lent, a
debt of over a second forgiven and pending connections worked on during a pause, a loaded machine once saw
47 %.)"""


def test_handshakes_replayed_from_64_addresses_take_a_bounded_share_of_a_core(holder):
    """A ClientHello replayed round 64 addresses (127.0.1.1-64) at the rate of the attack this budget is for
    (each address at the per-address handshake budget, 20/s: 1,280/s in all, where the endpoint once spent
    65 % of a core): the strangers' handshakes share one CPU budget, so the flood keeps the endpoint's
    process ≤ 35 % of a core (measured while only the flood runs: a member's own replicas are work the
    endpoint is there for) and the member is served. (A flood as fast as the endpoint answers is not
    bounded so: accepting and closing its connections is work no budget sheds; see the security page.)"""
    job, owner, root, addr, pid = holder
    member = _Member(job, owner, root, addr)
    sources = [f"127.0.1.{i}" for i in range(1, 65)]
    with _Flood("hello", addr, sources, 64, rate=1280) as flood:
        time.sleep(1.0)  # every address's burst spent: the share is measured from here
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        time.sleep(WINDOW_S)
        cpu, wall = _cpu_seconds(pid) - cpu0, time.monotonic() - t0
        member.work(puts=2, requests=20)
    print(f"handshake replay from 64 addresses: {flood.result} ({flood.rate:.0f}/s); the endpoint used {cpu:.2f} s "
          f"of CPU in {wall:.1f} s ({cpu / wall:.0%} of a core)")
    assert flood.result["opened"] >= 500
    assert cpu / wall <= 0.35, f"the endpoint took {cpu / wall:.0%} of a core"
    member.check("ClientHello replay from 64 addresses")


def test_a_closed_loop_replay_from_64_addresses_keeps_the_endpoint_within_its_share(holder):
    """A ClientHello replayed round 64 addresses in a closed loop: 4 flood processes keep 64 connections in
    flight each and open a new one as soon as the endpoint closed one — as fast as the endpoint answers
    (13,267/s on a quiet machine, where the endpoint once spent 94 % of a core accepting, sorting and closing
    them, no handshake budget shedding that work). Strangers' connections share one measured budget of a core
    (their handshakes and the loop's accepting, sorting and closing): over it, the endpoint's loop stops
    (no connection taken from the kernel's queue, no pending one worked on) until it refills. Its process then
    stays ≤ 35 % of a core (25 % configured; measured while only the flood runs), and the member, whose fresh
    connections wait behind at most the flood's 256, is served."""
    job, owner, root, addr, pid = holder
    member = _Member(job, owner, root, addr)
    sources = [f"127.0.1.{i}" for i in range(1, 65)]
    running = [_Flood("hello", addr, sources, 64) for _ in range(4)]
    for flood in running:
        flood.__enter__()
    try:
        time.sleep(1.0)  # the budget's burst spent: the share is measured from here
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        time.sleep(WINDOW_S)
        cpu, wall = _cpu_seconds(pid) - cpu0, time.monotonic() - t0
        member.work()
    finally:
        for flood in running:
            flood.__exit__()
    sent, rate = sum(f.result["opened"] for f in running), sum(f.rate for f in running)
    print(f"closed-loop replay from 64 addresses: {sent} connections ({rate:.0f}/s), "
          f"{sum(f.result['worked'] for f in running)} worked on; the endpoint used {cpu:.2f} s of CPU in "
          f"{wall:.1f} s ({cpu / wall:.0%} of a core)")
    assert sent >= 1000, f"the flood opened {sent} connections only"
    assert cpu / wall <= 0.35, f"the endpoint took {cpu / wall:.0%} of a core"
    member.check("closed-loop ClientHello replay from 64 addresses")
