"""The memory tier's restore half: which saves every rank can restore from shared memory, and their read.

The survey learns every rank's records (:meth:`MemorySource.report`,
:func:`usable`); a save is usable when every saving rank's copy is complete
and every rank finds what it reads on its machine (the same world size with
each rank's own copy, or every copy on every rank's machine).
``sources.complete`` builds its DCP metadata from the copies' descriptions
(:meth:`MemorySource.complete`) and the restorer reads it with
:class:`~shardckpt.dcp.memory.MemoryReader`. The save half is
``saving/memory.py``; the files and records are ``format/shm.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from shardckpt import _dist, _failpoints
from shardckpt._text import fmt_bytes
from shardckpt.dcp import memory as dcp_memory
from shardckpt.dcp.planner import unwrap_failure
from shardckpt.format import layout, shm
from shardckpt.format import lineage as lineage_mod

log = logging.getLogger("shardckpt")


class MemorySource:
    """Source 0 of a restore on this rank: the copies of ``root``'s saves in this machine's shared memory.

    A whole source (:class:`~shardckpt.restoring.views.Source`): a step is read from the copies as they are
    (:meth:`complete`, :meth:`view`), never file by file; the survey learns what every rank holds from
    :meth:`report`."""

    kind = "memory"
    whole = True

    def __init__(self, config: Any, root: str) -> None:
        self.config = config
        self.root = root
        self.ns: str | None = None
        self._views: dict[int, tuple[Any, list[dcp_memory.Copy], str]] = {}
        self._scanned = False
        self._warned: set[str] = set()

    def report(self) -> list[list[Any]]:
        """This machine's complete copies of this directory's run, for the survey: ``[saved rank, step,
        version, world size, info]``. The machine's first rank says once what is not used, and why: copies of
        another run of this path (freed when no process of theirs is alive), records that do not check out,
        and (``start_fresh``) the copies of the run it starts over (freed)."""
        first = _dist.local_rank() == 0
        self.ns = shm.namespace(self.root)
        scan, self._scanned = not self._scanned, True
        if first and scan:
            self._foreign()
        if self.config.start_fresh and scan:  # (once: a later load() of this job reads its own copies)
            if first and self.ns is not None:
                held = shm.steps(self.root)["saves"]
                freed = shm.purge(self.root, self.ns)
                if held:
                    log.warning("shardckpt: start_fresh: step(s) %s held in shared memory (%s) are not resumed; "
                                "freed %s", sorted({e["step"] for e in held}), self.ns, fmt_bytes(freed))
            return []
        records, bad = shm.read_records(self.root)
        if first and bad and not set(bad) <= self._warned:
            self._warned |= set(bad)
            if self.ns in bad:  # planted or tampered with: never read
                log.warning("shardckpt: the memory tier's directory %s cannot be trusted (%s): no step is restored "
                            "from it, the restore reads the other tiers. Remedy: remove it (it is not this job's), "
                            "or point SHARDCKPT_SHM_DIR at a tmpfs of this user's", self.ns, bad[self.ns])
            else:
                log.warning("shardckpt: %d record(s) in %s are not used, the restore reads the other tiers for "
                            "them: %s", len(bad), self.ns, "; ".join(f"{n}: {why}" for n, why in sorted(bad.items())))
        out = []
        for rec in records:
            try:
                info = lineage_mod.info_of(rec.manifest_obj(rec.name))
            except Exception:  # noqa: BLE001 - a record whose manifest cannot be read is not a copy
                continue
            out.append([rec.rank, rec.step, rec.version, rec.world_size, info.to_json()])
        return out

    def _foreign(self) -> None:
        """Copies of another run of this path: never read; one warning each; freed unless their run is alive."""
        run = shm.run_id(self.root)
        for found in shm.foreign(self.root):
            if found["alive"]:
                fate = "left to that run (a live trainer or keeper of it holds it: its keeper frees it)"
            else:
                fate = f"freed {fmt_bytes(shm.purge(self.root, found['dir']))}"
            log.warning(
                "shardckpt: shared memory %s holds step(s) %s of another run of %s (run %s; this directory's run is "
                "%s): the directory was removed and created again, or another container's directory is mounted "
                "at this path over the same shared memory (--ipc=host). Not used; %s", found["dir"],
                found["steps"] or "(none complete)", self.root, found["run"], run or "(none yet)", fate)

    def complete(self, step: int, choice: MemoryChoice, groups: _dist.SideGroups
                 ) -> tuple[layout.Manifest, set[str], str]:
        """Source 0 of a restore (collective over ``ctl``): the save of ``choice`` from the copies on the
        machines, its metadata built from every saving rank's description. Each copy this rank answers for
        is checked against its checksum when it has one; every copy it reads is opened here (a purge of the
        memory from here on leaves the open files readable). A copy gone or not checking out on any rank:
        :class:`MemoryMiss` on every rank (the restore reads the other tiers)."""
        rank = _dist.rank()
        mine: dict[int, Any] = {}
        problem = None
        _failpoints.hit("memory.complete")
        ns = self.ns or ""
        records = [r for r in shm.read_records(self.root)[0] if r.version == choice.version]
        copies = [dcp_memory.Copy.of(ns, r) for r in sorted(records, key=lambda r: (r.rank != rank, r.rank))]
        try:
            for copy in copies:
                copy.open()
        except OSError as exc:
            problem = f"a copy is gone from {ns} ({exc.strerror or exc})"
        for q, holders in enumerate(choice.holders):
            if min(holders) == rank and problem is None:
                rec = next((r for r in records if r.rank == q), None)
                copy = next((c for c in copies if c.rank == q), None)
                if rec is None or copy is None:
                    problem = f"the copy of rank {q} is gone from {ns}"
                    continue
                problem = dcp_memory.check_copy(ns, rec, copy)
                mine[q] = ({"tensors": rec.tensors, "values": rec.values, "planner_data": rec.planner_data},
                           rec.manifest)
        gathered = groups.all_gather_ctl((mine, problem, not os.path.isdir(ns)))
        problems = [p for _m, p, _g in gathered if p]
        if problems:
            for copy in copies:
                copy.close()
            raise dcp_memory.MemoryMiss(f"step {step} in memory: {problems[0]}", gone=any(g for _m, _p, g in gathered))
        tables = {q: t for m, _p, _g in gathered for q, t in m.items()}
        md = dcp_memory.metadata([tables[q][0] for q in sorted(tables)])
        manifest = layout.Manifest.from_json(tables[0][1], os.path.join(ns, shm.record_name(0, 0)))
        where = f"memory ({ns})"
        self._views[step] = (md, copies, where)
        return manifest, set(), where

    def view(self, step: int) -> MemoryView | None:
        """The read of ``step`` that :meth:`complete` prepared (once), else None."""
        found = self._views.pop(step, None)
        return MemoryView(step, *found) if found is not None else None

    def offers(self) -> dict[int, dict[str, list[str]]]:
        return {}  # not files of a directory: the survey reads :meth:`report`

    def views(self, step: int, version: str) -> list[Any]:
        return []  # read whole (:meth:`complete`)

    def close(self) -> None:
        """Close the copies of a read prepared and never made."""
        for _md, copies, _where in self._views.values():
            for copy in copies:
                copy.close()
        self._views.clear()


class MemoryView:
    """The save being restored from memory: its DCP metadata, and the read into the live state."""

    def __init__(self, step: int, md: Any, copies: list[dcp_memory.Copy], where: str) -> None:
        self.step, self.metadata, self.copies, self.where = step, md, copies, where

    def read(self, targets: dict[str, Any], planner: Any, group: Any) -> list[tuple[str, str]]:
        """DCP's load from the copies on this machine (collective); no checksum failures to report."""
        _failpoints.hit("memory.read")
        reader = dcp_memory.MemoryReader(self.metadata, self.copies, step=self.step, where=self.where)
        no_dist = not (dist.is_available() and dist.is_initialized())
        try:
            _load_state_dict(targets, storage_reader=reader, planner=planner, process_group=group, no_dist=no_dist)
        except CheckpointException as exc:
            raise unwrap_failure(exc, f"reading step {self.step} from {self.where}") from exc
        finally:
            for copy in self.copies:
                copy.close()
        return []


class MemoryChoice:
    """A save every rank can restore from memory: its version, info, and per saving rank the ranks that see its copy."""

    def __init__(self, version: str, info: Any, holders: list[list[int]]) -> None:
        self.version, self.info, self.holders = version, info, holders


def usable(reports: list[Any], world: int) -> dict[int, MemoryChoice]:
    """From every rank's :meth:`MemoryTier.report`: per step, the newest save restorable from memory.

    A save qualifies when every saving rank's copy is complete on some machine, and either the world size
    is the same and each rank sees its own copy, or every rank sees every copy (a world-size change on
    one machine). The same on every rank.
    """
    saves: dict[str, dict[str, Any]] = {}
    for r, report in enumerate(reports):
        for saved_rank, step, version, size, info in report or []:
            entry = saves.setdefault(version, {"step": step, "world": size, "holders": {}, "info": info})
            entry["holders"].setdefault(saved_rank, set()).add(r)
            if info[0] > entry["info"][0]:
                entry["info"] = info
    out: dict[int, MemoryChoice] = {}
    for version, e in saves.items():
        holders = e["holders"]
        if any(q not in holders for q in range(e["world"])):
            continue  # a copy never completed (killed during its copy) or its machine is not in this job
        own = e["world"] == world and all(q in holders[q] for q in range(world))
        everywhere = all(len(holders[q]) == world for q in range(e["world"]))
        if not (own or everywhere):
            continue
        best = out.get(e["step"])
        if best is None or e["info"][0] > best.info[0]:
            out[e["step"]] = MemoryChoice(version, e["info"], [sorted(holders[q]) for q in range(e["world"])])
    return out
