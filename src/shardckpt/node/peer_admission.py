"""The peer endpoint's doorway: which queue a new connection waits in, and what its handshake may cost.

The event loop of :mod:`shardckpt.node.peer_server` hands every accepted
connection to :class:`Doorway`, which reads its first bytes (without taking
a TLS ClientHello out of the socket) and sorts it:

* **A member** sent a valid admission token (:mod:`shardckpt.stores.admission`)
  before its ClientHello: checked in constant time, its nonce used once
  within the window (a bounded cache per member), it goes to the member's own
  queue — at most :data:`MEMBER_PENDING` pending per member, a budget of
  :data:`MEMBER_HANDSHAKES_PER_S` handshakes per member — which nothing a
  stranger does, from any address (the member's own included), spends.
* **A stranger** (no token, a wrong or replayed one: a member without a usable
  token is served this way too) shares one bounded budget with every other
  stranger: at most :data:`MAX_PENDING` pending places in all and
  :data:`PENDING_PER_SOURCE` per source address; handshakes per source
  address (:data:`HANDSHAKES_PER_S`, bursts of :data:`HANDSHAKE_BURST`); and
  one CPU budget, :data:`STRANGER_CPU_SHARE` of a core, for all their
  connections cost: their handshakes, measured one by one, and the loop's
  accepting, sorting and closing them, measured per round of the loop
  (:meth:`Doorway.settle`; over the budget the loop stops — no new connection
  taken, no pending one worked on — until it refills, :mod:`shardckpt.node.peer_server`). Their handshakes take at most
  :data:`HANDSHAKE_PART` of it (a budget of their own, measured the same
  way): the rest goes to sorting the queued connections, a member's among
  them, however many handshakes a flood's addresses are allowed; and a
  member served without a token still gets a handshake while a flood from
  other addresses keeps the share spent. A connection that sent nothing (or
  only part of a token) waits in the same places; when its deadline or a
  newer connection of its address closes it, its address is charged one
  handshake.

A full pool gives way from its oldest connection, per source first, then in
all (never the newcomer: it may be a member whose token is on its way).
Every pending connection has :data:`PENDING_S` seconds to end its
handshake. It imports no torch.
"""

from __future__ import annotations

import collections
import selectors
import socket
import ssl
import time
from typing import Any, Callable

from shardckpt.stores import admission as tokens

MAX_PENDING = 256
"""Strangers' connections whose TLS handshake is not done yet, all sources together (at most a quarter of
the open-file limit)."""
PENDING_PER_SOURCE = 64
"""Strangers' pending connections per source address (a socket each, no TLS object until it speaks)."""
PENDING_S = 3.0
"""Seconds a connection has from its acceptance to the end of its TLS handshake."""
HANDSHAKES_PER_S = 20.0
"""Strangers' ClientHellos per second and source address that are given a TLS handshake (on average)."""
HANDSHAKE_BURST = 40.0
"""Strangers' ClientHellos one source address may send at once before its rate applies."""
STRANGER_CPU_SHARE = 0.25
"""Share of one core that strangers' connections may take, all sources together: their TLS handshakes (measured
one by one) and the endpoint's loop accepting, sorting and closing them (measured per round of the loop)."""
DEBT_S = 4.0
"""Seconds' worth of a CPU share a budget may be owed (beyond it, a pathological round is forgiven)."""
CPU_BURST_S = 0.2
"""Seconds' worth of the strangers' share of a core the loop may spend ahead: a loop held off the CPU for a while
(a loaded machine) does not come back with a second's worth to spend at once. (Their handshakes' part lends a
second's worth: it decides which ClientHello is refused, not how long the loop runs.)"""
HANDSHAKE_PART = 0.3
"""Part of the strangers' share of a core their TLS handshakes may take (measured one by one): under a flood of
many addresses, each within its handshake rate, the rest of the share goes to sorting the queued connections
(a member's among them reaches its own queue that way), not to strangers' handshakes."""
MEMBER_PENDING = 16
"""A member's own connections pending at once (a member's client keeps a few per peer)."""
MEMBER_HANDSHAKES_PER_S = 50.0
"""Handshakes per second of one member (with its token), bursts of :data:`MEMBER_BURST`."""
MEMBER_BURST = 100.0
TOKENS_KEPT = 4096
"""Nonces remembered per member (a member's budget admits fewer within two windows); a full cache refuses."""
SOURCES_KEPT = 4096
"""Source addresses whose handshake budget is remembered; full budgets are forgotten beyond it."""


class Budgets:
    """Per key (a source address, a member), a token bucket: ``rate`` per second, bursts of ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._held: dict[str, tuple[float, float]] = {}

    def _level(self, key: str, now: float) -> float:
        tokens, last = self._held.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - last) * self.rate)

    def take(self, key: str, now: float) -> bool:
        tokens = self._level(key, now)
        if tokens < 1.0:
            self._held[key] = (tokens, now)
            return False
        self._held[key] = (tokens - 1.0, now)
        if len(self._held) > SOURCES_KEPT:
            self._forget_full(now)
        return True

    def charge(self, key: str, now: float) -> None:
        """Take one token whatever the level (an idle connection closed at its deadline); at most one
        burst of debt."""
        self._held[key] = (max(-self.burst, self._level(key, now) - 1.0), now)
        if len(self._held) > SOURCES_KEPT:
            self._forget_full(now)

    def spent(self, key: str, now: float) -> bool:
        return key in self._held and self._level(key, now) < 1.0

    def give_back(self, key: str, now: float) -> None:
        self._held[key] = (min(self.burst, self._level(key, now) + 1.0), now)

    def _forget_full(self, now: float) -> None:
        for key in list(self._held):
            if self._level(key, now) >= self.burst:
                del self._held[key]


class CpuBudget:
    """Seconds of CPU per second (``share`` of a core), spent as measured: it lends ahead ``burst_s`` seconds'
    worth of the share, and what was spent beyond it is owed (up to :data:`DEBT_S` seconds' worth: a round of
    the loop that overran on a loaded machine is paid back, not forgiven). Over any window of ``w`` seconds the
    work it paces takes at most ``share * (w + burst_s) + the debt left at its end``, one round's overrun."""

    def __init__(self, share: float, burst_s: float = 1.0) -> None:
        self.share = share
        self._cap = share * burst_s
        self._level, self._last = self._cap, time.monotonic()

    def _refill(self, now: float) -> None:
        self._level = min(self._cap, self._level + (now - self._last) * self.share)
        self._last = now

    def spent(self, now: float) -> bool:
        self._refill(now)
        return self._level <= 0.0

    def charge(self, seconds: float, now: float) -> None:
        self._refill(now)
        self._level = max(-self.share * DEBT_S, self._level - seconds)

    def ready_in(self, now: float) -> float:
        """Seconds until the budget is no longer spent (0 when it is not): at most one second, after which a
        debt of more is asked again."""
        self._refill(now)
        return 0.0 if self._level > 0.0 else min(1.0, -self._level / self.share + 1e-3)


class Replays:
    """Nonces of accepted tokens per member, each kept for two windows: a token is taken once."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[bytes, float]] = {}

    def first_use(self, member: str, nonce: bytes, now: float) -> bool:
        seen = self._seen.setdefault(member, {})
        if nonce in seen:
            return False
        if len(seen) >= TOKENS_KEPT:
            horizon = now - 2 * tokens.WINDOW_S
            for old in [n for n, t in seen.items() if t < horizon]:
                del seen[old]
            if len(seen) >= TOKENS_KEPT:
                return False
        seen[nonce] = now
        return True


class Pending:
    """A connection whose handshake is not done: ``member`` (fingerprint) once its token was taken."""

    __slots__ = ("sock", "fd", "source", "since", "deadline", "member", "tls", "cpu", "got")

    def __init__(self, sock: socket.socket, source: str, since: float) -> None:
        self.sock, self.fd, self.source, self.since, self.deadline = sock, sock.fileno(), source, since, \
            since + PENDING_S
        self.got = b""
        """The part of a token received so far (taken out of the socket)."""
        self.member: str | None = None
        self.tls = False
        self.cpu = 0.0


class Doorway:
    """The pending connections of one endpoint, their queues and budgets (used by the loop thread only).

    ``note`` logs a refusal (rate-bounded); ``done(pending)`` takes a connection whose handshake ended.
    """

    def __init__(self, sel: selectors.BaseSelector, context: Callable[[], ssl.SSLContext | None],
                 admission: Callable[[], tokens.Admission | None], note: Callable[[str], None],
                 done: Callable[[Pending], None], max_pending: int = MAX_PENDING) -> None:
        self.sel, self.context, self.admission, self.note, self.done = sel, context, admission, note, done
        self.max_pending = max_pending
        self.pending: collections.OrderedDict[int, Pending] = collections.OrderedDict()
        """Every pending connection by descriptor, oldest first (their deadlines in the same order)."""
        self.strangers: collections.OrderedDict[int, Pending] = collections.OrderedDict()
        self._by_source: dict[str, collections.OrderedDict[int, Pending]] = {}
        self._by_member: collections.Counter[str] = collections.Counter()
        self.sources = Budgets(HANDSHAKES_PER_S, HANDSHAKE_BURST)
        self.members = Budgets(MEMBER_HANDSHAKES_PER_S, MEMBER_BURST)
        self.cpu = CpuBudget(STRANGER_CPU_SHARE, CPU_BURST_S)
        self.handshake_cpu = CpuBudget(STRANGER_CPU_SHARE * HANDSHAKE_PART)
        self.measured = 0.0
        """CPU of the handshakes run since the last :meth:`settle` (strangers' already charged, members' never)."""
        self.replays = Replays()

    # ---- arrival and first bytes

    def admit(self, conn: socket.socket, source: str) -> None:
        now = time.monotonic()
        if self.context() is None:
            self.note(f"a connection from {source}: this node has no TLS identity yet")
            _drop(conn)
            return
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            _drop(conn)
            return
        pending = Pending(conn, source, now)
        self.pending[pending.fd] = pending
        self.sel.register(conn, selectors.EVENT_READ, pending)
        self._first_bytes(pending, now)

    def advance(self, pending: Pending) -> None:
        if pending.fd not in self.pending:
            return
        if not pending.tls:
            self._first_bytes(pending, time.monotonic())
        else:
            self._handshake(pending)

    def _first_bytes(self, pending: Pending, now: float) -> None:
        """Sort a connection by what it sent: a token, a ClientHello, or nothing yet (it waits)."""
        try:  # a ClientHello stays in the socket for TLS (peeked); a token is taken out as it comes
            flags = 0 if pending.got else socket.MSG_PEEK
            head = pending.got + pending.sock.recv(tokens.LENGTH - len(pending.got), flags)
        except (BlockingIOError, InterruptedError):
            head = None
        except OSError:
            head = b""
        if head == pending.got:  # closed by the client before its handshake
            self._close(pending)
            return
        if head is None:
            self._wait(pending, now)  # nothing yet: a stranger's place until it speaks
            return
        if head.startswith(tokens.MAGIC[:len(head)]) or head.startswith(tokens.MAGIC):
            if not pending.got:
                pending.sock.recv(len(head))  # taken out: what follows a token is the ClientHello
            pending.got = head
            if len(head) < tokens.LENGTH:
                self._wait(pending, now)  # a part of a token: the rest comes
                return
            keys = self.admission()
            found = keys.check(head) if keys is not None else None
            if found is not None:
                self._member(pending, found[0], found[1], now)
                return
            self.note(f"an admission token from {pending.source} that is not a member's, or out of its window; "
                      f"served as a stranger")
        self._stranger(pending, now)

    def _wait(self, pending: Pending, now: float) -> None:
        if pending.fd not in self.strangers:
            self._place(pending, now)

    def _member(self, pending: Pending, member: str, nonce: bytes, now: float) -> None:
        self._unplace(pending)
        if self._by_member[member] >= MEMBER_PENDING:
            self.note(f"a connection of member {member[:16]} from {pending.source}: {MEMBER_PENDING} of its "
                      f"handshakes pending")
            self._close(pending)
            return
        if self.members.spent(member, now) or not self.replays.first_use(member, nonce, now):
            self.note(f"a connection from {pending.source} with a member's token already used, or over the member's "
                      f"{MEMBER_HANDSHAKES_PER_S:.0f} handshakes per second")
            self._close(pending)
            return
        self.members.take(member, now)
        pending.member = member
        self._by_member[member] += 1
        self._start_tls(pending)

    def _stranger(self, pending: Pending, now: float) -> None:
        """A ClientHello without a token: the strangers' budgets, per address and in all."""
        if self.sources.spent(pending.source, now):
            self.note(f"a TLS handshake from {pending.source}: more than {HANDSHAKES_PER_S:.0f} per second from "
                      f"that address")
            self._close(pending)
            return
        if self.handshake_cpu.spent(now):  # not the loop's share: that one paces accepting, not who is handshaken
            self.note(f"a TLS handshake from {pending.source}: strangers' handshakes took "
                      f"{STRANGER_CPU_SHARE * HANDSHAKE_PART:.1%} of a core")
            self._close(pending)
            return
        if pending.fd not in self.strangers and not self._place(pending, now):
            return
        self.sources.take(pending.source, now)
        self._start_tls(pending)

    # ---- the strangers' places

    def _place(self, pending: Pending, now: float) -> bool:
        """A place in the strangers' pool: when its address's places (or all) are taken, the oldest of them
        gives way. The newcomer never does: a member's connection whose token is a moment late (its
        process descheduled between its connect and its send) thus keeps its place for as long as the
        flood takes to open as many connections as there are places (:data:`PENDING_PER_SOURCE` / rate)."""
        mine = self._by_source.setdefault(pending.source, collections.OrderedDict())
        for pool, bound, what in ((mine, PENDING_PER_SOURCE, f"from {pending.source}"),
                                  (self.strangers, self.max_pending, "in all")):
            if len(pool) < bound:
                continue
            oldest = next(iter(pool.values()))
            self.note(f"a pending connection from {oldest.source}: {bound} strangers' connections pending {what}, "
                      f"the oldest gives way")
            self.sources.charge(oldest.source, now)
            self._close(oldest)
        mine[pending.fd] = pending
        self.strangers[pending.fd] = pending
        return True

    def _unplace(self, pending: Pending) -> None:
        if self.strangers.pop(pending.fd, None) is not None:
            mine = self._by_source.get(pending.source)
            if mine is not None:
                mine.pop(pending.fd, None)
                if not mine:
                    del self._by_source[pending.source]

    # ---- TLS

    def _start_tls(self, pending: Pending) -> None:
        context = self.context()
        if context is None:
            self._close(pending)
            return
        try:
            self.sel.unregister(pending.sock)
            pending.sock = context.wrap_socket(pending.sock, server_side=True, do_handshake_on_connect=False)
            pending.tls = True
            self.sel.register(pending.sock, selectors.EVENT_READ, pending)
        except (OSError, ValueError, KeyError) as exc:
            self.note(f"a connection from {pending.source}: {exc}")
            self._close(pending)
            return
        self._handshake(pending)

    def _handshake(self, pending: Pending) -> None:
        t0 = time.thread_time()
        try:
            pending.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._charge(pending, t0)
            self.sel.modify(pending.sock, selectors.EVENT_READ, pending)
            return
        except ssl.SSLWantWriteError:
            self._charge(pending, t0)
            self.sel.modify(pending.sock, selectors.EVENT_WRITE, pending)
            return
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self._charge(pending, t0)
            self.note(f"a TLS handshake from {pending.source} (not a job peer): {exc}")
            self._close(pending)
            return
        self._charge(pending, t0)
        self._remove(pending)
        try:
            self.sel.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        if pending.member is None:
            self.sources.give_back(pending.source, time.monotonic())  # a member served without a token
        self.done(pending)

    def _charge(self, pending: Pending, t0: float) -> None:
        spent = time.thread_time() - t0
        pending.cpu += spent
        self.measured += spent
        if pending.member is None:
            now = time.monotonic()
            self.cpu.charge(spent, now)  # at once: the next ClientHello of this round sees it
            self.handshake_cpu.charge(spent, now)

    def settle(self, spent: float, now: float) -> None:
        """Charge the strangers' budget with the rest of one round of the loop: ``spent`` is the loop thread's
        CPU in it, of which the handshakes measured one by one are taken out (the strangers' were charged as
        they ran, the members' never are). The rest is accepting, sorting and closing connections, and the
        TLS objects' making and ending — strangers' work but for a member's own acceptance (a fraction of a
        millisecond each, counted with it)."""
        self.cpu.charge(max(0.0, spent - self.measured), now)
        self.measured = 0.0

    # ---- deadlines and closing

    def soonest(self, now: float) -> float:
        return next(iter(self.pending.values())).deadline if self.pending else now + 0.25

    def expire(self, now: float) -> None:
        while self.pending:
            first = next(iter(self.pending.values()))
            if first.deadline > now:
                return
            self.note(f"a connection from {first.source}: no TLS handshake within {PENDING_S:.0f} s")
            if first.member is None:
                self.sources.charge(first.source, now)  # an idle connection costs its address a handshake
            self._close(first)

    def _remove(self, pending: Pending) -> None:
        if self.pending.pop(pending.fd, None) is not None and pending.member is not None:
            self._by_member[pending.member] -= 1
            if self._by_member[pending.member] <= 0:
                del self._by_member[pending.member]
        self._unplace(pending)

    def _close(self, pending: Pending) -> None:
        self._remove(pending)
        try:
            self.sel.unregister(pending.sock)
        except (KeyError, ValueError):
            pass
        _drop(pending.sock)

    def close_all(self) -> None:
        for pending in list(self.pending.values()):
            self._close(pending)

    def counts(self) -> dict[str, Any]:
        """How many are pending: strangers (and per address), members' (and per member)."""
        return {"strangers": len(self.strangers), "by_source": {s: len(p) for s, p in self._by_source.items()},
                "members": dict(self._by_member), "all": len(self.pending)}


def _drop(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
