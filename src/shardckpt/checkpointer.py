"""The facade: the contract of the README, one room per job behind it.

``save(state, step)`` (main thread, every rank)
  ``saving/saver.py`` (``Saver.save``): decide, capture, agree, stage (<- training
  blocks until here), record, hand the write to the background thread; its
  docstring states the call order. Under ``shardckpt check-resume`` the facade
  records the digests of what each call was given (``resume_probe``).

``load(state, step=None)`` (main thread, every rank)
  waits for pending saves, then ``restore.Restorer.load``: candidates, fetch,
  verify, key matching, DCP read, elastic plan.

``close()`` writes a step newer in memory than on disk to disk, then frees this rank's shared memory.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch

from shardckpt import _dist, stores, topology
from shardckpt._text import fmt_bytes
from shardckpt.check_resume import digest as state_digest
from shardckpt.check_resume import probe as resume_probe
from shardckpt.errors import ConfigError
from shardckpt.format import layout
from shardckpt.node import memory_keeper
from shardckpt.node.node_registry import state_dir, unregister_trainer
from shardckpt.node.peer_tier import PeerTier
from shardckpt.node.uploader_client import UploaderClient
from shardckpt.options import CheckpointConfig, UploaderMode
from shardckpt.remote import commit as remote_commit
from shardckpt.restoring import elastic as elastic_mod
from shardckpt.restoring import step_peek as peek_mod
from shardckpt.restoring.memory import MemorySource
from shardckpt.restoring.restorer import Restorer
from shardckpt.saving import preflight
from shardckpt.saving.commit import StepWriter
from shardckpt.saving.durability import DurabilityLog
from shardckpt.saving.handle import SaveHandle
from shardckpt.saving.memory import MemoryTier
from shardckpt.saving.policy import SavePolicy
from shardckpt.saving.saver import Saver
from shardckpt.saving.stage import HostStager
from shardckpt.steps import LocalSteps, RemoteSteps

if TYPE_CHECKING:  # pragma: no cover
    from shardckpt.restoring.step_peek import StepPeek

log = logging.getLogger("shardckpt")

__all__ = ["Checkpointer", "SaveHandle"]


class Checkpointer:
    """Async sharded checkpoints of the full training state.

    ``Checkpointer(local_dir="checkpoints/run1", keep_last=3)`` or
    ``Checkpointer(CheckpointConfig(...))``. Every rank of the job creates one
    with the same configuration and calls ``save`` / ``load`` at the same
    points of the training loop.
    """

    def __init__(self, config: CheckpointConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise ConfigError("pass either a CheckpointConfig or keyword options, not both")
        # Explicit arguments win, then SHARDCKPT_* variables, then the defaults. A
        # CheckpointConfig object is taken as it is (CheckpointConfig.from_env builds one by the rule).
        self.config = config if config is not None else CheckpointConfig.from_env(**kwargs)
        if self.config.remote is not None:
            stores.check_remote_url(self.config.remote)
        self.root = os.path.abspath(self.config.local_dir)
        preflight.check_writable(self.root)
        self._groups = _dist.SideGroups(self.config.collective_timeout_s)
        pin = self.config.pin_memory
        if pin is None:
            pin = torch.cuda.is_available()
        self._stager = HostStager(pin_memory=bool(pin), max_pinned_bytes=self.config.max_pinned_bytes)
        self._policy = SavePolicy(self.config, self._groups)
        self._writer = StepWriter(self.config, self.root, self._groups, self._deletable)
        self._topology_known = False
        self._closed = False
        self._uploads: UploaderClient | None = None
        if self.config.remote is not None:
            self._uploads = UploaderClient(self.config, self.root)
            try:
                self._uploads.register()
            except OSError as exc:
                raise ConfigError(
                    f"cannot set up the uploader for {self.root} ({type(exc).__name__}: {exc}). Remedy: make "
                    f"local_dir a writable directory, or set uploader='off' to only restore from the remote."
                ) from exc
        self._peer = PeerTier(self.config, self.root, registered=self._uploads is not None and self._uploads.active)
        self._memory = MemoryTier(self.config, self.root, pin=bool(pin),
                                  join=lambda: memory_keeper.join(self.root, starts=_dist.local_rank() == 0))
        # a restore's sources: this machine's memory (source 0), the other nodes' daemons (the peer views)
        self._restorer = Restorer(self.config, self.root, self._groups, peer=self._peer,
                                  memory=MemorySource(self.config, self.root))
        self._writer.peer_facts, self._writer.peer_agreed = self._peer.facts, self._peer.agree
        self._durability = DurabilityLog(self.root, peer_on=lambda: self._peer.on,
                                         remote=self._uploads is not None and self._uploads.active)
        self._saver = Saver(
            self.config, self.root, self._groups, checkin=_dist.CheckIn(self.config.save_agree_timeout_s),
            stager=self._stager, policy=self._policy, writer=self._writer, memory=self._memory,
            restorer=self._restorer, peer=self._peer, uploads=self._uploads, durability=self._durability,
            ensure_ready=self._ensure_ready, topology_known=lambda: self._topology_known,
        )
        self._policy.install_signal_handlers()
        self._probe = resume_probe.recorder(self.root)  # None unless `shardckpt check-resume` runs this process

    # ---------------------------------------------------------------- public

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived and the save it triggered committed (with the peer tier
        on: and this node's files of it are on the other nodes, or the notice, ``drain_timeout_s``, ran out)."""
        return self._saver.preempted

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption signal arrived (the next ``save()`` saves at once)."""
        return self._policy.signal is not None

    @property
    def last_committed(self) -> int | None:
        """The step of the last save committed by this instance."""
        return self._writer.last_committed

    @property
    def last_plan(self) -> "elastic_mod.ElasticPlan | None":
        """The elastic plan of the last successful ``load()`` (``None`` before one)."""
        return self._restorer.last_plan

    @property
    def last_sources(self) -> dict[str, dict[str, int]]:
        """Where the last ``load()``'s bytes came from on this node's copy: per kind of source (``own disk``,
        ``replicas here``, ``peer``, ``other nodes``, ``remote``), the files and bytes taken from it and the
        files it offered that failed their check (``refused``); see ``restoring/sources.py``."""
        return dict(self._restorer.sources.report)

    def steps(self) -> list[int]:
        """Committed steps on the local tier, oldest first."""
        return layout.committed_steps(self.root)

    def save(
        self,
        state: dict[str, Any],
        step: int,
        *,
        force: bool = False,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        light: bool | None = None,
    ) -> SaveHandle | None:
        """Save ``state`` as ``step`` when the interval policy (or ``force``) says so.

        Returns a :class:`SaveHandle` when a save started, ``None`` when skipped.
        Blocks only while the state is copied into host memory (on a GPU
        until the copies are complete; with ``overlap_copies`` until they are
        enqueued), unless the mode is ``sync`` or a preemption signal arrived:
        then it returns once the step is committed. A failure of the previous save is raised here
        (as :class:`SaveError`) by the next call that saves, on every rank.
        Every rank calls ``save()`` at the same points: a call that some ranks
        do not make within ``save_agree_timeout_s`` raises :class:`SaveError`
        on the ranks that made it, naming the others (this instance cannot
        save again in this job).

        ``metrics`` (numbers, e.g. ``{"val_loss": 1.83}``) are recorded in the
        manifest for ``keep_best`` and ``load(state, step="best")``. ``light=True``
        saves the model and the small state without optimizer state (``None``:
        as ``full_every`` says; a preemption save is always full).
        """
        self._check_open()
        if self._probe is None:
            return self._saver.save(state, step, force=force, metadata=metadata, metrics=metrics, light=light)
        # `shardckpt check-resume`: the digests of what this call was given (before its write runs beside them)
        digests = self._probe.digest(lambda: state_digest.digest(state, _dist.rank()))
        handle = self._saver.save(state, step, force=force, metadata=metadata, metrics=metrics, light=light)
        self._probe.saved(_dist.rank(), _dist.world_size(), step, handle is not None, digests, metrics, self.wait)
        return handle

    def wait_for_copies(self) -> None:
        """Block until the device-to-host copies of the last save are done.

        Only useful with ``overlap_copies=True``: call it before a write to the
        saved tensors that the option does not fence (an EMA swap, a
        ``load_state_dict``, a second optimizer; see
        :attr:`CheckpointConfig.overlap_copies`). Without overlap ``save()``
        already returned with them done.
        """
        self._saver.wait_for_copies()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure.

        ``TimeoutError`` when it is still writing after ``timeout`` seconds (it
        goes on; a later ``wait()`` or ``save()`` picks it up).
        """
        self._saver.wait(timeout)

    def load(
        self,
        state: dict[str, Any],
        step: int | str | None = None,
        *,
        strict: bool | None = None,
        trust_pickles: bool = False,
        elastic: "elastic_mod.ElasticPolicy | None" = None,
    ) -> int | None:
        """Restore ``state`` in place from ``step`` (default: the newest live full step;
        ``"best"``: the best by ``best_metric``).

        Returns the restored step, or ``None`` when there is nothing to resume.
        ``trust_pickles=True`` lifts the restricted unpickling of DCP metadata
        and non-tensor items; only for checkpoints whose origin you trust.
        ``elastic`` (an :class:`ElasticPolicy`) says how batch and learning
        rate follow a world-size change; without it the global batch is kept,
        to the nearest accumulation count with a warning when not exactly.
        The resulting plan is logged in one line and kept as ``self.last_plan``.
        """
        self._check_open()
        self.wait()
        self._ensure_ready()
        restored = self._restorer.load(state, step, strict=strict, trust_pickles=trust_pickles, elastic=elastic)
        # When this run took its history over (rank 0's clock, the same in every rank's manifests):
        # a remote save of a step created before then is an orphan of an earlier run that this one
        # may replace; one created later is another instance's (remote_commit._replaces).
        self._saver.after_load(self._groups.broadcast_ctl(time.time()), restored)
        if self._restorer.next_lineage is not None:
            self._writer.continue_lineage(self._restorer.next_lineage, self._restorer.newest_created, restored)
        if self._probe is not None:
            self._probe.loaded(_dist.rank(), restored)
        return restored

    def peek(self, step: int | None = None, *, trust_pickles: bool = False) -> "StepPeek | None":
        """A read-only look at ``step`` (default: the newest on disk or the remote) without loading tensors.

        Returns a :class:`~shardckpt.StepPeek`: the manifest's metadata,
        ``run_config`` (as recorded at save) and the plain values of the state
        (``values``), or ``None`` when there is nothing to resume. Reads the
        local directory, else the remote: only the manifest, DCP's metadata and
        the files holding the values (checked against the manifest). Nothing
        is loaded into live objects, no collective is issued (every rank may
        call it alone, before the process group exists), and later saves and
        loads are unaffected. Build the model from its saved configuration,
        then ``load()`` into it (it may resume a newer step held in memory).
        """
        self._check_open()
        tiers: list[Any] = [LocalSteps(self.root)]
        if self.config.remote is not None:
            tiers.append(RemoteSteps(self.config.remote, self.config.transfer_options()))
        try:
            return peek_mod.peek_tiers(tiers, step, trust_pickles=trust_pickles,
                                       fallback=self.config.on_corrupt == "fallback")
        finally:
            for tier in tiers:
                tier.close()

    def status(self) -> dict[str, Any]:
        """Newest committed step (locally and remotely), the save in flight, uploads, memory and errors.

        ``last_error`` is the last failed save of this instance (``None`` if
        none failed). With a remote: ``latest_remote`` (newest step known
        committed there), ``pending_upload_steps`` / ``pending_upload_bytes``
        (this node's local steps not yet committed remotely),
        ``last_upload_error``, ``failed_commits`` (``{step: {"ranks", "nodes",
        ...}}``: pending steps not committed within ``remote_commit_timeout_s``,
        with the ranks and nodes whose files are missing) and ``uploader`` (pid
        and state of this node's uploader, from its status file). The memory
        tier: ``latest_memory`` (the newest step this rank holds a copy of in
        shared memory), ``memory_steps``, ``memory_bytes`` (what the job holds on
        this machine), ``memory_dir`` (tier on only); ``restored_from``: where the last
        ``load()`` read its step. No remote request is made.
        """
        steps = self.steps()
        pending = self._saver.pending
        out: dict[str, Any] = {
            "local_dir": self.root,
            "latest_local": steps[-1] if steps else None,
            "committed_local": steps,
            "in_flight": pending.step if pending is not None and not pending.done() else None,
            "last_error": self._saver.last_error,
        }
        if self._uploads is not None:
            out.update(self._uploads.status(self._restorer.remote_committed))
        out.update(self._peer.status())
        out.update(self._memory.status(), restored_from=self._restorer.restored_from)
        return out

    def close(self, timeout: float | None = None) -> None:
        """Flush the save in flight and the node's uploads; release threads, groups and signal handlers.

        ``timeout`` bounds the call: the wait for the save in flight raises
        ``TimeoutError`` when it is still writing (the write goes on in its
        thread, and the process waits for it at exit), and the wait for
        uploads gets what is left (``drain_timeout_s`` when ``None``).
        """
        if self._closed:
            return
        t0 = time.monotonic()
        writing = flushed = False
        try:
            self.wait(timeout)
            flushed = self._saver.flush_memory()
        except TimeoutError:
            writing = True
            raise
        finally:
            self._closed = True
            self._saver.close(writing)  # the writer thread, the staging buffers, the hooks
            self._policy.finish_vote()  # every rank started the same vote: finish it
            if flushed:  # the newest step is on disk: the memory copies go (the keeper frees them otherwise)
                self._memory.release()
            self._memory.detach()
            self._policy.restore_signal_handlers()
            self._groups.destroy(io=not writing)
            try:
                if self._uploads is not None:
                    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
                    self._uploads.close(left)
                    self._saver.retention_after_drain()
            finally:
                try:
                    self._peer.close(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))
                    if _dist.rank() == 0:
                        self._durability.report(final=True)
                finally:
                    self._restorer.close()
                    unregister_trainer(self._memory.trainer)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed; create a new one")

    def _ensure_ready(self) -> None:
        """First save or load: the side groups, and which ranks share this directory (collective)."""
        self._groups.ensure()
        if not self._topology_known:
            found = topology.detect(self.root, self._groups)
            self._writer.topology = found
            self._restorer.topology = found
            self._topology_known = True
            if self._uploads is not None:
                self._uploads.launch(found.committer)
            self._peer.launch(found, self._groups)

    def _deletable(self, step: int) -> bool:
        """Local retention guard: with uploads on, only steps already committed remotely go,
        unless the disk is about to fill (then loudly, naming the step). With the peer tier on, a
        step not older than the newest one complete across any node's loss stays too (``PeerTier.protects``)."""
        if self._peer.protects(step):
            return False
        if self.config.remote is None or self.config.uploader == UploaderMode.OFF:
            return True
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        if remote_commit.is_uploaded(step_dir, self.config.remote) or not remote_commit.for_upload(step_dir):
            return True
        steps = layout.committed_steps(self.root)
        newest = remote_commit.local_bytes(self.root, steps[-1]) if steps else 0
        needed = int(newest * (1 + self.config.free_space_margin)) + (1 << 20)
        free = shutil.disk_usage(self.root).free
        if free >= needed:
            return False
        log.warning(
            "shardckpt: LOCAL DISK NEARLY FULL in %s (%s free, the next save needs ~%s): dropping local step %d, "
            "which is NOT yet committed on the remote %s. Remedy: check the uploader (status(), %s), "
            "free disk space or lower keep_last.",
            self.root, fmt_bytes(free), fmt_bytes(needed), step, stores.safe_url(self.config.remote),
            os.path.join(state_dir(self.root), "uploader.log"),
        )
        return True
