"""The peer tier's endpoint: serves a node's committed steps and its replicas, and accepts replicas.

Reads of committed steps' files (whole or a byte ``Range``) from the local
directory or from the replica directory, a listing of both, and writes of
replicas (:mod:`shardckpt.format.replicas`). Every request must be signed with
the job's secret (:mod:`shardckpt.stores.peer_client`), which the trainer
hands to the daemon in ``<local_dir>/.shardckpt-remote/peer.secret`` (0600).
It imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.format.replicas import (committed_replicas, file_size, manifest_or_none, owner_dirname, remove_step,
                                       replicas_root, version_tag)
from shardckpt.node.node_registry import state_dir
from shardckpt.stores.peer_client import AUTH_HEADER, BODY_HEADER, CHUNK, MANIFEST_DIGEST, manifest_digest, sign

log = logging.getLogger("shardckpt")

SECRET_NAME = "peer.secret"
CLOCK_SKEW_S = 300
"""A signed request older (or newer) than this is refused: a captured request cannot be replayed later."""
MAX_SMALL_BODY = 16 << 20
"""Largest manifest or commit body accepted."""
_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


def write_secret(root: str, secret: str) -> str:
    """Hand the job's secret to this node's daemon: a file only this user can read (never argv or env)."""
    directory = state_dir(root)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SECRET_NAME)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_secret(root: str) -> bytes | None:
    """The job's secret, or ``None`` when absent or readable by others than this user (then refused)."""
    path = os.path.join(state_dir(root), SECRET_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            log.error("shardckpt: %s is readable by other users; the peer endpoint refuses every request. "
                      "Remedy: chmod 600 %s (a trainer writes it so at its first save or load)", path, path)
            return None
        secret = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    return secret or None


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _same(a: str, b: str) -> bool:
    """Constant-time comparison of two header values (any characters a client may send)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogateescape"), b.encode("utf-8", "surrogateescape"))


def _safe_name(name: str) -> str:
    """A file name from a request path: one plain component, no way out of its directory."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise _Refused(400, f"file name {name!r} is not a plain name")
    return name


def _open_inside(base: str, name: str) -> int:
    """Open ``base/name`` for reading, refusing symbolic links and anything resolving outside ``base``."""
    path = os.path.join(base, _safe_name(name))
    real_base = os.path.realpath(base)
    if os.path.dirname(os.path.realpath(path)) != real_base:
        raise _Refused(403, f"{name!r} resolves outside its step directory")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise _Refused(404, f"{name} is not held here") from None
    except OSError as exc:
        raise _Refused(403, f"{name} cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Refused(403, f"{name} is not a plain file")
    return fd


class PeerService:
    """What the endpoint serves and accepts for one ``local_dir`` (used by the HTTP handler)."""

    def __init__(self, root: str, node: str) -> None:
        self.root = os.path.abspath(root)
        self.node = node
        self._secret: tuple[Any, bytes | None] = (None, None)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.last_request = time.monotonic()
        self.keep_last: int | None = None
        """Replicas kept per owner (the trainer's keep_last, from peers.json)."""

    def secret(self) -> bytes | None:
        path = os.path.join(state_dir(self.root), SECRET_NAME)
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_ino, st.st_ctime_ns, st.st_mode)  # a new secret, or its mode changed: read again
        if key != self._secret[0]:
            self._secret = (key, read_secret(self.root))
        return self._secret[1]

    def owner_lock(self, owner: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(owner, threading.Lock())

    def authenticate(self, method: str, path: str, headers: Any) -> str:
        """Check the request's signature; returns the body digest it signed."""
        secret = self.secret()
        if secret is None:
            raise _Refused(503, "this node has no job secret yet")
        auth, digest = headers.get(AUTH_HEADER), headers.get(BODY_HEADER)
        if not auth or not digest or ":" not in auth:
            raise _Refused(401, "unauthenticated request")
        when, _, mac = auth.partition(":")
        if not when.isdigit() or abs(time.time() - int(when)) > CLOCK_SKEW_S:
            raise _Refused(401, "request signature expired")
        if not _same(mac, sign(secret, method, path, digest, int(when))):
            raise _Refused(401, "bad request signature")
        return digest

    # ---- reads

    def listing(self) -> dict[str, Any]:
        local: dict[str, str] = {}
        for step in layout.committed_steps(self.root):
            try:
                manifest = layout.read_manifest(os.path.join(self.root, layout.step_dirname(step)))
            except CorruptCheckpointError:
                continue
            if manifest is not None:
                local[str(step)] = layout.version_of(manifest)
        replicas = {owner: {str(s): layout.version_of(m) for s, m in steps.items()}
                    for owner, steps in committed_replicas(self.root).items()}
        return {"node": self.node, "local": local, "replicas": replicas}

    def step_dir_of(self, parts: list[str]) -> tuple[str, list[str]]:
        """``local/<step>/...`` or ``replica/<owner>/<step>/...`` -> (committed step directory, rest)."""
        if len(parts) >= 2 and parts[0] == "local":
            base, rest = self.root, parts[1:]
        elif len(parts) >= 3 and parts[0] == "replica":
            base, rest = os.path.join(replicas_root(self.root), self._owner(parts[1])), parts[2:]
        else:
            raise _Refused(404, "no such resource")
        if not rest[0].isdigit():
            raise _Refused(400, f"step {rest[0]!r} is not a number")
        return os.path.join(base, layout.step_dirname(int(rest[0]))), rest[1:]

    @staticmethod
    def _owner(name: str) -> str:
        if name != owner_dirname(name) or name.startswith("."):
            raise _Refused(400, f"owner {name!r} is not a node name")
        return name

    def held_files(self, step_dir: str) -> list[str]:
        """The files of a committed step's manifest present (as plain files) in its directory."""
        manifest = manifest_or_none(step_dir)
        if manifest is None:
            raise _Refused(404, "no committed step there")
        return sorted(n for n in manifest.files if os.path.isfile(os.path.join(step_dir, n))
                      and not os.path.islink(os.path.join(step_dir, n)))

    def open_file(self, step_dir: str, name: str) -> tuple[int, int]:
        """A committed step's file, named in its manifest: (fd, size)."""
        try:
            manifest = layout.read_manifest(step_dir)
        except CorruptCheckpointError:
            manifest = None
        if manifest is None:
            raise _Refused(404, "no committed step there")
        if name != layout.MANIFEST_NAME and name not in manifest.files:
            raise _Refused(404, f"{name} is not a file of that step")
        fd = _open_inside(step_dir, name)
        return fd, os.fstat(fd).st_size

    # ---- replica writes

    def partial_of(self, owner: str, step: int, tag: str) -> str:
        if not _TAG_RE.match(tag):
            raise _Refused(400, f"version {tag!r} is not a version tag")
        return os.path.join(replicas_root(self.root), self._owner(owner),
                            f"{layout.PARTIAL_PREFIX}{layout.step_dirname(step)}-{tag}")

    def begin(self, owner: str, step: int, tag: str, body: bytes) -> dict[str, Any]:
        manifest = layout.Manifest.from_json(body.decode("utf-8", errors="replace"), f"replica of {owner} step {step}")
        if manifest.step != step or version_tag(manifest) != tag:
            raise _Refused(400, f"the manifest is of step {manifest.step} version {version_tag(manifest)}, "
                                f"not step {step} version {tag}")
        with self.owner_lock(owner):
            final = os.path.join(replicas_root(self.root), self._owner(owner), layout.step_dirname(step))
            held = manifest_or_none(final)
            if held is not None and version_tag(held) == tag:
                return {"state": "committed"}
            partial = self.partial_of(owner, step, tag)
            os.makedirs(partial, exist_ok=True)
            pending = os.path.join(partial, layout.MANIFEST_NAME + ".pending")
            layout.atomic_write_text(pending, manifest.to_json())
            have = [n for n, e in manifest.files.items() if file_size(os.path.join(partial, n)) == e.size]
        return {"state": "begun", "have": sorted(have)}

    def pending_manifest(self, partial: str) -> layout.Manifest:
        path = os.path.join(partial, layout.MANIFEST_NAME + ".pending")
        try:
            with open(path, encoding="utf-8") as f:
                return layout.Manifest.from_json(f.read(), path)
        except FileNotFoundError:
            raise _Refused(409, "no replica of that version is begun here") from None

    def receive(self, owner: str, step: int, tag: str, name: str, length: int, digest: str,
                read: Callable[[int], bytes]) -> None:
        """Write one file of a begun replica: exactly its manifest size, its checksum and signed digest checked."""
        name = _safe_name(name)
        partial = self.partial_of(owner, step, tag)
        manifest = self.pending_manifest(partial)
        entry = manifest.files.get(name)
        if entry is None:
            raise _Refused(404, f"{name} is not a file of step {step}")
        if length != entry.size:
            raise _Refused(413, f"{name} is {entry.size} bytes in the manifest, the request sends {length}")
        bound = digest.startswith(MANIFEST_DIGEST)  # signed as the manifest's checksum of the file
        if bound and not _same(manifest_digest(entry), digest):
            raise _Refused(401, f"{name}: the request is signed for another checksum than the manifest's")
        tmp = os.path.join(partial, f".recv-{uuid.uuid4().hex[:8]}")
        checksum = layout.Checksum.like(entry.checksum)
        body = None if bound else hashlib.sha256()
        try:
            with open(tmp, "xb") as f:
                left = length
                while left:
                    chunk = read(min(CHUNK, left))
                    if not chunk:
                        raise _Refused(400, f"{name}: the body ended {left} bytes early")
                    left -= len(chunk)
                    checksum.update(chunk)
                    if body is not None:
                        body.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if body is not None and not _same(body.hexdigest(), digest):
                raise _Refused(401, f"{name}: the body is not the one signed")
            if checksum.value() != entry.checksum:
                raise _Refused(422, f"{name} fails its {entry.checksum.split(':')[0]} checksum; not kept")
            os.replace(tmp, os.path.join(partial, name))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def commit(self, owner: str, step: int, tag: str, names: list[str]) -> None:
        """Commit a begun replica holding ``names``: the manifest renamed into place last, then the directory."""
        with self.owner_lock(owner):
            partial = self.partial_of(owner, step, tag)
            manifest = self.pending_manifest(partial)
            for name in names:
                entry = manifest.files.get(_safe_name(name))
                if entry is None or file_size(os.path.join(partial, name)) != entry.size:
                    raise _Refused(409, f"{name} of step {step} has not arrived; nothing committed")
            os.replace(os.path.join(partial, layout.MANIFEST_NAME + ".pending"), os.path.join(partial, layout.MANIFEST_NAME))
            layout.fsync_dir(partial)
            owner_dir = os.path.dirname(partial)
            final = os.path.join(owner_dir, layout.step_dirname(step))
            if os.path.lexists(final):  # another save of this step number: replaced by this one
                remove_step(final, owner_dir)
            os.rename(partial, final)
            layout.fsync_dir(owner_dir)
            log.info("shardckpt: holding the replica of node %s step %d (%d file(s))", owner, step, len(names))
            self._retain(owner_dir)

    def _retain(self, owner_dir: str) -> None:
        """``keep_last`` replicas per owner; the newest one is never deleted."""
        if not self.keep_last:
            return
        steps = layout.committed_steps(owner_dir)
        for old in steps[: max(0, len(steps) - self.keep_last)]:
            remove_step(os.path.join(owner_dir, layout.step_dirname(old)), owner_dir)
        for name in os.listdir(owner_dir):  # begun replicas older than every kept one
            if name.startswith(layout.PARTIAL_PREFIX):
                step = layout.parse_step_dirname(name[len(layout.PARTIAL_PREFIX):].split("-", 1)[0])
                if step is not None and steps and step < steps[-1]:
                    shutil.rmtree(os.path.join(owner_dir, name), ignore_errors=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "shardckpt-peer"
    protocol_version = "HTTP/1.1"
    timeout = 60.0
    """Seconds a connection may stay silent (a client that stops sending does not hold a thread forever)."""
    service: PeerService

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
        # The body (if any) is left unread: the connection closes after the answer.
        self.close_connection = True
        if exc.status in (401, 403):
            log.warning("shardckpt: peer endpoint refused %s %s from %s: %s", self.command, self.path[:200],
                        self.client_address[0], exc)
        try:
            self._reply(exc.status, json.dumps({"error": str(exc)}).encode(), headers={"Connection": "close"})
        except OSError:
            pass  # the client went away (or the answer had begun): nothing more to tell it

    def _route(self) -> tuple[list[str], str]:
        url = urllib.parse.urlsplit(self.path)
        if url.query or not url.path.startswith("/v1/"):
            raise _Refused(404, "no such resource")
        parts = [urllib.parse.unquote(p) for p in url.path[len("/v1/"):].split("/")]
        digest = self.service.authenticate(self.command, self.path, self.headers)
        self.service.last_request = time.monotonic()
        return parts, digest

    def _length(self, limit: int) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(411, "a body must have a Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.isdigit():
            raise _Refused(411, "a body must have a Content-Length")
        if int(raw) > limit:
            raise _Refused(413, f"body of {raw} bytes is larger than {limit}")
        return int(raw)

    def _small_body(self, digest: str) -> bytes:
        body = self.rfile.read(self._length(MAX_SMALL_BODY))
        if not _same(hashlib.sha256(body).hexdigest(), digest):
            raise _Refused(401, "the body is not the one signed")
        return body

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
        parts, _digest = self._route()
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
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", spec.strip())
            if not match or int(match.group(1)) >= size:
                raise _Refused(416, f"range {spec!r} of a {size}-byte file")
            start = int(match.group(1))
            end = min(size, int(match.group(2)) + 1) if match.group(2) else size
            if end <= start:
                raise _Refused(416, f"range {spec!r} of a {size}-byte file")
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        offset = start
        while offset < end:
            chunk = os.pread(fd, min(CHUNK, end - offset), offset)
            if not chunk:
                break
            self.wfile.write(chunk)
            offset += len(chunk)

    def _post(self) -> None:
        parts, digest = self._route()
        if len(parts) != 5 or parts[0] != "replica" or not parts[2].isdigit() or parts[4] not in ("begin", "commit"):
            raise _Refused(404, "no such resource")
        owner, step, tag = parts[1], int(parts[2]), parts[3]
        body = self._small_body(digest)
        if parts[4] == "begin":
            answer = self.service.begin(owner, step, tag, body)
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
        parts, digest = self._route()
        if len(parts) != 6 or parts[0] != "replica" or not parts[2].isdigit() or parts[4] != "f":
            raise _Refused(404, "no such resource")
        length = self._length(1 << 62)
        self.service.receive(parts[1], int(parts[2]), parts[3], parts[5], length, digest, self.rfile.read)
        self._reply(200, b"{}")

    def do_DELETE(self) -> None:  # noqa: N802
        self._refuse(_Refused(405, "not allowed"))

    do_HEAD = do_PATCH = do_OPTIONS = do_DELETE  # noqa: N815


class PeerHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def serve(service: PeerService, host: str, port: int = 0) -> PeerHTTPServer:
    """Start the endpoint for ``service`` on ``host`` (a free port unless given), in a daemon thread."""
    handler = type("PeerHandler", (_Handler,), {"service": service})
    server = PeerHTTPServer((host, port), handler)
    threading.Thread(target=server.serve_forever, name="shardckpt-peer-http", daemon=True).start()
    return server
