"""Need-only restores from the remote: a node fetches only the byte ranges its ranks read.

A node that holds nothing of the step being restored does not download the
whole step. Its copy is a *sparse step directory*::

    <local_dir>/.ranges-step_<N>-<save id>/
        remote-manifest.json      the remote manifest (never named shardckpt.json: not a committed step)
        .metadata                 fetched whole, checked against its whole-file checksum
        __0_0.distcp ...          sparse files of the step's size, holding the fetched chunks
        held.json                 which chunks of each file are held, each verified when fetched

DCP's load plans say which bytes each rank reads (a ``ReadItem``'s
``storage_index`` -> the metadata's ``storage_data``: file, offset, length).
The coordinator of the read gathers them (``CheckedReader.prepare_global_plan``),
and the committer of each sparse copy fetches the union of its ranks' ranges,
widened to whole chunks of the manifest's chunk table (:data:`layout.CHUNK_BYTES`)
and coalesced into requests of at most ``part_size`` bytes, many in flight. Every
chunk is compared with its checksum as it lands; one that fails is fetched again
once, then the step fails like a corrupt file (``on_corrupt``). Chunks already held
are checked from disk instead of fetched: the next restore of the same step at the
same world size reads nothing from the remote. One sparse directory is kept per
node (a newer one replaces it); it is never read as a committed step.

What is fetched comes from a :class:`Source`: a step on any store
(:class:`shardckpt.steps.StepView`; the remote today).

Read once, share: when several nodes restore from sparse copies, bytes that more
than one of them needs (a replicated model and optimizer, small records every rank
reads) are read from the remote once per job. The coordinator of the read, which
knows every copy's ranges, gives each needed chunk to exactly one copy
(:func:`share_plan`: a copy already holding it, else one of the copies needing
it, spread by bytes); each copy fetches its share (:meth:`SparseStep.ensure`),
then the copies pass one another the chunks they need over the job's side
process group (:meth:`SparseStep.share`). A received chunk is compared with its
checksum before it is written; one that fails, or that its sender could not
fetch, is fetched from the remote by the receiver itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Protocol

from shardckpt import _failpoints
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout
from shardckpt.format.chunks import Chunks, _union_bytes, chunk_runs, coalesce, share_plan  # noqa: F401 - part of this API
from shardckpt.stores import safe_url

log = logging.getLogger("shardckpt")

SPARSE_PREFIX = ".ranges-"
MANIFEST_COPY = "remote-manifest.json"
HELD_NAME = "held.json"



class Source(Protocol):
    """Where the bytes of a step's files come from."""

    def where(self, name: str) -> str:
        """The source's name for the file (in error messages)."""

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the step's file ``name``."""

    def fetch_whole(self, name: str, path: str, entry: layout.FileEntry) -> None:
        """The whole file into ``path``, checked against ``entry``'s checksum."""

    request_bytes: int
    """The most bytes one request asks for."""

    def run_all(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        """Run ``jobs`` (each one request) with as many in flight as the source allows."""


def sparse_dirname(step: int, version: str) -> str:
    tag = version.split(":", 1)[-1][:32]
    return f"{SPARSE_PREFIX}{layout.step_dirname(step)}-{tag}"


def usable(manifest: layout.Manifest) -> bool:
    """Whether every file of the step can be verified by chunks (else it is fetched whole, as before)."""
    return bool(manifest.files) and all(
        layout.chunk_table(e.chunks, e.size) is not None for n, e in manifest.files.items() if n != layout.METADATA_NAME
    )


class SparseStep:
    """One node's sparse copy of a remote step (see the module's description)."""

    def __init__(self, directory: str, manifest: layout.Manifest) -> None:
        self.dir = directory
        self.manifest = manifest
        self.step = manifest.step
        self.fetched_bytes = 0
        self.requests = 0

    # ---- opening

    @classmethod
    def open(
        cls, root: str, version: str, manifest_of: Callable[[], "layout.Manifest | None"], source: Source,
        *, metadata: bool = True,
    ) -> "SparseStep | None":
        """The sparse copy of the step of ``version`` under ``root``, made or reused, with ``.metadata`` held
        (``metadata=False``: not fetched here, see :meth:`has_metadata`).

        ``manifest_of()`` reads the remote manifest (only when no copy of that version is here).
        Returns ``None`` when the step has no chunk table (it is fetched whole instead).
        Other sparse copies under ``root`` are removed.
        """
        name = None
        manifest = None
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            names = []
        for existing in names:
            if not existing.startswith(SPARSE_PREFIX):
                continue
            path = os.path.join(root, existing)
            held = _read_manifest_copy(path)
            if held is not None and layout.version_of(held) == version and name is None:
                name, manifest = existing, held
            else:
                shutil.rmtree(path, ignore_errors=True)
        if manifest is None:
            manifest = manifest_of()
            if manifest is None or layout.version_of(manifest) != version or not usable(manifest):
                return None
            name = sparse_dirname(manifest.step, version)
            os.makedirs(os.path.join(root, name), exist_ok=True)
            layout.atomic_write_text(os.path.join(root, name, MANIFEST_COPY), manifest.to_json())
        sparse = cls(os.path.join(root, name), manifest)
        if metadata:
            sparse._ensure_metadata(source)
        return sparse

    @classmethod
    def attach(cls, directory: str) -> "SparseStep":
        """The sparse copy another rank of this node opened."""
        manifest = _read_manifest_copy(directory)
        if manifest is None:
            raise CorruptCheckpointError(
                f"sparse step directory {directory} has no readable {MANIFEST_COPY}. Remedy: delete it and load again."
            )
        return cls(directory, manifest)

    def has_metadata(self) -> bool:
        """Whether ``.metadata`` is here and matches the manifest (or the step lists none)."""
        entry = self.manifest.files.get(layout.METADATA_NAME)
        if entry is None:
            return True
        try:
            path = os.path.join(self.dir, layout.METADATA_NAME)
            return layout.checksum_file(path, like=entry.checksum) == (entry.size, entry.checksum)
        except FileNotFoundError:
            return False

    def _ensure_metadata(self, source: Source) -> None:
        entry = self.manifest.files.get(layout.METADATA_NAME)
        if entry is None or self.has_metadata():
            return
        path = os.path.join(self.dir, layout.METADATA_NAME)
        tmp = f"{path}.fetch"
        source.fetch_whole(layout.METADATA_NAME, tmp, entry)
        os.replace(tmp, path)
        self.fetched_bytes += entry.size
        self.requests += 1

    # ---- the chunks held

    def held(self) -> dict[str, set[int]]:
        try:
            with open(os.path.join(self.dir, HELD_NAME), encoding="utf-8") as f:
                body = json.load(f)
            return {str(n): {int(i) for i in v} for n, v in body.items()}
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return {}

    def _write_held(self, held: dict[str, set[int]]) -> None:
        layout.atomic_write_text(os.path.join(self.dir, HELD_NAME), json.dumps({n: sorted(v) for n, v in held.items()}))

    def lacking(self, needs: dict[str, list[tuple[int, int]]]) -> list[str]:
        """Files of which some byte of ``needs`` is not held (nothing is read)."""
        held = self.held()
        out = []
        for name, intervals in needs.items():
            entry = self.manifest.files[name]
            chunk, _sums = layout.chunk_table(entry.chunks, entry.size)  # type: ignore[misc]
            if not set(chunk_runs(intervals, chunk, entry.size)) <= held.get(name, set()):
                out.append(name)
        return out

    # ---- fetching

    def ensure(
        self, needs: dict[str, list[tuple[int, int]]], source: Source, *, verified: "Chunks | None" = None,
        quiet: bool = False,
    ) -> None:
        """Hold every chunk covering ``needs`` (``{file: [(start, end), ...]}``), each verified.

        Held chunks are checked from disk; the others are fetched from ``source`` in
        coalesced requests of at most ``source.request_bytes``, many in flight. A chunk failing its checksum is
        fetched once more; failing again raises :class:`CorruptCheckpointError`. Chunks in ``verified``
        were checked a moment ago (not read again); ``quiet``: no log line (a part of a larger fetch).
        """
        t0 = time.monotonic()
        held = self.held()
        needed = 0
        jobs = []
        lock = threading.Lock()
        max_bytes = source.request_bytes
        for name in sorted(needs):
            entry = self.manifest.files.get(name)
            if entry is None:
                continue
            table = layout.chunk_table(entry.chunks, entry.size)
            if table is None:
                raise CorruptCheckpointError(
                    f"step {self.step}: file {name} has no chunk checksums in {self.dir}; it cannot be read in ranges. "
                    f"Remedy: delete {self.dir} and load again."
                )
            chunk, sums = table
            path = os.path.join(self.dir, name)
            if not os.path.exists(path):
                with open(path, "wb") as f:
                    f.truncate(entry.size)
                held.pop(name, None)
            wanted = chunk_runs(needs[name], chunk, entry.size)
            needed += _union_bytes(needs[name], entry.size)
            have = held.setdefault(name, set())
            fresh = (verified or {}).get(name, set())
            bad = [i for i in wanted if i in have and i not in fresh
                   and not self._disk_ok(path, i, chunk, entry.size, sums[i])]
            have.difference_update(bad)
            todo = [i for i in wanted if i not in have]
            for offset, length in coalesce(todo, chunk, entry.size, max_bytes):
                jobs.append(lambda n=name, p=path, o=offset, ln=length, c=chunk, s=sums: self._fetch(
                    source, n, p, o, ln, c, s, held, lock))
        try:
            source.run_all(jobs)
        finally:
            for name in held:
                path = os.path.join(self.dir, name)
                if os.path.exists(path):
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            self._write_held(held)
        if jobs and not quiet:
            log.info(
                "shardckpt: step %d: fetched %d range(s), %d bytes, for the %d bytes this node's ranks read, into %s "
                "in %.2f s", self.step, len(jobs), self.fetched_bytes, needed, self.dir, time.monotonic() - t0,
            )

    # ---- read once, share

    def share(self, mine: dict[str, Any], needs: dict[str, list[tuple[int, int]]], source: Source,
              group: Any, ranks: list[int]) -> None:
        """This copy's part of a shared fetch (:func:`share_plan`); on the fetching rank of each copy.

        ``mine`` is this copy's entry of the plan: fetch its share from ``source``, send
        the chunks other copies need (``ranks[j]`` fetches for copy ``j``), receive the
        ones it needs, then hold every chunk of ``needs``: a chunk that did not arrive
        intact is fetched from ``source`` here. Every copy sends all it was given to
        send even when its own fetch failed (the receivers count on it); that error is
        raised at the end.
        """
        t0 = time.monotonic()
        error: BaseException | None = None
        before = self.fetched_bytes
        try:
            self.ensure(self._intervals(mine["fetch"]), source, quiet=True)
        except Exception as exc:  # noqa: BLE001 - raised once the chunks promised were sent
            error = exc
        share_bytes = self.fetched_bytes - before
        received, sent, peers = self._exchange(mine, group, ranks)
        fixed_before = self.fetched_bytes
        verified = {n: set(v) for n, v in (mine["fetch"] if error is None else {}).items()}
        for name, indices in received.items():
            verified.setdefault(name, set()).update(indices)
        self.ensure(needs, source, verified=verified, quiet=True)  # checks the rest, fetches what did not arrive
        refetched = self.fetched_bytes - fixed_before
        if error is not None:
            raise error
        got = sum(self._span(n, i) for n, idx in received.items() for i in idx)
        log.info(
            "shardckpt: step %d: read once, shared: fetched %d bytes (its share %d, again after a failed delivery %d) "
            "for the %d bytes this node's ranks read, received %d bytes from %d node(s), sent %d bytes, into %s "
            "in %.2f s", self.step, self.fetched_bytes - before, share_bytes, refetched,
            sum(_union_bytes(v, self.manifest.files[n].size) for n, v in needs.items() if n in self.manifest.files),
            got, peers, sent, self.dir, time.monotonic() - t0,
        )

    def _span(self, name: str, index: int) -> int:
        entry = self.manifest.files[name]
        chunk, _sums = layout.chunk_table(entry.chunks, entry.size)  # type: ignore[misc]
        return min(entry.size, (index + 1) * chunk) - index * chunk

    def _intervals(self, chunks: "Chunks") -> dict[str, list[tuple[int, int]]]:
        out = {}
        for name, indices in chunks.items():
            entry = self.manifest.files[name]
            chunk, _sums = layout.chunk_table(entry.chunks, entry.size)  # type: ignore[misc]
            out[name] = [(i * chunk, min(entry.size, (i + 1) * chunk)) for i in sorted(indices)]
        return out

    def _exchange(self, mine: dict[str, Any], group: Any, ranks: list[int]) -> tuple["Chunks", int, int]:
        """Send and receive the chunks of ``mine`` (one message per pair of copies, all in flight at
        once); write those that pass their checksum. Returns (chunks received intact, bytes sent, peers)."""
        import torch
        import torch.distributed as dist

        pending = []
        sent = 0
        built: dict[tuple, Any] = {}  # one buffer per set of chunks (with replicated state, every peer's)
        for dst, chunks in sorted(mine["send"].items()):
            key = tuple((name, tuple(sorted(chunks[name]))) for name in sorted(chunks))
            if key not in built:
                buf = bytearray()
                for name, indices in key:
                    path = os.path.join(self.dir, name)
                    for i in indices:
                        part = self._read_chunk(path, name, i)
                        _failpoints.hit("share.chunk_send", part)
                        buf += part
                built[key] = torch.frombuffer(buf, dtype=torch.uint8) if buf else None
            if built[key] is not None:
                sent += built[key].numel()
                pending.append(dist.isend(built[key], dst=ranks[dst], group=group))
        incoming = []
        for src, chunks in sorted(mine["recv"].items()):
            order = [(name, i) for name in sorted(chunks) for i in sorted(chunks[name])]
            size = sum(self._span(n, i) for n, i in order)
            if size:
                buf = torch.empty(size, dtype=torch.uint8)
                pending.append(dist.irecv(buf, src=ranks[src], group=group))
                incoming.append((src, order, buf))
        for work in pending:
            work.wait()
        held = self.held()
        good: Chunks = {}
        for src, order, buf in incoming:
            view = memoryview(buf.numpy()).cast("B")
            at = 0
            for name, i in order:
                entry = self.manifest.files[name]
                chunk, sums = layout.chunk_table(entry.chunks, entry.size)  # type: ignore[misc]
                n = self._span(name, i)
                data = view[at : at + n]
                at += n
                if layout.chunk_sum(data) != sums[i]:
                    log.warning(
                        "shardckpt: step %d: chunk %d of %s received from rank %d fails its checksum; fetching it "
                        "from the remote instead", self.step, i, name, ranks[src],
                    )
                    continue
                path = os.path.join(self.dir, name)
                if not os.path.exists(path):
                    with open(path, "wb") as f:
                        f.truncate(entry.size)
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, data, i * chunk)
                finally:
                    os.close(fd)
                held.setdefault(name, set()).add(i)
                good.setdefault(name, set()).add(i)
        for name in good:
            fd = os.open(os.path.join(self.dir, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if good:
            self._write_held(held)
        return good, sent, len(incoming)

    def _read_chunk(self, path: str, name: str, index: int) -> bytearray:
        """Chunk ``index`` of the sparse file (zeros where it cannot be read: the receiver refuses them)."""
        entry = self.manifest.files[name]
        chunk, _sums = layout.chunk_table(entry.chunks, entry.size)  # type: ignore[misc]
        n = self._span(name, index)
        try:
            with open(path, "rb", buffering=0) as f:
                data = os.pread(f.fileno(), n, index * chunk)
        except OSError:
            data = b""
        return bytearray(data) + bytes(n - len(data))

    def _disk_ok(self, path: str, index: int, chunk: int, size: int, expected: str) -> bool:
        start = index * chunk
        length = min(size, start + chunk) - start
        with open(path, "rb", buffering=0) as f:
            data = os.pread(f.fileno(), length, start)
        return len(data) == length and layout.chunk_sum(data) == expected

    def _fetch(
        self, source: Source, name: str, path: str, offset: int, length: int, chunk: int, sums: list[str],
        held: dict[str, set[int]], lock: threading.Lock,
    ) -> None:
        first = offset // chunk
        for attempt in (1, 2):
            data = source.read(name, offset, length)
            with lock:
                self.requests += 1
                self.fetched_bytes += len(data)
            view = memoryview(data)
            failing = [
                first + k for k in range(0, -(-length // chunk))
                if layout.chunk_sum(view[k * chunk : (k + 1) * chunk]) != sums[first + k]
            ]
            if not failing:
                break
            if attempt == 1:
                log.warning(
                    "shardckpt: step %d: bytes [%d, %d) of %s fail their chunk checksum; fetching them again",
                    self.step, offset, offset + length, safe_url(source.where(name)),
                )
                continue
            raise CorruptCheckpointError(
                f"step {self.step}: remote object {safe_url(source.where(name))} is corrupt (bytes "
                f"[{failing[0] * chunk}, {min(offset + length, (failing[0] + 1) * chunk)}) fail their chunk checksum "
                f"twice); it was not loaded. Remedy: load an earlier step (load(step=...)) or set "
                f"on_corrupt='fallback'; repair it from a node that still has the step (`shardckpt push --local "
                f"LOCAL_DIR --remote URL --step N` checks the remote copy and uploads again what fails)."
            )
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        with lock:
            held.setdefault(name, set()).update(range(first, first + -(-length // chunk)))


def _read_manifest_copy(directory: str) -> layout.Manifest | None:
    path = os.path.join(directory, MANIFEST_COPY)
    try:
        with open(path, "rb") as f:
            return layout.Manifest.from_json(f.read(), path)
    except (FileNotFoundError, CorruptCheckpointError):
        return None
