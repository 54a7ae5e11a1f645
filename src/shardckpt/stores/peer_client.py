"""The peer tier's HTTPS client: reads of a peer's committed steps and replicas, writes of replicas.

Every connection is mutual TLS 1.3 (:mod:`shardckpt.stores.tls`): the client
presents its node's certificate, and accepts only a server presenting the
certificate pinned for the node it meant to reach (``expect``), so an answer
comes from that node or not at all. Every file it installs is still checked
against the owner's manifest.

Connections are kept open and reused: at most :data:`PARALLEL` per peer, one
per file in flight, so a replica's files (and a restore's) travel side by
side and the TLS work of several files runs on several cores at both ends. It
imports no torch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import logging
import os
import ssl
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable, Iterator

from shardckpt.errors import CorruptCheckpointError, PeerError
from shardckpt.format import layout
from shardckpt.format.replicas import owner_dirname, version_tag
from shardckpt.stores.admission import Admission
from shardckpt.stores.tls import fingerprint

log = logging.getLogger("shardckpt")

PARALLEL = 4
"""Files in flight at once to or from one peer: one connection each, kept open and reused."""
BUFFER = 4 << 20
"""Bytes of a file read and sent, or received, at a time (one buffer per connection, reused)."""
LIVE_HEADER = "X-Shardckpt-Live-Lineage"
"""On a replica's ``begin``: the owner's live lineage (JSON), which says whether an older save of a step
number may replace a newer one on the holder (a rollback) or not (a replay)."""
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ssl.SSLEOFError)
"""What a kept-open connection that the peer closed meanwhile (its idle limit) answers a new request with."""


_RESET = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)
"""What a new connection that the peer closed before its TLS handshake ended answers (nothing was asked of
the peer yet: it is opened once more)."""


class PeerClient:
    """One peer endpoint, with the small interface the remote store has: list, get (a range), put.

    ``addr`` is ``host:port``; ``context`` a client context of
    :mod:`shardckpt.stores.tls`; ``expect`` the SHA-256 fingerprint of the
    certificate the node at ``addr`` must present (``None``: any certificate the
    context trusts, e.g. an operator's CA). At most ``connections`` requests are
    in flight at once, each on a connection kept open for the next (bounded by
    ``timeout_s`` per blocking step); ``admission``: this node's admission keys
    (:mod:`shardckpt.stores.admission`), whose token for ``expect`` opens each
    new connection, so that the peer takes it in its member's queue rather than
    the strangers'. Every call raises :class:`PeerError` when
    the peer refuses, cannot be reached, or is not the node expected. Safe to
    use from several threads; :meth:`close` ends the kept connections.
    """

    def __init__(self, addr: str, context: ssl.SSLContext, *, expect: str | None = None,
                 timeout_s: float = 60.0, connections: int = PARALLEL, admission: Admission | None = None) -> None:
        host, _, port = addr.rpartition(":")
        self.addr = addr
        self.host, self.port = host, int(port)
        self.context = context
        self.expect = expect
        self.admission = admission
        self.timeout_s = timeout_s
        self.connections = max(1, connections)
        self._idle: list[_PinnedConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.connections)

    # ---- connections

    def _connect(self) -> "_PinnedConnection":
        """An open connection to the peer, its certificate checked against the one pinned for it (and again
        on any reconnection the connection makes by itself)."""
        for attempt in (1, 2):
            conn = _PinnedConnection(self.host, self.port, timeout=self.timeout_s, context=self.context)
            conn.pinned, conn.addr, conn.admission = self.expect, self.addr, self.admission
            try:
                conn.connect()
                return conn
            except PeerError:
                conn.close()
                raise
            except _RESET as exc:  # dropped before the handshake ended (a flood's turnover): once more
                conn.close()
                if attempt == 1:
                    continue
                failure: Exception = exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                failure = exc
            raise PeerError(f"peer {self.addr}: no TLS connection (refused, not a job peer, or unreachable): "
                            f"{type(failure).__name__}: {failure}") from failure
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _connection(self) -> Iterator[tuple["_PinnedConnection", bool]]:
        """A connection of the pool (``reused``: it served a request before); back to the pool when the block
        ends normally (its answer read whole), closed when it raises."""
        self._slots.acquire()
        conn = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            if conn is None:
                conn = self._connect()
            yield conn, reused
            with self._lock:
                self._idle.append(conn)
            conn = None
        finally:
            if conn is not None:
                conn.close()
            self._slots.release()

    def _exchange(self, what: str, fn: Callable[["_PinnedConnection"], Any]) -> Any:
        """``fn(conn)`` on a pooled connection; once more on a fresh one when a kept connection turns out
        closed by the peer before it answered (nothing was done there)."""
        for attempt in (1, 2):
            try:
                with self._connection() as (conn, reused):
                    try:
                        return fn(conn)
                    except _STALE:
                        if reused and attempt == 1:
                            raise _Retry() from None
                        raise
            except _Retry:
                continue
            except PeerError:
                raise
            except (OSError, http.client.HTTPException) as exc:
                raise PeerError(f"peer {self.addr}: {what} failed: {type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    def close(self) -> None:
        """End the kept connections (new calls open others)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        def one(conn: "_PinnedConnection") -> tuple[int, dict[str, str], bytes]:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()

        return self._exchange(f"{method} {path}", one)

    def _ok(self, method: str, path: str, status: int, body: bytes, accept: tuple[int, ...] = (200,),
            headers: dict[str, str] | None = None) -> None:
        if status not in accept:
            raise PeerError(f"peer {self.addr}: {method} {path} answered {status}: "
                            f"{body[:300].decode(errors='replace')}", status, headers)

    # ---- reads

    def list_steps(self) -> dict[str, Any]:
        """``{"node", "local": {step: version}, "replicas": {owner: {step: version}}}`` (steps as strings)."""
        status, _h, body = self._request("GET", "/v1/steps")
        self._ok("GET", "/v1/steps", status, body)
        return json.loads(body)

    @staticmethod
    def file_path(step: int, name: str, owner: str | None = None) -> str:
        quoted = urllib.parse.quote(name, safe="")
        if owner is None:
            return f"/v1/local/{step}/{quoted}"
        return f"/v1/replica/{owner_dirname(owner)}/{step}/{quoted}"

    def get(self, step: int, name: str, *, owner: str | None = None, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of a committed step's file (``owner``: from its replica of that node)."""
        path = self.file_path(step, name, owner)
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        status, answer, body = self._request("GET", path, headers=headers)
        self._ok("GET", path, status, body, (200, 206), answer)
        return body

    def held_files(self, step: int, *, owner: str | None = None) -> list[str]:
        """The manifest files the peer holds of a committed step (its copy, or its replica of ``owner``)."""
        path = self.file_path(step, "", owner)
        status, _h, body = self._request("GET", path)
        self._ok("GET", path, status, body)
        return list(json.loads(body)["files"])

    def stream(self, step: int, name: str, sink: Callable[[memoryview], None], *, owner: str | None = None) -> int:
        """A committed step's whole file, passed to ``sink`` in parts as it arrives; returns its size."""
        path = self.file_path(step, name, owner)

        def one(conn: "_PinnedConnection") -> int:
            conn.request("GET", path)
            resp = conn.getresponse()
            if resp.status != 200:
                body = resp.read()
                self._ok("GET", path, resp.status, body, headers={k.lower(): v for k, v in resp.getheaders()})
            buffer = conn.buffer()
            size = 0
            while got := resp.readinto(buffer):
                sink(buffer[:got])
                size += got
            return size

        return self._exchange(f"GET {path}", one)

    def get_file(self, step: int, name: str, dest: str, entry: layout.FileEntry, *, owner: str | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        """Download a committed step's file to ``dest``, checked against ``entry`` on the way (tmp + rename).

        Raises :class:`PeerError` when the peer refuses and
        :class:`~shardckpt.errors.CorruptCheckpointError` when the bytes are not the manifest's; nothing is
        left at ``dest`` then.
        """
        from_peer = f"peer {self.addr}: step {step} file {name}"
        layout_check = _Checked(entry, from_peer)
        tmp = f"{dest}.peer-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb", buffering=0) as f:
                def sink(part: memoryview) -> None:
                    layout_check.update(part)
                    _write_all(f, part)
                    if on_bytes is not None:
                        on_bytes(len(part))

                self.stream(step, name, sink, owner=owner)
            layout_check.verify()
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    # ---- replica writes

    def put_replica(self, owner: str, step_dir: str, manifest: layout.Manifest, names: list[str],
                    bandwidth: int | None = None, *, live: dict[str, Any] | None = None) -> int:
        """Send ``names`` of ``step_dir`` as ``owner``'s replica; committed on the peer with the manifest last.

        ``live``: the owner's live lineage (:meth:`Lineage.to_json`), with which the
        holder may replace a newer save of the step number by this one (a rollback).
        Files the peer already holds of this version are not sent again; the
        others travel side by side, one connection each (at most
        ``connections``), the largest first. Returns the bytes sent.
        """
        base = f"/v1/replica/{owner_dirname(owner)}/{manifest.step}/{version_tag(manifest)}"
        text = manifest.to_json().encode()
        headers = {LIVE_HEADER: json.dumps(live, separators=(",", ":"))} if live is not None else None
        status, answer_headers, body = self._request("POST", base + "/begin", text, headers)
        self._ok("POST", base + "/begin", status, body, headers=answer_headers)
        answer = json.loads(body)
        if answer.get("state") == "committed":
            return 0
        have = set(answer.get("have") or [])
        todo = sorted((n for n in names if n not in have), key=lambda n: -manifest.files[n].size)
        throttle = _Throttle(bandwidth)

        def one(name: str) -> int:
            path = f"{base}/f/{urllib.parse.quote(name, safe='')}"
            return self._put_file(path, os.path.join(step_dir, name), throttle)

        if len(todo) > 1 and self.connections > 1:
            with concurrent.futures.ThreadPoolExecutor(min(self.connections, len(todo)),
                                                       thread_name_prefix="shardckpt-peer-put") as pool:
                sent = sum(pool.map(one, todo))
        else:
            sent = sum(one(n) for n in todo)
        commit = json.dumps({"files": sorted(names)}).encode()
        status, answer_headers, body = self._request("POST", base + "/commit", commit, None)
        self._ok("POST", base + "/commit", status, body, headers=answer_headers)
        return sent

    def _put_file(self, path: str, local: str, throttle: "_Throttle") -> int:
        size = os.path.getsize(local)

        def one(conn: "_PinnedConnection") -> tuple[int, bytes]:
            buffer = conn.buffer()
            conn.putrequest("PUT", path)
            conn.putheader("Content-Length", str(size))
            conn.endheaders()
            with open(local, "rb", buffering=0) as f:
                while got := f.readinto(buffer):
                    throttle.take(got)
                    conn.send(buffer[:got])
            resp = conn.getresponse()
            return resp.status, resp.read()

        status, body = self._exchange(f"PUT {path}", one)
        self._ok("PUT", path, status, body)
        return size


class _Retry(Exception):
    """A kept connection was closed by the peer before it answered: the request goes again on a fresh one."""


class _Checked:
    """Size and checksum of bytes as they pass, against a manifest entry."""

    def __init__(self, entry: layout.FileEntry, where: str) -> None:
        self.entry, self.where = entry, where
        self.size = 0
        self.digest = layout.Checksum.like(entry.checksum)

    def update(self, part: memoryview) -> None:
        self.size += len(part)
        if self.size <= self.entry.size:
            self.digest.update(part)

    def verify(self) -> None:
        if self.size != self.entry.size or self.digest.value() != self.entry.checksum:
            detail = f"{self.size} bytes, {self.entry.size} expected" if self.size != self.entry.size else \
                "its checksum differs from the manifest's"
            raise CorruptCheckpointError(f"{self.where} is not the manifest's ({detail}); it was not used. Remedy: "
                                         f"read it from another source (another peer, or the remote)")


def _write_all(f: Any, part: memoryview) -> None:
    while part:
        part = part[f.write(part):]


class _PinnedConnection(http.client.HTTPSConnection):
    """An HTTPS connection that accepts only the certificate pinned for the node it means to reach, on its
    first connection and on any reconnection (after a response that closed the previous one)."""

    pinned: str | None = None
    addr: str = ""
    admission: Admission | None = None
    _transfer: memoryview | None = None

    def connect(self) -> None:
        token = self.admission.preamble(self.pinned) if self.admission is not None else None
        if token is None:
            super().connect()
        else:  # http.client's HTTPSConnection.connect, with the token sent before the ClientHello
            http.client.HTTPConnection.connect(self)
            self.sock.sendall(token)
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)
        presented = self.sock.getpeercert(binary_form=True) if self.sock is not None else None
        if self.pinned is not None and (presented is None or fingerprint(presented) != self.pinned):
            self.close()
            raise PeerError(f"peer {self.addr} presented a certificate that is not the one of the node expected "
                            f"there (another job member, or a stale address); nothing read from it")

    def buffer(self) -> memoryview:
        """This connection's transfer buffer (made once, reused by every file it carries)."""
        if self._transfer is None:
            self._transfer = memoryview(bytearray(BUFFER))
        return self._transfer


class _Throttle:
    """At most ``rate`` bytes per second on average over every file in flight (``None``: unlimited)."""

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.sent = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            self.sent += n
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)
