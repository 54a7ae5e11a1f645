"""The commit path: write -> hash -> exchange -> commit -> outcome -> retention.

Runs in the background writer thread on every rank, over the ``io`` side
group (never the trainer's process group). Every path through it passes both
exchanges, so one rank's failure is every rank's failure, raised by every
rank for the same step::

    1. DCP writes this rank's shards into <local_dir>/.partial-step_<N>-<nonce>
    2. every rank takes the checksums of the files it wrote (rank 0 also
       .metadata), computed while writing (no read back)
    3. exchange 1: file tables and errors                   (all_gather, io)
       any error: the partial directory goes, every rank raises SaveError
    4. each copy's committer (see topology.py: rank 0 of a shared directory,
       the lowest rank of each node with node-local ones) writes the manifest
       last and renames the partial directory to step_<N>: the commit
    5. exchange 2: commit outcomes, and with the peer tier on each copy's
       facts (which nodes hold its files of which save)  (all_gather, io)
       any error: the copies that did commit withdraw the step (an earlier
       copy of the same step number is put back); every rank raises SaveError
    6. retention in each copy, by its committer, below the newest step that
       the facts of step 5 show complete across any one node's loss (the same
       point on every node); a failure there is logged as a warning (the step
       is committed), never a failed save

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

from shardckpt import _dist, _failpoints
from shardckpt._text import fmt_bytes
from shardckpt._version import __version__
from shardckpt.dcp import writer as dcp_writer
from shardckpt.dcp.memory import TWICE, names_twice
from shardckpt.errors import (
    CopiesRacedError,
    FailedElsewhere,
    InsufficientSpaceError,
    SaveError,
)
from shardckpt.format import layout, retention, step_dirs
from shardckpt.format import lineage as lineage_mod
from shardckpt.options import CheckpointConfig, OnDiskFull
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")


def _version() -> str:
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
    kind: str = "full"
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    upload: bool = True
    frozen: dict[str, Any] = dataclasses.field(default_factory=dict)
    run: dict[str, Any] = dataclasses.field(default_factory=dict)
    fence: Any = None
    """When the staging copies are done (``stage.CopyFence``); the writer waits for it first."""
    lineage: lineage_mod.Lineage | None = None
    """The history this save belongs to (:meth:`StepWriter.lineage_for`); it becomes the writer's once committed."""
    save_id: str = ""
    """This save's identity, the same on every rank (:meth:`StepWriter.partial_dir`)."""
    later: Any = None
    """The plain tensors whose content the ranks compare before the write (``values.Later``), or ``None``."""
    planner: Any = None
    """DCP's save planner when ``staged`` is not the state to write (a step written from its copy in memory)."""
    created: float = 0.0
    """When the save was made, when it is also kept in memory (:meth:`StepWriter.held`): its manifests on
    both tiers carry it. 0: stamped at the commit."""


class StepWriter:
    """Writes and commits steps into ``root`` (the local tier)."""

    def __init__(
        self, config: CheckpointConfig, root: str, groups: _dist.SideGroups, deletable: Callable[[int], bool]
    ) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self._deletable = deletable
        self._policy = retention.policy_from(
            config.keep_last, config.keep_every, keep_best=config.keep_best, best_metric=config.best_metric,
            best_mode=config.best_mode, keep_last_light=config.keep_last_light,
        )
        self._nonce: str | None = None
        self._count = 0
        self.last_total_bytes: int | None = None
        self.last_committed: int | None = None
        self.topology = Topology.single()
        """Which ranks share this directory; set by the Checkpointer at the first save or load."""
        self.lineage: lineage_mod.Lineage | None = None
        """The branch this instance's saves belong to: set by a load, else at the first save."""
        self.head_step: int | None = None
        """The newest step of that branch: the step loaded, then each step committed."""
        self.head_on_disk = True
        """The head's save is one for the disk (else it was kept in memory only)."""
        self._newest_created = 0.0
        self.file_done: Callable[[SaveJob, int, str, int, str], None] | None = None
        """``(job, rank, name, size, checksum)`` as each file of a save is complete (early uploads)."""
        self.peer_facts: Callable[[], Any] | None = None
        """What this copy's committer reports of its peer replicas at each commit (``PeerTier.facts``)."""
        self.peer_agreed: Callable[[list[Any]], None] | None = None
        """Every rank, after each commit, with every copy's reports (``PeerTier.agree``), before retention."""

    def continue_lineage(
        self, lineage: lineage_mod.Lineage, newest_created: float, head_step: int | None = None
    ) -> None:
        """After a load: later saves continue (or fork from) the loaded step's history."""
        self.lineage = lineage
        self.head_step = head_step
        self._newest_created = max(self._newest_created, newest_created)

    def lineage_for(self, step: int) -> lineage_mod.Lineage:
        """The history a save of ``step`` belongs to (after :meth:`prepare`; the same on every rank).

        A step number not above the newest step of the branch continued (a loop
        that did not take its step counter from ``load()``, or saves a lower
        number after loading) is handled like a rollback: a new branch forked
        just below it, whose head is this save; the steps it passes over are
        kept, abandoned, until ``shardckpt gc``. The same number as the head is
        a save of that step again on the same branch (the earlier save is kept
        aside, see :func:`step_dirs.finish_commit`).
        """
        current = self.lineage or lineage_mod.Lineage()
        head = self.head_step
        if head is None or step > head:
            return current
        if step == head:
            # The head kept in memory only, saved again (for the disk: a loop's last save with force=True) is
            # nothing to warn about; a step saved twice on disk is.
            if _dist.rank() == 0 and self.head_on_disk:
                log.warning(
                    "shardckpt: step %d is saved a second time: this save replaces the earlier save of step %d in "
                    "%s, which is kept aside (abandoned; `shardckpt gc` removes it). Remedy: give each save its own "
                    "step number (a loop that saves after its last iteration and again at exit, or right after "
                    "load() at the step it loaded, saves the same step twice)", step, step, self.root,
                )
            return current
        # The new branch's id is derived from the nonce every rank agreed on and the save count.
        lineage = current.fork(step - 1, branch=f"{self._nonce}{self._count + 1:x}"[-10:])
        if _dist.rank() == 0:
            log.warning(
                "shardckpt: step %d is not above step %d, the newest step of the history this run continues "
                "(did the loop restore its step counter from load()?). It starts a new branch whose head is step %d; "
                "steps after %d of the earlier branch are kept but no longer resumed by default nor counted by "
                "retention (`shardckpt gc` removes them)", step, head, step, step - 1,
            )
        return lineage

    # ---- main thread, before the write

    def prepare(self) -> None:
        """First save: agree on a nonce for partial names, remove leftovers of crashed saves."""
        if self._nonce is not None:
            return
        if self.lineage is None:
            # Nothing was loaded: a directory with steps gets a new branch (see lineage.py).
            proposal = None
            if _dist.rank() == 0:
                infos = lineage_mod.local_infos(self.root)
                proposal = (lineage_mod.continue_from(infos, None),
                            max((i.created for i in infos.values()), default=0.0))
                if infos:
                    log.warning(
                        "shardckpt: %s holds steps %s but nothing was loaded from it: this run starts a new "
                        "branch; those steps are kept, not resumed by default, not counted by retention "
                        "(`shardckpt gc` removes them)", self.root, sorted(infos),
                    )
            lineage, newest = self._groups.broadcast_ctl(proposal)
            self.continue_lineage(lineage, newest)
        self._nonce = self._groups.broadcast_ctl(uuid.uuid4().hex[:12])
        if self.topology.committer:
            removed = step_dirs.clean_leftovers(self.root, keep_nonce=self._nonce)
            if removed:
                log.info("shardckpt: removed leftovers of interrupted saves in %s: %s", self.root, ", ".join(removed))

    def forks(self, step: int) -> bool:
        """A save of ``step`` starts a new branch (:meth:`lineage_for`)."""
        return self.head_step is not None and step < self.head_step

    def held(self, job: SaveJob, disk: bool) -> layout.Manifest:
        """A save kept in memory (``disk``: and written to disk): its manifest (as a disk copy would say,
        without files), and the head moves on."""
        created = job.created = max(time.time(), self._newest_created + 1e-3)
        self._newest_created = created
        if job.lineage is not None:
            self.lineage = job.lineage
        self.head_step, self.head_on_disk = job.step, disk
        return self._manifest(job, [], created)

    def partial_dir(self, step: int, save_id: str | None = None) -> str:
        """The partial directory of the next save (or of the save ``save_id``, written again from memory)."""
        if save_id is not None:
            nonce, _sep, count = save_id.rpartition("-")
            return os.path.join(self.root, layout.partial_dirname(step, f"{count}-{nonce}"))
        self._count += 1
        return os.path.join(self.root, layout.partial_dirname(step, f"{self._count}-{self._nonce}"))

    def save_id(self) -> str:
        """The identity of the save :meth:`partial_dir` was last called for: agreed nonce + count."""
        return f"{self._nonce}-{self._count}"

    def space_ok(self, step: int, local_bytes: int, shared_bytes: int = 0) -> bool:
        """Agree across ranks whether every node has room for this step.

        ``local_bytes``: what only this rank writes (shards, per-rank entries);
        ``shared_bytes``: what every rank holds alike (a DDP replica), written once.
        """
        os.makedirs(self.root, exist_ok=True)
        # Upper bound of what this directory receives: the ranks sharing it write about as
        # much of their own as this one, a replicated tensor once (DCP picks one writer,
        # possibly on this node); never more than the whole previous checkpoint.
        node_bytes = local_bytes * len(self.topology.copy) + shared_bytes
        if self.last_total_bytes is not None:
            node_bytes = min(node_bytes, max(self.last_total_bytes, local_bytes + shared_bytes))
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
        """Steps 1-6 above for one save; returns the step directory or raises :class:`SaveError`."""
        topo = self.topology
        step, partial = job.step, job.partial
        rank = _dist.rank()

        # 1-2: write and hash (first, every rank alike, the plain tensors' digests: values.Later)
        failure: BaseException | None = None
        table: dict[str, Any] = {}
        metadata_bytes: bytes | None = None
        staged = job.staged
        try:
            if job.fence is not None:
                job.fence.synchronize()  # on a GPU the copies into the buffers may still run
        except BaseException as exc:
            failure = exc
        if job.later is not None:
            try:
                staged = job.later.settle(staged, self._groups.all_gather_io, failed=failure is not None)
            except BaseException as exc:
                failure = failure or exc
        if failure is None:
            try:
                table, metadata_bytes = self._write(job, staged, rank)
            except BaseException as exc:  # DCP reports failures as CheckpointException (a BaseException)
                failure = exc

        # 3: exchange 1
        reports = self._groups.all_gather_io((table, _describe(failure), metadata_bytes, job.created or time.time(),
                                              _disk(failure)))
        problems = [(r, report[1], report[4]) for r, report in enumerate(reports) if report[1] is not None]
        if problems:
            if topo.committer:
                shutil.rmtree(partial, ignore_errors=True)
            causes = [p for p in problems if not p[1].startswith(FailedElsewhere.__name__ + ":")] or problems
            where, what, disk = next((p for p in causes if p[2]), causes[0])
            raced = what.startswith(CopiesRacedError.__name__ + ":")  # it names its own remedy
            remedy = "" if raced else f" {self._remedy(disk)}"
            if not disk and names_twice(what):
                remedy = f" The cause: {TWICE}. Remedy: rename one of the two."
            error = SaveError(
                f"step {step}: writing {partial} failed on rank {where} ({what}); the partial step was "
                f"removed on every node and earlier steps are intact." + remedy
            )
            raise error from failure

        # 4: commit, by each copy's committer
        commit: step_dirs.Commit | None = None
        manifest: layout.Manifest | None = None
        try:
            # One timestamp for every copy (rank 0's), and later than every step this run
            # has seen: the newest manifest is the head of the run's history (lineage.py). A save
            # also kept in memory was stamped when it was made, as its memory copies were.
            created = reports[0][3] if job.created else max(reports[0][3], self._newest_created + 1e-3)
            manifest = self._manifest(job, [r[0] for r in reports], created)
            if topo.committer:
                meta = next((r[2] for r in reports if r[2] is not None), None)
                if meta is not None and rank != 0:
                    _write_file(os.path.join(partial, layout.METADATA_NAME), meta)
                commit = step_dirs.commit_step(self.root, partial, manifest)
                _failpoints.hit("commit.renamed")
        except BaseException as exc:  # disk full while writing the manifest, ...
            failure = exc
            if commit is None and topo.committer:
                shutil.rmtree(partial, ignore_errors=True)

        # 5: exchange 2, which also carries each copy's peer facts (what its peers hold of its steps)
        facts = None
        if topo.committer and self.peer_facts is not None:
            try:
                facts = self.peer_facts()
            except Exception as exc:  # noqa: BLE001 - without them no step becomes safer; nothing is deleted for it
                log.warning("shardckpt: step %d: the peer tier's facts of %s could not be read: %s",
                            step, self.root, exc)
        outcomes = self._groups.all_gather_io((_describe(failure), _disk(failure), facts))
        problems = [(r, err, disk) for r, (err, disk, _facts) in enumerate(outcomes) if err is not None]
        if problems:
            if commit is not None:
                try:
                    step_dirs.undo_commit(commit)
                except OSError as exc:
                    log.error("shardckpt: step %d: could not withdraw %s after a failed commit: %s",
                              step, commit.final, exc)
            where, what, disk = next((p for p in problems if p[2]), problems[0])
            error = SaveError(
                f"step {step}: the commit failed on rank {where} ({what}); the step was withdrawn on every "
                f"node and earlier steps are intact. {self._remedy(disk)}"
            )
            raise error from failure
        if commit is not None:
            try:
                kept = step_dirs.finish_commit(commit)
            except OSError as exc:  # the step is committed on every copy; the earlier save stays where it is
                kept = None
                log.warning("shardckpt: step %d is committed, but the earlier save of it (%s) could not be moved "
                            "aside: %s", step, commit.displaced, exc)
            if kept is not None:
                log.info("shardckpt: step %d: the earlier save of step %d was kept aside as %s", step, step, kept)
        if manifest is None:  # not reached: a failure to build it is reported by exchange 2
            raise SaveError(f"step {step}: no manifest was built")
        self.last_total_bytes = manifest.total_bytes
        self.last_committed = step
        self._newest_created = max(self._newest_created, manifest.created)
        # (compared by what the lineages say: a write from memory rebuilds the same lineage from its record)
        forked = (job.lineage is not None and self.head_step is not None and step < self.head_step
                  and (self.lineage is None or job.lineage.to_json() != self.lineage.to_json()))
        if job.lineage is not None:
            self.lineage = job.lineage
        # A save that forked is the new branch's head, below the old head. Otherwise a save kept only in memory
        # may have moved the head on meanwhile (never onto another branch: a save that forks waits for this
        # write first).
        self.head_step = step if forked or self.head_step is None else max(self.head_step, step)

        # 6: retention (after the step is committed on every copy), every node from the same peer facts
        if self.peer_agreed is not None:
            self.peer_agreed([o[2] for o in outcomes])
        if topo.committer:
            try:
                self.apply_retention(protect=step)
            except Exception as exc:  # noqa: BLE001 - the step is committed; old steps wait for the next save
                log.warning(
                    "shardckpt: step %d is committed, but retention in %s failed (%s: %s); older steps stay "
                    "until the next save", step, self.root, type(exc).__name__, exc,
                )
        final = os.path.join(self.root, layout.step_dirname(step))
        if rank == 0:
            log.info(
                "shardckpt: saved step %d to %s: %s, blocked %.3f s, committed in %.2f s",
                step, final, fmt_bytes(manifest.total_bytes), job.blocked, time.monotonic() - job.t_start,
            )
        return final

    def _write(self, job: SaveJob, staged: dict[str, Any], rank: int) -> tuple[dict[str, Any], bytes | None]:
        """This rank's files of the save, checksummed while written: ``(file table, .metadata for the copies)``."""
        os.makedirs(job.partial, exist_ok=True)
        done = self.file_done
        sums = dcp_writer.dcp_write(
            staged, job.partial, process_group=self._groups.io, io_threads=self.config.io_threads, rank=rank,
            on_file=(lambda name, size, digest: done(job, rank, name, size, digest)) if done else None,
            planner=job.planner,
        )
        _failpoints.hit("write.done")
        table = {name: (size, digest, rank, chunks) for name, (size, digest, chunks) in sums.items()}
        _failpoints.hit("write.hashed")
        if rank == 0 and not self.topology.shared:
            with open(os.path.join(job.partial, layout.METADATA_NAME), "rb") as f:
                return table, f.read()  # every node-local copy holds .metadata
        return table, None

    def _remedy(self, disk: bool) -> str:
        if disk:
            return f"Remedy: check the disk under {self.root} (free space, permissions, errors), then save again."
        return (
            "The disk is not the cause: the state could not be planned or serialised. Remedy: make every "
            "non-tensor value picklable and the same on every rank (wrap per-rank values in shardckpt.PerRank), "
            "then save again."
        )

    def _manifest(self, job: SaveJob, tables: list[dict[str, Any]], created: float) -> layout.Manifest:
        files: dict[str, layout.FileEntry] = {}
        for table in tables:
            for name, (size, digest, owner, chunks) in table.items():
                files[name] = layout.FileEntry(size, digest, owner, chunks)
        return layout.Manifest(
            step=job.step,
            world_size=_dist.world_size(),
            files=files,
            torch_version=str(torch.__version__),
            shardckpt_version=_version(),
            keys=dict(job.kinds),
            metadata=job.metadata,
            total_bytes=sum(e.size for e in files.values()),
            run_id=self.config.run_id,
            copies=[list(g) for g in self.topology.copies],
            created=created,
            lineage=(job.lineage or self.lineage or lineage_mod.Lineage()).to_json(),
            kind=job.kind,
            metrics=dict(job.metrics),
            upload=job.upload,
            frozen=job.frozen,
            run=job.run,
            save_id=job.save_id,
        )

    def apply_retention(self, protect: int | None = None) -> None:
        """Retention over the live steps of this copy: steps abandoned by a rollback are neither
        counted nor deleted (``shardckpt gc`` removes them); ``protect`` (the step just
        saved) is never deleted."""
        infos = lineage_mod.local_infos(self.root)
        live, _abandoned = lineage_mod.classify(infos)
        keep = () if protect is None else (protect,)
        for old in retention.plan_deletions(live, self._policy, self._deletable, infos=infos, protect=keep):
            step_dirs.delete_step(self.root, old)
            log.info("shardckpt: retention removed step %d from %s", old, self.root)


def _describe(exc: BaseException | None) -> str | None:
    """One line for a failure; for DCP's per-rank report, its first inner failure."""
    if exc is None:
        return None
    inner = _inner(exc)
    return f"{type(inner).__name__}: {inner}"


def _inner(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return inner
    return exc


def _disk(exc: BaseException | None) -> bool:
    """Whether a failure came from the filesystem (an OSError, e.g. ENOSPC), not from the state's values."""
    seen = 0
    while exc is not None and seen < 8:
        inner = _inner(exc)
        if isinstance(inner, OSError) or isinstance(exc, OSError):
            return True
        exc = inner.__cause__
        seen += 1
    return False


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
