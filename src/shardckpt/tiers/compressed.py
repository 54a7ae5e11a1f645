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

What is verified is what is restored: the manifest's checksums (whole file
and per chunk) are of the logical bytes, checked after decoding; the
stored form's checksum guards the stored object itself (``shardckpt
verify``, the commit's check of each node's objects). A stored chunk that
fails to decode is fetched once more, like a chunk failing its checksum,
then refused with :class:`CorruptCheckpointError`.

The local tier is not touched: local copies, local manifests and peer
replicas hold the files as DCP wrote them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import codec, layout
from shardckpt.stores import Deadline, Store, join, safe_url
from shardckpt.tiers.missing import read_committed

log = logging.getLogger("shardckpt")

SUFFIX = ".szc"
_CODEC_NAMES = {"bytegroup-zstd": codec.CODEC}
WORKERS = max(1, (os.cpu_count() or 1) // 2)
"""Threads compressing on a node: half its cores (the trainer's data loading keeps the rest)."""

OnBytes = Callable[[int], None]


@dataclasses.dataclass
class StoredForm:
    """How one file is stored on the remote: codec, object size and checksum, stored chunk lengths."""

    codec: str
    size: int
    checksum: str
    lengths: list[int]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "StoredForm":
        return cls(str(body["codec"]), int(body["size"]), str(body["checksum"]), [int(n) for n in body["lengths"]])

    def offsets(self) -> list[int]:
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


def form_of(manifest: layout.Manifest, name: str) -> StoredForm | None:
    """The stored form of ``name`` in a remote manifest; ``None``: stored as it is.

    A form this version cannot read, or one that does not fit the file's chunk table, is damage.
    """
    body = manifest.stored.get(name)
    if body is None:
        return None
    form = StoredForm.from_json(body)
    entry = manifest.files[name]
    table = layout.chunk_table(entry.chunks, entry.size)
    if form.codec != codec.CODEC or table is None or len(table[1]) != len(form.lengths) \
            or sum(form.lengths) != form.size:
        raise CorruptCheckpointError(
            f"step {manifest.step}: the manifest's stored form of {name} ({form.codec}, {len(form.lengths)} chunks) "
            f"does not fit the file or this version of shardckpt cannot decode it. Remedy: upgrade shardckpt, "
            f"load an earlier step, or upload the step again (`shardckpt push`)."
        )
    return form


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
"""Files are encoded one at a time (each on every worker): the first is ready to upload after its own
encoding, not after all of them, so the uploads of the first files overlap the encoding of the next."""


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


def encode_file(src: str, dst: str, entry: layout.FileEntry, step: int, level: int = codec.LEVEL) -> StoredForm:
    """Write the stored form of the local file ``src`` to ``dst``; the file must match ``entry``.

    Chunks are encoded on :data:`WORKERS` threads, a bounded number in flight,
    and written in order. The logical bytes are checksummed on the way: a file
    that differs from its manifest entry raises :class:`CorruptCheckpointError`
    (as a plain upload would) and ``dst`` is removed.
    """
    table = layout.chunk_table(entry.chunks, entry.size)
    chunk = table[0] if table is not None else layout.CHUNK_BYTES
    logical = layout.Checksum.like(entry.checksum)
    stored = layout.Checksum()
    lengths: list[int] = []
    pool = _workers()
    pending: list[concurrent.futures.Future[bytes]] = []
    size = 0
    try:
        with open(dst, "wb") as out:
            def drain(keep: int) -> None:
                while len(pending) > keep:
                    data = pending.pop(0).result()
                    out.write(data)
                    stored.update(data)
                    lengths.append(len(data))

            for data in _chunks_of(src, chunk):
                size += len(data)
                logical.update(data)
                pending.append(pool.submit(codec.encode_chunk, data, level))
                drain(2 * WORKERS)
            drain(0)
            out.flush()
        problem = layout.file_problem(step, src, entry, size, logical.value())
        if problem:
            raise CorruptCheckpointError(problem)
    except BaseException:
        for f in pending:
            f.cancel()
        if os.path.exists(dst):
            os.unlink(dst)
        raise
    return StoredForm(codec.CODEC, sum(lengths), stored.value(), lengths)


def put_compressed(store: Store, key: str, path: str, entry: layout.FileEntry, step: int, deadline: Deadline,
                   on_bytes: OnBytes | None = None) -> tuple[StoredForm | None, str | None]:
    """Upload the local file ``path`` (the step's file ``key``) in its stored form under ``key`` +
    :data:`SUFFIX`; when compressing does not pay for the file as a whole, upload it as it is under
    ``key`` (the form is then ``None``). Returns the form and the tag the store gave the object."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}{SUFFIX}")
    try:
        with _one_file:
            form = encode_file(path, tmp, entry, step)
        if form.size > entry.size * (1 - codec.MIN_SAVING):
            return None, store.put_file(path, key, entry.size, entry.checksum, deadline, on_bytes)
        sent = 0

        def scaled(n: int) -> None:  # progress is counted in the file's logical bytes
            nonlocal sent
            if on_bytes is not None and form.size:
                share = min(entry.size, (sent + n) * entry.size // form.size) - min(entry.size, sent * entry.size // form.size)
                on_bytes(share)
            sent += n

        return form, store.put_file(tmp, key + SUFFIX, form.size, form.checksum, deadline, scaled)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def put_again(store: Store, key: str, path: str, entry: layout.FileEntry, step: int, form: StoredForm,
              deadline: Deadline) -> None:
    """Upload the stored form of ``path`` again (repairing a damaged object). Encoding is deterministic
    (same codec, level and chunking), so the object comes out as the manifest's stored form records."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}{SUFFIX}")
    try:
        again = encode_file(path, tmp, entry, step)
        if (again.size, again.checksum) != (form.size, form.checksum):
            raise CorruptCheckpointError(
                f"step {step}: {store.where(key + SUFFIX)} cannot be repaired from {path}: compressing it again "
                f"gives other bytes than the manifest records (another zstandard version?). Remedy: delete the "
                f"remote step (`shardckpt gc`) and push it again, or load another step."
            )
        store.put_file(tmp, key + SUFFIX, form.size, form.checksum, deadline)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ------------------------------------------------------------ reads


def _refused(step: int, where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"step {step}: remote object {safe_url(where)} is corrupt ({what}, twice); it was not loaded. "
        f"Remedy: load an earlier step (load(step=...)) or set on_corrupt='fallback'; repair it from a node that "
        f"still has the step (`shardckpt push --local LOCAL_DIR --remote URL --step N` checks the remote copy and "
        f"uploads again what fails)."
    )


def read_range(store: Store, key: str, step: int, entry: layout.FileEntry, form: StoredForm, offset: int,
               length: int, deadline: Deadline) -> bytes:
    """Logical bytes ``[offset, offset + length)`` of a compressed file whose object is ``key``: the
    stored chunks covering them, fetched in one ranged read and decoded. A chunk that does not decode
    is fetched once more, then refused; the caller checks the chunk checksums."""
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
    for attempt in (1, 2):
        data = memoryview(read_committed(store, key, step, deadline,
                                         lambda: store.get_range(key, start, end - start, deadline), end=end))
        try:
            plain = b"".join(
                codec.decode_chunk(data[offsets[i] - start : offsets[i + 1] - start],
                                   min(entry.size, (i + 1) * chunk) - i * chunk)
                for i in range(first, last + 1)
            )
            break
        except codec.CodecError as exc:
            if attempt == 2:
                raise _refused(step, store.where(key), f"a stored chunk of bytes [{start}, {end}) does not decode: {exc}") from exc
            log.warning("shardckpt: step %d: stored bytes [%d, %d) of %s do not decode (%s); fetching them again",
                        step, start, end, safe_url(store.where(key)), exc)
    skip = offset - first * chunk
    return plain[skip : skip + length]


def fetch_whole(store: Store, key: str, step: int, entry: layout.FileEntry, form: StoredForm, path: str,
                deadline: Deadline, on_bytes: OnBytes | None = None) -> None:
    """The compressed file whose object is ``key``, decoded into ``path`` and checked against ``entry``
    (size, checksum, chunk checksums); a bad object is fetched once more, then refused."""
    table = layout.chunk_table(entry.chunks, entry.size)
    chunk = table[0] if table is not None else layout.CHUNK_BYTES
    tmp = f"{path}.szc-{uuid.uuid4().hex[:8]}"
    offsets = form.offsets()
    try:
        for attempt in (1, 2):
            problem = None
            try:
                read_committed(store, key, step, deadline,
                               lambda: store.get_file(key, tmp, form.size, form.checksum, deadline), end=form.size)
                problem = _decode_file(tmp, path, entry, offsets, chunk, table[1] if table else None, on_bytes)
            except codec.CodecError as exc:
                problem = f"a stored chunk does not decode: {exc}"
            except CorruptCheckpointError as exc:
                if attempt == 2:
                    raise
                problem = str(exc)
            if problem is None:
                return
            if attempt == 2:
                raise _refused(step, store.where(key), problem)
            log.warning("shardckpt: step %d: %s fails after decoding (%s); fetching it again",
                        step, safe_url(store.where(key)), problem)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _decode_file(src: str, dst: str, entry: layout.FileEntry, offsets: list[int], chunk: int,
                 sums: list[str] | None, on_bytes: OnBytes | None) -> str | None:
    """Decode ``src`` into ``dst``; what is wrong with the result, or ``None``."""
    check = layout.Checksum.like(entry.checksum)
    size = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        for i in range(len(offsets) - 1):
            plain = codec.decode_chunk(f.read(offsets[i + 1] - offsets[i]), min(entry.size, (i + 1) * chunk) - i * chunk)
            if sums is not None and layout.chunk_sum(plain) != sums[i]:
                return f"bytes [{i * chunk}, {i * chunk + len(plain)}) fail their chunk checksum"
            out.write(plain)
            check.update(plain)
            size += len(plain)
            if on_bytes is not None:
                on_bytes(len(plain))
    if size != entry.size or check.value() != entry.checksum:
        return f"the decoded file ({size} bytes) fails its size or checksum"
    return None


def verify_object(store: Store, key: str, form: StoredForm, deadline: Deadline) -> tuple[int, str] | None:
    """Size and checksum of the stored object, to compare with ``(form.size, form.checksum)``."""
    return store.read_checksum(key, form.checksum, deadline)


# ------------------------------------------------------------ auto: decided by measurement


PROBE_BYTES = 8 << 20
SAMPLE_BYTES = 16 << 20


@dataclasses.dataclass
class Decision:
    compress: bool
    upload_mb_s: float
    compress_mb_s: float
    ratio: float

    def text(self) -> str:
        verdict = "compressing" if self.compress else "not compressing"
        return (f"{verdict} uploads: measured upload {self.upload_mb_s:.0f} MB/s, compression "
                f"{self.compress_mb_s:.0f} MB/s on {WORKERS} thread(s) to {self.ratio:.2f}x of the bytes")


def measure(store: Store, sample: str, deadline: Deadline) -> Decision:
    """Upload rate (one PUT of incompressible bytes, then deleted), and the rate and ratio at which this
    node compresses the first bytes of ``sample``. Compressing pays when the link time it saves exceeds
    the time it takes: ``upload < (1 - ratio) * compression``."""
    with open(sample, "rb") as f:
        data = f.read(SAMPLE_BYTES)
    t0 = time.perf_counter()
    out = sum(len(codec.encode_chunk(data[i : i + layout.CHUNK_BYTES]))
              for i in range(0, len(data), layout.CHUNK_BYTES))
    took = max(time.perf_counter() - t0, 1e-6)
    ratio = out / len(data) if data else 1.0
    compress = len(data) / took * WORKERS / 1e6
    key = join(".shardckpt-probe", f"rate-{uuid.uuid4().hex}.bin")
    t0 = time.perf_counter()
    store.put_bytes(key, os.urandom(PROBE_BYTES), deadline)
    upload = PROBE_BYTES / max(time.perf_counter() - t0, 1e-6) / 1e6
    store.delete(key, deadline)
    return Decision(upload < (1 - ratio) * compress, upload, compress, ratio)


AUTO_MIN_BYTES = 64 << 20
"""``auto`` leaves uploads smaller than this as they are, unmeasured: the probe would cost more
than compressing could save."""

_decided: dict[tuple[str, str | None], Decision] = {}
"""Decisions per link: the bucket (or host) and endpoint, not the prefix (a run's remote or another)."""
_decided_lock = threading.Lock()


def _link(store: Store) -> tuple[str, str | None]:
    """What a decision is about: the bucket (or host) and the endpoint."""
    bucket = store.url.split("/")[2] if store.url.count("/") >= 2 else store.url
    return bucket, getattr(getattr(store, "options", None), "endpoint_url", None)


def wanted(store: Store, sample: str | None, total: int, deadline: Deadline) -> bool:
    """Whether this node compresses the ``total`` bytes it is about to upload to ``store``
    (``remote_compression``). ``auto`` is measured once per bucket and endpoint per process (on
    ``sample``, a file about to be uploaded) and the decision is logged once."""
    options = getattr(store, "options", None)
    mode = getattr(options, "compression", "off")
    if mode == "off" or sample is None:
        return False
    if mode in _CODEC_NAMES:
        return True
    if total < AUTO_MIN_BYTES:
        return False
    where = _link(store)
    with _decided_lock:
        decision = _decided.get(where)
        if decision is None:
            decision = _decided[where] = measure(store, sample, deadline)
            log.info("shardckpt: remote_compression=auto for %s: %s", safe_url(store.url), decision.text())
    return decision.compress


def will_compress(store: Store) -> bool:
    """Whether uploads to ``store`` are compressed as far as this process knows already: the codec is
    asked for, or ``auto`` decided so for its link. Files are then not uploaded early (plain, while the
    save is written) but compressed after the local commit: on a link slow enough for compression to
    pay, a fifth fewer bytes outweighs overlapping the upload with the local write."""
    options = getattr(store, "options", None)
    mode = getattr(options, "compression", "off")
    if mode in _CODEC_NAMES:
        return True
    if mode != "auto":
        return False
    decision = _decided.get(_link(store))
    return decision is not None and decision.compress

