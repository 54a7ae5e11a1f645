"""The peer tier: each node keeps replicas of other nodes' step files, served over HTTP.

One daemon per node (per ``local_dir``; ``shardckpt peer``, started by the
node's local rank 0 like the uploader, and outliving the trainer) does two
things:

* **serves** an HTTP endpoint on the node's address: reads of committed
  steps' files (whole or a byte ``Range``) from the local directory or from
  the replica directory, a listing of both, and writes of replicas;
* **replicates**: after each local commit it sends this node's files of the
  newest committed step to ``peer_replicas`` other nodes (a ring over the
  nodes, off the owner's ``SHARDCKPT_FAILURE_DOMAIN``), at most
  ``peer_bandwidth`` bytes/s.

A replica on its holder::

    <local_dir>/.shardckpt-replicas/<owner>/step_<N>/   the owner's files + its manifest
    <local_dir>/.shardckpt-replicas/<owner>/.partial-step_<N>-<version>/   while it arrives

It is written into the partial directory, every file checked against the
owner's manifest while it arrives (size and checksum), and committed by
renaming the manifest into place last, then the directory. Two saves of one
step number are told apart by the manifest's version
(:func:`shardckpt.format.layout.version_of`), never by the number.

Every request is authenticated with the job's secret (created by rank 0 at
the first save or load, handed to the daemon in a 0600 file): the header
``X-Shardckpt-Auth: <unix time>:<HMAC-SHA256(secret, method, path, body
digest, time)>``; the body digest is sent in ``X-Shardckpt-Body-Sha256``: the
body's SHA-256, or for a replica file ``manifest:<its checksum in the
replica's manifest>`` (that manifest came in a signed request, and the file is
kept only when its bytes match it). Files the daemon and the trainer
share, in ``<local_dir>/.shardckpt-remote/``: ``peer.secret`` (0600),
``peers.json`` (the job's nodes, written by the trainer), ``peer.json``
(the daemon's address and what it replicated), ``peer.lock``, ``peer.log``.
It imports no torch.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import hmac
import http.client
import http.server
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import threading
import time
import urllib.parse
import uuid
from typing import Any, Callable

from shardckpt.format import layout
from shardckpt.errors import CorruptCheckpointError, ShardckptError
from shardckpt.node.node_registry import daemon_logging, process_record, read_json, state_dir, trainers_alive

log = logging.getLogger("shardckpt")

REPLICAS_DIR = ".shardckpt-replicas"
SECRET_NAME = "peer.secret"
PEERS_NAME = "peers.json"
STATUS_NAME = "peer.json"
LOCK_NAME = "peer.lock"
AUTH_HEADER = "X-Shardckpt-Auth"
BODY_HEADER = "X-Shardckpt-Body-Sha256"
CLOCK_SKEW_S = 300
"""A signed request older (or newer) than this is refused: a captured request cannot be replayed later."""
MAX_SMALL_BODY = 16 << 20
"""Largest manifest or commit body accepted."""
CHUNK = 1 << 20
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
MANIFEST_DIGEST = "manifest:"
"""Prefix of a body digest that names the file's checksum in the replica's manifest (:func:`manifest_digest`)."""
_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


class PeerError(ShardckptError, OSError):
    """A peer request failed (refused, unreachable, or the bytes did not match); in the ``OSError`` family
    like the remote tier's errors."""


# ------------------------------------------------------------ names and files


def replicas_root(root: str) -> str:
    return os.path.join(root, REPLICAS_DIR)


def owner_dirname(node: str) -> str:
    """A node's name as a directory name (``host:1`` -> ``host_1``)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", node)
    return "_" + name if name.startswith(".") or not name else name


def version_tag(manifest: layout.Manifest) -> str:
    """The manifest's version as a path component."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", layout.version_of(manifest))[:100]


def replica_dir(root: str, owner: str, step: int) -> str:
    return os.path.join(replicas_root(root), owner_dirname(owner), layout.step_dirname(step))


def committed_replicas(root: str) -> dict[str, dict[int, layout.Manifest]]:
    """``{owner dir: {step: manifest}}`` of the committed replicas held here (unreadable ones skipped)."""
    out: dict[str, dict[int, layout.Manifest]] = {}
    base = replicas_root(root)
    try:
        owners = sorted(os.listdir(base))
    except FileNotFoundError:
        return out
    for owner in owners:
        if owner.startswith("."):
            continue
        for step in layout.committed_steps(os.path.join(base, owner)):
            try:
                manifest = layout.read_manifest(os.path.join(base, owner, layout.step_dirname(step)))
            except CorruptCheckpointError:
                continue
            if manifest is not None:
                out.setdefault(owner, {})[step] = manifest
    return out


def adopt_replicas(root: str) -> dict[int, list[str]]:
    """Make the replica files held here count for restore: hard-link them into the local step directory.

    Only into a committed local step of the same version (a replica of another
    save of that number is left alone), only files the step directory lacks.
    Each rank of a directory may run it at once: a link is made under a fresh
    name and renamed into place. Returns ``{step: [names linked]}``.
    """
    out: dict[int, list[str]] = {}
    for owner, steps in committed_replicas(root).items():
        for step, manifest in steps.items():
            step_dir = os.path.join(root, layout.step_dirname(step))
            mine = _manifest_or_none(step_dir)
            if mine is None or layout.version_of(mine) != layout.version_of(manifest):
                continue
            held = os.path.join(replicas_root(root), owner, layout.step_dirname(step))
            for name in layout.absent_files(step_dir, manifest):
                source = os.path.join(held, name)
                if "/" in name or _size(source) != manifest.files[name].size:
                    continue
                tmp = os.path.join(step_dir, f".adopt-{uuid.uuid4().hex[:8]}")
                try:
                    os.link(source, tmp)
                    os.replace(tmp, os.path.join(step_dir, name))
                except OSError as exc:
                    log.warning("shardckpt: step %d: cannot use the replica file %s of node %s: %s", step, source,
                                owner, exc)
                    continue
                finally:
                    if os.path.lexists(tmp):
                        os.unlink(tmp)
                out.setdefault(step, []).append(name)
    return out


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


def sign(secret: bytes, method: str, path: str, body_sha256: str, when: int) -> str:
    message = f"{method}\n{path}\n{body_sha256}\n{when}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def auth_headers(secret: bytes, method: str, path: str, body_sha256: str = EMPTY_SHA256) -> dict[str, str]:
    when = int(time.time())
    return {AUTH_HEADER: f"{when}:{sign(secret, method, path, body_sha256, when)}", BODY_HEADER: body_sha256}


def manifest_digest(entry: layout.FileEntry) -> str:
    """The body binding of a replica file's PUT: the owner's checksum of it, as its (signed) manifest says.

    The manifest arrived in the signed ``begin`` request (bound by the SHA-256 of
    its text), and the holder keeps a file only when its bytes match that
    checksum: no SHA-256 pass over the file on either side (README, "Peer tier").
    """
    return MANIFEST_DIGEST + entry.checksum


def placement(nodes: list[dict[str, Any]], owner: str, count: int) -> list[dict[str, Any]]:
    """The nodes that hold ``owner``'s replicas: the next ``count`` on the ring, other failure domains first.

    When fewer than ``count`` nodes lie outside the owner's domain, nodes of its
    domain fill the rest (a replica in the same rack still survives a lost node).
    """
    names = [n["node"] for n in nodes]
    if owner not in names or count <= 0:
        return []
    i = names.index(owner)
    ring = [nodes[(i + k) % len(nodes)] for k in range(1, len(nodes))]
    domain = nodes[i].get("domain")
    apart = [n for n in ring if not domain or n.get("domain") != domain]
    near = [n for n in ring if n not in apart]
    return (apart + near)[:count]


# ------------------------------------------------------------ client


class PeerClient:
    """One peer endpoint, with the small interface the remote store has: list, get (a range), put.

    ``addr`` is ``host:port``. Every call opens one connection (bounded by
    ``timeout_s``) and raises :class:`PeerError` when the peer refuses or
    cannot be reached.
    """

    def __init__(self, addr: str, secret: bytes, *, timeout_s: float = 60.0) -> None:
        host, _, port = addr.rpartition(":")
        self.addr = addr
        self.host, self.port = host, int(port)
        self.secret = secret
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        digest = hashlib.sha256(body).hexdigest() if body is not None else EMPTY_SHA256
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request(method, path, body=body, headers={**auth_headers(self.secret, method, path, digest),
                                                           **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"peer {self.addr}: {method} {path} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()

    def _ok(self, method: str, path: str, status: int, body: bytes, accept: tuple[int, ...] = (200,)) -> None:
        if status not in accept:
            raise PeerError(f"peer {self.addr}: {method} {path} answered {status}: {body[:300].decode(errors='replace')}")

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
        status, _h, body = self._request("GET", path, headers=headers)
        self._ok("GET", path, status, body, (200, 206))
        return body

    def held_files(self, step: int, *, owner: str | None = None) -> list[str]:
        """The manifest files the peer holds of a committed step (its copy, or its replica of ``owner``)."""
        path = self.file_path(step, "", owner)
        status, _h, body = self._request("GET", path)
        self._ok("GET", path, status, body)
        return list(json.loads(body)["files"])

    def get_file(self, step: int, name: str, dest: str, entry: layout.FileEntry, *, owner: str | None = None) -> None:
        """Download a committed step's file to ``dest``, checked against ``entry`` on the way (tmp + rename).

        Raises :class:`PeerError` when the peer refuses or the bytes are not the manifest's; nothing is left at ``dest`` then.
        """
        path = self.file_path(step, name, owner)
        tmp = f"{dest}.peer-{uuid.uuid4().hex[:8]}"
        checksum = layout.Checksum.like(entry.checksum)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("GET", path, headers=auth_headers(self.secret, "GET", path))
            resp = conn.getresponse()
            if resp.status != 200:
                self._ok("GET", path, resp.status, resp.read())
            size = 0
            with open(tmp, "xb") as f:
                while size <= entry.size and (chunk := resp.read(CHUNK)):
                    size += len(chunk)
                    checksum.update(chunk)
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            if size != entry.size or checksum.value() != entry.checksum:
                raise PeerError(f"peer {self.addr}: step {step} file {name} is not the manifest's "
                                f"({size} bytes, {entry.size} expected, or its checksum differs); not used")
            os.replace(tmp, dest)
        except PeerError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"peer {self.addr}: GET {path} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
            if os.path.exists(tmp):
                os.unlink(tmp)

    def put_replica(self, owner: str, step_dir: str, manifest: layout.Manifest, names: list[str],
                    bandwidth: int | None = None) -> int:
        """Send ``names`` of ``step_dir`` as ``owner``'s replica; committed on the peer with the manifest last.

        Files the peer already holds of this version are not sent again. Returns the bytes sent.
        """
        base = f"/v1/replica/{owner_dirname(owner)}/{manifest.step}/{version_tag(manifest)}"
        text = manifest.to_json().encode()
        status, _h, body = self._request("POST", base + "/begin", text)
        self._ok("POST", base + "/begin", status, body)
        answer = json.loads(body)
        if answer.get("state") == "committed":
            return 0
        have = set(answer.get("have") or [])
        sent = 0
        throttle = _Throttle(bandwidth)
        for name in names:
            if name in have:
                continue
            sent += self._put_file(f"{base}/f/{urllib.parse.quote(name, safe='')}", os.path.join(step_dir, name), throttle,
                                   manifest_digest(manifest.files[name]))
        commit = json.dumps({"files": sorted(names)}).encode()
        status, _h, body = self._request("POST", base + "/commit", commit)
        self._ok("POST", base + "/commit", status, body)
        return sent

    def _put_file(self, path: str, local: str, throttle: "_Throttle", digest: str) -> int:
        size = os.path.getsize(local)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.putrequest("PUT", path)
            for k, v in {**auth_headers(self.secret, "PUT", path, digest),
                         "Content-Length": str(size)}.items():
                conn.putheader(k, v)
            conn.endheaders()
            with open(local, "rb") as f:
                while chunk := f.read(CHUNK):
                    throttle.take(len(chunk))
                    conn.send(chunk)
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise PeerError(f"peer {self.addr}: PUT {path} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            conn.close()
        self._ok("PUT", path, resp.status, body)
        return size


class _Throttle:
    """At most ``rate`` bytes per second on average (``None``: unlimited)."""

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.sent = 0

    def take(self, n: int) -> None:
        if not self.rate:
            return
        self.sent += n
        ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


def fetch_own_replica(root: str, node: str, peers: list[tuple[str, PeerClient]]) -> tuple[int, list[str]] | None:
    """Bring back this node's files of its newest step from a peer holding its replica (a replacement node).

    The peers' listings say which steps they hold of ``node`` (by version) and
    which versions of each step they hold themselves. The step taken is the
    newest replica of ``node`` that is newer than every step committed in
    ``root`` and that no peer holds another version of (a replica of an
    earlier save of that number is never brought back). Its manifest and
    files are read from the holder (each file checked against the manifest on
    the way) into a partial directory of ``root``, committed by renaming the
    manifest into place last, then the directory; a holder that fails gives
    way to the next. Returns ``(step, [holder nodes tried])`` or ``None``
    when nothing is to be fetched.
    """
    mine = owner_dirname(node)
    offers: dict[int, dict[str, list[tuple[str, PeerClient]]]] = {}
    held: dict[int, set[str]] = {}
    for name, client in peers:
        try:
            listing = client.list_steps()
        except PeerError as exc:
            log.warning("shardckpt: node %s cannot list the steps of peer %s: %s", node, name, exc)
            continue
        for s, version in (listing.get("local") or {}).items():
            held.setdefault(int(s), set()).add(version)
        for s, version in ((listing.get("replicas") or {}).get(mine) or {}).items():
            offers.setdefault(int(s), {}).setdefault(version, []).append((name, client))
    newest_here = max(layout.committed_steps(root), default=-1)
    for step in sorted((s for s in offers if s > newest_here), reverse=True):
        if len(offers[step]) != 1 or not held.get(step, set()) <= set(offers[step]):
            continue  # two saves of this number among the replicas, or a peer's own step is another save
        tried = []
        version, holders = next(iter(offers[step].items()))
        for holder, client in holders:
            tried.append(holder)
            try:
                _fetch_step(root, step, node, client, version)
                return step, tried
            except (PeerError, CorruptCheckpointError, OSError) as exc:
                log.warning("shardckpt: node %s: step %d from the replica on node %s failed, trying the next "
                            "holder: %s", node, step, holder, exc)
        return None
    return None


def _fetch_step(root: str, step: int, node: str, client: PeerClient, version: str) -> None:
    text = client.get(step, layout.MANIFEST_NAME, owner=node).decode("utf-8", errors="replace")
    manifest = layout.Manifest.from_json(text, f"the replica of node {node} step {step} on {client.addr}")
    if manifest.step != step or layout.version_of(manifest) != version:
        raise CorruptCheckpointError(f"the replica of step {step} on {client.addr} is no longer the save it listed "
                                     f"({version}); not used")
    final = os.path.join(root, layout.step_dirname(step))
    partial = os.path.join(root, layout.partial_dirname(step, f"peer{uuid.uuid4().hex[:8]}"))
    os.makedirs(partial)
    try:
        names = client.held_files(step, owner=node)
        unknown = [n for n in names if n not in manifest.files or "/" in n]
        if unknown:
            raise CorruptCheckpointError(f"the replica of step {step} on {client.addr} holds files its manifest "
                                         f"does not name: {unknown[:3]}")
        for name in names:
            client.get_file(step, name, os.path.join(partial, name), manifest.files[name], owner=node)
        layout.atomic_write_text(os.path.join(partial, layout.MANIFEST_NAME), text)
        layout.fsync_dir(partial)
        if os.path.lexists(final):
            raise OSError(f"{final} appeared while step {step} was fetched from {client.addr}; not replaced")
        os.rename(partial, final)
        layout.fsync_dir(root)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("shardckpt: node %s: step %d (%d file(s)) fetched from the replica on %s", node, step, len(names),
             client.addr)


# ------------------------------------------------------------ server


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
        manifest = _manifest_or_none(step_dir)
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
            held = _manifest_or_none(final)
            if held is not None and version_tag(held) == tag:
                return {"state": "committed"}
            partial = self.partial_of(owner, step, tag)
            os.makedirs(partial, exist_ok=True)
            pending = os.path.join(partial, layout.MANIFEST_NAME + ".pending")
            layout.atomic_write_text(pending, manifest.to_json())
            have = [n for n, e in manifest.files.items() if _size(os.path.join(partial, n)) == e.size]
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
                if entry is None or _size(os.path.join(partial, name)) != entry.size:
                    raise _Refused(409, f"{name} of step {step} has not arrived; nothing committed")
            os.replace(os.path.join(partial, layout.MANIFEST_NAME + ".pending"), os.path.join(partial, layout.MANIFEST_NAME))
            layout.fsync_dir(partial)
            owner_dir = os.path.dirname(partial)
            final = os.path.join(owner_dir, layout.step_dirname(step))
            if os.path.lexists(final):  # another save of this step number: replaced by this one
                _remove_step(final, owner_dir)
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
            _remove_step(os.path.join(owner_dir, layout.step_dirname(old)), owner_dir)
        for name in os.listdir(owner_dir):  # begun replicas older than every kept one
            if name.startswith(layout.PARTIAL_PREFIX):
                step = layout.parse_step_dirname(name[len(layout.PARTIAL_PREFIX):].split("-", 1)[0])
                if step is not None and steps and step < steps[-1]:
                    shutil.rmtree(os.path.join(owner_dir, name), ignore_errors=True)


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _manifest_or_none(step_dir: str) -> layout.Manifest | None:
    try:
        return layout.read_manifest(step_dir)
    except CorruptCheckpointError:
        return None


def _remove_step(step_dir: str, parent: str) -> None:
    """Delete a replica: its manifest first (an interrupted deletion leaves no step), then the rest."""
    try:
        os.unlink(os.path.join(step_dir, layout.MANIFEST_NAME))
    except OSError:
        pass
    trash = os.path.join(parent, f"{layout.TRASH_PREFIX}{os.path.basename(step_dir)}-{uuid.uuid4().hex[:8]}")
    os.rename(step_dir, trash)
    shutil.rmtree(trash, ignore_errors=True)


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


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def serve(service: PeerService, host: str, port: int = 0) -> _Server:
    """Start the endpoint for ``service`` on ``host`` (a free port unless given), in a daemon thread."""
    handler = type("PeerHandler", (_Handler,), {"service": service})
    server = _Server((host, port), handler)
    threading.Thread(target=server.serve_forever, name="shardckpt-peer-http", daemon=True).start()
    return server


# ------------------------------------------------------------ the daemon


@dataclasses.dataclass
class _Sent:
    version: str
    holders: list[str]
    time: float
    seconds: float


class PeerDaemon:
    """Serves this node's endpoint and replicates its newest committed step to the nodes in ``peers.json``.

    Exits on SIGTERM, or once no trainer of the node is alive, nothing is left
    to replicate and no request came for ``linger_s`` (other nodes may still
    be sending their replicas here).
    """

    def __init__(self, root: str, node: str, host: str, *, poll_s: float = 0.5, linger_s: float = 60.0) -> None:
        self.root = os.path.abspath(root)
        self.node = node
        self.host = host
        self.poll_s = poll_s
        self.linger_s = linger_s
        self.service = PeerService(self.root, node)
        self.sent: dict[int, _Sent] = {}
        self.last_error: str | None = None
        self.sent_bytes = 0
        self._retry_at = 0.0
        self._failures = 0
        self._nodes_seen: str | None = None
        self._stop = threading.Event()
        self._lock_fd: int | None = None
        self._server: _Server | None = None
        self._alone_since: float | None = None

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def run(self) -> int:
        os.makedirs(state_dir(self.root), exist_ok=True)
        fd = os.open(os.path.join(state_dir(self.root), LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            log.info("shardckpt: a peer daemon already serves %s; this one exits", self.root)
            return 0
        self._lock_fd = fd
        try:
            self._server = serve(self.service, self.host)
            log.info("shardckpt: peer daemon (pid %d, node %s) serves %s on %s", os.getpid(), self.node,
                     self.root, self.addr)
            while not self._stop.is_set():
                if not os.path.isdir(state_dir(self.root)):
                    log.info("shardckpt: %s is gone; the peer daemon exits", self.root)
                    break
                pending = self.tick()
                self._write_status("running")
                if self._idle(pending):
                    log.info("shardckpt: peer daemon idle, no trainer left on this node; exiting")
                    break
                self._stop.wait(self.poll_s)
            return 0
        finally:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
            if os.path.isdir(state_dir(self.root)):
                self._write_status("exited")
            os.close(fd)

    @property
    def addr(self) -> str:
        assert self._server is not None
        return f"{self.host}:{self._server.server_address[1]}"

    def _idle(self, pending: bool) -> bool:
        now = time.monotonic()
        if pending or trainers_alive(self.root):
            self._alone_since = None
            return False
        self._alone_since = self._alone_since or now
        quiet = min(now - self._alone_since, now - self.service.last_request)
        return quiet >= self.linger_s

    def peers(self) -> dict[str, Any]:
        return read_json(os.path.join(state_dir(self.root), PEERS_NAME))

    def tick(self) -> bool:
        """Replicate the newest committed step where it is not yet; True while something is left to do."""
        config = self.peers()
        keep = config.get("keep_last")
        self.service.keep_last = keep if isinstance(keep, int) and keep > 0 else None
        count = int(config.get("replicas") or 0)
        nodes = config.get("nodes") or []
        seen = json.dumps(nodes, sort_keys=True)
        if seen != self._nodes_seen:  # a restarted job (new addresses): retry at once, not after the backoff
            self._nodes_seen, self._retry_at, self._failures = seen, 0.0, 0
        secret = self.service.secret()
        holders = placement(nodes, self.node, count)
        steps = layout.committed_steps(self.root)
        if not holders or not steps or secret is None:
            return False
        step = steps[-1]
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        manifest = _manifest_or_none(step_dir)
        if manifest is None:
            return False
        version = layout.version_of(manifest)
        done = self.sent.get(step)
        if done is not None and done.version == version and {h["node"] for h in holders} <= set(done.holders):
            return False
        if time.monotonic() < self._retry_at:
            return True
        names, _elsewhere = layout.copy_files(step_dir, manifest)
        t0 = time.monotonic()
        reached: list[str] = []
        for holder in holders:
            try:
                self.sent_bytes += PeerClient(holder["addr"], secret).put_replica(
                    self.node, step_dir, manifest, names, config.get("bandwidth"))
                reached.append(holder["node"])
            except (PeerError, OSError, ValueError) as exc:
                self.last_error = f"step {step} to node {holder['node']} ({holder['addr']}): {exc}"
        if len(reached) < len(holders):
            self._failures += 1
            self._retry_at = time.monotonic() + min(30.0, 0.5 * 2 ** self._failures)
            log.warning("shardckpt: step %d is not yet replicated to every peer (retry in %.1f s): %s", step,
                        self._retry_at - time.monotonic(), self.last_error)
            return True
        self._failures = 0
        self.last_error = None
        self.sent = {s: v for s, v in self.sent.items() if s in steps[-4:]}
        self.sent[step] = _Sent(version, reached, time.time(), round(time.monotonic() - t0, 3))
        log.info("shardckpt: step %d peer-durable: replicated to %s in %.2f s", step, ", ".join(reached),
                 time.monotonic() - t0)
        return False

    def _write_status(self, state: str) -> None:
        body = {
            **process_record(state, self.node),
            "addr": self.addr if self._server is not None else None,
            "replicated": {str(s): dataclasses.asdict(v) for s, v in sorted(self.sent.items())},
            "sent_bytes": self.sent_bytes,
            "last_error": self.last_error,
        }
        path = os.path.join(state_dir(self.root), STATUS_NAME)
        if read_json(path) == body:
            return
        try:
            layout.atomic_write_text(path, json.dumps(body, indent=1))
        except OSError as exc:
            log.warning("shardckpt: cannot write the peer status under %s: %s", self.root, exc)


def replicated(root: str, step: int, manifest: layout.Manifest | None = None) -> dict[str, Any] | None:
    """What this node's daemon recorded of sending its files of ``step``, for the version committed
    here (``{"holders", "time", "seconds"}``); ``None`` when not replicated (or another save was)."""
    info = read_json(os.path.join(state_dir(root), STATUS_NAME))
    sent = (info.get("replicated") or {}).get(str(step))
    if manifest is None:
        manifest = _manifest_or_none(os.path.join(root, layout.step_dirname(step)))
    if not sent or manifest is None or sent.get("version") != layout.version_of(manifest):
        return None
    return sent


def node_status(root: str) -> dict[str, Any] | None:
    """What ``shardckpt status`` shows of the peer tier on this node (``None``: no daemon has run here)."""
    info = read_json(os.path.join(state_dir(root), STATUS_NAME))
    if not info:
        return None
    replicated = info.get("replicated") or {}
    newest = max((int(s) for s in replicated if s.isdigit()), default=None)
    return {
        "state": info.get("state"),
        "addr": info.get("addr"),
        "latest_peer": newest,
        "holders": replicated.get(str(newest), {}).get("holders") if newest is not None else None,
        "holding": {owner: sorted(steps) for owner, steps in committed_replicas(root).items()},
        "last_error": info.get("last_error"),
    }


def status_line(body: dict[str, Any]) -> str:
    holding = "; ".join(f"{o} steps {s}" for o, s in body["holding"].items()) or "nothing"
    return (f"  peer: daemon {body['state']} on {body['addr']}; newest step replicated: {body['latest_peer']}"
            f"{' to ' + ', '.join(body['holders']) if body['holders'] else ''}; holding replicas of {holding}"
            + (f"; last error: {body['last_error']}" if body["last_error"] else ""))


def peer_main(argv: list[str]) -> int:
    """Entry point of the peer daemon started by a trainer (no torch import)."""
    import argparse

    daemon_logging()
    parser = argparse.ArgumentParser(prog="shardckpt peer")
    parser.add_argument("--local", required=True, help="the node's local_dir")
    parser.add_argument("--node", default=socket.gethostname(), help="this node's name (default: hostname)")
    parser.add_argument("--host", required=True, help="the address to serve on (this node's address)")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between looks for a new step")
    parser.add_argument("--linger", type=float, default=60.0,
                        help="seconds to keep serving once no trainer of this node is left (default 60)")
    args = parser.parse_args(argv)
    daemon = PeerDaemon(args.local, args.node, args.host, poll_s=args.poll, linger_s=args.linger)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, daemon.stop)
    return daemon.run()
