"""The save path: decide -> capture -> agree -> stage -> record -> hand to the writer.

``Saver.save(state, step)`` runs on the main thread of every rank::

    1. re-raise a failed background save (``_wait_previous``, at the same call on every rank)
    2. decide (``policy.SavePolicy``): interval, and the previous call's agreed time and
       preemption votes; with the memory tier (``saving/memory.py``) also whether the step
       is kept in memory
    3. wait for the previous write (never two at once; the wait is logged; a save kept
       only in memory waits for none)
    4. capture the state through its save plan (``plan.SavePlan``: DCP's ``state.capture``
       -- modules, optimizers, stateful objects, values, RNG -- at the first save and
       whenever the plan's cheap check finds the state's structure changed; else the
       same tensors, with what changes every step read anew), then one value per entry
       for every rank (``values.agree``)
    5. agree on free space; first save: agree on a nonce, clean leftovers
       (``commit.StepWriter``); the first memory save starts the memory tier
    6. stage into reused host buffers (``stage.HostStager``; with the memory tier a slot of
       shared memory, then its record: memory-durable); the plan's fixed tensors are
       copied by one batched copy recorded at the plan's first save into that buffer set
       <- training blocks until here
    7. start this call's vote, hand the write to the background thread
       (``commit.StepWriter.write_and_commit``), return a ``SaveHandle``; with a remote,
       the node's uploader process picks committed steps up from disk

``flush_memory()`` (``close()``): a step newer in memory than on disk is written to disk
from its copy in memory first.

The collaborators come in through the constructor; the facade (``checkpointer.py``) owns
them and the restore path, and delegates ``save``, ``wait`` and ``wait_for_copies`` here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from typing import Any, Callable, Protocol

import torch

from shardckpt import _dist, _failpoints
from shardckpt._version import __version__
from shardckpt.errors import ConfigError, SaveError
from shardckpt.format.retention import FULL, LIGHT
from shardckpt.options import CheckpointConfig, SaveMode, run_config_of
from shardckpt.remote import early_upload
from shardckpt.saving import preflight
from shardckpt.saving.commit import SaveJob, StepWriter
from shardckpt.saving.durability import DurabilityLog
from shardckpt.saving.handle import SaveHandle
from shardckpt.saving.memory import MemoryTier
from shardckpt.saving.plan import SavePlan
from shardckpt.saving.policy import SavePolicy
from shardckpt.saving.stage import CopyFence, HostStager, split_bytes
from shardckpt.state import capture as state_mod
from shardckpt.state import values
from shardckpt.state.per_rank import PerRank

log = logging.getLogger("shardckpt")


class RestoreFacts(Protocol):
    """What a save reads of the restore path: the step loaded (the memory tier adopts its copies) and the remote."""

    loaded: Any
    store: Any


class PeerFacts(Protocol):
    """What a save asks the peer tier: whether it is on, and the wait of a preemption save."""

    on: bool

    def wait_durable(self, step: int, left: float) -> float | None: ...


class Uploads(Protocol):
    """The node's uploader, as a save uses it."""

    active: bool

    def check_health(self) -> None: ...

    def kick(self) -> None: ...

    def wake(self) -> None: ...


class Saver:
    """Runs ``save()`` (the steps of the module's docstring) over the collaborators it is given."""

    def __init__(
        self, config: CheckpointConfig, root: str, groups: _dist.SideGroups, *, checkin: _dist.CheckIn,
        stager: HostStager, policy: SavePolicy, writer: StepWriter, memory: MemoryTier, restorer: RestoreFacts,
        peer: PeerFacts, uploads: Uploads | None, durability: DurabilityLog,
        ensure_ready: Callable[[], None], topology_known: Callable[[], bool],
    ) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self._checkin = checkin
        self._stager = stager
        self._policy = policy
        self._writer = writer
        self._memory = memory
        self._restorer = restorer
        self._peer = peer
        self._uploads = uploads
        self._durability = durability
        self._ensure_ready = ensure_ready
        self._topology_known = topology_known
        self._remote_checked = config.remote is None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-save")
        self._fence: CopyFence | None = None
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self._saves = 0
        self._plans: dict[bool, SavePlan] = {}
        self.plans_built = 0
        """How many save plans were built (one per change of the state's structure: ``plan.py``)."""
        self._warned_values: set[str] = set()
        self._agreed = values.Known()
        self._frozen: dict[str, Any] | None = None
        self._run: dict[str, Any] | None = None
        self._loaded_at: float | None = None
        self.pending: SaveHandle | None = None
        """The save in flight (or the last one, until ``wait()`` reports it)."""
        self.last_error: str | None = None
        """The last failed save of this instance (``status()``)."""
        self.preempted = False
        if uploads is not None and uploads.active:
            writer.file_done = self._file_done

    # ---------------------------------------------------------------- the call

    def save(self, state: dict[str, Any], step: int, *, force: bool, metadata: dict[str, Any] | None,
             metrics: dict[str, float] | None, light: bool | None) -> SaveHandle | None:
        """Steps 1-7 of the module's docstring; ``None`` when the call saves nothing."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        t_start = time.monotonic()
        if not self._topology_known() or not self._remote_checked or self._policy.may_collect(step, force):
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
            plan = self._plan_for(state, kind == LIGHT)
            captured, kinds, frozen = plan.capture(state)
            own_keys = {k for k, v in state.items() if isinstance(v, PerRank)} | {state_mod.RESERVED_KEY}
            captured, later = values.agree(captured, kinds, self._groups, step, self._warned_values, own_keys, memory,
                                           known=self._agreed)
            preflight.at_save(state, step, first=self._saves == 0 and self._memory.last is None)
            disk = decision.due and self._writer.space_ok(step, *split_bytes(captured, own_keys))
            if not disk and not memory:
                return None
            self._writer.prepare()
            self._memory.begin(memory, self._groups, captured, self._restorer.loaded, self._writer.lineage,
                               f"step {step}")
            lineage = self._writer.lineage_for(step)
            if frozen and self._frozen is None:
                self._frozen = self._fingerprint(state, frozen)
            writing = self.pending is not None and not self.pending.done()
            # the copy into shared memory, read by the disk write (None: the memory tier stepped aside)
            held = memory and self._memory.stage(captured, f"step {step}", disk=disk, writing=writing, plan=plan)
            staged, fence = held or self._stager.stage(captured if disk else {}, what=f"step {step}",
                                                       plan=plan if disk else None)
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
        return self._hand_over(job, decision.preempt)

    def _hand_over(self, job: SaveJob, preempt: bool) -> SaveHandle:
        """Step 7: the write goes to the background thread (a sync or preemption save waits for its commit)."""
        step, t_start = job.step, job.t_start
        self._saves += 1
        self._policy.record_blocked(job.blocked)
        future = self._executor.submit(self._writer.write_and_commit, job)
        future.started_at = t_start  # type: ignore[attr-defined]
        future.step = step  # type: ignore[attr-defined]
        future.started_wall = time.time() - (time.monotonic() - t_start)  # type: ignore[attr-defined]
        future.add_done_callback(self._record_outcome)
        handle = SaveHandle(step, future)
        self.pending = handle
        if _dist.rank() == 0:
            self._durability.report()  # the earlier saves' levels learned since (while this one writes)
        if preempt or self.config.mode == SaveMode.SYNC:
            try:
                handle.wait()
            finally:
                self.pending = None
            if preempt:
                peer_s = self._peer.wait_durable(step, self._policy.notice_left()) if self._peer.on else None
                self.preempted = True
                (log.warning if _dist.rank() == 0 else log.debug)(
                    "shardckpt: preemption (signal %s): step %d committed%s; exit the training loop now",
                    self._policy.signal,
                    step,
                    "" if peer_s is None else f" and peer-durable ({peer_s:.1f} s later)",
                )
        return handle

    # ---------------------------------------------------------------- waits

    def wait_for_copies(self) -> None:
        """Block until the device-to-host copies of the last save are done (``Checkpointer.wait_for_copies``)."""
        fence = self._fence
        if fence is not None:
            fence.complete()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure (``Checkpointer.wait``)."""
        handle = self.pending
        if handle is None or handle.reported:
            self.pending = None
            return
        try:
            handle.wait(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self.pending = None
            raise
        self.pending = None

    def _wait_previous(self, step: int) -> None:
        """Wait for the save in flight; re-raise its failure (on every rank alike: the outcome was exchanged)."""
        pending = self.pending
        if pending is None:
            return
        self.pending = None
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

    # ---------------------------------------------------------------- load and close

    def after_load(self, loaded_at: float, restored: int | None) -> None:
        """A load took the run's history over at ``loaded_at`` (rank 0's clock): the run record is made again."""
        self._loaded_at = loaded_at
        self._run = None
        if restored is not None:
            self._policy.last_saved_step = self._memory.last = restored  # a rollback saves its steps again

    def flush_memory(self) -> bool:
        """close(): a step newer in memory than on disk is committed to disk first, from its copy in memory
        (collective). Returns whether the memory may go (a failure raises: the memory stays, for the next launch)."""
        rec, free = self._memory.unflushed(self._groups) if self._topology_known() else (None, True)
        if rec is not None:
            (log.info if _dist.rank() == 0 else log.debug)("shardckpt: close(): step %d is only in memory; writing "
                                                           "it to %s", rec.step, self.root)
            job = self._memory.flush_job(rec, self._writer.partial_dir(rec.step, rec.save_id))
            self._executor.submit(self._writer.write_and_commit, job).result()
            if self._uploads is not None:
                self._uploads.kick()
        return free

    def close(self, writing: bool) -> None:
        """Release the writer thread, the staging buffers (unless a write still reads them) and the hooks."""
        self._executor.shutdown(wait=not writing)
        if not writing:
            self._stager.release()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def retention_after_drain(self) -> None:
        """Local retention waits for uploads; once close() drained them, it catches up."""
        if not self._writer.topology.committer or self._writer.last_committed is None:
            return
        try:
            self._writer.apply_retention()
        except Exception as exc:  # noqa: BLE001 - the steps are committed; the next run's saves retry
            log.warning("shardckpt: retention in %s after the uploads drained failed: %s", self.root, exc)

    # ---------------------------------------------------------------- helpers

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
            who = (f"rank(s) {', '.join(map(str, missing))} did not call save() "
                   f"within save_agree_timeout_s={timeout:g} s")
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

    def _plan_for(self, state: dict[str, Any], light: bool) -> SavePlan:
        """The save plan of ``state`` (``plan.py``): the last one while it holds, else a new one (DCP's capture)."""
        plan = self._plans.get(light)
        if plan is not None and self._fence is not None:
            self._fence.complete()  # the last save's copies read the plan's RNG tensors, refreshed next
        if plan is None or not plan.holds(state) or not plan.refresh():
            plan = SavePlan(state, _dist.rank(), self.config.capture_rng, light=light,
                            trainable_only=self.config.trainable_only)
            self._plans[light] = plan
            self.plans_built += 1
        return plan

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
                "torch": str(torch.__version__),  # (not its TorchVersion: a str compares as JSON text)
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
        self.last_error = f"{type(exc).__name__}: {exc}"
        if _dist.rank() == 0:
            log.error("shardckpt: %s (raised by the next save() that saves, wait() or close())", exc)

    def _durability_committed(self, future: concurrent.futures.Future) -> None:
        """Rank 0 follows the peer and remote levels of the step just committed (``durability.py``)."""
        if _dist.rank() == 0 and (self._peer.on or self._durability.remote) and hasattr(future, "step"):
            started = getattr(future, "started_at", time.monotonic())
            self._durability.committed(future.step, future.started_wall, time.monotonic() - started)
