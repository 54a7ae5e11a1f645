"""The memory tier's save half: each rank's newest saves in shared memory that outlives the trainer process.

Why files in a tmpfs (``/dev/shm``) and not memfds handed to a node daemon: a
file needs nobody to hold it, so the copy survives a SIGKILL of the trainer
(and of any daemon) the moment its record is written, with no hand-over in
``save()``; the next process finds it by name and maps it; ``shardckpt ls`` /
``status`` read the records without torch and without asking a process. The
cost of files is that nothing frees them by itself: the trainer frees its own
at ``close()``, the node's memory keeper (``node/memory_keeper.py``) once no
trainer of the node is left for its linger, and a record of another boot is
never trusted (``format/shm.py``).

Save, every rank, on the main thread inside ``save()``; only the first memory
save issues a collective (:meth:`MemoryTier.start`)::

    1. a slot: memory_keep + 1 per rank (3 with memory_keep=1). A copy never takes the slot
       of the newest save that returned, nor (a save kept only in memory) the slot whose
       disk write is still under way: a kill at any point of the copy leaves the newest
       returned save usable. Else an empty slot while fewer than memory_keep + 1 are laid
       out, else the one holding the oldest save (memory_keep=1: the third slot is laid out
       only when the other two are the newest save's and the one being written to disk)
    2. the slot's record is removed: from here the slot holds no save
    3. the slot is laid out again only when a tensor is new or changed shape, dtype or
       sharding (a new file, its pages reserved at once, the budget checked); else the
       copy goes into the pages of the last time
    4. the copy (``HostStager`` over the slot's views; on a GPU into memory pinned with
       ``cudaHostRegister``), waited for
    5. the non-tensor values, then the record: the save is memory-durable
    6. off the training loop (a thread): the copy's checksum (``.sum``), which a restore checks
    The disk write of a save due on disk reads the same buffers (no second copy).

Whatever goes wrong with shared memory (the namespace taken, ``/dev/shm``
missing, too small or full, the budget too small, a state the tier cannot
hold) makes the tier step aside with one warning (:meth:`MemoryTier._aside`):
the save, and the next ones, go on to disk and the remote. Found at the first
memory save (collective), every rank steps aside; found later on one rank,
that rank keeps no copies (its saves stay restorable from disk).

Restore: ``restoring/memory.py``; the files and records: ``format/shm.py``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardckpt import _dist, _failpoints
from shardckpt._text import fmt_bytes
from shardckpt.dcp import memory as dcp_memory
from shardckpt.errors import SaveError
from shardckpt.format import layout, shm
from shardckpt.format import lineage as lineage_mod
from shardckpt.saving.commit import SaveJob
from shardckpt.saving.memory_slots import (
    Slot,
    SlotStager,
    Unfit,
    align,
    leaves,
    state_key,
)
from shardckpt.saving.stage import CopyFence, leaf_signature

log = logging.getLogger("shardckpt")

DEFAULT_BUDGET = 0.5
"""The memory tier's budget when none is set: this fraction of the host's RAM, for all ranks of a machine."""


def _nbytes(entry: list[Any]) -> int:
    return math.prod(entry[2]) * dcp_memory._dtype(entry[1]).itemsize


def budget_bytes(budget: float | None) -> int:
    """``memory_budget`` in bytes: a fraction (<= 1) of the host's RAM, or a number of bytes."""
    if budget is None:
        budget = DEFAULT_BUDGET
    if budget <= 1:
        return int(budget * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return int(budget)


def _shm_free() -> int | str:
    """Free bytes where the namespaces live, or why that place cannot hold them."""
    try:
        st = os.statvfs(shm.shm_root())
    except OSError as exc:
        return f"{shm.shm_root()} cannot be used ({exc.strerror or exc})"
    return st.f_bavail * st.f_frsize


class MemoryTier:
    """This rank's save side of the memory tier of ``root`` (the restore side: ``restoring/memory.py``)."""

    def __init__(self, config: Any, root: str, *, pin: bool, join: Callable[[], str] | None = None) -> None:
        self.root = root
        self._join = join
        self.trainer: str | None = None
        """This process's file as a trainer of the node (``join()``: the keeper frees the memory once none is left)."""
        self.every = config.memory_every_steps
        self.keep = config.memory_keep
        self.budget = budget_bytes(config.memory_budget)
        self.max_pinned = config.max_pinned_bytes
        self.pin = pin
        self.ns: str | None = None
        """This run's namespace (known once the tier starts)."""
        self.off: str | None = None
        """Why the tier stepped aside on every rank (a problem found at the first memory save)."""
        self.broken: str | None = None
        """Why it stepped aside on this rank alone (a problem found later): no copies from here."""
        self.nslots = self.keep + 1 + (self.keep == 1)
        self._hold: int | None = None
        self._sums = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-memsum")
        self.slots: list[Slot] = []
        self.started = False
        self.disk_slot: int | None = None
        """The slot of the newest save due on disk: saves kept only in memory leave it alone while it is written."""
        self._writing: Slot | None = None
        self._share = self.budget
        self._pinned = 0
        self.last: int | None = None
        """The step of this process's newest save kept in memory."""
        self._host = socket.gethostname()
        self._manifests: dict[str, Any] = {}
        """The text of each field of the last manifest recorded (``Manifest.to_json``: only what changed is encoded)."""

    @property
    def enabled(self) -> bool:
        return self.every is not None and self.off is None

    def due(self, step: int) -> bool:
        """A save of ``step`` is kept in memory (every save due on disk is too)."""
        return self.enabled and step % self.every == 0 and step != self.last

    # ------------------------------------------------------------ save

    def begin(self, memory: bool, groups: _dist.SideGroups, captured: dict[str, Any], loaded: Any, head: Any,
              what: str) -> None:
        """Before the copy of every save: the first one kept in memory starts the tier (:meth:`start`, collective,
        then the node's keeper); with the tier off, what an earlier job left is freed."""
        if memory and not self.started and self.enabled:
            self.start(groups, captured, loaded, head or lineage_mod.Lineage(), what)
            if self.off is None:
                self.trainer = self._join() if self._join is not None else None
        elif self.every is None:
            self.purge_unused()

    def _aside(self, why: str, *, every_rank: bool) -> None:
        """Step aside (one warning): the saves go on without the memory tier, this rank's copies are freed."""
        if every_rank:
            self.off = why
        self.broken = why
        if not every_rank or _dist.rank() == 0:
            log.warning(
                "shardckpt: the memory tier steps aside%s: %s. Saves go on to disk (and the remote) without it; "
                "nothing more is kept in shared memory by this job%s. Remedy: point SHARDCKPT_SHM_DIR at a tmpfs "
                "of this user's with room for the copies, raise memory_budget, lower memory_keep, or turn the memory "
                "tier off (memory_every_steps=None)", "" if every_rank else f" on rank {_dist.rank()}", why,
                "" if every_rank else " on this rank (the other ranks' copies are not restorable without it)")
        try:
            self.release()
        except OSError:
            pass

    def start(self, groups: _dist.SideGroups, captured: dict[str, Any], loaded: Any, head: Any, what: str) -> None:
        """First memory save (collective over ``ctl``, every rank at the same save): this run's namespace and
        the budget on every machine, then the copies of the step the job continues adopted, the rest removed.

        ``loaded``: the ``StepInfo`` of the step the job loaded (``None``: nothing); ``head``: the lineage
        its saves continue. A rank that cannot keep copies makes every rank step aside (:meth:`_aside`).
        """
        why, mine, free = None, 0, _shm_free()
        try:
            mine = self.nslots * sum(align(n) for _k, _s, n in self._wanted(captured))
        except Unfit as exc:
            why = str(exc)
        if why is None and isinstance(free, str):
            why = free
        if why is None:
            try:
                self.ns = shm.ensure_namespace(self.root)
            except OSError as exc:
                why = f"its shared memory cannot be used ({exc})"
        held = shm.held_bytes(self.root) if why is None else 0
        me = (shm.machine(), mine, free + held if isinstance(free, int) else 0, self.budget, why)
        everyone = groups.all_gather_ctl(me)
        broken = [(r, e[4]) for r, e in enumerate(everyone) if e[4]]
        if broken:  # on every rank alike, after the exchange
            return self._aside(f"{what}: on rank(s) {', '.join(str(r) for r, _e in broken)}: {broken[0][1]}",
                               every_rank=True)
        here = [r for r, e in enumerate(everyone) if e[0] == me[0]]
        for key in dict.fromkeys(e[0] for e in everyone):
            ranks = [r for r, e in enumerate(everyone) if e[0] == key]
            need = sum(everyone[r][1] for r in ranks)
            free, budget = min(everyone[r][2] for r in ranks), everyone[ranks[0]][3]
            if need > min(free, budget):
                return self._aside(
                    f"{what}: it needs {fmt_bytes(need)} of shared memory on {key.split('/')[0]} ({self.nslots} "
                    f"copies of the staged state of its {len(ranks)} rank(s), {fmt_bytes(need // self.nslots)} each "
                    f"time, for memory_keep={self.keep}), but "
                    + (f"memory_budget allows {fmt_bytes(budget)}" if budget < free else
                       f"{shm.shm_root()} has {fmt_bytes(free)} free"), every_rank=True)
        self._share = me[3] - (sum(everyone[r][1] for r in here) - mine)
        assert self.ns is not None
        self._hold = shm.hold(self.ns)  # this run is alive: no job of another run frees its memory
        self._adopt(loaded, head, here)
        self.started = True

    def _wanted(self, captured: dict[str, Any]) -> list[tuple[str, str, int]]:
        out = []
        for path, obj in leaves(captured):
            local = obj._local_tensor if isinstance(obj, DTensor) else obj
            if not (type(local) in (torch.Tensor, torch.nn.Parameter) and local.layout == torch.strided
                    and not local.is_quantized and not local.is_meta):
                raise Unfit(
                    f"it holds dense tensors and DTensors; {'.'.join(map(str, path))} is a {type(obj).__name__} "
                    f"({local.layout}) (save DTensor-sharded state: FSDP2, or get_state_dict's defaults)"
                )
            out.append((state_key(path), repr(leaf_signature(obj)), local.numel() * local.element_size()))
        return out

    def _adopt(self, loaded: Any, head: Any, here: list[int]) -> None:
        """Keep this rank's copies of the history the job continues (at or below the step it loaded) as its
        slots; remove its other files, and (the machine's lowest rank) those of ranks not on this machine."""
        rank = _dist.rank()
        records, _stale = shm.read_records(self.root)  # a stale record's files go with its rank's (below)
        kept: dict[int, shm.Record] = {}
        for rec in sorted((r for r in records if r.rank == rank), key=lambda r: -r.created):
            if loaded is None or rec.slot >= self.nslots or rec.slot in kept or rec.step > loaded.step:
                continue
            if rec.step == loaded.step and rec.version != loaded.version:
                continue
            try:
                lineage = lineage_mod.Lineage.from_json(rec.manifest_obj(rec.name).lineage)
            except Exception:  # noqa: BLE001 - an unreadable manifest is not adopted
                continue
            if lineage_mod.excluded_by(head, rec.step, lineage) is None:
                kept[rec.slot] = rec
        self.slots = [Slot(i) for i in range(self.nslots)]
        keep_names = set()
        for index, rec in kept.items():
            slot = self.slots[index]
            slot.buffer, slot.size = rec.buffer, rec.buffer_size
            slot.entries = {k: (sig, off, n) for k, sig, off, n in rec.layout}
            slot.holds = (rec.step, rec.version, rec.created)
            keep_names |= {rec.name, rec.buffer, rec.values_file, rec.layout_file}
        try:
            names = os.listdir(self.ns)
        except FileNotFoundError:
            names = []
        drop = [n for n in names if (shm.parse_name(n) or (-1,))[0] == rank and n not in keep_names]
        if rank == min(here):
            drop += [n for n in names if (shm.parse_name(n) or (rank,))[0] not in here]  # (the lock stays)
        shm.remove(self.ns, drop)
        if kept and rank == 0:
            log.info("shardckpt: memory tier: steps %s of this history stay in %s",
                     sorted(r.step for r in kept.values()), self.ns)

    def stage(self, captured: dict[str, Any], what: str, *, disk: bool, writing: bool = False, plan: Any = None
              ) -> tuple[dict[str, Any], CopyFence] | None:
        """Steps 1-4 of the module docstring: the copy into a slot (its record removed first). ``None``: the
        tier stepped aside on this rank (now or before): the caller stages for the disk without it.

        ``writing``: the disk write of the newest save due on disk still reads its slot. ``plan``
        (``saving.plan.SavePlan``): a slot whose stager copied under this plan before is laid out for its
        fixed tensors; only the rest of the state is checked against the layout.
        """
        if self.broken is not None or not self.started:
            return None
        try:
            slot = self._pick(disk, writing)
            planned = plan is not None and slot.stager is not None and slot.stager.staged_under(plan)
            wanted = self._wanted(plan.volatile(captured) if planned else captured)
            self._stop_sum(slot)
            shm.drop_record(self.ns, _dist.rank(), slot.index)
            slot.holds = None
            if slot.fits(wanted) and slot.base is None:  # a slot adopted from the process before: its file, mapped
                try:
                    self._map(slot, create=False)
                except OSError:
                    self._unmap(slot, remove=True)
                    slot.buffer, slot.entries = "", {}
            if not slot.fits(wanted):
                self._lay_out(slot, wanted)
        except (OSError, Unfit) as exc:
            self._aside(f"{what}: {exc}", every_rank=False)
            return None
        if disk:
            self.disk_slot = slot.index
        self._writing = slot
        return slot.stager.stage(captured, what=what, plan=plan)

    def _pick(self, disk: bool, writing: bool) -> Slot:
        """Step 1: never the newest save's slot, nor (kept only in memory) the one being written to disk."""
        newest = max((s for s in self.slots if s.holds is not None), key=lambda s: s.holds[2], default=None)
        candidates = [s for s in self.slots if s is not newest and (disk or not writing or s.index != self.disk_slot)]
        if sum(1 for s in self.slots if s.buffer) < self.keep + 1:
            empty = [s for s in candidates if s.holds is None]
            if empty:
                return empty[0]
        laid = [s for s in candidates if s.buffer]
        return (next((s for s in laid if s.holds is None), None)
                or min((s for s in laid if s.holds is not None), key=lambda s: s.holds[2], default=None)
                or next(s for s in candidates if s.holds is None))

    def _lay_out(self, slot: Slot, wanted: list[tuple[str, str, int]]) -> None:
        keys = {k for k, _s, _n in wanted}
        entries, offset = {}, 0
        for key, sig, nbytes in wanted + [(k, s, n) for k, (s, _o, n) in slot.entries.items() if k not in keys]:
            entries[key] = (sig, offset, nbytes)
            offset += align(nbytes)
        size = max(offset, shm.ALIGN)
        others = sum(s.size for s in self.slots if s is not slot)
        projected = max(others + size, self.nslots * size)
        if projected > self._share:
            raise Unfit(f"it now needs {fmt_bytes(projected)} ({self.nslots} copies of {fmt_bytes(size)}: the state "
                         f"grew), more than its share of memory_budget ({fmt_bytes(self._share)})")
        self._unmap(slot, remove=True)
        slot.entries, slot.size, slot.buffer = entries, size, shm.buffer_name(_dist.rank(), slot.index)
        try:
            self._map(slot, create=True)
        except OSError as exc:
            shm.remove(self.ns, [slot.buffer])
            slot.buffer, slot.entries = "", {}
            free = _shm_free()
            raise Unfit(f"{fmt_bytes(size)} of shared memory could not be reserved in {self.ns} ({exc}); "
                         f"{fmt_bytes(free) if isinstance(free, int) else free} free") from exc

    def _map(self, slot: Slot, *, create: bool) -> None:
        path = os.path.join(self.ns, slot.buffer)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, slot.size)  # the pages now, or ENOSPC now: never a SIGBUS mid-copy
            elif os.fstat(fd).st_size < slot.size:
                raise OSError(f"{path} is shorter than its record says")
            region = mmap.mmap(fd, slot.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        slot.region = region
        slot.base = torch.frombuffer(region, dtype=torch.uint8)
        slot.stager = SlotStager(slot)
        slot.cache = {}
        slot.pinned = self._register(slot.base)

    def _register(self, base: torch.Tensor) -> int:
        """Pin the slot for the GPU's copies (``cudaHostRegister``); 0 when not pinned. Not run without a GPU."""
        nbytes = base.numel()
        if not self.pin or (self.max_pinned is not None and self._pinned + nbytes > self.max_pinned):
            return 0
        error = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), nbytes, 0)
        if int(getattr(error, "value", error)) != 0:
            log.warning("shardckpt: memory tier: cudaHostRegister of %s failed (%s); its copies run unpinned "
                        "(slower)", fmt_bytes(nbytes), error)
            return 0
        self._pinned += nbytes
        return nbytes

    def _unmap(self, slot: Slot, *, remove: bool) -> None:
        self._stop_sum(slot)
        if slot.pinned and slot.base is not None:
            torch.cuda.cudart().cudaHostUnregister(slot.base.data_ptr())
            self._pinned -= slot.pinned
        slot.pinned = 0
        written = slot.cache.get(("record", 0), {}).get("layout")  # type: ignore[union-attr]
        slot.region, slot.base, slot.stager, slot.cache = None, None, None, {}  # the mapping goes with its last view
        slot.close_values()
        if remove and slot.buffer:
            shm.drop_record(self.ns, _dist.rank(), slot.index)
            shm.remove(self.ns, [slot.buffer, shm.values_name(_dist.rank(), slot.index)] + ([written[1]] if written
                                                                                            else []))
            slot.holds = None

    def record(self, job: Any, manifest: layout.Manifest) -> str | None:
        """Step 5: the values, then the record of the copy just made (after its copies are complete); then
        step 6, its checksum, in the background. ``None``: nothing kept (the tier stepped aside on this rank)."""
        slot = self._writing
        self.last = job.step
        self._writing = None
        if slot is None or slot.stager is None:
            return None
        rank = _dist.rank()
        _failpoints.hit("memory.copied")
        try:
            tensors, values, planner_data = dcp_memory.describe(job.staged, slot.offset_of, slot.cache)
        except ValueError as exc:
            if not dcp_memory.names_twice(exc):
                raise self._unserialisable(job.step, exc) from exc
            raise SaveError(f"step {job.step}: {dcp_memory.TWICE} ({exc}); nothing of step {job.step} was kept in "
                            f"memory, earlier steps are intact. Remedy: rename one of the two.") from exc
        except Exception as exc:
            raise self._unserialisable(job.step, exc) from exc
        ids = tuple(map(id, tensors))  # the entries are describe's cached ones: the same list, the same sizes
        sized = slot.cache.get(("nbytes", 0))
        if sized is None or sized[0] != ids:
            sized = slot.cache[("nbytes", 0)] = (ids, sum(_nbytes(t) for t in tensors))  # type: ignore[assignment]
        manifest.total_bytes = sum(len(v) for _f, v in values) + sized[1]
        items, pos = [], 0
        values_file = shm.values_name(rank, slot.index)
        for fqn, data in values:
            items.append([fqn, pos, len(data)])
            pos += len(data)
        values_bytes = b"".join(data for _f, data in values)
        try:
            slot.write_values(os.path.join(self.ns, values_file), values_bytes)
            rec = shm.Record(
                rank=rank, slot=slot.index, step=job.step, save_id=job.save_id, world_size=_dist.world_size(),
                created=manifest.created, boot_id=shm.boot_id(), local_dir=self.root, buffer=slot.buffer,
                buffer_size=slot.size, values_file=values_file, values_size=pos,
                manifest=manifest.to_json(self._manifests),
                tensors=tensors, values=items, planner_data=planner_data,
                layout=self._layout_rows(slot), host=self._host,
                run=os.path.basename(self.ns).rsplit("-", 1)[-1],
            )
            shm.write_record(self.ns, rec, slot.cache.setdefault(("record", 0), {}))  # type: ignore[arg-type]
        except OSError as exc:
            self._aside(f"step {job.step}: the copy could not be recorded in {self.ns} ({exc})", every_rank=False)
            return None
        slot.holds = (job.step, rec.version, rec.created)
        stop = threading.Event()
        slot.summing = (stop, self._sums.submit(self._sum, slot, rec, values_bytes, stop))
        return os.path.join(self.ns, shm.record_name(rank, slot.index))

    @staticmethod
    def _unserialisable(step: int, exc: Exception) -> SaveError:
        return SaveError(
            f"step {step}: a non-tensor value of the state cannot be serialised ({type(exc).__name__}: {exc}); "
            f"nothing of step {step} was kept in memory, earlier steps are intact. Remedy: make every "
            f"non-tensor value picklable (or keep it behind a state_dict())."
        )

    @staticmethod
    def _layout_rows(slot: Slot) -> list[list[Any]]:
        """The slot's layout as its record lists it (made again only when the slot was laid out again)."""
        found = slot.cache.get(("layout", 0))
        if found is None or found[0] is not slot.entries:
            found = slot.cache[("layout", 0)] = (  # type: ignore[assignment]
                slot.entries, [[k, s, o, n] for k, (s, o, n) in slot.entries.items()])
        return found[1]

    def _sum(self, slot: Slot, rec: shm.Record, values: bytes, stop: threading.Event) -> None:
        """Step 6 (the background thread): the copy's checksum, unless the slot is taken again first."""
        assert slot.region is not None
        with memoryview(slot.region) as whole:
            value = shm.digest([whole[:rec.buffer_size], values], stop.is_set)
        if value is not None and not stop.is_set():
            try:
                shm.write_sum(self.ns, rec, value)
            except OSError:
                pass  # a copy without its checksum is read unchecked, as one killed before it was taken

    def _stop_sum(self, slot: Slot) -> None:
        if slot.summing is not None:
            stop, future = slot.summing
            stop.set()
            try:
                future.result()
            except Exception:  # noqa: BLE001 - a failed checksum only leaves the copy without one
                pass
            slot.summing = None

    def release(self) -> None:
        """Free this rank's copies (``close()``, once nothing is only there: the job is over for this process)."""
        for slot in self.slots:
            self._unmap(slot, remove=True)
        self.slots = []
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None
        ns = self.ns or shm.namespace(self.root)  # (copies of a process before this one, when none was made here)
        if ns is None or shm.namespace_problem(ns) is not None:
            return
        try:
            names = os.listdir(ns)
        except FileNotFoundError:
            return
        shm.remove(ns, [n for n in names if (shm.parse_name(n) or (-1,))[0] == _dist.rank()])
        shm.remove_if_empty(ns)  # the last rank out removes the directory

    def detach(self) -> None:
        """``close()``: the copies' checksums finished, this process no longer holds the run alive (the keeper does)."""
        self._sums.shutdown(wait=True)
        for slot in self.slots:
            slot.close_values()
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None

    def purge_unused(self) -> None:
        """With the tier off: what an earlier job left in this ``local_dir``'s namespace is freed (at the first
        save; nothing of this job writes there)."""
        ns = shm.namespace(self.root)
        if ns is not None and os.path.isdir(ns):
            freed = shm.purge(self.root, ns)
            if freed and _dist.rank() == 0:
                log.info("shardckpt: memory tier off: freed %s of shared memory an earlier job left in %s",
                         fmt_bytes(freed), ns)

    def status(self) -> dict[str, Any]:
        """What ``Checkpointer.status()`` shows of the memory tier (on this rank and machine)."""
        mine = sorted((r for r in shm.read_records(self.root)[0] if r.rank == _dist.rank()), key=lambda r: r.created)
        out = {"latest_memory": mine[-1].step if mine else None, "memory_steps": sorted({r.step for r in mine}),
               "memory_bytes": shm.held_bytes(self.root)}
        return out if self.every is None else dict(out, memory_dir=self.ns or shm.namespace(self.root))

    # ------------------------------------------------------------ close: the newest step onto disk

    def unflushed(self, groups: _dist.SideGroups) -> tuple[shm.Record | None, bool]:
        """``close()``: the newest save held in memory when its step is newer than the newest on disk and every
        rank holds its copy of it (collective over ``ctl``), and whether the memory may then go.

        A newer save that cannot be written from here (copies of another world size, or differing between
        ranks) is left in memory, with a warning: a launch at its world size within the keeper's linger finds it.
        """
        mine = None
        records = [r for r in shm.read_records(self.root)[0] if r.rank == _dist.rank()]
        newest = max(records, key=lambda r: r.created, default=None)
        if newest is not None:
            head = lineage_mod.head(lineage_mod.local_infos(self.root))
            # The same save on disk is not newer, whatever this rank's clock stamped its copy with (the disk's
            # manifest carries rank 0's time).
            if head is None or (newest.version != head.version and newest.created > head.created):
                mine = newest
                copy = dcp_memory.Copy.of(shm.namespace(self.root) or "", newest)
                problem = dcp_memory.check_copy(shm.namespace(self.root) or "", newest, copy)
                copy.close()
                if problem is not None:  # never written to disk
                    log.warning("shardckpt: close(): step %d is not written to disk from memory: %s", newest.step,
                                problem)
                    mine = None
        gathered = groups.all_gather_ctl(None if mine is None else (mine.step, mine.version, mine.world_size))
        if all(g is None for g in gathered):
            return None, True
        if len(set(gathered)) == 1 and gathered[0][2] == _dist.world_size():
            return mine, True
        if _dist.rank() == 0:
            log.warning(
                "shardckpt: close(): step %s is newer in memory (%s) than on disk in %s, but it cannot be written "
                "from here (saved at world size %s, or not held by every rank: %s); it stays in memory until the "
                "node's keeper frees it. Remedy: save() the state before close()", next(g[0] for g in gathered if g),
                self.ns, self.root, next(g[2] for g in gathered if g), sorted(map(str, set(gathered))),
            )
        return None, False

    def flush_job(self, rec: shm.Record, partial: str) -> SaveJob:
        """A write job for the save of ``rec`` from its copy in memory (the same save id and time: the same version)."""
        manifest = rec.manifest_obj(rec.name)
        return SaveJob(
            rec.step, {}, dict(manifest.keys), partial, dict(manifest.metadata), time.monotonic(), 0.0,
            kind=manifest.kind, metrics=dict(manifest.metrics), frozen=manifest.frozen, run=manifest.run,
            created=manifest.created, lineage=lineage_mod.Lineage.from_json(manifest.lineage), save_id=manifest.save_id,
            planner=dcp_memory.RecordPlanner(dcp_memory.Copy.of(shm.namespace(self.root) or "", rec)),
        )
