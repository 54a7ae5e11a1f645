"""Compressed objects on the remote: upload, ranged read, whole fetch, and the ``auto`` decision.

A file the uploader compresses is stored beside where its plain object
would be, under ``<name>.szc`` (:data:`SUFFIX`), in the stored form of
:mod:`shardckpt.format.codec`: one self-describing encoded chunk per chunk
of the manifest's chunk table. Its *stored form* (:class:`StoredForm`: the
codec, the object's size and checksum, each chunk's stored length) travels
in the uploading node's marker to the committer, which writes the stored
forms of every node into the remote manifest (``Manifest.stored``). A
reader of the remote copy has it from the manifest it already reads: no
request more per file, and the manifest's digest covers it.

Uploads stream: each file's chunks are encoded by a small pool of threads,
a few ahead, and go up as the parts of one multipart upload while later
chunks are still being encoded (:meth:`Store.put_stream`), so a file is
remote-durable after about the longer of its encoding and its upload, and
no encoded copy is written to disk. Early uploads (while the save is
written) go up compressed too.

What is verified is what is restored, and nothing is decoded unchecked:

* the stored form names each stored chunk's checksum (``sums``: xxh3-64 of
  its stored bytes, 16 hex digits each), checked before the chunk is
  decoded, on every path (ranged and whole); the stored form's whole
  checksum guards the object (``shardckpt verify``, whole fetches);
* decoding is bounded by the manifest, not by the stored bytes: each
  stored chunk's length is at most one raw chunk, its header's length and
  every zstd frame's declared content size must equal the chunk's logical
  length before anything is allocated (:func:`codec.decode_chunk`);
* the manifest's checksums (whole file and per chunk) are of the logical
  bytes, checked after decoding.

Any violation is a bad read: fetched once more from the store, then refused
with :class:`CorruptCheckpointError` naming the object and the chunk.
Stored forms written before ``sums`` existed load as before (their chunks
checked after decoding, decoding bounded all the same).

The local tier is not touched: local copies, local manifests and peer
replicas hold the files as DCP wrote them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import uuid
from typing import Any, Callable, Iterator, Mapping

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import codec, layout
from shardckpt.remote import auto_compress
from shardckpt.remote.auto_compress import WORKERS
from shardckpt.remote.missing import read_committed
from shardckpt.stores import Deadline, Store, safe_url

log = logging.getLogger("shardckpt")

SUFFIX = ".szc"
_CODEC_NAMES = {"bytegroup-zstd": codec.CODEC}
SUM_HEX = 16
"""Hex digits of one stored chunk's checksum in a stored form's ``sums``."""

OnBytes = Callable[[int], None]


@dataclasses.dataclass
class StoredForm:
    """How one file is stored on the remote: codec, object size and checksum, stored chunk lengths
    and checksums (``""`` in forms written before they were recorded)."""

    codec: str
    size: int
    checksum: str
    lengths: list[int]
    sums: str = ""

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        if not self.sums:
            del body["sums"]
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "StoredForm":
        return cls(str(body["codec"]), int(body["size"]), str(body["checksum"]), [int(n) for n in body["lengths"]],
                   str(body.get("sums") or ""))

    def stored_sum(self, index: int) -> str | None:
        """The checksum of stored chunk ``index``; ``None`` where the form records none."""
        return self.sums[index * SUM_HEX : (index + 1) * SUM_HEX] if self.sums else None

    def offsets(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


def form_of(manifest: layout.Manifest, name: str) -> StoredForm | None:
    """The stored form of ``name`` in a remote manifest; ``None``: stored as it is.

    A form this version cannot read, or one that does not fit the file's chunk table (a stored chunk
    longer than a raw one, checksums of another count), is damage.
    """
    body = manifest.stored.get(name)
    if body is None:
        return None
    form = StoredForm.from_json(body)
    entry = manifest.files[name]
    table = layout.chunk_table(entry.chunks, entry.size)
    if form.codec != codec.CODEC or table is None or len(table[1]) != len(form.lengths) \
            or sum(form.lengths) != form.size or not fits(form, table[0], entry.size):
        raise CorruptCheckpointError(
            f"step {manifest.step}: the manifest's stored form of {name} ({form.codec}, {len(form.lengths)} chunks) "
            f"does not fit the file or this version of shardckpt cannot decode it. Remedy: upgrade shardckpt, "
            f"load an earlier step, or upload the step again (`shardckpt push`)."
        )
    return form


def fits(form: StoredForm, chunk: int, size: int) -> bool:
    """Whether every stored chunk of ``form`` is no longer than the raw chunk it stands for, and its
    checksums (when recorded) one per chunk."""
    spans = [min(size, (i + 1) * chunk) - i * chunk for i in range(len(form.lengths))]
    return all(codec.HEADER.size <= n <= codec.max_stored(s) for n, s in zip(form.lengths, spans)) \
        and (not form.sums or len(form.sums) == SUM_HEX * len(form.lengths))


def object_name(manifest: layout.Manifest, name: str) -> str:
    """The object's name within the step's prefix on the remote."""
    return name + SUFFIX if name in manifest.stored else name


def expected(manifest: layout.Manifest, name: str) -> tuple[str, int, str]:
    """``(object name, size, checksum)`` the remote must hold for ``name``."""
    body = manifest.stored.get(name)
    if body is None:
        entry = manifest.files[name]
        return name, entry.size, entry.checksum
    return name + SUFFIX, int(body["size"]), str(body["checksum"])


def stored_bytes(manifest: layout.Manifest) -> int:
    """What the step's objects take on the remote (the logical size of files stored as they are)."""
    return sum(int(manifest.stored[n]["size"]) if n in manifest.stored else e.size for n, e in manifest.files.items())


def stored_note(manifest: layout.Manifest, fmt: Callable[[int], str]) -> str:
    """``"; stored compressed: X of the files' Y (0.81x)"`` for a step with compressed files, else ``""``."""
    if not manifest.stored:
        return ""
    logical = sum(e.size for e in manifest.files.values())
    stored = stored_bytes(manifest)
    return f"; stored compressed: {fmt(stored)} of the files' {fmt(logical)} ({stored / max(logical, 1):.2f}x)"


def early_forms(manifest: layout.Manifest,
                forms: Mapping[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Of the stored forms of files sent compressed while the save was written: those that fit this
    manifest's entries, and the names of those that do not (they are sent again)."""
    good: dict[str, dict[str, Any]] = {}
    misfit: set[str] = set()
    for name, body in forms.items():
        entry = manifest.files.get(name)
        table = layout.chunk_table(entry.chunks, entry.size) if entry is not None else None
        form = StoredForm.from_json(body)
        if table is not None and len(table[1]) == len(form.lengths) and fits(form, table[0], entry.size):
            good[name] = body
        else:
            misfit.add(name)
    return good, misfit


def from_markers(markers: list[dict[str, Any]], manifest: layout.Manifest, digest: str) -> dict[str, dict[str, Any]]:
    """The stored forms the nodes' markers of this save report, for files whose checksum they name."""
    out: dict[str, dict[str, Any]] = {}
    for marker in markers:
        if marker.get("files_digest") != digest:
            continue
        files = marker.get("files", {})
        for name, form in (marker.get("stored") or {}).items():
            entry = manifest.files.get(name)
            if entry is not None and files.get(name) == entry.checksum and isinstance(form, dict):
                out[name] = form
    return out


# ------------------------------------------------------------ upload


_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_one_file = threading.Lock()
"""Files are encoded one at a time (each on every worker): the first is done after its own encoding,
not after all of them, and goes up while the next one is encoded."""


def _workers() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="shardckpt-compress")
        return _pool


def _chunks_of(path: str, chunk: int) -> Iterator[bytes]:
    with open(path, "rb", buffering=0) as f:
        while True:
            data = f.read(chunk)
            if not data:
                return
            yield data


class _Encoding:
    """What the stream of one file's stored chunks has given so far (``whole``: with a checksum of all the
    stored bytes, for a repair to compare; an upload has the store's own)."""

    def __init__(self, entry: layout.FileEntry, whole: bool = False) -> None:
        self.logical = layout.Checksum.like(entry.checksum)
        self.stored = layout.Checksum() if whole else None
        self.read = 0
        self.stored_bytes = 0
        self.lengths: list[int] = []
        self.sums: list[str] = []

    def add(self, stored: bytes) -> bytes:
        if self.stored is not None:
            self.stored.update(stored)
        self.lengths.append(len(stored))
        self.stored_bytes += len(stored)
        self.sums.append(layout.chunk_sum(stored))
        return stored


def _encoded(path: str, entry: layout.FileEntry, step: int, chunk: int, level: int, done: _Encoding,
             again: StoredForm | None, where: str) -> Iterator[bytes]:
    """The stored chunks of the local file ``path``, in order, encoded on :data:`WORKERS` threads at most
    ``2 * WORKERS`` ahead of the reader. The file must match ``entry`` (and, ``again``, encode to that
    stored form): else :class:`CorruptCheckpointError`, raised before the stream ends (the store keeps
    no object of it)."""
    pool = _workers()
    pending: collections.deque[concurrent.futures.Future[bytes]] = collections.deque()
    with _one_file:
        try:
            for data in _chunks_of(path, chunk):
                done.read += len(data)
                done.logical.update(data)
                pending.append(pool.submit(codec.encode_chunk, data, level))
                while len(pending) > 2 * WORKERS:
                    yield done.add(pending.popleft().result())
            while pending:
                yield done.add(pending.popleft().result())
        finally:
            for f in pending:
                f.cancel()
    problem = layout.file_problem(step, path, entry, done.read, done.logical.value())
    if problem:
        raise CorruptCheckpointError(problem)
    if again is not None and done.stored is not None and \
            (done.stored_bytes, done.stored.value()) != (again.size, again.checksum):
        raise CorruptCheckpointError(
            f"step {step}: {where} cannot be repaired from {path}: compressing it again gives other bytes than "
            f"the manifest records (another zstandard version?). Remedy: delete the remote step (`shardckpt gc`) "
            f"and push it again, or load another step."
        )


def put_compressed(store: Store, key: str, path: str, entry: layout.FileEntry, step: int, deadline: Deadline,
                   on_bytes: OnBytes | None = None, *, chunk: int | None = None,
                   again: StoredForm | None = None) -> tuple[StoredForm, str | None]:
    """Upload the local file ``path`` (the step's file ``key``, described by ``entry``) in its stored form
    under ``key`` + :data:`SUFFIX`, streamed: chunks are encoded while the parts before them upload.
    ``chunk``: the chunk size (default: ``entry``'s chunk table's); ``again``: the stored form the
    object must have (a repair). Returns the form and the tag the store gave the object. Progress
    (``on_bytes``) is counted in the file's logical bytes."""
    table = layout.chunk_table(entry.chunks, entry.size)
    chunk = chunk or (table[0] if table is not None else layout.CHUNK_BYTES)
    done = _Encoding(entry, whole=again is not None)
    told = [0, 0]  # stored bytes sent, logical bytes reported (parts finish on several threads)
    lock = threading.Lock()

    def progress(n: int) -> None:
        with lock:
            told[0] += n
            share = min(entry.size, told[0] * done.read // max(1, done.stored_bytes))
            more, told[1] = max(0, share - told[1]), max(share, told[1])
        if on_bytes is not None and more:
            on_bytes(more)

    stream = _encoded(path, entry, step, chunk, codec.LEVEL, done, again, store.where(key + SUFFIX))
    try:
        size, checksum, tag = store.put_stream(key + SUFFIX, stream, deadline, progress)
    finally:
        stream.close()
    if on_bytes is not None and entry.size > told[1]:
        on_bytes(entry.size - told[1])
    return StoredForm(codec.CODEC, size, checksum, done.lengths, "".join(done.sums)), tag


def put_again(store: Store, key: str, path: str, entry: layout.FileEntry, step: int, form: StoredForm,
              deadline: Deadline) -> None:
    """Upload the stored form of ``path`` again (repairing a damaged object). Encoding is deterministic
    (same codec, level and chunking), so the object comes out as the manifest's stored form records;
    where it would not, nothing is stored and :class:`CorruptCheckpointError` says so."""
    put_compressed(store, key, path, entry, step, deadline, again=form)


AUTO_MIN_FILE_BYTES = 8 << 20
"""``auto`` sends files smaller than this as they are: a request costs them more than a fifth of their
bytes could save (each file is one object either way)."""


def chooser(store: Store, root: str, wait_s: float = 0.0) -> Callable[[str, int], bool] | None:
    """Which files of ``root``'s steps go up compressed to ``store`` (``remote_compression``): a test of
    a file's name and size; ``None`` while ``auto`` has not decided (waiting at most ``wait_s``).
    ``.metadata`` never (it is read by name)."""
    decided = auto_compress.wanted(store, auto_compress.links_path(root), wait_s)
    if decided is None:
        return None
    least = AUTO_MIN_FILE_BYTES if getattr(getattr(store, "options", None), "compression", "off") == "auto" else 0
    return lambda name, size: decided and name != layout.METADATA_NAME and size >= least


# ------------------------------------------------------------ reads


def _refused(step: int, where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"step {step}: remote object {safe_url(where)} is corrupt ({what}, twice); it was not loaded. "
        f"Remedy: load an earlier step (load(step=...)) or set on_corrupt='fallback'; repair it from a node that "
        f"still has the step (`shardckpt push --local LOCAL_DIR --remote URL --step N` checks the remote copy and "
        f"uploads again what fails)."
    )


def _decode(form: StoredForm, index: int, stored: memoryview, span: int, at: int) -> bytes | bytearray:
    """Stored chunk ``index`` (object bytes from ``at``), checked against its stored checksum first,
    then decoded into ``span`` logical bytes; :class:`codec.CodecError` naming the chunk."""
    want = form.stored_sum(index)
    where = f"stored chunk {index} (bytes [{at}, {at + len(stored)}) of the object)"
    if want is not None and layout.chunk_sum(stored) != want:
        raise codec.CodecError(f"{where} fails its stored checksum")
    try:
        return codec.decode_chunk(stored, span)
    except codec.CodecError as exc:
        raise codec.CodecError(f"{where} does not decode: {exc}") from exc


def read_range(store: Store, key: str, step: int, entry: layout.FileEntry, form: StoredForm, offset: int,
               length: int, deadline: Deadline) -> bytes | bytearray:
    """Logical bytes ``[offset, offset + length)`` of a compressed file whose object is ``key``: the
    stored chunks covering them, fetched in one ranged read, each checked against its stored checksum
    and decoded into one buffer. A chunk that fails is fetched once more, then refused; the caller
    checks the chunk checksums of what is returned."""
    if length <= 0:
        return b""
    table = layout.chunk_table(entry.chunks, entry.size)
    if table is None:
        raise CorruptCheckpointError(f"step {step}: {store.where(key)} has no chunk table; it cannot be decoded. "
                                     f"Remedy: upload the step again (`shardckpt push`).")
    chunk = table[0]
    first, last = offset // chunk, (offset + length - 1) // chunk
    offsets = form.offsets()
    start, end = offsets[first], offsets[last + 1]
    plain: bytes | bytearray = b""
    for attempt in (1, 2):
        data = memoryview(read_committed(store, key, step, deadline,
                                         lambda: store.get_range(key, start, end - start, deadline), end=end))
        try:
            for i in range(first, last + 1):
                piece = _decode(form, i, data[offsets[i] - start : offsets[i + 1] - start],
                                min(entry.size, (i + 1) * chunk) - i * chunk, offsets[i])
                if first == last:
                    plain = piece
                    break
                if i == first:  # one buffer for the request, allocated once a chunk has passed
                    plain = bytearray(min(entry.size, (last + 1) * chunk) - first * chunk)
                plain[(i - first) * chunk : (i - first) * chunk + len(piece)] = piece
            break
        except codec.CodecError as exc:
            if attempt == 2:
                raise _refused(step, store.where(key), str(exc)) from exc
            log.warning("shardckpt: step %d: %s: %s; fetching it again", step, safe_url(store.where(key)), exc)
    skip = offset - first * chunk
    return plain if skip == 0 and length == len(plain) else bytes(memoryview(plain)[skip : skip + length])


def fetch_whole(store: Store, key: str, step: int, entry: layout.FileEntry, form: StoredForm, path: str,
                deadline: Deadline, on_bytes: OnBytes | None = None) -> None:
    """The compressed file whose object is ``key``, decoded into ``path`` and checked against ``entry``
    (size, checksum, chunk checksums); a bad object is fetched once more, then refused."""
    table = layout.chunk_table(entry.chunks, entry.size)
    chunk = table[0] if table is not None else layout.CHUNK_BYTES
    tmp = f"{path}.szc-{uuid.uuid4().hex[:8]}"
    try:
        for attempt in (1, 2):
            problem = None
            try:
                # The stored object whole, checked against the form's size and checksum before any decoding.
                read_committed(store, key, step, deadline,
                               lambda: store.get_file(key, tmp, form.size, form.checksum, deadline), end=form.size)
                problem = _decode_file(tmp, path, entry, form, chunk, table[1] if table else None, on_bytes)
            except codec.CodecError as exc:
                problem = str(exc)
            except CorruptCheckpointError as exc:
                if attempt == 2:
                    raise
                problem = str(exc)
            if problem is None:
                return
            if os.path.exists(path):
                os.unlink(path)
            if attempt == 2:
                raise _refused(step, store.where(key), problem)
            log.warning("shardckpt: step %d: %s fails (%s); fetching it again", step, safe_url(store.where(key)),
                        problem)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _decode_file(src: str, dst: str, entry: layout.FileEntry, form: StoredForm, chunk: int,
                 sums: list[str] | None, on_bytes: OnBytes | None) -> str | None:
    """Decode ``src`` (the stored object) into ``dst``; what is wrong with the result, or ``None``."""
    check = layout.Checksum.like(entry.checksum)
    offsets = form.offsets()
    size = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        for i in range(len(form.lengths)):
            plain = _decode(form, i, memoryview(f.read(form.lengths[i])), min(entry.size, (i + 1) * chunk) - i * chunk,
                            offsets[i])
            if sums is not None and layout.chunk_sum(plain) != sums[i]:
                return f"bytes [{i * chunk}, {i * chunk + len(plain)}) fail their chunk checksum after decoding"
            out.write(plain)
            check.update(plain)
            size += len(plain)
            if on_bytes is not None:
                on_bytes(len(plain))
    if size != entry.size or check.value() != entry.checksum:
        return f"the decoded file ({size} bytes) fails its size or checksum"
    return None

