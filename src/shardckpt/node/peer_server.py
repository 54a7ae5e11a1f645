"""The peer endpoint facing the network: mutual TLS, the job's members only, bounded against strangers.

A connection passes three gates before a request of it is read:

1. **Sorted, pending**: accepted by one event loop (a :mod:`selectors` loop in
   one thread) and handed to :mod:`shardckpt.node.peer_admission`, which reads
   its first bytes: a member's admission token puts it in that member's own
   queue and budget; anything else (no token, a forged or replayed one, or
   nothing yet) waits in the strangers' pool, bounded in all and per source
   address, whose handshakes share one budget (per address, and of CPU in
   all). The TLS handshake runs non-blocking in the same loop — a pending
   connection costs a socket and a TLS object, no thread — and must end
   within :data:`~shardckpt.node.peer_admission.PENDING_S` seconds. While
   strangers' connections have taken their share of a core (the loop's own
   CPU, measured round by round), the loop stops — no new connection taken
   from the kernel's queue, no pending one worked on — until the share
   refills: a flood, however fast and from
   however many addresses, keeps the loop within that share, and a member's
   connection waits behind what the flood queued (in a closed loop, one
   connection per flooding connection in flight).
2. **Authenticated**: the client presented a certificate the TLS context
   trusts (CERT_REQUIRED: the job's pinned certificates, or an operator CA's)
   *and* it is the certificate of a member of this launch (an operator CA
   signs more than the job's nodes: such a certificate is closed here, on
   every route) — the very member whose token it sent, when it sent one.
3. **Served**: only then does the connection get a thread of its own;
   members' connections are bounded per certificate (:data:`MAX_PER_MEMBER`),
   never per address, and no stranger counts against them. Every request
   checks membership again (a relaunch that dropped a node ends its
   connections' rights).

Refusals are logged at a bounded rate. What a member may read and write is
:mod:`shardckpt.node.peer_service`'s. It imports no torch.
"""

from __future__ import annotations

import errno
import http.server
import json
import logging
import os
import re
import resource
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import lineage
from shardckpt.format.replicas import owner_dirname
from shardckpt.node.peer_admission import MAX_PENDING, Doorway, Pending
from shardckpt.node.peer_service import MAX_SMALL_BODY, PeerService, _Refused, number
from shardckpt.stores.peer_client import LIVE_HEADER
from shardckpt.stores.tls import fingerprint

log = logging.getLogger("shardckpt")

MAX_PER_MEMBER = 32
"""Connections open at once per member certificate (its client keeps a few per peer)."""
IDLE_S = 60.0
"""Seconds a member's connection may stay silent between requests."""
SEND_BUFFER = 4 << 20
"""Bytes of a served file read and sent at a time (one buffer per connection, reused)."""
REFUSAL_LOG_EVERY_S = 10.0
"""At most one log line of refused connections per this many seconds (the rest are counted in it)."""
class _Refusals:
    """Refused connections and requests, logged at most once per :data:`REFUSAL_LOG_EVERY_S` (with a count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0.0
        self._quiet = 0
        self.total = 0

    def note(self, what: str) -> None:
        with self._lock:
            self.total += 1
            now = time.monotonic()
            if now < self._next:
                self._quiet += 1
                return
            quiet, self._quiet, self._next = self._quiet, 0, now + REFUSAL_LOG_EVERY_S
        log.warning("shardckpt: peer endpoint refused %s%s", what,
                    f" (and {quiet} more refusal(s) in the last {REFUSAL_LOG_EVERY_S:.0f} s)" if quiet else "")


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "shardckpt-peer"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """An answer's headers and body leave at once: with Nagle's algorithm the body waited for the client's
    delayed acknowledgement of the headers, ~40 ms per request (5 per replica of a 3-file step)."""
    timeout = IDLE_S
    """Seconds a connection may stay silent (a client that stops sending does not hold a thread forever)."""
    server: "PeerServer"

    def setup(self) -> None:
        super().setup()
        self.service = self.server.service
        self._buffer: memoryview | None = None

    def handle_one_request(self) -> None:
        self._body_taken = False
        super().handle_one_request()

    @property
    def peer_node(self) -> str | None:
        try:
            return self.service.member(self.connection.getpeercert(binary_form=True))
        except (ValueError, OSError):
            return None

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("shardckpt: peer %s: " + fmt, self.address_string(), *args)

    def _reply(self, status: int, body: bytes = b"", ctype: str = "application/json",
               headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _refuse(self, exc: _Refused) -> None:
        # A large body is left unread (the connection closes after the answer); a small one is read
        # first, so that the client gets the answer rather than a reset.
        self.close_connection = True
        raw = self.headers.get("Content-Length", "") if self.headers is not None else ""
        if not getattr(self, "_body_taken", True) and raw.isascii() and raw.isdigit() and len(raw) <= 5 \
                and int(raw) <= 65536:
            self._body_taken = True
            try:
                self.rfile.read(int(raw))
            except OSError:
                pass
        if exc.status in (400, 401, 403):
            self.server.refusals.note(f"{self.command} {self.path[:200]} from {self.client_address[0]}: {exc}")
        try:
            self._reply(exc.status, json.dumps({"error": str(exc)}).encode(),
                        headers={"Connection": "close", **exc.headers})
        except OSError:
            pass  # the client went away (or the answer had begun): nothing more to tell it

    def _route(self) -> list[str]:
        if self.peer_node is None:  # every request: a relaunch may have dropped this node from the job
            raise _Refused(403, "the client's certificate is no longer one of this job's nodes")
        url = urllib.parse.urlsplit(self.path)
        if url.query or not url.path.startswith("/v1/"):
            raise _Refused(404, "no such resource")
        parts = [urllib.parse.unquote(p) for p in url.path[len("/v1/"):].split("/")]
        self.service.last_request = time.monotonic()
        return parts

    def _writer(self, owner: str) -> None:
        """Only a node writes its own replicas (its certificate names it; a stranger never got this far)."""
        node = self.peer_node
        if node is None or owner != owner_dirname(node):
            raise _Refused(403, f"replicas of {owner!r} are written by that node only; the client is "
                                f"{'node ' + node if node else 'no node of this launch'}")

    def _length(self, limit: int) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(411, "a body must have a Content-Length")
        raw = self.headers.get("Content-Length")
        length = number(raw, "Content-Length") if raw is not None else None
        if length is None:
            raise _Refused(411, "a body must have a Content-Length")
        if length > limit:
            raise _Refused(413, f"body of {raw} bytes is larger than {limit}")
        return length

    def _small_body(self) -> bytes:
        length = self._length(MAX_SMALL_BODY)
        self._body_taken = True
        return self.rfile.read(length)

    def _guarded(self, serve: Callable[[], None]) -> None:
        """Run one request; a refusal or a failure on this side becomes an answer, never a dropped connection."""
        try:
            serve()
        except _Refused as exc:
            self._refuse(exc)
        except CorruptCheckpointError as exc:
            self._refuse(_Refused(400, str(exc)))
        except (OSError, UnicodeError, ValueError) as exc:
            log.warning("shardckpt: peer endpoint failed %s %s: %s", self.command, self.path[:200], exc)
            self._refuse(_Refused(500, f"{type(exc).__name__}: {exc}"))

    def do_GET(self) -> None:  # noqa: N802 - the http.server interface
        self._guarded(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._guarded(self._post)

    def do_PUT(self) -> None:  # noqa: N802
        self._guarded(self._put)

    def _get(self) -> None:
        parts = self._route()
        if parts == ["steps"]:
            self._reply(200, json.dumps(self.service.listing()).encode())
            return
        step_dir, rest = self.service.step_dir_of(parts)
        if len(rest) != 1:
            raise _Refused(404, "no such resource")
        if rest == [""]:
            self._reply(200, json.dumps({"files": self.service.held_files(step_dir)}).encode())
            return
        fd, size = self.service.open_file(step_dir, rest[0])
        try:
            self._send_range(fd, size)
        finally:
            os.close(fd)

    def _send_range(self, fd: int, size: int) -> None:
        start, end, status = 0, size, 200
        spec = self.headers.get("Range")
        if spec:
            match = re.fullmatch(r"bytes=([0-9]+)-([0-9]*)", spec.strip())
            start = (number(match.group(1), "Range start") or 0) if match else 0
            end = (min(size, (number(match.group(2), "Range end") or 0) + 1) if match.group(2) else size) \
                if match else 0
            if not match or start >= size or end <= start:
                raise _Refused(416, f"range {spec!r} of a {size}-byte file", {"Content-Range": f"bytes */{size}"})
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if self._buffer is None:
            self._buffer = memoryview(bytearray(SEND_BUFFER))
        offset = start
        while offset < end:
            part = self._buffer[: min(len(self._buffer), end - offset)]
            got = os.preadv(fd, [part], offset)
            if not got:
                break
            self.connection.sendall(part[:got])
            offset += got

    def _post(self) -> None:
        parts = self._route()
        step = number(parts[2], "step") if len(parts) == 5 else None
        if step is None or parts[0] != "replica" or parts[4] not in ("begin", "commit"):
            raise _Refused(404, "no such resource")
        owner, tag = parts[1], parts[3]
        body = self._small_body()  # read first (bounded): the refusal below then reaches the client
        self._writer(owner)
        if parts[4] == "begin":
            live = self.headers.get(LIVE_HEADER)
            try:
                claimed = lineage.Lineage.from_json(json.loads(live)) if live else None
            except (ValueError, TypeError):
                raise _Refused(400, f"{LIVE_HEADER} is not a lineage") from None
            answer = self.service.begin(owner, step, tag, body, claimed)
        else:
            try:
                names = json.loads(body)["files"]
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise ValueError(names)
            except (ValueError, KeyError, TypeError):
                raise _Refused(400, "the commit body must be {\"files\": [names]}") from None
            self.service.commit(owner, step, tag, names)
            answer = {"state": "committed"}
        self._reply(200, json.dumps(answer).encode())

    def _put(self) -> None:
        parts = self._route()
        step = number(parts[2], "step") if len(parts) == 6 else None
        if step is None or parts[0] != "replica" or parts[4] != "f":
            raise _Refused(404, "no such resource")
        self._writer(parts[1])
        length = self._length(1 << 62)

        def readinto(into: memoryview) -> int:
            self._body_taken = True
            return self.rfile.readinto(into) or 0

        self.service.receive(parts[1], step, parts[3], parts[5], length, readinto)
        self._reply(200, b"{}")

    def do_DELETE(self) -> None:  # noqa: N802
        self._refuse(_Refused(405, "not allowed"))

    do_HEAD = do_PATCH = do_OPTIONS = do_DELETE  # noqa: N815


class PeerServer:
    """The endpoint: one event loop for acceptance and handshakes, a thread per member connection."""

    def __init__(self, address: tuple[str, int], service: PeerService) -> None:
        self.service = service
        self.refusals = _Refusals()
        self._sock = socket.create_server(address, backlog=1024)
        self._sock.setblocking(False)
        self.server_address = self._sock.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self.doorway = Doorway(self._sel, lambda: self.service.context, lambda: self.service.admission,
                               self.refusals.note, self._authenticated, _pending_bound())
        self._lock = threading.Lock()
        self._members: dict[str, int] = {}
        """Open connections per member certificate fingerprint."""
        self._serving: set[ssl.SSLSocket] = set()
        self._closed = threading.Event()
        self._paused_until = 0.0
        self._loop_thread = threading.Thread(target=self._loop, name="shardckpt-peer-accept", daemon=True)
        self._loop_thread.start()

    # ---- the event loop: acceptance and handshakes

    def _loop(self) -> None:
        while not self._closed.is_set():
            # Strangers over their share of a core: the loop stops, the next connections wait in the kernel's
            # queue and the pending ones where they are until it refills (a member's among them waits behind
            # what the flood queued: one each in a closed loop). Only stopping the whole loop bounds it: the
            # pending connections' rounds cost CPU too, and a pause of accepting alone went on spending.
            wait = self.doorway.cpu.ready_in(time.monotonic())
            if wait:
                self._closed.wait(wait)
                continue
            t0 = time.thread_time()
            now = time.monotonic()
            if self._paused_until and now >= self._paused_until:
                self._paused_until = 0.0
                self._sel.register(self._sock, selectors.EVENT_READ, None)
            wake = min(self.doorway.soonest(now), self._paused_until or now + 0.25)
            try:
                events = self._sel.select(max(0.0, min(0.25, wake - now)))
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                raise
            for key, _mask in events:
                if key.data is None:
                    self._accept_some()
                else:
                    self.doorway.advance(key.data)
            now = time.monotonic()
            self.doorway.expire(now)
            self.doorway.settle(time.thread_time() - t0, now)

    def _pause(self, seconds: float) -> None:
        """Stop taking connections from the kernel's queue for ``seconds``."""
        self._sel.unregister(self._sock)
        self._paused_until = time.monotonic() + seconds

    def _accept_some(self) -> None:
        for _ in range(64):
            try:
                conn, client = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: stop accepting for a moment (the kernel queues the rest).
                    self.refusals.note(f"connections: out of file descriptors ({exc.strerror})")
                    self._pause(0.1)
                    return
                if self._closed.is_set():
                    return
                continue
            self.doorway.admit(conn, client[0] if isinstance(client, tuple) else str(client))

    # ---- members

    def _authenticated(self, pending: Pending) -> None:
        sock = pending.sock
        try:
            der = sock.getpeercert(binary_form=True)
        except (OSError, ValueError):
            der = None
        node = self.service.member(der)
        key = fingerprint(der) if der else ""
        if node is None or (pending.member is not None and pending.member != key):
            # A certificate the context trusts (an operator CA's) that is no member of this launch, or another
            # member's than the token named.
            self.refusals.note(f"a connection from {pending.source}: its certificate is not one of this job's nodes"
                               f"{' (or not the one its token named)' if node else ''}")
            _drop(sock)
            return
        with self._lock:
            if self._members.get(key, 0) >= MAX_PER_MEMBER:
                refused = True
            else:
                refused = False
                self._members[key] = self._members.get(key, 0) + 1
                self._serving.add(sock)
        if refused:
            self.refusals.note(f"a connection of node {node}: {MAX_PER_MEMBER} of its connections are open")
            _drop(sock)
            return
        try:
            sock.setblocking(True)
            sock.settimeout(IDLE_S)
            threading.Thread(target=self._serve_member, args=(sock, pending.source, key),
                             name=f"shardckpt-peer-{node}", daemon=True).start()
        except (OSError, RuntimeError) as exc:
            log.warning("shardckpt: peer endpoint cannot serve node %s: %s", node, exc)
            self._release(sock, key)

    def _serve_member(self, sock: ssl.SSLSocket, source: str, key: str) -> None:
        try:
            _Handler(sock, (source, 0), self)
        except (OSError, ValueError):
            pass  # the member went away mid-request; nothing to tell it
        finally:
            self._release(sock, key)

    def _release(self, sock: ssl.SSLSocket, key: str) -> None:
        with self._lock:
            self._serving.discard(sock)
            self._members[key] -= 1
            if not self._members[key]:
                del self._members[key]
        _drop(sock)

    # ---- lifecycle

    def shutdown(self) -> None:
        """Stop accepting and end every connection (their threads end with them)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._loop_thread.join(timeout=5)
        self.doorway.close_all()
        with self._lock:
            serving = list(self._serving)
        for sock in serving:
            try:
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # wakes the thread blocked on it
            except OSError:
                pass
        try:
            self._sel.close()
        except (OSError, ValueError):
            pass
        self._sock.close()

    def server_close(self) -> None:
        self.shutdown()


def _drop(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _pending_bound() -> int:
    """The strangers' pending places: :data:`~shardckpt.node.peer_admission.MAX_PENDING`, or a quarter of the
    open-file limit when that is lower (at least 16)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return MAX_PENDING
    return MAX_PENDING if soft == resource.RLIM_INFINITY else max(16, min(MAX_PENDING, soft // 4))


def serve(service: PeerService, host: str, port: int = 0) -> PeerServer:
    """Start the endpoint for ``service`` on ``host`` (a free port unless given)."""
    return PeerServer((host, port), service)
