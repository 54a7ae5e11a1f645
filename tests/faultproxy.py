"""A small HTTP proxy on 127.0.0.1 that injects faults between client and S3 server.

Every request the client sends is either forwarded to the upstream server or
answered with a fault, chosen by ``decide(method, path, index)``:

    "pass"    forward to the upstream, relay its answer
    "503"     HTTP 503 with S3's <Code>SlowDown</Code> (throttling)
    "500"     HTTP 500 with <Code>InternalError</Code>
    "reset"   read the request, then reset the connection (no answer)
    "stall"   read the request, answer nothing for ``stall_s`` seconds, then close

Modes: :meth:`set_mode` with ``"pass"``, ``"fail503"`` (every request 503),
``"cycle"`` (every ``every``-th request gets the next fault of ``kinds`` in
turn: deterministic counts) or ``"random"`` (a seeded mix at ``rate``). Counts of what was
injected are kept in ``counts``; the body bytes of every forwarded GET, per path, in ``got``.

A listing that lags behind writes (some S3-compatible stores list a new key only
some time after its PUT, while GET and HEAD see it at once): keys under the
prefixes in ``unlisted`` (``"bucket/key prefix"``) are left out of every listing
answer (their ``<Contents>`` and ``<CommonPrefixes>``); every other request passes.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import socketserver
import struct
import threading
import time
import urllib.parse

_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{msg}</Message>'
    "<RequestId>fault</RequestId></Error>"
)


class FaultProxy:
    def __init__(
        self, upstream: str, *, seed: int = 0, rate: float = 0.3, stall_s: float = 3.0, every: int = 3
    ) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self.up_host, self.up_port = parsed.hostname, parsed.port
        self.rate = rate
        self.stall_s = stall_s
        self.mode = "pass"
        self.every = every
        self._cycle = 0
        self.kinds = ("503", "500", "reset", "stall")
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.got: list[tuple[str, int]] = []
        """``(path, body bytes)`` of every GET forwarded and answered."""
        self.index = 0
        self.unlisted: tuple[str, ...] = ()
        """``"bucket/key prefix"`` entries that listings do not show (a lagging listing)."""
        self.cap_bytes_per_s: float | None = None
        """A bandwidth cap, each direction on its own: request bodies (uploads) and answers (downloads)
        pass at most this many bytes per second over all connections together (a slow link)."""
        self._free_at = {"up": 0.0, "down": 0.0}
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()

    def set_mode(self, mode: str, *, kinds: tuple[str, ...] | None = None) -> None:
        with self._lock:
            self.mode = mode
            if kinds is not None:
                self.kinds = kinds

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------

    def _decide(self) -> str:
        with self._lock:
            self.index += 1
            if self.mode == "pass":
                kind = "pass"
            elif self.mode == "fail503":
                kind = "503"
            elif self.mode == "cycle":
                kind = "pass"
                if self.index % self.every == 0:
                    kind = self.kinds[self._cycle % len(self.kinds)]
                    self._cycle += 1
            else:
                kind = self._rng.choice(self.kinds) if self._rng.random() < self.rate else "pass"
            self.counts[kind] = self.counts.get(kind, 0) + 1
            return kind

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = []
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "expect" and value.strip().lower() == "100-continue":
                        # Answered here (the upstream gets the whole body at once): a client
                        # waiting for it would otherwise stall about a second per PUT.
                        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                        continue
                    headers.append((name.strip(), value.strip()))
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                while len(buf) < length:
                    chunk = conn.recv(max(65536, length - len(buf)))
                    if not chunk:
                        return
                    buf += chunk
                body, buf = buf[:length], buf[length:]
                kind = self._decide()
                if kind == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    conn.close()
                    return
                if kind == "stall":
                    time.sleep(self.stall_s)
                    conn.close()
                    return
                if kind in ("503", "500"):
                    code, msg = ("SlowDown", "Please reduce your request rate.") if kind == "503" else (
                        "InternalError", "We encountered an internal error.")
                    payload = _ERROR_BODY.format(code=code, msg=msg).encode()
                    status = "503 Slow Down" if kind == "503" else "500 Internal Server Error"
                    conn.sendall(
                        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(payload)}\r\n"
                        f"Connection: close\r\n\r\n".encode() + (payload if method != "HEAD" else b"")
                    )
                    conn.close()
                    return
                self._pace("up", len(body))
                self._forward(conn, method, target, headers, body)
        except OSError:
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _forward(self, conn: socket.socket, method: str, target: str, headers: list, body: bytes) -> None:
        up = http.client.HTTPConnection(self.up_host, self.up_port, timeout=60)
        try:
            up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                up.putheader(name, value)
            up.endheaders(body if body else None)
            resp = up.getresponse()
            data = resp.read()
            out = [f"HTTP/1.1 {resp.status} {resp.reason}"]
            for name, value in resp.getheaders():
                if name.lower() in ("transfer-encoding", "connection"):
                    continue
                if name.lower() == "content-length" and method != "HEAD":
                    continue
                out.append(f"{name}: {value}")
            if method == "GET":
                data = self._lagging_listing(target, data)
            if method != "HEAD":
                out.append(f"Content-Length: {len(data)}")
            if method == "GET":
                with self._lock:
                    self.got.append((urllib.parse.urlparse(target).path, len(data)))
            self._pace("down", len(data) if method != "HEAD" else 0)
            conn.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + (data if method != "HEAD" else b""))
        finally:
            up.close()

    def _pace(self, direction: str, nbytes: int) -> None:
        """Hold ``nbytes`` back until the cap lets them through (the link is shared by all connections)."""
        rate = self.cap_bytes_per_s
        if not rate or not nbytes:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at[direction])
            self._free_at[direction] = start + nbytes / rate
            until = self._free_at[direction]
        time.sleep(max(0.0, until - time.monotonic()))

    def _lagging_listing(self, target: str, data: bytes) -> bytes:
        """A bucket listing's answer without the entries under :attr:`unlisted` (others unchanged)."""
        parsed = urllib.parse.urlparse(target)
        bucket = parsed.path.strip("/")
        if not self.unlisted or "/" in bucket or not bucket:
            return data  # not a bucket-level request (a key's GET), or nothing hidden
        hidden = [p.split("/", 1)[1] for p in self.unlisted if p.split("/", 1)[0] == bucket]
        if not hidden:
            return data
        text = data.decode("utf-8")

        def keep(match: re.Match) -> str:
            key = urllib.parse.unquote_plus(match.group(2))
            return "" if any(key.startswith(h) for h in hidden) else match.group(0)

        text = re.sub(r"<Contents>(.*?<Key>)(.*?)</Key>.*?</Contents>", keep, text, flags=re.S)
        text = re.sub(r"<CommonPrefixes>(\s*<Prefix>)(.*?)</Prefix>\s*</CommonPrefixes>", keep, text, flags=re.S)
        return text.encode("utf-8")
