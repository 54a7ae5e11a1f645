"""The peer endpoint's doorway, on real loopback sockets in this process: the strangers' places per source
address and the strangers' share of a core are each a bound a test breaks when the bound is removed, and an
endpoint whose strangers are over their share stops its loop (no connection taken from the kernel's queue) until
it refills.

The flood tests (tests/jobs/test_peer_flood.py) show a member served through floods; on two shared cores
their flood processes cannot send enough handshakes to pass the CPU share, nor do members need a stranger's
place (they come with a token). These tests check the two bounds themselves.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time

import pytest
from peer_helpers import Job

from shardckpt.node import peer_admission
from shardckpt.node.peer_admission import HANDSHAKE_PART, PENDING_PER_SOURCE, STRANGER_CPU_SHARE, Doorway
from shardckpt.stores import admission, peer_client, tls


@pytest.fixture
def door():
    listener = socket.create_server(("127.0.0.1", 0))
    sel = selectors.DefaultSelector()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    notes: list[str] = []
    doorway = Doorway(sel, lambda: context, lambda: None, notes.append, lambda pending: None)
    clients: list[socket.socket] = []

    def connect(source: str, send: bytes = b"") -> socket.socket:
        """A client connection accepted by the doorway as coming from ``source`` (what it sent first)."""
        client = socket.create_connection(listener.getsockname())
        clients.append(client)
        if send:
            client.sendall(send)
        conn, _addr = listener.accept()
        if send:
            deadline = time.monotonic() + 5
            while not select_readable(conn) and time.monotonic() < deadline:
                time.sleep(0.01)
        doorway.admit(conn, source)
        return client

    yield doorway, connect, notes
    doorway.close_all()
    for client in clients:
        client.close()
    sel.close()
    listener.close()


def select_readable(conn: socket.socket) -> bool:
    with selectors.DefaultSelector() as probe:
        probe.register(conn, selectors.EVENT_READ)
        return bool(probe.select(0))


def closed_by_server(client: socket.socket) -> bool:
    client.settimeout(0.5)  # the doorway closes synchronously: a closed connection reads EOF at once
    try:
        return client.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_one_address_holds_at_most_its_share_of_the_strangers_places_and_its_oldest_gives_way(door):
    doorway, connect, notes = door
    other = connect("192.0.2.7")  # an idle connection of another address, opened first
    flood = [connect("192.0.2.1") for _ in range(PENDING_PER_SOURCE + 5)]  # idle: no byte sent
    counts = doorway.counts()
    assert counts["by_source"]["192.0.2.1"] == PENDING_PER_SOURCE, counts
    assert counts["by_source"]["192.0.2.7"] == 1, counts  # the other address keeps its place
    assert all(closed_by_server(c) for c in flood[:5]), "the flood's oldest connections give way"
    assert not closed_by_server(flood[-1]), "the newcomer keeps its place"
    assert not closed_by_server(other)
    assert any(f"{PENDING_PER_SOURCE} strangers' connections pending from 192.0.2.1" in n for n in notes), notes


CLIENT_HELLO_START = b"\x16\x03\x01\x00\xc8\x01\x00\x00\xc4\x03\x03"
"""The first bytes of a TLS ClientHello: a stranger's handshake (no admission token before it)."""


def test_strangers_handshakes_stop_once_they_took_their_share_of_a_core(door):
    doorway, connect, notes = door
    fresh = connect("198.51.100.1", CLIENT_HELLO_START)
    assert doorway.counts()["all"] == 1, "a stranger's handshake is begun while the strangers' CPU is not spent"
    doorway.handshake_cpu.charge(STRANGER_CPU_SHARE, time.monotonic())  # strangers' handshakes took more than theirs
    late = connect("198.51.100.2", CLIENT_HELLO_START)  # another address: its own budget is untouched
    assert closed_by_server(late)
    assert doorway.counts()["all"] == 1, doorway.counts()
    assert any(f"strangers' handshakes took {STRANGER_CPU_SHARE * HANDSHAKE_PART:.1%} of a core" in n for n in notes), \
        notes
    assert not doorway.cpu.spent(time.monotonic())  # the loop's share was not: the rest of it sorts connections
    assert not closed_by_server(fresh)


def test_the_cpu_share_refills_with_time():
    budget = peer_admission.CpuBudget(0.1)
    now = time.monotonic()
    budget.charge(0.3, now)
    assert budget.spent(now)
    assert budget.spent(now + 1.0)  # 0.1 s of CPU back per second: still in debt
    assert budget.spent(now + 1.9)  # the whole overrun is owed (0.2 s), none of it forgiven
    assert not budget.spent(now + 3.0)


def test_a_loop_held_off_the_cpu_comes_back_with_a_fifth_of_a_seconds_share_only():
    """A budget left alone for 10 s (a loop descheduled on a loaded machine, or a quiet endpoint) lends
    ahead CPU_BURST_S seconds' worth of its share, not what the 10 s would have earned: the flood's measured
    share stays within share * (window + burst) and one round's overrun."""
    budget = peer_admission.CpuBudget(peer_admission.STRANGER_CPU_SHARE, peer_admission.CPU_BURST_S)
    now = time.monotonic() + 10.0
    assert not budget.spent(now)
    budget.charge(peer_admission.STRANGER_CPU_SHARE * peer_admission.CPU_BURST_S + 0.001, now)
    assert budget.spent(now)


def test_over_their_share_strangers_wait_in_the_kernels_queue_and_a_member_is_served_after(tmp_path):
    """The endpoint's loop spends on strangers' connections (accepting, sorting, closing them) at most their
    share of a core: once it is spent, the next connection waits in the kernel's queue until the share
    refills, instead of being accepted (and closed) at once — a closed-loop flood then goes no faster than
    the share allows. A member's connection queued meanwhile is served once the share refilled."""
    job = Job(tmp_path)
    (tmp_path / "root").mkdir()
    server, addr = job.serve("holder", tmp_path / "root")
    host, port = addr.rsplit(":", 1)
    member = peer_client.PeerClient(addr, tls.client_context(job.ids["owner"], job.certs),
                                    expect=job.ids["holder"].fingerprint,
                                    admission=admission.load(job.ids["owner"], job.certs), timeout_s=10)
    try:
        t0 = time.monotonic()
        member.list_steps()  # quiet: nothing paces a member's connection
        assert time.monotonic() - t0 < 2.0
        member.close()
        # The share spent with 0.45 s of CPU owed (its lent 0.05 s taken first): it refills 1.8 s from now.
        charged = time.monotonic()
        server.doorway.cpu.charge(STRANGER_CPU_SHARE * 2, charged)
        time.sleep(0.4)  # the loop's round ends (at most 0.25 s): it sees the share spent
        stranger = socket.create_connection((host, int(port)), timeout=10)
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")  # no TLS: closed as soon as the endpoint takes it
        stranger.settimeout(10)
        try:
            while stranger.recv(4096):
                pass
        except ConnectionResetError:
            pass
        closed = time.monotonic() - charged
        stranger.close()
        assert closed >= 0.9, f"the stranger's connection was taken {closed:.2f} s after the share was spent"
        charged = time.monotonic()
        server.doorway.cpu.charge(STRANGER_CPU_SHARE * 2, charged)
        time.sleep(0.4)
        assert member.list_steps()["node"] == "holder:0"  # queued behind the pause, then served with its own budget
        assert time.monotonic() - charged >= 0.9
    finally:
        member.close()
        server.shutdown()
