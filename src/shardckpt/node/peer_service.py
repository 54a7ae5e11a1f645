"""What a node's peer endpoint serves and accepts: its committed steps and replicas, and replicas of others.

Reads of committed steps' files from the local directory or from the replica
directory, a listing of both, and writes of replicas
(:mod:`shardckpt.format.replicas`): a replica is begun with the owner's
manifest, each file is checked against it as it arrives (size and checksum),
and it is committed by renaming the manifest into place last. Who may ask
(mutual TLS, the job's members, the bounds a network-facing server keeps) is
the server's business: :mod:`shardckpt.node.peer_server`. It imports no torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import ssl
import stat
import threading
import time
import uuid
from typing import Any, Callable

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout, lineage
from shardckpt.format.replicas import (
    committed_replicas,
    file_size,
    manifest_or_none,
    owner_dirname,
    remove_step,
    replicas_root,
    version_tag,
)
from shardckpt.stores.admission import Admission
from shardckpt.stores.tls import fingerprint

log = logging.getLogger("shardckpt")

RECEIVE_BUFFER = 4 << 20
"""Bytes of a replica file received, checksummed and written at a time (one buffer per file, reused)."""
MAX_SMALL_BODY = 16 << 20
"""Largest manifest or commit body accepted."""
_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,100}$")


class _Refused(Exception):
    """A request refused with an HTTP status (and extra answer headers)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


MAX_DIGITS = 18
"""Digits of a number a request may carry (a step, a byte offset, a length): below 10**18."""


def number(text: str, what: str) -> int | None:
    """``text`` as a number (``None``: not plain ASCII digits); refused with 400 when it has more than
    :data:`MAX_DIGITS` digits (Python would not even convert 5,000)."""
    if not text or not text.isascii() or not text.isdigit():
        return None
    if len(text) > MAX_DIGITS:
        raise _Refused(400, f"{what} {text[:24]}... has {len(text)} digits; at most {MAX_DIGITS} are accepted")
    return int(text)


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
        self.admission: Admission | None = None
        """This node's admission keys with the members (:mod:`shardckpt.stores.admission`): whose token
        puts a connection in its member's own queue (``None``: every connection waits with strangers)."""
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self.last_request = time.monotonic()
        self.keep_last: int | None = None
        """Replicas kept per owner (the trainer's keep_last, from peers.json)."""
        self.agreed: tuple[int, str] | None = None
        """The newest step complete across any single node's loss, as the job's nodes agreed at a save
        (``peer-agreed.json``, set by the daemon): replicas of it and of newer steps are never deleted."""

    def configure(self, context: ssl.SSLContext, members: dict[str, str], admission: Admission | None = None) -> None:
        """Serve new connections with ``context`` (a relaunch's certificates) and ``admission`` (the members'
        tokens); connections open go on."""
        self.context, self.members, self.admission = context, dict(members), admission

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
        step = number(rest[0], "step")
        if step is None:
            raise _Refused(400, f"step {rest[0][:40]!r} is not a number")
        return os.path.join(base, layout.step_dirname(step)), rest[1:]

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

    def begin(
        self, owner: str, step: int, tag: str, body: bytes, live: lineage.Lineage | None = None
    ) -> dict[str, Any]:
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
            os.replace(os.path.join(partial, layout.MANIFEST_NAME + ".pending"),
                       os.path.join(partial, layout.MANIFEST_NAME))
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
        if (agreed is not None and agreed[0] in replicas_held
                and layout.version_of(replicas_held[agreed[0]]) != agreed[1]):
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
