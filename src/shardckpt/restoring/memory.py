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

from shardckpt import _dist
from shardckpt.dcp import memory as dcp_memory
from shardckpt.dcp.planner import unwrap_failure
from shardckpt.format import layout, shm
from shardckpt.format import lineage as lineage_mod

log = logging.getLogger("shardckpt")


class MemorySource:
    """Source 0 of a restore on this rank: the copies of ``root``'s saves in this machine's shared memory."""

    def __init__(self, config: Any, root: str) -> None:
        self.config = config
        self.root = root
        self.ns = shm.namespace(root)
        self._views: dict[int, tuple[Any, list[dcp_memory.Copy], str]] = {}

    def report(self) -> list[list[Any]]:
        """This machine's complete copies for the survey: ``[saved rank, step, version, world size, info]``."""
        out = []
        records, bad = shm.read_records(self.root)
        if self.ns in bad and os.environ.get("LOCAL_RANK", "0") == "0":  # planted or tampered with: never read
            log.warning("shardckpt: the memory tier's directory %s cannot be trusted (%s): no step is restored "
                        "from it, the restore reads the other tiers. Remedy: remove it (it is not this job's), or "
                        "point SHARDCKPT_SHM_DIR at a tmpfs of this user's", self.ns, bad[self.ns])
        for rec in records:
            try:
                info = lineage_mod.info_of(rec.manifest_obj(rec.name))
            except Exception:  # noqa: BLE001 - a record whose manifest cannot be read is not a copy
                continue
            out.append([rec.rank, rec.step, rec.version, rec.world_size, info.to_json()])
        return out

    def complete(self, step: int, choice: "MemoryChoice", groups: _dist.SideGroups) -> tuple[layout.Manifest, set[str], str]:
        """Source 0 of a restore (collective over ``ctl``): the save of ``choice`` from the copies on the
        machines, its metadata built from every saving rank's description."""
        rank = _dist.rank()
        mine: dict[int, Any] = {}
        problem = None
        records = [r for r in shm.read_records(self.root)[0] if r.version == choice.version]
        for q, holders in enumerate(choice.holders):
            if min(holders) == rank:
                rec = next((r for r in records if r.rank == q), None)
                if rec is None:
                    problem = f"the copy of rank {q} is gone from {self.ns}"
                    continue
                mine[q] = ({"tensors": rec.tensors, "values": rec.values, "planner_data": rec.planner_data},
                           rec.manifest)
        gathered = groups.all_gather_ctl((mine, problem))
        problems = [p for _m, p in gathered if p]
        if problems:
            raise dcp_memory.MemoryMiss(f"step {step} in memory: {problems[0]}")
        tables = {q: t for m, _p in gathered for q, t in m.items()}
        md = dcp_memory.metadata([tables[q][0] for q in sorted(tables)])
        manifest = layout.Manifest.from_json(tables[0][1], os.path.join(self.ns, shm.record_name(0, 0)))
        copies = [dcp_memory.Copy.of(self.ns, r) for r in sorted(records, key=lambda r: (r.rank != rank, r.rank))]
        where = f"memory ({self.ns})"
        self._views[step] = (md, copies, where)
        return manifest, set(), where

    def view(self, step: int) -> "MemoryView | None":
        """The read of ``step`` that :meth:`complete` prepared (once), else None."""
        found = self._views.pop(step, None)
        return MemoryView(step, *found) if found is not None else None




class MemoryView:
    """The save being restored from memory: its DCP metadata, and the read into the live state."""

    def __init__(self, step: int, md: Any, copies: list[dcp_memory.Copy], where: str) -> None:
        self.step, self.metadata, self.copies, self.where = step, md, copies, where

    def read(self, targets: dict[str, Any], planner: Any, group: Any) -> list[tuple[str, str]]:
        """DCP's load from the copies on this machine (collective); no checksum failures to report."""
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
