"""Read a step's DCP files straight into the live tensors, checking checksums on the way.

Stock DCP reads every stored tensor with ``torch.load`` into freshly
allocated memory and then copies it into the destination: two passes over
new memory, plus a separate pass to hash the files when the manifest is
checked first. :class:`CheckedReader` instead

* finds where the raw bytes of each stored tensor lie inside DCP's record (a
  ``torch.save`` zip written uncompressed) and reads them with ``readinto``
  directly into the destination tensor when dtype and layout allow (else into
  one buffer of the stored shape, then copies the part that is needed);
* reads each file front to back, feeding every byte to the file's checksum in
  a helper thread while the next chunk is read (xxhash releases the GIL), so
  verification costs no second read;
* splits verification over the ranks of each copy of the step: a file is
  checked by one rank of the copy that reads it (or, if none does, by the
  least loaded rank of the copy), decided by DCP's coordinator from every
  rank's load plan.

Files are left as DCP wrote them: stock ``dcp.load`` reads them, and this
reader reads stock DCP files. Anything the fast path does not recognise goes
through ``torch.load`` as in DCP. A checksum failure is recorded (not raised)
so that every rank can learn every failure in one exchange after the read;
the destination tensors may then hold bytes of the failed file.
"""

from __future__ import annotations

import dataclasses
import io
import os
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from shardckpt.dcp.planner import RestorePlanner, TrustingReader, unwrap_failure
from shardckpt.dcp.record_layout import central_directory, memory_of, stored_tensor
from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import chunks as chunks_mod
from shardckpt.format import layout

try:
    from torch.distributed.checkpoint._traverse import narrow_tensor_by_index  # type: ignore
except ImportError:  # pragma: no cover - moved between torch releases
    from torch.distributed._shard._utils import narrow_tensor_by_index  # type: ignore

CHUNK = 8 << 20
"""Bytes per read: small enough that the hash thread finds them in the CPU cache."""


# ------------------------------------------------------------ hashing beside the reads


class _Hasher:
    """Feeds views to a checksum in a helper thread, in order; ``value()`` waits for the last."""

    def __init__(self, like: str | None) -> None:
        self.checksum = layout.Checksum.like(like)
        self._q: queue.Queue = queue.Queue(maxsize=8)
        self._error: BaseException | None = None
        self._closed = False
        self._t = threading.Thread(target=self._run, name="shardckpt-hash", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while True:
            got = self._q.get()
            if got is None:
                return
            try:
                self.checksum.update(got[0])
            except BaseException as exc:  # noqa: BLE001 - reported by value()
                self._error = exc

    def feed(self, view: Any, owner: Any = None) -> None:
        """Queue ``view`` for the checksum; ``owner`` (the tensor whose memory it is) is kept alive until then."""
        self._q.put((view, owner))

    def value(self) -> str:
        self.abandon()
        self._t.join()
        if self._error is not None:
            raise self._error
        return self.checksum.value()

    def abandon(self) -> None:
        if not self._closed:
            self._closed = True
            self._q.put(None)


# ------------------------------------------------------------ the reader


class CheckedReader(TrustingReader):
    """DCP's file reader with in-place reads and checksums checked while reading.

    ``entries`` are the manifest's files (None: nothing to verify); ``copies``
    the ranks sharing each copy of the step; ``skip`` files this rank already
    verified (downloaded and checked). After the read, :attr:`failures` holds
    ``(file, message)`` for every file this rank checked and found bad.
    """

    def __init__(
        self,
        path: str,
        metadata: Metadata,
        *,
        step: int,
        entries: dict[str, layout.FileEntry] | None,
        copies: list[list[int]],
        skip: set[str] = frozenset(),  # type: ignore[assignment]
        sparse: Any = None,
        source: Any = None,
        group: Any = None,
    ) -> None:
        super().__init__(path, metadata)
        self._step = step
        self._entries = entries
        self._copies = copies
        self._skip = set(skip)
        self._sparse = sparse
        """This rank's copy is a sparse step directory (``ranged.SparseStep``): the ranges the
        ranks of its copy read are fetched from ``source`` first, by one rank of the copy."""
        self._source = source
        self._group = group
        self.failures: list[tuple[str, str]] = []

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        data: dict[str, Any] = {"skip": sorted(self._skip), "sparse": self._sparse is not None}
        if self._sparse is not None:
            data["held"] = self._sparse.held()  # chunks a shared fetch need not fetch again
        return dataclasses.replace(plan, storage_data=data)

    def _needs(self, plans: list[LoadPlan]) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges of each file that ``plans`` read."""
        needs: dict[str, list[tuple[int, int]]] = {}
        for p in plans:
            for item in p.items:
                info = self.storage_data[item.storage_index]
                needs.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
        return needs

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: which rank checks which file (one rank per file and copy), and
        which rank of each sparse copy fetches the ranges its copy's ranks read."""
        local = [p.storage_data or {} for p in plans]
        copies = [list(c) for c in self._copies if c] or [list(range(len(plans)))]
        fetch: list[Any] = [None] * len(plans)
        for copy in copies:
            ranks = [r for r in copy if r < len(plans) and local[r].get("sparse")]
            if ranks:
                fetch[min(ranks)] = self._needs([plans[r] for r in copy if r < len(plans)])
        barrier = any(p.get("sparse") for p in local)
        shared = self._share_plan(fetch, local)
        assigned: list[list[str]] = [[] for _ in plans]
        if self._entries is not None:
            reads = [{self.storage_data[i.storage_index].relative_path for i in p.items} for p in plans]
            load = [0] * len(plans)
            for copy in copies:
                ranks = [r for r in copy if r < len(plans)]
                if not ranks:
                    continue
                done = set().union(*(set(local[r].get("skip", ())) for r in ranks))
                for name in sorted(self._entries, key=lambda n: -self._entries[n].size):  # type: ignore[index]
                    if name in done:
                        continue
                    readers = [r for r in ranks if name in reads[r]] or ranks
                    r = min(readers, key=lambda x: load[x])
                    assigned[r].append(name)
                    load[r] += self._entries[name].size  # type: ignore[index]
        return [
            dataclasses.replace(p, storage_data={"check": sorted(a), "fetch": f, "barrier": barrier, "share": s})
            for p, a, f, s in zip(plans, assigned, fetch, shared)
        ]

    def _share_plan(self, fetch: list[Any], local: list[dict[str, Any]]) -> list[Any]:
        """Per rank: its part of the read-once plan (``ranged.share_plan``) when two or more sparse
        copies fetch (else None): ``(plan, fetching rank per copy)``."""
        fetchers = [r for r, f in enumerate(fetch) if f is not None]
        out: list[Any] = [None] * len(fetch)
        files = self._sparse.manifest.files if self._sparse is not None else self._entries
        if len(fetchers) < 2 or files is None or self._group is None:
            return out
        wants = []
        for r in fetchers:
            want: dict[str, set[int]] = {}
            for name, intervals in fetch[r].items():
                table = layout.chunk_table(files[name].chunks, files[name].size) if name in files else None
                if table is not None:
                    want[name] = set(chunks_mod.chunk_runs(intervals, table[0], files[name].size))
            wants.append(want)
        holds = [{n: set(v) for n, v in (local[r].get("held") or {}).items()} for r in fetchers]
        for r, part in zip(fetchers, chunks_mod.share_plan(wants, holds, files)):
            out[r] = (part, fetchers)
        return out

    def _fetch_ranges(self, plan: LoadPlan, todo: Any, barrier: bool, share: Any = None) -> None:
        """The sparse copy's fetch (by the rank given ``todo``); every rank waits for it when any copy is sparse.

        ``share``: several copies fetch; chunks more than one needs are read once and passed on."""
        error: BaseException | None = None
        if todo:
            try:
                if share is not None:
                    self._sparse.share(share[0], todo, self._source, self._group, share[1])
                else:
                    self._sparse.ensure(todo, self._source)
            except Exception as exc:  # noqa: BLE001 - raised after the other ranks were released
                error = exc
        if barrier and self._group is not None and torch.distributed.is_initialized():
            torch.distributed.barrier(group=self._group)
        if error is not None:
            raise error
        if self._sparse is not None:
            lacking = self._sparse.lacking(self._needs([plan]))
            if lacking:
                raise CorruptCheckpointError(
                    f"step {self._step}: {', '.join(lacking[:5])} in {self.path} lack(s) ranges this rank reads: the "
                    f"fetch by another rank of this node failed (its error is reported by that rank). Remedy: see "
                    f"that error; load an earlier step or set on_corrupt='fallback'."
                )

    def read_data(self, plan: LoadPlan, planner: Any) -> Any:
        data = plan.storage_data or {}
        self._fetch_ranges(plan, data.get("fetch"), bool(data.get("barrier")), data.get("share"))
        check = set(data.get("check", ()))
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name in sorted(set(per_file) | check):
            path = os.path.join(str(self.path), name)
            entry = (self._entries or {}).get(name) if name in check else None
            if name in check and entry is None:
                continue  # not in the manifest: nothing to compare with
            self._read_file(path, name, per_file.get(name, []), planner, entry)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    # ---- one file

    def _read_file(
        self, path: str, name: str, items: list[ReadItem], planner: Any, entry: layout.FileEntry | None
    ) -> None:
        hasher = _Hasher(entry.checksum) if entry is not None else None
        try:
            try:
                f = open(path, "rb", buffering=0)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"step {self._step}: file {path} named in the manifest is missing. "
                    + layout.verify_remedy(self._step)
                ) from None
            with f:
                try:
                    hasher = self._read_records(f, path, name, items, planner, entry, hasher)
                except Exception:
                    # A record that cannot be parsed: a damaged file tells by its checksum.
                    if hasher is not None:
                        hasher.abandon()
                        hasher = None
                    known = (self._entries or {}).get(name)
                    problem = self._whole_file_problem(path, known) if known is not None else None
                    if problem is None:
                        raise
                    self.failures.append((name, problem))
        finally:
            if hasher is not None:
                hasher.abandon()

    def _read_records(
        self, f: Any, path: str, name: str, items: list[ReadItem], planner: Any,
        entry: layout.FileEntry | None, hasher: _Hasher | None,
    ) -> _Hasher | None:
        """Every requested record of one file, in file order; returns the hasher still running (None)."""
        size = os.fstat(f.fileno()).st_size
        self._check_extents(path, name)
        pos = 0
        records = sorted(items, key=lambda i: self.storage_data[i.storage_index].offset)
        for item in records:
            info = self.storage_data[item.storage_index]
            start, end = info.offset, info.offset + info.length
            if end > size:
                raise CorruptCheckpointError(
                    f"step {self._step}: file {path} is {size} bytes, too short for the item "
                    f"{item.storage_index.fqn!r} it holds (truncated). " + layout.verify_remedy(self._step)
                )
            if hasher is not None and start > pos:
                _feed_range(f, pos, start, hasher)
            self._read_item(f, item, start, end, planner, hasher)
            pos = max(pos, end)
        if hasher is not None:
            if size > pos:
                _feed_range(f, pos, size, hasher)
            digest = hasher.value()
            hasher = None
            problem = layout.file_problem(self._step, path, entry, size, digest)  # type: ignore[arg-type]
            if problem:
                self.failures.append((name, problem))
        return hasher

    def _check_extents(self, path: str, name: str) -> None:
        """DCP writes a file's records one after the other: records of ``.metadata`` that overlap are refused."""
        extents = sorted(
            {(i.offset, i.offset + i.length, index.fqn) for index, i in self.storage_data.items()
             if i.relative_path == name}
        )
        for (a_start, a_end, a_fqn), (b_start, b_end, b_fqn) in zip(extents, extents[1:]):
            if b_start < a_end and (a_start, a_end) != (b_start, b_end):
                raise self._misplaced(
                    path, f"the record of {a_fqn!r} at [{a_start}, {a_end}) overlaps the record of {b_fqn!r} at "
                    f"[{b_start}, {b_end})"
                )

    def _misplaced(self, path: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"step {self._step}: file {path}: {what}, so its bytes cannot be told apart; the step's .metadata "
            f"does not describe the file DCP wrote (edited, or the file of another save). "
            + layout.verify_remedy(self._step)
        )

    def _whole_file_problem(self, path: str, entry: layout.FileEntry) -> str | None:
        """The file checked on its own, from disk: what is wrong with it, or None."""
        size, digest = layout.checksum_file(path, like=entry.checksum)
        return layout.file_problem(self._step, path, entry, size, digest)

    def _read_item(self, f: Any, item: ReadItem, start: int, end: int, planner: Any, hasher: _Hasher | None) -> None:
        if item.type == LoadItemType.BYTE_IO:
            data = _read_range(f, start, end, hasher)
            planner.load_bytes(item, io.BytesIO(data))
            return
        target = planner.resolve_tensor(item).detach()
        _, problem = central_directory(f, start, end - start)
        if problem is not None:
            raise self._misplaced(f.name, f"the record of {item.storage_index.fqn!r} at [{start}, {end}) {problem}")
        stored = stored_tensor(f, start, end - start) if target.device.type == "cpu" else None
        if stored is None or stored.dtype != target.dtype:
            tensor = torch.load(io.BytesIO(_read_range(f, start, end, hasher)), map_location="cpu", weights_only=True)
        else:
            whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == stored.size
            if hasher is not None:
                _feed_range(f, start, stored.data_offset, hasher)
            if whole and target.is_contiguous() and tuple(target.size()) == stored.size:
                _read_into(f, stored.data_offset, memory_of(target), hasher, target)
                if hasher is not None:
                    _feed_range(f, stored.data_offset + stored.nbytes, end, hasher)
                planner.commit_tensor(item, target)
                return
            tensor = torch.empty(stored.size, dtype=stored.dtype)
            _read_into(f, stored.data_offset, memory_of(tensor), hasher, tensor)
            if hasher is not None:
                _feed_range(f, stored.data_offset + stored.nbytes, end, hasher)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"step {self._step}: the stored item {item.storage_index.fqn!r} has shape {tuple(tensor.size())}, "
                f"the state expects {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _read_into(f: Any, offset: int, view: memoryview, hasher: _Hasher | None, owner: Any = None) -> None:
    """Fill ``view`` from the file at ``offset`` (chunks handed to ``hasher`` as they land).

    ``owner`` holds the memory behind ``view`` (a tensor: views of its memory do
    not keep it alive) until the hash thread is done with it.
    """
    view = view.cast("B") if view.format != "B" else view
    n = view.nbytes
    done = 0
    while done < n:
        want = min(CHUNK, n - done)
        got = os.preadv(f.fileno(), [view[done : done + want]], offset + done)
        if got <= 0:
            raise CorruptCheckpointError(
                f"{f.name}: ends at {offset + done}, the item needs {n - done} more bytes (truncated)"
            )
        if hasher is not None:
            hasher.feed(view[done : done + got], owner if owner is not None else view)
        done += got


def _read_range(f: Any, start: int, end: int, hasher: _Hasher | None) -> bytearray:
    buf = bytearray(end - start)
    _read_into(f, start, memoryview(buf), hasher)
    return buf


def _feed_range(f: Any, start: int, end: int, hasher: _Hasher) -> None:
    """Read [start, end) only to checksum it (bytes no destination needs)."""
    pos = start
    while pos < end:
        data = os.pread(f.fileno(), min(CHUNK, end - pos), pos)
        if not data:
            return  # the size comparison reports the short file
        hasher.feed(data)
        pos += len(data)


def dcp_read(
    target: dict[str, Any],
    step_dir: str,
    metadata: Metadata,
    planner: RestorePlanner,
    process_group: Any,
    *,
    step: int,
    entries: dict[str, layout.FileEntry] | None,
    copies: list[list[int]],
    checked: set[str] = frozenset(),  # type: ignore[assignment]
    sparse: Any = None,
    source: Any = None,
) -> list[tuple[str, str]]:
    """Read ``step_dir`` into ``target`` in place (:class:`CheckedReader`).

    With ``entries`` (the manifest's files) every file not in ``checked`` is
    checksummed by one rank of its copy while it is read; returns this rank's
    ``(file, problem)`` pairs. ``target`` is taken as is: dcp.load would
    replace the top-level dict, losing entries the planner rebuilds there.
    ``sparse``: ``step_dir`` is a sparse copy (``ranged.SparseStep``) completed from
    ``source`` with the ranges its ranks read.
    """
    reader = CheckedReader(step_dir, metadata, step=step, entries=entries, copies=copies, skip=checked,
                           sparse=sparse, source=source, group=process_group)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        _load_state_dict(target, storage_reader=reader, planner=planner, process_group=process_group, no_dist=no_dist)
    except CheckpointException as exc:
        raise unwrap_failure(exc, f"reading {step_dir}") from exc
    return reader.failures
