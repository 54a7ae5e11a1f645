"""The commit path: write -> hash -> exchange -> commit -> retention.

Runs in the background writer thread on every rank, over the ``io`` side
group (never the trainer's process group)::

    1. DCP writes this rank's shards into <local_dir>/.partial-step_<N>-<nonce>
    2. every rank hashes the files it wrote (rank 0 also .metadata)
    3. the ranks exchange their file tables and errors      (all_gather, io)
    4. the node leader writes the manifest last and renames the partial
       directory to step_<N>                               (the commit)
    5. the ranks exchange the commit outcomes               (all_gather, io)
    6. retention on the node leader, one log line on rank 0

Before the write, on the main thread: free space is agreed by all ranks
(:meth:`StepWriter.space_ok`), and the first save agrees on a nonce and
removes leftovers of crashed saves (:meth:`StepWriter.prepare`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import uuid
from typing import Any, Callable

import torch

from . import _dist, _failpoints, layout, local, retention
from ._text import fmt_bytes
from .errors import InsufficientSpaceError, SaveError
from .options import CheckpointConfig, OnDiskFull

log = logging.getLogger("shardckpt")


def _version() -> str:
    from . import __version__

    return __version__


@dataclasses.dataclass
class SaveJob:
    """One save handed to the background writer."""

    step: int
    staged: dict[str, Any]
    kinds: dict[str, str]
    partial: str
    metadata: dict[str, Any]
    t_start: float
    blocked: float


class StepWriter:
    """Writes and commits steps into ``root`` (the local tier)."""

    def __init__(
        self, config: CheckpointConfig, root: str, groups: _dist.SideGroups, deletable: Callable[[int], bool]
    ) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self._deletable = deletable
        self._policy = retention.policy_from(config.keep_last, config.keep_every)
        self._nonce: str | None = None
        self._count = 0
        self.last_total_bytes: int | None = None
        self.last_committed: int | None = None

    # ---- main thread, before the write

    def prepare(self) -> None:
        """First save: agree on a nonce for partial names, remove leftovers of crashed saves."""
        if self._nonce is not None:
            return
        self._nonce = self._groups.broadcast_ctl(uuid.uuid4().hex[:12])
        if _dist.local_rank() == 0:
            removed = local.clean_leftovers(self.root, keep_nonce=self._nonce)
            if removed:
                log.info("shardckpt: removed leftovers of interrupted saves in %s: %s", self.root, ", ".join(removed))

    def partial_dir(self, step: int) -> str:
        self._count += 1
        return os.path.join(self.root, layout.partial_dirname(step, f"{self._count}-{self._nonce}"))

    def space_ok(self, step: int, local_bytes: int) -> bool:
        """Agree across ranks whether every node has room for this step."""
        os.makedirs(self.root, exist_ok=True)
        # Upper bound of what this node writes: its ranks hold about as much
        # as this one; never more than the whole previous checkpoint.
        node_bytes = local_bytes * max(1, _dist.local_world_size())
        if self.last_total_bytes is not None:
            node_bytes = min(node_bytes, max(self.last_total_bytes, local_bytes))
        needed = int(node_bytes * (1 + self.config.free_space_margin)) + (1 << 20)
        free = shutil.disk_usage(self.root).free
        short = 0 if free >= needed else 1
        if self._groups.all_reduce_max([short])[0] == 0:
            return True
        where = "this node" if short else "another node"
        message = (
            f"step {step}: not enough free space in {self.root} on {where} "
            f"(this node needs ~{fmt_bytes(needed)}, has {fmt_bytes(free)} free). "
            f"Existing checkpoints are untouched. Remedy: free disk space, lower keep_last, "
            f"or point local_dir at a larger disk."
        )
        if self.config.on_disk_full == OnDiskFull.SKIP:
            log.warning("shardckpt: skipping save: %s", message)
            return False
        raise InsufficientSpaceError(message)

    # ---- background thread

    def write_and_commit(self, job: SaveJob) -> str:
        step, partial = job.step, job.partial
        rank = _dist.rank()
        leader = _dist.local_rank() == 0
        failure: BaseException | None = None
        mine: dict[str, Any] = {}
        try:
            os.makedirs(partial, exist_ok=True)
            local.dcp_write(job.staged, partial, process_group=self._groups.io, io_threads=self.config.io_threads)
            _failpoints.hit("write.done")
            mine = local.hash_files(partial, local.own_files(partial, rank), rank)
        except BaseException as exc:  # DCP reports failures as CheckpointException (a BaseException)
            failure = exc
        # Every rank reports, so one rank's failure never leaves the others waiting.
        reports = self._groups.all_gather_io((mine, None if failure is None else f"{type(failure).__name__}: {failure}"))
        problems = [(r, err) for r, (_table, err) in enumerate(reports) if err is not None]
        if problems:
            if leader:
                shutil.rmtree(partial, ignore_errors=True)
            where, what = problems[0]
            error = SaveError(
                f"step {step}: writing {partial} failed on rank {where} ({what}); the partial step was "
                f"removed and earlier steps are intact. Remedy: check the disk under {self.root}, then save again."
            )
            raise error from failure
        files: dict[str, layout.FileEntry] = {}
        for table, _err in reports:
            for name, (size, digest, owner) in table.items():
                files[name] = layout.FileEntry(size, digest, owner)
        manifest = layout.Manifest(
            step=step,
            world_size=_dist.world_size(),
            files=files,
            torch_version=torch.__version__,
            shardckpt_version=_version(),
            keys=dict(job.kinds),
            metadata=job.metadata,
            total_bytes=sum(e.size for e in files.values()),
            run_id=self.config.run_id,
        )
        final = os.path.join(self.root, layout.step_dirname(step))
        error: BaseException | None = None
        if leader:
            try:
                final = local.commit_step(self.root, partial, manifest)
                _failpoints.hit("commit.renamed")
            except FileNotFoundError:
                # Another node leader sharing this directory renamed it first.
                if layout.read_manifest(final) is None:
                    error = SaveError(f"step {step}: commit of {final} lost its partial directory")
            except BaseException as exc:  # disk full while writing the manifest, ...
                shutil.rmtree(partial, ignore_errors=True)
                error = SaveError(f"step {step}: commit of {final} failed ({exc}); earlier steps are intact")
                error.__cause__ = exc
        outcomes = self._groups.all_gather_io(None if error is None else str(error))
        if error is not None:
            raise error
        failures = [o for o in outcomes if o is not None]
        if failures:
            raise SaveError(f"step {step}: another node failed to commit: {failures[0]}")
        self.last_total_bytes = manifest.total_bytes
        self.last_committed = step
        committed = time.monotonic() - job.t_start
        if leader:
            self.apply_retention()
        if rank == 0:
            log.info(
                "shardckpt: saved step %d to %s: %s, blocked %.3f s, committed in %.2f s",
                step, final, fmt_bytes(manifest.total_bytes), job.blocked, committed,
            )
        return final

    def apply_retention(self) -> None:
        steps = layout.committed_steps(self.root)
        for old in retention.plan_deletions(steps, self._policy, self._deletable):
            local.delete_step(self.root, old)
            log.debug("shardckpt: retention removed step %d from %s", old, self.root)
