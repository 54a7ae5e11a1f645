"""The facade: the contract of the README, one room per job behind it.

``save(state, step)`` (main thread, every rank)
  1. re-raise a failed background save
  2. decide (``policy.SavePolicy``): interval, and the previous call's
     agreed time and preemption votes; with the memory tier
     (``saving/memory.py``) also whether the step is kept in memory
  3. wait for the previous write (never two at once; the wait is logged;
     a save kept only in memory waits for none)
  4. capture the state (``state.capture``: modules, optimizers, stateful
     objects, values, RNG)
  5. agree on free space; first save: agree on a nonce, clean leftovers
     (``commit.StepWriter``)
  6. stage into reused host buffers (``stage.HostStager``; with the memory
     tier a slot of shared memory, then its record: memory-durable)
     <- training blocks until here
  7. start this call's vote, hand the write to the background thread
     (``commit.StepWriter.write_and_commit``), return a ``SaveHandle``;
     with a remote, the node's uploader process picks committed steps up
     from disk (``uploader_client``, ``uploader``, ``remote_commit``)

``load(state, step=None)`` (main thread, every rank)
  waits for pending saves, then ``restore.Restorer.load``: candidates, fetch,
  verify, key matching, DCP read, elastic plan.

``close()`` writes a step newer in memory than on disk to disk, then frees this rank's shared memory.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from shardckpt import _dist, _failpoints, resume_probe, state_digest, stores, topology, values
from shardckpt.saving import preflight
from shardckpt.restoring import elastic as elastic_mod, step_peek as peek_mod
from shardckpt.tiers.steps import LocalSteps, RemoteSteps
from shardckpt._version import __version__
from shardckpt.tiers import early_upload, remote_commit
from shardckpt.format import layout
from shardckpt import state as state_mod
from shardckpt._text import fmt_bytes
from shardckpt.saving.commit import SaveJob, StepWriter
from shardckpt.format.retention import FULL, LIGHT
from shardckpt.errors import ConfigError, SaveError
from shardckpt.options import CheckpointConfig, SaveMode, UploaderMode, run_config_of
from shardckpt.saving.handle import SaveHandle
from shardckpt.saving.policy import SavePolicy
from shardckpt.restoring.restorer import Restorer
from shardckpt.saving.stage import CopyFence, HostStager, split_bytes
from shardckpt.saving.durability import DurabilityLog
from shardckpt.node.peer_tier import PeerTier
from shardckpt.node.uploader_client import UploaderClient
from shardckpt.node import memory_keeper
from shardckpt.node.node_registry import state_dir, unregister_trainer
from shardckpt.saving.memory import MemoryTier
from shardckpt.restoring.memory import MemorySource

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
        self._checkin = _dist.CheckIn(self.config.save_agree_timeout_s)
        pin = self.config.pin_memory
        if pin is None:
            pin = torch.cuda.is_available()
        self._stager = HostStager(pin_memory=bool(pin), max_pinned_bytes=self.config.max_pinned_bytes)
        self._fence: CopyFence | None = None
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._policy = SavePolicy(self.config, self._groups)
        self._writer = StepWriter(self.config, self.root, self._groups, self._deletable)
        self._restorer = Restorer(self.config, self.root, self._groups)
        self._topology_known = False
        self._saves = 0
        self._warned_values: set[str] = set()
        self._frozen: dict[str, Any] | None = None
        self._run: dict[str, Any] | None = None
        self._loaded_at: float | None = None
        self._remote_checked = self.config.remote is None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-save")
        self._pending: SaveHandle | None = None
        self._last_error: str | None = None
        self._preempted = False
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
            if self._uploads.active:
                self._writer.file_done = self._file_done
        self._peer = PeerTier(self.config, self.root, registered=self._uploads is not None and self._uploads.active)
        self._restorer.sources.peer = self._peer  # a restore's peer views: the other nodes' daemons
        self._memory = MemoryTier(self.config, self.root, pin=bool(pin),
                                  join=lambda: memory_keeper.join(self.root, starts=_dist.local_rank() == 0))
        self._restorer.sources.memory = MemorySource(self.config, self.root)  # source 0: this machine's memory
        self._writer.peer_facts, self._writer.peer_agreed = self._peer.facts, self._peer.agree
        self._durability = DurabilityLog(self.root, peer_on=lambda: self._peer.on,
                                         remote=self._uploads is not None and self._uploads.active)
        self._policy.install_signal_handlers()
        self._probe = resume_probe.recorder(self.root)  # None unless `shardckpt check-resume` runs this process

    # ---------------------------------------------------------------- public

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived and the save it triggered committed (with the peer tier
        on: and this node's files of it are on the other nodes, or the notice, ``drain_timeout_s``, ran out)."""
        return self._preempted

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
        if self._probe is None:
            return self._save(state, step, force=force, metadata=metadata, metrics=metrics, light=light)
        # `shardckpt check-resume`: the digests of what this call was given (before its write runs beside them)
        digests = self._probe.digest(lambda: state_digest.digest(state, _dist.rank()))
        handle = self._save(state, step, force=force, metadata=metadata, metrics=metrics, light=light)
        self._probe.saved(_dist.rank(), _dist.world_size(), step, handle is not None, digests, metrics, self.wait)
        return handle

    def _save(self, state: dict[str, Any], step: int, *, force: bool, metadata: dict[str, Any] | None,
              metrics: dict[str, float] | None, light: bool | None) -> SaveHandle | None:
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        t_start = time.monotonic()
        if not self._topology_known or not self._remote_checked or self._policy.may_collect(step, force):
            self._check_in(step)
        self._ensure_ready()
        if not self._remote_checked:
            self._check_remote()
        self._policy.report_signal()
        if self._uploads is not None:
            self._uploads.check_health()
        # Every path from here resolves one vote and starts one (policy.py), so
        # the ranks stay in step whatever happens; a failed earlier save is
        # raised by _wait_previous, at the same call on every rank.
        try:
            decision = self._policy.decide(step, force)
            memory = self._memory.enabled and (decision.due or self._memory.due(step))
            if not decision.due and not memory:
                return None
            if decision.due or self._writer.forks(step):  # a save kept only in memory waits for no write
                self._wait_previous(step)
            kind = self._kind(light, decision.preempt) if decision.due else FULL
            captured, kinds, frozen = state_mod.capture(
                state, _dist.rank(), self.config.capture_rng, light=kind == LIGHT,
                trainable_only=self.config.trainable_only,
            )
            own_keys = {k for k, v in state.items() if isinstance(v, elastic_mod.PerRank)} | {state_mod.RESERVED_KEY}
            captured, later = values.agree(captured, kinds, self._groups, step, self._warned_values, own_keys, memory)
            if self._saves == 0 and self._memory.last is None:
                preflight.note_missing_optimizer(state)
            disk = decision.due and self._writer.space_ok(step, *split_bytes(captured, own_keys))
            if not disk and not memory:
                return None
            self._writer.prepare()
            self._memory.begin(memory, self._groups, captured, self._restorer.loaded, self._writer.lineage,
                               f"step {step}")
            lineage = self._writer.lineage_for(step)
            if frozen and self._frozen is None:
                self._frozen = self._fingerprint(state, frozen)
            writing = self._pending is not None and not self._pending.done()
            # the copy into shared memory, read by the disk write (None: the memory tier stepped aside)
            held = memory and self._memory.stage(captured, f"step {step}", disk=disk, writing=writing)
            staged, fence = held or self._stager.stage(captured if disk else {}, what=f"step {step}")
            del captured
            if memory or not self.config.overlap_copies:
                fence.complete()  # returns with the copies done: no later write can reach them
            self._fence = fence
            if self.config.overlap_copies and not memory:
                self._hook_writes(state)
            if disk:
                self._policy.started(step, decision.preempt)
            _failpoints.hit("save.staged")
        finally:
            self._policy.start_vote()
        blocked = time.monotonic() - t_start

        user_md = dict(self.config.metadata)
        user_md.update(metadata or {})
        job = SaveJob(step, staged, kinds, self._writer.partial_dir(step), user_md, t_start, blocked,
                      kind=kind, metrics=preflight.metrics(metrics), upload=self._upload_this(decision.preempt),
                      frozen=self._frozen or {}, run=self._run_record(), fence=fence, lineage=lineage,
                      save_id=self._writer.save_id(), later=later)
        if memory:
            where = self._memory.record(job, self._writer.held(job, disk))  # memory-durable from here
            if not disk:
                return SaveHandle.held(step, where) if where else None
        self._saves += 1
        self._policy.record_blocked(blocked)
        future = self._executor.submit(self._writer.write_and_commit, job)
        future.started_at = t_start  # type: ignore[attr-defined]
        future.step = step  # type: ignore[attr-defined]
        future.started_wall = time.time() - (time.monotonic() - t_start)  # type: ignore[attr-defined]
        future.add_done_callback(self._record_outcome)
        handle = SaveHandle(step, future)
        self._pending = handle
        if _dist.rank() == 0:
            self._durability.report()  # the earlier saves' levels learned since (while this one writes)
        if decision.preempt or self.config.mode == SaveMode.SYNC:
            try:
                handle.wait()
            finally:
                self._pending = None
            if decision.preempt:
                peer_s = self._peer.wait_durable(step, self._policy.notice_left()) if self._peer.on else None
                self._preempted = True
                (log.warning if _dist.rank() == 0 else log.debug)(
                    "shardckpt: preemption (signal %s): step %d committed%s; exit the training loop now",
                    self._policy.signal,
                    step,
                    "" if peer_s is None else f" and peer-durable ({peer_s:.1f} s later)",
                )
        return handle

    def wait_for_copies(self) -> None:
        """Block until the device-to-host copies of the last save are done.

        Only useful with ``overlap_copies=True``: call it before a write to the
        saved tensors that the option does not fence (an EMA swap, a
        ``load_state_dict``, a second optimizer; see
        :attr:`CheckpointConfig.overlap_copies`). Without overlap ``save()``
        already returned with them done.
        """
        fence = self._fence
        if fence is not None:
            fence.complete()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure.

        ``TimeoutError`` when it is still writing after ``timeout`` seconds (it
        goes on; a later ``wait()`` or ``save()`` picks it up).
        """
        handle = self._pending
        if handle is None or handle.reported:
            self._pending = None
            return
        try:
            handle.wait(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._pending = None
            raise
        self._pending = None

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
        self._loaded_at = self._groups.broadcast_ctl(time.time())
        self._run = None
        if self._restorer.next_lineage is not None:
            self._writer.continue_lineage(self._restorer.next_lineage, self._restorer.newest_created, restored)
        if restored is not None:
            self._policy.last_saved_step = self._memory.last = restored  # a rollback saves its steps again
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
        pending = self._pending
        out: dict[str, Any] = {
            "local_dir": self.root,
            "latest_local": steps[-1] if steps else None,
            "committed_local": steps,
            "in_flight": pending.step if pending is not None and not pending.done() else None,
            "last_error": self._last_error,
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
            flushed = self._flush_memory()
        except TimeoutError:
            writing = True
            raise
        finally:
            self._closed = True
            self._executor.shutdown(wait=not writing)
            self._policy.finish_vote()  # every rank started the same vote: finish it
            if not writing:
                self._stager.release()
            if flushed:  # the newest step is on disk: the memory copies go (the keeper frees them otherwise)
                self._memory.release()
            self._memory.detach()
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._policy.restore_signal_handlers()
            self._groups.destroy(io=not writing)
            try:
                if self._uploads is not None:
                    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
                    self._uploads.close(left)
                    self._retention_after_drain()
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

    def _flush_memory(self) -> bool:
        """close(): a step newer in memory than on disk is committed to disk first, from its copy in memory
        (collective). Returns whether the memory may go (a failure raises: the memory stays, for the next launch)."""
        rec, free = self._memory.unflushed(self._groups) if self._topology_known else (None, True)
        if rec is not None:
            (log.info if _dist.rank() == 0 else log.debug)("shardckpt: close(): step %d is only in memory; writing "
                                                           "it to %s", rec.step, self.root)
            job = self._memory.flush_job(rec, self._writer.partial_dir(rec.step, rec.save_id))
            self._executor.submit(self._writer.write_and_commit, job).result()
            if self._uploads is not None:
                self._uploads.kick()
        return free

    def _check_in(self, step: int) -> None:
        """Before this call's first collective: every rank called ``save()`` (bounded by ``save_agree_timeout_s``)."""
        timeout = self.config.save_agree_timeout_s

        def waiting(arrived: int, left: float) -> None:
            log.warning(
                "shardckpt: save() of step %d on rank %d waits for %d of %d ranks to call save() too (every rank "
                "calls save() at the same points); SaveError in %.0f s (save_agree_timeout_s=%g)",
                step, _dist.rank(), _dist.world_size() - arrived, _dist.world_size(), left, timeout,
            )

        missing = self._checkin.enter(waiting)
        if missing is None:
            return
        if missing:
            who = f"rank(s) {', '.join(map(str, missing))} did not call save() within save_agree_timeout_s={timeout:g} s"
        else:
            who = f"another rank stopped waiting for rank {_dist.rank()} (save_agree_timeout_s={timeout:g} s)"
        raise SaveError(
            f"step {step} was not saved: save() was called on rank {_dist.rank()} but {who}. Every rank calls "
            f"save() at the same points of the training loop, also in scripts that evaluate or log on rank 0 only "
            f"(call it outside `if rank == 0:`). Nothing of step {step} was written to {self.root}. If a rank only "
            f"reaches save() later (e.g. after evaluating alone), raise save_agree_timeout_s."
        )

    def _check_remote(self) -> None:
        """First save: the remote works and holds no other history (``saving/preflight.py``); all ranks agree."""
        self._remote_checked = True
        try:
            preflight.check_remote(self.config, self._groups, self._restorer.store, self._writer)
        except ConfigError:
            self._remote_checked = False  # every later save() is refused alike until it loads or starts fresh
            raise

    def _hook_writes(self, state: dict[str, Any]) -> None:
        """Once per object: the steps that would change saved tensors wait for the copies of a save.

        Only with ``overlap_copies``: on a GPU ``save()`` then returns with the
        copies only enqueued; the next forward and backward run beside them. An
        optimizer's step (it writes parameters and optimizer state) and the
        forward of a submodule that owns buffers (BatchNorm updates its running
        statistics) first make the compute stream wait for the copies. Every
        other write is unfenced (``CheckpointConfig.overlap_copies`` lists them);
        the fence's version check fails a step such a write reached.
        """
        for value in state.values():
            if id(value) in self._hooked:
                continue
            if isinstance(value, torch.optim.Optimizer):
                self._hooks.append(value.register_step_pre_hook(lambda *_: self._order_after_copies()))
            elif isinstance(value, torch.nn.Module):
                for module in value.modules():
                    if any(True for _ in module.buffers(recurse=False)):
                        self._hooks.append(module.register_forward_pre_hook(lambda *_: self._order_after_copies()))
            else:
                continue
            self._hooked.add(id(value))

    def _order_after_copies(self) -> None:
        fence = self._fence
        if fence is not None:
            fence.order_after()  # settles the version check even when the copies are done

    def _retention_after_drain(self) -> None:
        """Local retention waits for uploads; once close() drained them, it catches up."""
        if not self._writer.topology.committer or self._writer.last_committed is None:
            return
        try:
            self._writer.apply_retention()
        except Exception as exc:  # noqa: BLE001 - the steps are committed; the next run's saves retry
            log.warning("shardckpt: retention in %s after the uploads drained failed: %s", self.root, exc)

    def _kind(self, light: bool | None, preempt: bool) -> str:
        if preempt:
            return FULL  # the last save before the machine goes: everything
        if light is not None:
            return LIGHT if light else FULL
        every = self.config.full_every
        return FULL if every is None or self._saves % every == 0 else LIGHT

    def _upload_this(self, preempt: bool) -> bool:
        """``remote_every=M``: the first save, then every M-th, goes to the remote; a preemption save always."""
        every = self.config.remote_every
        return every is None or preempt or self._saves % every == 0

    def _fingerprint(self, state: dict[str, Any], frozen: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """First save with ``trainable_only``: what was left out, with a fingerprint of the frozen values."""
        out: dict[str, Any] = {}
        for key, entries in sorted(frozen.items()):
            prints = state_mod.fingerprints(state[key], sorted(entries), self._groups.ctl)
            out[key] = {name: dict(entries[name], fingerprint=prints[name]) for name in sorted(entries)}
        return out

    def _run_record(self) -> dict[str, Any]:
        """What was this checkpoint: the run's config, command line, world size, device, versions."""
        if self._run is None:
            self._run = {
                "config": run_config_of(self.config.run_config),
                "argv": list(sys.argv),
                "world_size": _dist.world_size(),
                "device": "cuda" if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__,
                "shardckpt": __version__,
                "run_id": self.config.run_id,
                "loaded_at": self._loaded_at,
            }
            if self.config.keep_best is not None and self.config.best_metric:
                self._run["best"] = {"metric": self.config.best_metric, "mode": self.config.best_mode}
        return self._run

    def _file_done(self, job: SaveJob, rank: int, name: str, size: int, checksum: str) -> None:
        """Writer thread: a shard file of ``job`` is complete; publish it for an early upload, wake the uploader."""
        if not job.upload or self._uploads is None:
            return
        try:
            if early_upload.publish(job.partial, step=job.step, save_id=job.save_id, rank=rank, name=name,
                                    size=size, checksum=checksum):
                self._uploads.wake()
        except Exception as exc:  # noqa: BLE001 - the upload after the local commit sends the file
            log.debug("shardckpt: step %d: %s was not offered for an early upload: %s", job.step, name, exc)

    def _record_outcome(self, future: concurrent.futures.Future) -> None:
        """Done-callback of every save: keeps the last failure for ``status()`` and logs it at once."""
        exc = future.exception()
        if exc is None:
            self._policy.record_committed(time.monotonic() - getattr(future, "started_at", time.monotonic()))
            self._durability_committed(future)
            if self._uploads is not None:
                self._uploads.kick()
            return
        self._last_error = f"{type(exc).__name__}: {exc}"
        if _dist.rank() == 0:
            log.error("shardckpt: %s (raised by the next save() that saves, wait() or close())", exc)

    def _durability_committed(self, future: concurrent.futures.Future) -> None:
        """Rank 0 follows the peer and remote levels of the step just committed (``durability.py``)."""
        if _dist.rank() == 0 and (self._peer.on or self._durability.remote) and hasattr(future, "step"):
            started = getattr(future, "started_at", time.monotonic())
            self._durability.committed(future.step, future.started_wall, time.monotonic() - started)

    def _wait_previous(self, step: int) -> None:
        """Wait for the save in flight; re-raise its failure (on every rank alike: the outcome was exchanged)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if pending.done():
            if not pending.reported:
                pending.wait()  # returns, or raises its failure
            return
        t0 = time.monotonic()
        started = getattr(pending._future, "started_at", t0)
        (log.info if _dist.rank() == 0 else log.debug)(
            "shardckpt: step %d waits for step %d: its save is still writing, %.2f s after it started",
            step,
            pending.step,
            t0 - started,
        )
        pending.wait()
        (log.info if _dist.rank() == 0 else log.debug)(
            "shardckpt: waited %.2f s for step %d", time.monotonic() - t0, pending.step
        )

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
