"""The peer tier's endpoint: serves a node's committed steps and its replicas, and accepts replicas.

Reads of committed steps' files (whole or a byte ``Range``) from the local
directory or from the replica directory, a listing of both, and writes of
replicas (:mod:`shardckpt.format.replicas`), over mutual TLS 1.3 only
(:mod:`shardckpt.stores.tls`): a client must present the certificate of one
of the job's nodes, and may write only its own node's replicas.

Facing a network, the server is bounded: at most :data:`MAX_CONNECTIONS`
connections at once and :data:`MAX_PER_ADDRESS` from one address (others are
closed as they are accepted), :data:`HANDSHAKE_S` seconds to finish the TLS
handshake and as many to send a request's headers (a watchdog shuts a
connection down at its deadline), and refusals logged at a bounded rate. It
imports no torch.
"""

from __future__ import annotations

import errno
import http.server
import json
import logging
import os
import re
import shutil
import socket
import socketserver
import ssl
import stat
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout, lineage
from shardckpt.format.replicas import (committed_replicas, file_size, manifest_or_none, owner_dirname, remove_step,
                                       replicas_root, version_tag)
from shardckpt.stores.peer_client import CHUNK, LIVE_HEADER
from shardckpt.stores.tls import fingerprint

log = logging.getLogger("shardckpt")

RECEIVE_BUFFER = 4 << 20
"""Bytes of a replica file received, checksummed and written at a time (one buffer per file, reused)."""
MAX_SMALL_BODY = 16 << 20
"""Largest manifest or commit body accepted."""
MAX_CONNECTIONS = 64
"""Connections served at once; more are closed as soon as they are accepted."""
MAX_PER_ADDRESS = 16
"""Connections served at once from one client address."""
HANDSHAKE_S = 5.0
"""Seconds a connection has to finish its TLS handshake, and then to send each request's line and headers."""
REFUSAL_LOG_EVERY_S = 10.0
"""At most one log line of refused connections per this many seconds (the rest are counted in it)."""
_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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

    def __init__(self, root: str, node: str, context: ssl.SSLContext | None = None,
                 members: dict[str, str] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.node = node
        self.context = context
        """The server TLS context (:func:`shardckpt.stores.tls.server_context`); ``None``: no connection is served."""
        self.members: dict[str, str] = dict(members or {})
        """``{certificate fingerprint: node}`` of the job's nodes: who may write which owner's replicas."""
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.last_request = time.monotonic()
        self.keep_last: int | None = None
        """Replicas kept per owner (the trainer's keep_last, from peers.json)."""
        self.agreed: tuple[int, str] | None = None
        """The newest step complete across any single node's loss, as the job's nodes agreed at a save
        (``peer-agreed.json``, set by the daemon): replicas of it and of newer steps are never deleted."""

    def configure(self, context: ssl.SSLContext, members: dict[str, str]) -> None:
        """Serve new connections with ``context`` (a relaunch's certificates); connections open go on."""
        self.context, self.members = context, dict(members)

    def owner_lock(self, owner: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(owner_dirname(owner), threading.Lock())  # a node or its directory

    def member(self, cert_der: bytes | None) -> str | None:
        """The job node that presented ``cert_der`` (``None``: a certificate the context trusts, e.g. an
        operator CA's, that no node of this launch announced)."""
        return self.members.get(fingerprint(cert_der)) if cert_der else None

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

    def begin(self, owner: str, step: int, tag: str, body: bytes, live: lineage.Lineage | None = None) -> dict[str, Any]:
        """Begin ``owner``'s replica of a save of ``step`` (its manifest in ``body``); ``live``: the owner's
        live lineage, sent along (see :meth:`replaces`)."""
        manifest = layout.Manifest.from_json(body.decode("utf-8", errors="replace"), f"replica of {owner} step {step}")
        if manifest.step != step or version_tag(manifest) != tag:
            raise _Refused(400, f"the manifest is of step {manifest.step} version {version_tag(manifest)}, "
                                f"not step {step} version {tag}")
        with self.owner_lock(owner):
            final = os.path.join(replicas_root(self.root), self._owner(owner), layout.step_dirname(step))
            held = manifest_or_none(final)
            if held is not None and version_tag(held) == tag:
                return {"state": "committed"}
            self.replaces(owner, held, manifest, live)
            partial = self.partial_of(owner, step, tag)
            _private_dirs(self.root, partial)
            pending = os.path.join(partial, layout.MANIFEST_NAME + ".pending")
            layout.atomic_write_text(pending, manifest.to_json())
            os.chmod(pending, 0o600)
            if live is not None:
                layout.atomic_write_text(os.path.join(partial, ".live"), json.dumps(live.to_json()))
                os.chmod(os.path.join(partial, ".live"), 0o600)
            have = [n for n, e in manifest.files.items() if file_size(os.path.join(partial, n)) == e.size]
        return {"state": "begun", "have": sorted(have)}

    @staticmethod
    def replaces(owner: str, held: layout.Manifest | None, incoming: layout.Manifest,
                 live: lineage.Lineage | None) -> None:
        """Refuse a save of a step number older than the one held, unless the owner's live lineage says
        the held one was abandoned and the incoming one is live (a rollback): a replayed or late transfer
        never replaces a newer save."""
        if held is None or incoming.created >= held.created:
            return
        step = incoming.step
        if live is not None and lineage.excluded_by(live, step, lineage.Lineage.from_json(incoming.lineage)) is None \
                and lineage.excluded_by(live, step, lineage.Lineage.from_json(held.lineage)) is not None:
            return
        raise _Refused(409, f"node {owner} step {step}: this save ({layout.version_of(incoming)}) is older than the "
                            f"replica held ({layout.version_of(held)}) and the owner's live lineage does not "
                            f"abandon the held one; not replaced")

    def pending_manifest(self, partial: str) -> layout.Manifest:
        path = os.path.join(partial, layout.MANIFEST_NAME + ".pending")
        try:
            with open(path, encoding="utf-8") as f:
                return layout.Manifest.from_json(f.read(), path)
        except FileNotFoundError:
            raise _Refused(409, "no replica of that version is begun here") from None

    def receive(self, owner: str, step: int, tag: str, name: str, length: int,
                readinto: Callable[[memoryview], int]) -> None:
        """Write one file of a begun replica: exactly its manifest size, kept only when its checksum matches.

        ``readinto`` fills a part of one buffer reused for the whole file (no fresh
        memory per chunk) and returns how many bytes it read (0: the body ended)."""
        name = _safe_name(name)
        partial = self.partial_of(owner, step, tag)
        manifest = self.pending_manifest(partial)
        entry = manifest.files.get(name)
        if entry is None:
            raise _Refused(404, f"{name} is not a file of step {step}")
        if length != entry.size:
            raise _Refused(413, f"{name} is {entry.size} bytes in the manifest, the request sends {length}")
        tmp = os.path.join(partial, f".recv-{uuid.uuid4().hex[:8]}")
        checksum = layout.Checksum.like(entry.checksum)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb", buffering=0) as f:
                buffer = memoryview(bytearray(min(RECEIVE_BUFFER, max(1, length))))
                left = length
                while left:
                    got = readinto(buffer[: min(len(buffer), left)])
                    if not got:
                        raise _Refused(400, f"{name}: the body ended {left} bytes early")
                    left -= got
                    checksum.update(buffer[:got])
                    _write_all(f.fileno(), buffer[:got])
                os.fsync(f.fileno())
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
            owner_dir = os.path.dirname(partial)
            final = os.path.join(owner_dir, layout.step_dirname(step))
            live = _read_live(partial)
            self.replaces(owner, manifest_or_none(final), manifest, live)  # another save committed meanwhile
            if live is not None:
                os.unlink(os.path.join(partial, ".live"))
            os.replace(os.path.join(partial, layout.MANIFEST_NAME + ".pending"), os.path.join(partial, layout.MANIFEST_NAME))
            layout.fsync_dir(partial)
            if os.path.lexists(final):  # another save of this step number: replaced by this one
                remove_step(final, owner_dir)
            os.rename(partial, final)
            layout.fsync_dir(owner_dir)
            log.info("shardckpt: holding the replica of node %s step %d (%d file(s))", owner, step, len(names))
            self._retain(owner_dir)

    def retain_all(self) -> None:
        """Apply :meth:`_retain` to every owner held here (the agreed point moved)."""
        for owner in committed_replicas(self.root):
            with self.owner_lock(owner):
                self._retain(os.path.join(replicas_root(self.root), owner))

    def _retain(self, owner_dir: str) -> None:
        """Per owner: the newest ``keep_last`` replicas of the owner's live branch (its lineage's head:
        the replica saved last), and every replica from the agreed step on (:attr:`agreed`; all of them
        while no point of this branch is agreed); replicas of steps the owner abandoned are dropped and
        never count. The head is never deleted."""
        replicas_held = _owner_replicas(owner_dir)
        held = {s: lineage.info_of(m) for s, m in replicas_held.items()}
        live, abandoned = lineage.classify(held)
        if not self.keep_last or not live:
            return
        agreed = self.agreed
        if agreed is not None and agreed[0] in replicas_held and layout.version_of(replicas_held[agreed[0]]) != agreed[1]:
            agreed = None  # the point is another branch's save of that number
        floor = agreed[0] if agreed is not None else live[0]
        for old in sorted(abandoned) + [s for s in live[: max(0, len(live) - self.keep_last)] if s < floor]:
            remove_step(os.path.join(owner_dir, layout.step_dirname(old)), owner_dir)
        for name in os.listdir(owner_dir):  # begun replicas older than every kept one
            if name.startswith(layout.PARTIAL_PREFIX):
                step = layout.parse_step_dirname(name[len(layout.PARTIAL_PREFIX):].split("-", 1)[0])
                if step is not None and step < live[0]:
                    shutil.rmtree(os.path.join(owner_dir, name), ignore_errors=True)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _owner_replicas(owner_dir: str) -> dict[int, layout.Manifest]:
    out = {}
    for step in layout.committed_steps(owner_dir):
        manifest = manifest_or_none(os.path.join(owner_dir, layout.step_dirname(step)))
        if manifest is not None:
            out[step] = manifest
    return out


def _read_live(partial: str) -> lineage.Lineage | None:
    try:
        with open(os.path.join(partial, ".live"), encoding="utf-8") as f:
            return lineage.Lineage.from_json(json.load(f))
    except (OSError, ValueError):
        return None


def _private_dirs(root: str, path: str) -> None:
    """Make ``path`` and the replica directories above it (below ``root``), each mode 0700 whatever the umask."""
    top = replicas_root(root)
    chain = []
    here = path
    while len(here) >= len(top):
        chain.append(here)
        if here == top:
            break
        here = os.path.dirname(here)
    for directory in reversed(chain):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        if stat.S_IMODE(os.lstat(directory).st_mode) != 0o700:
            os.chmod(directory, 0o700)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "shardckpt-peer"
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """An answer's headers and body leave at once: with Nagle's algorithm the body waited for the client's
    delayed acknowledgement of the headers, ~40 ms per request (5 per replica of a 3-file step)."""
    timeout = 60.0
    """Seconds a connection may stay silent (a client that stops sending does not hold a thread forever)."""
    service: PeerService
    server: "PeerHTTPServer"

    def handle_one_request(self) -> None:
        # The request line and headers must arrive within HANDSHAKE_S (the watchdog's deadline).
        self.server.watch(self.connection, HANDSHAKE_S)
        self._body_taken = False
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.unwatch(self.connection)
        return ok

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
        if not getattr(self, "_body_taken", True) and raw.isdigit() and int(raw) <= 65536:
            self._body_taken = True
            try:
                self.rfile.read(int(raw))
            except OSError:
                pass
        if exc.status in (401, 403):
            self.server.refusals.note(f"{self.command} {self.path[:200]} from {self.client_address[0]}: {exc}")
        try:
            self._reply(exc.status, json.dumps({"error": str(exc)}).encode(), headers={"Connection": "close"})
        except OSError:
            pass  # the client went away (or the answer had begun): nothing more to tell it

    def _route(self) -> list[str]:
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
        if raw is None or not raw.isdigit():
            raise _Refused(411, "a body must have a Content-Length")
        if int(raw) > limit:
            raise _Refused(413, f"body of {raw} bytes is larger than {limit}")
        return int(raw)

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
        parts = self._route()
        if len(parts) != 5 or parts[0] != "replica" or not parts[2].isdigit() or parts[4] not in ("begin", "commit"):
            raise _Refused(404, "no such resource")
        owner, step, tag = parts[1], int(parts[2]), parts[3]
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
        if len(parts) != 6 or parts[0] != "replica" or not parts[2].isdigit() or parts[4] != "f":
            raise _Refused(404, "no such resource")
        self._writer(parts[1])
        length = self._length(1 << 62)

        def readinto(into: memoryview) -> int:
            self._body_taken = True
            return self.rfile.readinto(into) or 0

        self.service.receive(parts[1], int(parts[2]), parts[3], parts[5], length, readinto)
        self._reply(200, b"{}")

    def do_DELETE(self) -> None:  # noqa: N802
        self._refuse(_Refused(405, "not allowed"))

    do_HEAD = do_PATCH = do_OPTIONS = do_DELETE  # noqa: N815


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


class PeerHTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """The endpoint's server: mutual TLS on every connection, and bounded (see the module's docstring)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[_Handler], service: PeerService) -> None:
        self.service = service
        self.refusals = _Refusals()
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}
        self._deadlines: dict[int, tuple[float, socket.socket]] = {}
        self._closed = threading.Event()
        super().__init__(address, handler)
        threading.Thread(target=self._watchdog, name="shardckpt-peer-deadlines", daemon=True).start()

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self.refusals.note(f"a connection: out of file descriptors ({exc.strerror})")
                time.sleep(0.1)  # not a busy loop while the descriptors are out
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        address = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        with self._lock:
            total = sum(self._open.values())
            if total >= MAX_CONNECTIONS or self._open.get(address, 0) >= MAX_PER_ADDRESS:
                refused = True
            else:
                refused = False
                self._open[address] = self._open.get(address, 0) + 1
        if refused:
            self.refusals.note(f"a connection from {address}: {total} open (at most {MAX_CONNECTIONS}, "
                               f"{MAX_PER_ADDRESS} per address)")
        return not refused

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            address = client_address[0] if isinstance(client_address, tuple) else str(client_address)
            with self._lock:
                self._open[address] -= 1
                if not self._open[address]:
                    del self._open[address]

    def finish_request(self, request: Any, client_address: Any) -> None:
        context = self.service.context
        if context is None:
            self.refusals.note(f"a connection from {client_address[0]}: this node has no TLS identity yet")
            return
        try:
            conn = context.wrap_socket(request, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            self.refusals.note(f"a connection from {client_address[0]}: {exc}")
            return
        self.watch(conn, HANDSHAKE_S)
        try:
            conn.settimeout(HANDSHAKE_S)
            conn.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self.refusals.note(f"a TLS handshake from {client_address[0]} (not a job peer, or too slow): {exc}")
            self.unwatch(conn)
            conn.close()
            return
        try:
            self.RequestHandlerClass(conn, client_address, self)
        finally:
            self.unwatch(conn)
            try:
                conn.close()
            except OSError:
                pass

    def watch(self, sock: socket.socket, seconds: float) -> None:
        """Shut ``sock`` down unless :meth:`unwatch` comes within ``seconds``."""
        with self._lock:
            self._deadlines[sock.fileno()] = (time.monotonic() + seconds, sock)

    def unwatch(self, sock: socket.socket) -> None:
        with self._lock:
            for fd, (_t, held) in list(self._deadlines.items()):
                if held is sock:
                    del self._deadlines[fd]

    def _watchdog(self) -> None:
        while not self._closed.wait(0.25):
            now = time.monotonic()
            with self._lock:
                late = [(fd, s) for fd, (t, s) in self._deadlines.items() if t <= now]
                for fd, _s in late:
                    del self._deadlines[fd]
            for _fd, sock in late:
                try:
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # wakes the thread blocked on it
                except OSError:
                    pass

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()


def serve(service: PeerService, host: str, port: int = 0) -> PeerHTTPServer:
    """Start the endpoint for ``service`` on ``host`` (a free port unless given), in a daemon thread."""
    handler = type("PeerHandler", (_Handler,), {"service": service})
    server = PeerHTTPServer((host, port), handler, service)
    threading.Thread(target=server.serve_forever, name="shardckpt-peer-http", daemon=True).start()
    return server
