"""On-disk layout: step names, the manifest (commit record) and file checksums.

A tier (local directory or remote prefix) holds one directory per step::

    step_0000000010/
        .metadata                 DCP's metadata (written by rank 0)
        __0_0.distcp ...          DCP's shard files, one set per rank
        shardckpt.json            the manifest: written last, makes the step exist

A step directory without its manifest does not exist for anyone. A save in
progress is written under ``.partial-step_<step>-<nonce>`` and renamed into
place once the manifest is in it; a step being deleted first loses its
manifest, so an interrupted deletion is also invisible.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import tempfile
import time
from typing import Any, Iterable

import xxhash

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import manifest_schema

MANIFEST_NAME = "shardckpt.json"
METADATA_NAME = ".metadata"
HIDDEN_MANIFEST_NAME = "shardckpt.json.deleted"
MANIFEST_FORMAT = "shardckpt/1"
STEP_PREFIX = "step_"
PARTIAL_PREFIX = ".partial-"
TRASH_PREFIX = ".trash-"
REPLACED_PREFIX = ".replaced-"
KEPT_PREFIX = ".kept-"
"""An earlier save of a step number, set aside by a later save of that number: never read as
the step, kept (abandoned) until ``shardckpt gc`` removes it."""
_STEP_RE = re.compile(r"^step_(\d{10,})$")
_CHUNK = 8 << 20


def step_dirname(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:010d}"


def parse_step_dirname(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def partial_dirname(step: int, nonce: str) -> str:
    return f"{PARTIAL_PREFIX}{step_dirname(step)}-{nonce}"


def parse_partial_save(name: str) -> tuple[int, str] | None:
    """``(step, save id)`` of a partial directory ``.partial-step_<N>-<count>-<nonce>`` (the save
    ``<nonce>-<count>``); ``None`` for a name of another form."""
    if not name.startswith(PARTIAL_PREFIX):
        return None
    parts = name[len(PARTIAL_PREFIX):].split("-")
    step = parse_step_dirname(parts[0])
    if step is None or len(parts) != 3:
        return None
    return step, f"{parts[2]}-{parts[1]}"


CHECKSUM_ALGO = "xxh3-128"
"""Checksum of new files. The manifest is not signed, so a cryptographic hash
would add no protection against tampering (whoever can change a file can
rewrite its manifest entry); the checksum catches corruption and truncation,
and xxh3-128 does that at memory speed (about 6x SHA-256 here). Untrusted
content is handled by the loaders, which never unpickle arbitrary objects."""

_ALGOS = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}


CHUNK_ALGO = "xxh3-64"
CHUNK_BYTES = 4 << 20
"""Files are also checksummed per chunk of this many bytes (xxh3-64 each), so that a byte
range of a file can be verified without the whole file (a ranged fetch from the remote).
The manifest records them per file as one hex string (:attr:`FileEntry.chunks`): 16 hex
characters per 4 MiB, 3.2 MB for an 840 GB step. A ranged fetch reads whole chunks: a
small record costs up to one chunk (see README, "Need-only restores"). The size is recorded with the sums: a
reader follows the writer's (the multi-node tests save with small chunks to see ranges)."""


class Checksum:
    """An incremental checksum whose value names its algorithm: ``"xxh3-128:<hex>"``.

    With ``chunked``, the same updates also checksum every :data:`CHUNK_BYTES` chunk
    (:meth:`chunk_sums`): one pass over the bytes for both.
    """

    def __init__(self, algo: str = CHECKSUM_ALGO, *, chunked: bool = False) -> None:
        if algo not in _ALGOS:
            raise ValueError(f"unknown checksum algorithm {algo!r}; known: {sorted(_ALGOS)}")
        self.algo = algo
        self._h = _ALGOS[algo]()
        self._chunks: list[str] | None = [] if chunked else None
        self._chunk = xxhash.xxh3_64()
        self._in_chunk = 0
        self._chunk_bytes = CHUNK_BYTES

    @classmethod
    def like(cls, expected: str | None) -> "Checksum":
        """A fresh checksum of the same algorithm as the value ``expected`` (the default one for ``None``)."""
        return cls() if expected is None else cls(expected.split(":", 1)[0])

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)
        if self._chunks is None:
            return
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, self._chunk_bytes - self._in_chunk)
            self._chunk.update(view[:take])
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self._chunk_bytes:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk.reset()
                self._in_chunk = 0

    def value(self) -> str:
        return f"{self.algo}:{self._h.hexdigest()}"

    def chunk_sums(self) -> str:
        """The chunk checksums so far (a last partial chunk included): see :attr:`FileEntry.chunks`."""
        if self._chunks is None:
            return ""
        tail = [self._chunk.hexdigest()] if self._in_chunk else []
        return f"{CHUNK_ALGO}:{self._chunk_bytes}:" + "".join(self._chunks + tail)


def checksum_bytes(data: bytes | memoryview, like: str | None = None) -> str:
    c = Checksum.like(like)
    c.update(data)
    return c.value()


def _hash_file(path: str, c: Checksum) -> int:
    """Feed the file to ``c`` in 8 MiB reads; returns its size."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            size += n
            c.update(view[:n])
    return size


def checksum_file(path: str, like: str | None = None) -> tuple[int, str]:
    """Size and checksum of a file (algorithm of ``like`` when given), read in 8 MiB chunks."""
    c = Checksum.like(like)
    return _hash_file(path, c), c.value()


def file_sums(path: str) -> tuple[int, str, str]:
    """Size, checksum and chunk checksums (:attr:`FileEntry.chunks`) of a file, in one read."""
    c = Checksum(chunked=True)
    return _hash_file(path, c), c.value(), c.chunk_sums()


def chunk_table(chunks: str, size: int) -> tuple[int, list[str]] | None:
    """``(chunk size, [hex digest per chunk])`` of a :attr:`FileEntry.chunks` value for a file
    of ``size`` bytes; ``None`` when there is none or it does not fit the file (then the file
    can only be verified whole)."""
    parts = chunks.split(":")
    if len(parts) != 3 or parts[0] != CHUNK_ALGO or not parts[1].isdigit() or int(parts[1]) <= 0:
        return None
    step, digits = int(parts[1]), parts[2]
    count = -(-size // step)
    if len(digits) != 16 * count:
        return None
    return step, [digits[i : i + 16] for i in range(0, len(digits), 16)]


def chunk_sum(data: bytes | memoryview) -> str:
    """The chunk checksum of ``data`` (one chunk, or the last one of a file), as in :func:`chunk_table`."""
    return xxhash.xxh3_64_hexdigest(data)


def _parse_checksum(entry: dict[str, Any], name: str) -> str:
    if "checksum" in entry:
        value = str(entry["checksum"])
    else:  # manifests written before checksums named their algorithm
        value = "sha256:" + str(entry["sha256"])
    if value.split(":", 1)[0] not in _ALGOS or ":" not in value:
        raise ValueError(f"file {name!r} has a checksum of unknown kind {value[:24]!r}")
    return value


@dataclasses.dataclass
class FileEntry:
    size: int
    checksum: str
    """``"<algorithm>:<hex digest>"``, see :data:`CHECKSUM_ALGO`."""
    rank: int
    chunks: str = ""
    """``"xxh3-64:<chunk bytes>:<16 hex digits per chunk>"``: the checksum of every chunk of the
    file (the last one may be short), for verifying byte ranges (:func:`chunk_table`). Empty in
    manifests from before it was recorded, and for files hashed without it: such a file is
    fetched and verified whole."""


@dataclasses.dataclass
class Manifest:
    """The commit record of one step. Its presence is what makes a step exist."""

    step: int
    world_size: int
    files: dict[str, FileEntry]
    created: float = dataclasses.field(default_factory=time.time)
    torch_version: str = ""
    shardckpt_version: str = ""
    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    """Top-level state key -> kind (module, optimizer, stateful, value, rng)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    total_bytes: int = 0
    run_id: str | None = None
    """The run that wrote the step (``CheckpointConfig.run_id``), when set."""
    copies: list[list[int]] = dataclasses.field(default_factory=list)
    """Ranks whose shard files each directory copy holds: one group when the
    directory was shared by all ranks, one per node when node-local. Every copy
    holds ``.metadata``. Empty in manifests from before this field: one copy."""
    lineage: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The branch of the run's history this step belongs to (see ``shardckpt.format.lineage``);
    empty in manifests from before rollbacks were tracked: the first branch."""
    kind: str = "full"
    """``full``, or ``light``: model weights and the small state, without optimizer state."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Metrics recorded at save (``save(..., metrics={"val_loss": 1.83})``), for ``keep_best``."""
    upload: bool = True
    """Whether the uploader sends this step (``remote_every`` uploads only every M-th)."""
    frozen: dict[str, Any] = dataclasses.field(default_factory=dict)
    """With ``trainable_only``: the frozen keys left out by design, per module key:
    ``{module: {fqn: {"shape": [...], "dtype": str, "fingerprint": [sum, sum of squares]}}}``."""
    run: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What was this checkpoint: the run's config, command line, world size, device,
    versions, run id (``Checkpointer(run_config=...)``)."""
    save_id: str = ""
    """The identity of this save, agreed by every rank (every directory copy of one save
    carries the same id). Two saves of one step number have different ids; see
    :func:`version_of`. Empty in manifests from before it was recorded."""
    stored: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Remote manifests only: the files stored compressed, ``{name: stored form}`` (see
    :mod:`shardckpt.format.codec` and ``remote/compressed.py``). Not part of the step's identity
    (:func:`files_digest`): the files' logical bytes are. Empty for local copies and for files
    stored as they are."""
    format: str = MANIFEST_FORMAT

    def to_json(self, cache: dict[str, Any] | None = None) -> str:
        """The manifest's text (sealed). ``cache``: kept by the caller between manifests of one kind of save,
        each field's text reused when its value is the same (the same text)."""
        if cache is not None:  # the fields as they are, not deep-copied (a value JSON cannot encode: as below)
            body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
            body["files"] = {name: {k: v for k, v in dataclasses.asdict(entry).items() if k != "chunks" or v}
                             for name, entry in self.files.items()}
            if not body["stored"]:
                del body["stored"]
            try:
                return manifest_schema.seal_reusing(body, cache)
            except TypeError:
                cache.clear()
        body = dataclasses.asdict(self)
        for entry in body["files"].values():
            if not entry["chunks"]:
                del entry["chunks"]
        if not body["stored"]:
            del body["stored"]
        return manifest_schema.seal(body)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "Manifest":
        """The manifest in ``text`` (read from ``where``); its digest and every field's type are
        checked first (:mod:`shardckpt.format.manifest_schema`)."""
        parent = os.path.basename(os.path.dirname(where.replace("\\", "/").rstrip("/")))
        body = manifest_schema.decode(text, where, expected_format=MANIFEST_FORMAT, step=parse_step_dirname(parent))
        try:
            files = {}
            for name, entry in body["files"].items():
                check_relpath(name, where)
                files[name] = FileEntry(
                    int(entry["size"]), _parse_checksum(entry, name), int(entry["rank"]), str(entry.get("chunks") or "")
                )
            return cls(
                step=int(body["step"]),
                world_size=int(body["world_size"]),
                files=files,
                created=float(body.get("created", 0.0)),
                torch_version=str(body.get("torch_version", "")),
                shardckpt_version=str(body.get("shardckpt_version", "")),
                keys=dict(body.get("keys", {})),
                metadata=dict(body.get("metadata", {})),
                total_bytes=int(body.get("total_bytes", 0)),
                run_id=None if body.get("run_id") is None else str(body["run_id"]),
                copies=[[int(r) for r in group] for group in body.get("copies", [])],
                lineage=dict(body.get("lineage") or {}),
                kind=_kind(body.get("kind", "full")),
                metrics={str(k): float(v) for k, v in (body.get("metrics") or {}).items()},
                upload=bool(body.get("upload", True)),
                frozen=dict(body.get("frozen") or {}),
                run=dict(body.get("run") or {}),
                save_id=str(body.get("save_id") or ""),
                stored={str(k): dict(v) for k, v in (body.get("stored") or {}).items() if k in files},
            )
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"manifest {where} is unreadable ({exc}); the step cannot be trusted. "
                f"Remedy: load an earlier step (load(step=...)) or delete this step directory."
            ) from exc


def files_digest(manifest: Manifest) -> str:
    """A digest of a step's file table: the names and checksums of its files."""
    h = hashlib.sha256()
    for name in sorted(manifest.files):
        h.update(f"{name}\0{manifest.files[name].checksum}\n".encode())
    return h.hexdigest()


def version_of(manifest: Manifest) -> str:
    """What identifies one save of a step, whatever its number: the save's id, or for
    manifests without one the digest of its file table. Choosing, comparing, fetching,
    committing and deleting a step compare this, never the step number alone."""
    return f"id:{manifest.save_id}" if manifest.save_id else f"files:{files_digest(manifest)[:32]}"


def kept_name(step_name: str, manifest: "Manifest | None") -> str:
    """The name an earlier save of a step is kept aside under: ``.kept-step_<N>-<its save id>``."""
    tag = (manifest.save_id or files_digest(manifest)[:16]) if manifest is not None else ""
    return f"{KEPT_PREFIX}{step_name}-{tag}"


def _kind(value: Any) -> str:
    if value not in ("full", "light"):
        raise ValueError(f"unknown step kind {value!r}")
    return str(value)


def check_relpath(name: str, where: str) -> None:
    """Refuse manifest entries that would escape the step directory."""
    if (
        not name
        or name.startswith(("/", "\\"))
        or os.path.isabs(name)
        or any(part in ("..", "") for part in name.replace("\\", "/").split("/"))
    ):
        raise CorruptCheckpointError(
            f"manifest {where} names the file {name!r}, which is outside its step directory; "
            f"the checkpoint was tampered with or corrupted. Remedy: delete this step."
        )


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str, *, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` atomically: tmp file (of ``mode``) + fsync + rename + dir fsync."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def read_manifest(step_dir: str) -> Manifest | None:
    """The manifest of a step directory, ``None`` when it has none (not committed)."""
    path = os.path.join(step_dir, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(data, path)


def committed_steps(root: str) -> list[int]:
    """Steps under ``root`` that have a manifest, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        step = parse_step_dirname(name)
        if step is not None and os.path.isfile(os.path.join(root, name, MANIFEST_NAME)):
            steps.append(step)
    return sorted(steps)


def verify_remedy(step: int) -> str:
    return (
        "Remedy: restore the file from the remote tier (`shardckpt pull --remote URL --local DIR "
        f"--step {step}` replaces files that fail), load an earlier step with load(step=...), "
        "or set on_corrupt='fallback'."
    )


def file_problem(step: int, path: str, entry: FileEntry, size: int, digest: str | None) -> str | None:
    """What is wrong with a file of ``size`` bytes and checksum ``digest`` (None: not hashed), or None."""
    if size != entry.size:
        return (
            f"step {step}: file {path} is {size} bytes, the manifest says {entry.size} "
            f"(truncated or overwritten). {verify_remedy(step)}"
        )
    if digest is not None and digest != entry.checksum:
        return (
            f"step {step}: file {path} fails its {entry.checksum.split(':')[0]} checksum "
            f"(corrupted or tampered). {verify_remedy(step)}"
        )
    return None


def verify_files(step_dir: str, manifest: Manifest, names: Iterable[str] | None = None, *, hash: bool = True) -> None:
    """Check size and checksum of ``names`` (all files by default) against the manifest.

    ``hash=False`` checks presence and size only (a ``stat``).
    """
    for name in manifest.files if names is None else names:
        entry = manifest.files[name]
        path = os.path.join(step_dir, name)
        try:
            if hash:
                size, digest = checksum_file(path, like=entry.checksum)
            else:
                size, digest = os.path.getsize(path), None
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"step {manifest.step}: file {path} named in the manifest is missing. {verify_remedy(manifest.step)}"
            ) from None
        problem = file_problem(manifest.step, path, entry, size, digest)
        if problem:
            raise CorruptCheckpointError(problem)


def absent_files(step_dir: str, manifest: Manifest) -> list[str]:
    """Manifest files that do not exist in ``step_dir`` (held by another node's copy, or lost)."""
    return sorted(n for n in manifest.files if not os.path.exists(os.path.join(step_dir, n)))


def missing_files(step_dir: str, manifest: Manifest) -> list[str]:
    """Manifest files absent from ``step_dir`` or of the wrong size (cheap, no hashing)."""
    out = []
    for name, entry in manifest.files.items():
        try:
            if os.path.getsize(os.path.join(step_dir, name)) != entry.size:
                out.append(name)
        except OSError:
            out.append(name)
    return out


def copy_files(step_dir: str, manifest: Manifest) -> tuple[list[str], list[list[int]]]:
    """The files this directory copy of a step must hold, and the copies held elsewhere.

    A step saved into node-local directories leaves on each node the shard
    files of that node's ranks (and ``.metadata``). A copy is recognised by
    the files present: a group of ranks with any file here must have all of
    them here; a group with none lives on another node (or on the remote).
    """
    groups = manifest.copies or [sorted({e.rank for e in manifest.files.values()})]
    if len(groups) <= 1:
        return sorted(manifest.files), []
    must: list[str] = []
    elsewhere: list[list[int]] = []
    for group in groups:
        names = [n for n, e in manifest.files.items() if e.rank in group and n != METADATA_NAME]
        if any(os.path.exists(os.path.join(step_dir, n)) for n in names):
            must += names
        else:
            elsewhere.append(list(group))
    if METADATA_NAME in manifest.files:
        must.append(METADATA_NAME)
    return sorted(must), elsewhere
