"""The one place that spells out save and load in order.

save(state, step)                                     (main thread, every rank)
  1. re-raise a failed background save
  2. decide: interval policy; time and preemption triggers come from the
     previous call's non-blocking vote (agreed by all ranks)
  3. wait for the previous write (never two at once; the wait is logged)
  4. capture the state (models, optimizers, stateful objects, values, RNG)
  5. check free space on the local tier (agreed by all ranks)
  6. stage: copy into reused host buffers          <- training blocks until here
  7. start this call's vote, hand the write to the background thread and
     return a SaveHandle
     background: DCP write -> checksums -> every rank reports -> manifest +
                 rename (commit) -> outcome exchange -> retention -> log line
     the uploader process (remote set) picks committed steps up from disk

load(state, step=None)                                (main thread, every rank)
  1. wait for pending saves
  2. pick the newest step committed for every rank, locally or remotely
     (or the one asked for)
  3. fetch missing files from the remote; verify checksums (work split over
     ranks; a failure is seen by all)
  4. read DCP metadata with a restricted unpickler, check run id, keys and
     shapes (strict)
  5. DCP read into the live module/optimizer state dicts and rebuilt entries
  6. apply to the live objects, restore this rank's RNG, one log line
  7. elastic plan (accumulation / LR / data position), one log line
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from typing import Any, Callable

import torch

from . import _dist, _failpoints, layout, local, remote, retention, upload
from . import elastic as elastic_mod
from . import state as state_mod
from .errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    InsufficientSpaceError,
    RemoteError,
    SaveError,
    StateMismatchError,
)
from .options import CheckpointConfig, OnCorrupt, OnDiskFull, SaveMode, UploaderMode
from .stage import HostStager, tensor_bytes

log = logging.getLogger("shardckpt")

__all__ = ["Checkpointer", "SaveHandle"]


def _version() -> str:
    from . import __version__

    return __version__


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


class SaveHandle:
    """A save in flight. ``wait()`` returns the step directory once committed."""

    def __init__(self, step: int, future: concurrent.futures.Future) -> None:
        self.step = step
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed (or ``timeout`` seconds); re-raises a failure."""
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"step {self.step} was not committed within {timeout} s") from None

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


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
        self.config = config if config is not None else CheckpointConfig(**kwargs)
        if self.config.remote is not None:
            remote.check_remote_url(self.config.remote)
        self.root = os.path.abspath(self.config.local_dir)
        self._groups = _dist.SideGroups(self.config.collective_timeout_s)
        pin = self.config.pin_memory
        if pin is None:
            pin = torch.cuda.is_available()
        self._stager = HostStager(pin_memory=bool(pin))
        self._policy = retention.policy_from(self.config.keep_last, self.config.keep_every)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-save")
        self._pending: SaveHandle | None = None
        self._failed: BaseException | None = None
        self._nonce: str | None = None
        self._save_count = 0
        self._last_save_time: float | None = None
        self._last_saved_step: int | None = None
        self._last_total_bytes: int | None = None
        self._preempt_signal: int | None = None
        self._preempted = False
        self._closed = False
        self._previous_handlers: dict[int, Any] = {}
        self._vote: tuple[Any, torch.Tensor] | None = None
        self._preempt_decided = False
        self._lock = threading.Lock()
        self.last_committed: int | None = None
        self._install_signal_handlers()
        self._store: remote.Store | None = None
        self._remote_committed: set[int] = set()
        self._uploader_spawned: float | None = None
        self._trainer_file: str | None = None
        self._drain_report: dict[str, Any] | None = None
        if self.config.remote is not None:
            self._setup_remote()

    # ---------------------------------------------------------------- public

    @property
    def preempted(self) -> bool:
        """True once a preemption signal arrived and the save it triggered committed."""
        return self._preempted

    @property
    def preemption_requested(self) -> bool:
        """True once a preemption signal arrived (the next ``save()`` saves at once)."""
        return self._preempt_signal is not None

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
    ) -> SaveHandle | None:
        """Save ``state`` as ``step`` when the interval policy (or ``force``) says so.

        Returns a :class:`SaveHandle` when a save started, ``None`` when skipped.
        Blocks only while the state is copied into host memory, unless the
        mode is ``sync`` or a preemption signal arrived: then it returns once
        the step is committed.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative int, got {step!r}")
        self._raise_failed()
        t_start = time.monotonic()
        self._groups.ensure()
        try:
            due, preempt = self._decide(step, force)
            if not due:
                return None
            if preempt:
                self._preempt_decided = True
            self._wait_previous(step)
            captured, kinds = state_mod.capture(state, _dist.rank(), self.config.capture_rng)
            if not self._space_ok(step, tensor_bytes(captured)):
                return None
            if self._nonce is None:
                self._nonce = self._groups.broadcast_ctl(uuid.uuid4().hex[:12])
                if _dist.local_rank() == 0:
                    removed = local.clean_leftovers(self.root, keep_nonce=self._nonce)
                    if removed:
                        log.info(
                            "shardckpt: removed leftovers of interrupted saves in %s: %s", self.root, ", ".join(removed)
                        )
            self._save_count += 1
            self._last_save_time = time.monotonic()
            staged = self._stager.stage(captured)
            del captured
            _failpoints.hit("save.staged")
        finally:
            self._start_vote()
        blocked = time.monotonic() - t_start

        user_md = dict(self.config.metadata)
        user_md.update(metadata or {})
        partial = os.path.join(self.root, layout.partial_dirname(step, f"{self._save_count}-{self._nonce}"))
        future = self._executor.submit(
            self._write_and_commit, staged, kinds, step, partial, user_md, t_start, blocked
        )
        handle = SaveHandle(step, future)
        self._pending = handle
        self._last_saved_step = step
        if preempt or self.config.mode == SaveMode.SYNC:
            try:
                handle.wait()
            finally:
                self._pending = None
            if preempt:
                self._preempted = True
                (log.warning if _dist.rank() == 0 else log.debug)(
                    "shardckpt: preemption (signal %s): step %d committed; exit the training loop now",
                    self._preempt_signal,
                    step,
                )
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save in flight (if any) is committed; re-raise its failure."""
        handle = self._pending
        if handle is not None:
            try:
                handle.wait(timeout)
            except TimeoutError:
                raise
            except BaseException:
                self._pending = None
                self._failed = None
                raise
            self._pending = None
        self._raise_failed()

    last_plan: "elastic_mod.ElasticPlan | None" = None
    """The elastic plan of the last successful ``load()`` (``None`` before one)."""

    def load(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        strict: bool | None = None,
        trust_pickles: bool = False,
        elastic: "elastic_mod.ElasticPolicy | None" = None,
    ) -> int | None:
        """Restore ``state`` in place from ``step`` (default: the newest committed).

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
        strict = self.config.strict if strict is None else strict
        t_start = time.monotonic()
        self._groups.ensure()
        candidates, early = self._agreed_candidates(step)
        if not candidates:
            if step is not None:
                self._raise_not_found(step)
            if _dist.rank() == 0:
                log.info("shardckpt: nothing to resume in %s; starting fresh", self.root)
            self.last_plan = None
            return None
        last_error: BaseException | None = None
        for candidate in candidates:
            step_dir = os.path.join(self.root, layout.step_dirname(candidate))
            try:
                manifest = self._verify(candidate, step_dir, early)
            except CorruptCheckpointError as exc:
                if self.config.on_corrupt == OnCorrupt.FALLBACK and step is None:
                    log.warning("shardckpt: step %d failed verification, falling back: %s", candidate, exc)
                    last_error = exc
                    continue
                raise
            self._load_step(state, candidate, step_dir, manifest, strict=strict, trust_pickles=trust_pickles)
            took = time.monotonic() - t_start
            if _dist.rank() == 0:
                log.info(
                    "shardckpt: restored step %d from %s: %s, world size %d -> %d, %.2f s",
                    candidate,
                    step_dir,
                    _fmt_bytes(manifest.total_bytes),
                    manifest.world_size,
                    _dist.world_size(),
                    took,
                )
            self.last_plan = elastic_mod.after_restore(
                state,
                step=candidate,
                saved_world_size=manifest.world_size,
                world_size=_dist.world_size(),
                manifest_metadata=manifest.metadata,
                policy=elastic,
                config=self.config,
                log_plan=_dist.rank() == 0,
            )
            self._last_saved_step = candidate
            return candidate
        raise CorruptCheckpointError(
            f"no committed step in {self.root} passed verification; the last error was: {last_error}"
        ) from last_error

    def status(self) -> dict[str, Any]:
        """Newest committed step (locally and remotely), the save in flight, uploads and errors.

        With a remote: ``latest_remote`` (newest step known committed there),
        ``pending_upload_steps`` / ``pending_upload_bytes`` (this node's local
        steps not yet committed remotely), ``last_upload_error`` and
        ``uploader`` (pid and state of this node's uploader, from its status
        file). No remote request is made.
        """
        steps = self.steps()
        pending = self._pending
        out: dict[str, Any] = {
            "local_dir": self.root,
            "latest_local": steps[-1] if steps else None,
            "committed_local": steps,
            "in_flight": pending.step if pending is not None and not pending.done() else None,
            "last_error": repr(self._failed) if self._failed is not None else None,
        }
        if self.config.remote is not None:
            out.update(self._remote_status())
        return out

    def close(self, timeout: float | None = None) -> None:
        """Flush the save in flight, stop the background thread, restore signal handlers."""
        if self._closed:
            return
        try:
            self.wait(timeout)
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            if self._vote is not None:  # every rank started the same vote: finish it
                self._resolve_vote()
            self._stager.release()
            self._restore_signal_handlers()
            if self.config.remote is not None:
                self._close_remote(timeout)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ save steps

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed; create a new one")

    def _raise_failed(self) -> None:
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            exc = pending._future.exception()
            if exc is not None:
                raise exc
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise exc

    def _decide(self, step: int, force: bool) -> tuple[bool, bool]:
        """Whether this call saves, and whether it is a preemption save.

        Time- and signal-based triggers can differ between ranks, so they are
        agreed with an all-reduce. That vote is pipelined: each call starts a
        non-blocking all-reduce of this rank's flags and acts on the result
        of the previous call's vote, which has long completed. A signal or an
        elapsed interval therefore takes effect one ``save()`` call later on
        every rank at once, and deciding never blocks training.
        """
        cfg = self.config
        if step == self._last_saved_step and not force:
            return False, False
        by_step = cfg.every_steps is not None and step % cfg.every_steps == 0
        every_call = cfg.every_steps is None and cfg.every_seconds is None
        if _dist.is_dist() and (cfg.every_seconds is not None or self._previous_handlers):
            by_time, preempt = self._resolve_vote()
        else:
            by_time, preempt = self._local_flags()
        return bool(force or every_call or by_step or by_time or preempt), bool(preempt)

    def _local_flags(self) -> tuple[int, int]:
        cfg = self.config
        by_time = 0
        if cfg.every_seconds is not None and _dist.rank() == 0:
            by_time = int(self._last_save_time is None or time.monotonic() - self._last_save_time >= cfg.every_seconds)
        return by_time, int(self._preempt_signal is not None and not self._preempt_decided)

    def _resolve_vote(self) -> tuple[int, int]:
        vote = self._vote
        self._vote = None
        if vote is None:
            return 0, 0
        work, flags = vote
        work.wait()
        by_time, preempt = flags.tolist()
        return by_time, preempt

    def _start_vote(self) -> None:
        cfg = self.config
        if not (_dist.is_dist() and (cfg.every_seconds is not None or self._previous_handlers)):
            return
        if self._vote is not None:  # an early return left one unresolved: finish it first
            self._resolve_vote()
        flags = torch.tensor(self._local_flags(), dtype=torch.int64)
        work = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self._groups.ctl, async_op=True)
        self._vote = (work, flags)

    def _wait_previous(self, step: int) -> None:
        pending = self._pending
        if pending is None:
            return
        if not pending.done():
            t0 = time.monotonic()
            (log.info if _dist.rank() == 0 else log.debug)(
                "shardckpt: step %d waits for step %d to finish writing (save interval shorter than write time)",
                step,
                pending.step,
            )
            try:
                pending.wait()
            finally:
                self._pending = None
            (log.info if _dist.rank() == 0 else log.debug)(
                "shardckpt: waited %.2f s for step %d", time.monotonic() - t0, pending.step
            )
        self._raise_failed()

    def _space_ok(self, step: int, local_bytes: int) -> bool:
        """Agree across ranks whether every node has room for this step."""
        os.makedirs(self.root, exist_ok=True)
        # Upper bound of what this node writes: its ranks hold about as much
        # as this one; never more than the whole previous checkpoint.
        node_bytes = local_bytes * max(1, _dist.local_world_size())
        if self._last_total_bytes is not None:
            node_bytes = min(node_bytes, max(self._last_total_bytes, local_bytes))
        needed = int(node_bytes * (1 + self.config.free_space_margin)) + (1 << 20)
        free = shutil.disk_usage(self.root).free
        short = 0 if free >= needed else 1
        if self._groups.all_reduce_max([short])[0] == 0:
            return True
        where = "this node" if short else "another node"
        message = (
            f"step {step}: not enough free space in {self.root} on {where} "
            f"(this node needs ~{_fmt_bytes(needed)}, has {_fmt_bytes(free)} free). "
            f"Existing checkpoints are untouched. Remedy: free disk space, lower keep_last, "
            f"or point local_dir at a larger disk."
        )
        if self.config.on_disk_full == OnDiskFull.SKIP:
            log.warning("shardckpt: skipping save: %s", message)
            return False
        raise InsufficientSpaceError(message)

    def _write_and_commit(
        self,
        staged: dict[str, Any],
        kinds: dict[str, str],
        step: int,
        partial: str,
        user_md: dict[str, Any],
        t_start: float,
        blocked: float,
    ) -> str:
        rank = _dist.rank()
        leader = _dist.local_rank() == 0
        failure: BaseException | None = None
        mine: dict[str, Any] = {}
        try:
            os.makedirs(partial, exist_ok=True)
            local.dcp_write(staged, partial, process_group=self._groups.io, io_threads=self.config.io_threads)
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
        tables = [table for table, _err in reports]
        files: dict[str, layout.FileEntry] = {}
        for table in tables:
            for name, (size, digest, owner) in table.items():
                files[name] = layout.FileEntry(size, digest, owner)
        manifest = layout.Manifest(
            step=step,
            world_size=_dist.world_size(),
            files=files,
            torch_version=torch.__version__,
            shardckpt_version=_version(),
            keys=dict(kinds),
            metadata=user_md,
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
        self._last_total_bytes = manifest.total_bytes
        self.last_committed = step
        committed = time.monotonic() - t_start
        if leader:
            self._apply_retention()
        if rank == 0:
            log.info(
                "shardckpt: saved step %d to %s: %s, blocked %.3f s, committed in %.2f s",
                step,
                final,
                _fmt_bytes(manifest.total_bytes),
                blocked,
                committed,
            )
        return final

    def _apply_retention(self) -> None:
        steps = layout.committed_steps(self.root)
        for old in retention.plan_deletions(steps, self._policy, self._deletable):
            local.delete_step(self.root, old)
            log.debug("shardckpt: retention removed step %d from %s", old, self.root)

    def _deletable(self, step: int) -> bool:
        """Local retention guard: with uploads on, only steps already committed remotely go,
        unless the disk is about to fill (then loudly, naming the step)."""
        if self.config.remote is None or self.config.uploader == UploaderMode.OFF:
            return True
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        if upload.is_uploaded(step_dir, self.config.remote):
            return True
        steps = layout.committed_steps(self.root)
        newest = upload.local_bytes(self.root, steps[-1]) if steps else 0
        needed = int(newest * (1 + self.config.free_space_margin)) + (1 << 20)
        free = shutil.disk_usage(self.root).free
        if free >= needed:
            return False
        log.warning(
            "shardckpt: LOCAL DISK NEARLY FULL in %s (%s free, the next save needs ~%s): dropping local step %d, "
            "which is NOT yet committed on the remote %s. Remedy: check the uploader (status(), %s), "
            "free disk space or lower keep_last.",
            self.root, _fmt_bytes(free), _fmt_bytes(needed), step, remote.safe_url(self.config.remote),
            os.path.join(upload.state_dir(self.root), "uploader.log"),
        )
        return True

    # ------------------------------------------------------------ load steps

    def _candidate_steps(self) -> list[int]:
        """Steps committed locally, plus (with a remote) those committed remotely.

        Collective over the ``ctl`` group when a remote is set: rank 0 lists
        the remote and broadcasts the list (one listing per job, not per rank).
        When the listing fails (after its bounded retries), ranks that all hold
        a committed local step go on with the local steps and a warning; if
        any rank holds none, every rank raises :class:`RemoteError` rather
        than report "nothing to resume" and restart training from scratch.
        """
        steps = set(layout.committed_steps(self.root))
        if self.config.remote is None:
            return sorted(steps)
        # With node-local disks a local step may hold only this node's shards:
        # it counts here when complete, or when the remote can complete it.
        complete = set()
        for step in steps:
            try:
                manifest = layout.read_manifest(os.path.join(self.root, layout.step_dirname(step)))
            except CorruptCheckpointError:
                complete.add(step)  # let verification report it
                continue
            if manifest is not None and not layout.missing_files(
                os.path.join(self.root, layout.step_dirname(step)), manifest
            ):
                complete.add(step)
        listing: tuple[list[int], str | None] = ([], None)
        if _dist.rank() == 0:
            try:
                listing = (upload.remote_steps(self._remote_store(), remote.Deadline(self.config.step_deadline_s)), None)
            except RemoteError as exc:
                listing = ([], remote.redact(str(exc)))
        found, error = self._groups.broadcast_ctl(listing)
        if error is not None:
            # Every rank decides alike: all see the same error and the same
            # agreement below. Without any local step, "nothing to resume"
            # would silently restart training from scratch: refuse instead.
            have_local = self._groups.all_gather_ctl(bool(complete))
            if not all(have_local):
                where = self.root if not complete else f"the local_dir of {have_local.count(False)} rank(s)"
                raise RemoteError(
                    f"cannot list the remote {remote.safe_url(self.config.remote)} and {where} holds no "
                    f"committed step, so nothing was loaded (starting fresh could discard a run that exists "
                    f"remotely). Cause: {error}"
                )
            if _dist.rank() == 0:
                log.warning(
                    "shardckpt: cannot list the remote %s; using local steps only (a newer step committed "
                    "remotely would be missed): %s",
                    remote.safe_url(self.config.remote), error,
                )
        self._remote_committed = set(found or [])
        return sorted(complete | self._remote_committed)

    def _agreed_candidates(
        self, step: int | None
    ) -> tuple[list[int], dict[int, tuple[list[str], layout.Manifest | None]]]:
        """Steps every rank can load, newest first, and the verification already done.

        Without a remote each rank checks its share of the step it expects to
        load (the requested one, else its newest) before the one exchange of
        step lists; when every rank checked the step that turns out to be the
        agreed first candidate, its verification needs no second exchange.
        Returns ``(candidates, {step: (errors of all ranks, this rank's manifest)})``.
        """
        mine = set(self._candidate_steps())
        report: tuple[int, str | None] | None = None
        manifest: layout.Manifest | None = None
        guess = step if step is not None else max(mine, default=None)
        if self.config.remote is None and guess is not None and guess in mine:
            step_dir = os.path.join(self.root, layout.step_dirname(guess))
            try:
                manifest = layout.read_manifest(step_dir)
            except CorruptCheckpointError as exc:
                report = (guess, str(exc))
            else:
                if manifest is not None:
                    report = (guess, self._check_share(step_dir, manifest, set()))
        gathered = self._groups.all_gather_ctl((sorted(mine), report))
        common = set(gathered[0][0])
        for other, _report in gathered[1:]:
            common &= set(other)
        if step is not None:
            candidates = [step] if step in common else []
        else:
            candidates = sorted(common, reverse=True)
        early: dict[int, tuple[list[str], layout.Manifest | None]] = {}
        if candidates and all(r is not None and r[0] == candidates[0] for _steps, r in gathered):
            # A rank reports no error only after reading its manifest, so
            # without errors every rank holds its manifest here.
            early[candidates[0]] = ([r[1] for _steps, r in gathered if r[1]], manifest)
        return candidates, early

    def _raise_not_found(self, step: int) -> None:
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        if os.path.isdir(step_dir) and not os.path.exists(os.path.join(step_dir, layout.MANIFEST_NAME)):
            hint = (
                " It has no shardckpt manifest: either a save was interrupted before its commit, or it "
                "was written by plain torch.distributed.checkpoint.save. Remedy: load an earlier step; "
                "to use a stock DCP checkpoint, commit a copy of it with `shardckpt adopt DIR --into "
                "LOCAL_DIR --step N`, or read it with torch.distributed.checkpoint.load directly."
            )
        else:
            hint = f" Committed steps here: {self.steps() or 'none'}."
        raise CheckpointNotFoundError(f"step {step} is not committed in {self.root} on every rank.{hint}")

    def _verify(
        self, step: int, step_dir: str, early: dict[int, tuple[list[str], layout.Manifest | None]] | None = None
    ) -> layout.Manifest:
        """Check ``step`` on every rank (each its share of the files); collective unless ``early`` has it.

        ``early`` maps a step to the errors every rank already reported for it
        and this rank's manifest (see :meth:`_agreed_candidates`), saving a
        round of messages.
        """
        manifest: layout.Manifest | None
        if early is not None and step in early:
            errors, manifest = early[step]
        else:
            fetched: set[str] = set()
            if self.config.remote is not None:
                fetched = self._fetch_missing(step, step_dir)
            manifest = layout.read_manifest(step_dir)
            if manifest is None:
                self._raise_not_found(step)
            error = self._check_share(step_dir, manifest, fetched)
            errors = [e for e in self._groups.all_gather_ctl(error) if e]
        if errors:
            raise CorruptCheckpointError(errors[0] + (f" ({len(errors) - 1} more)" if len(errors) > 1 else ""))
        assert manifest is not None
        return manifest

    def _check_share(self, step_dir: str, manifest: layout.Manifest, skip: set[str]) -> str | None:
        """This rank's share of the checksum verification; the error message or ``None``."""
        if not self.config.verify_on_load:
            return None
        names = sorted(n for n in manifest.files if n not in skip)
        if self.config.remote is not None:
            # Node-local copies: each node checks its own copy, split over its ranks.
            share = names[_dist.local_rank() :: max(1, _dist.local_world_size())]
        else:
            share = names[_dist.rank() :: _dist.world_size()]
        try:
            layout.verify_files(step_dir, manifest, share)
        except CorruptCheckpointError as exc:
            return str(exc)
        return None

    def _load_step(
        self,
        state: dict[str, Any],
        step: int,
        step_dir: str,
        manifest: layout.Manifest,
        *,
        strict: bool,
        trust_pickles: bool,
    ) -> None:
        run_id = self.config.run_id
        if run_id is not None and manifest.run_id is not None and manifest.run_id != run_id:
            raise ForeignCheckpointError(
                f"step {step} in {step_dir} was written by run {manifest.run_id!r}, this is run {run_id!r} "
                f"(see {os.path.join(step_dir, layout.MANIFEST_NAME)}). Remedy: point local_dir/remote at this "
                f"run's checkpoints, or set run_id to {manifest.run_id!r} (or None) to continue that run."
            )
        metadata = local.read_metadata(step_dir, step, trust_pickles=trust_pickles)
        kinds_live = state_mod.classify(state)
        # Adopted stock DCP checkpoints record no kinds: take the live ones.
        saved_kinds = {
            k: (kinds_live.get(k, state_mod.VALUE) if v == state_mod.STOCK else v) for k, v in manifest.keys.items()
        }
        targets = state_mod.live_targets(state, kinds_live)
        rank = _dist.rank()
        rng_key = state_mod.rng_key(rank)

        saved_paths = [tuple((metadata.planner_data or {}).get(fqn, (fqn,))) for fqn in metadata.state_dict_metadata]
        saved_fqns = {".".join(map(str, p)) for p in saved_paths}
        top_saved = {p[0] for p in saved_paths}
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat_live = flatten_state_dict(targets)[0]
        live_fqns = set(flat_live.keys())
        reshaped = _shape_mismatches(flat_live, metadata)
        if reshaped:
            raise StateMismatchError(
                f"step {step} in {step_dir} holds tensors of other shapes than the state being loaded "
                f"(a checkpoint of another model?): {'; '.join(reshaped[:10])}"
                + (f"; ... ({len(reshaped) - 10} more)" if len(reshaped) > 10 else "")
                + ". Remedy: build the model with the configuration it was saved with, or load another "
                "checkpoint directory.",
                unexpected=[r.split(" ", 1)[0] for r in reshaped],
            )
        missing = sorted(f for f in live_fqns if f not in saved_fqns)
        unexpected = sorted(
            f
            for f in saved_fqns
            if f.split(".", 1)[0] in targets and f not in live_fqns
        )
        # Stateful objects / modules present live but not saved at all.
        for key, kind in kinds_live.items():
            if kind in (state_mod.STATEFUL,) and key not in top_saved and key not in saved_kinds:
                missing.append(key)
        for key, kind in saved_kinds.items():
            if kind in (state_mod.MODULE, state_mod.OPTIMIZER, state_mod.STATEFUL) and key not in kinds_live:
                unexpected.append(key)
        if missing or unexpected:
            message = _mismatch_message(step, step_dir, missing, unexpected)
            if strict:
                raise StateMismatchError(message, missing, unexpected)
            log.warning("shardckpt: loading with strict=False, skipping: %s", message)
        for key in list(targets):
            if not strict:
                # Drop entries the checkpoint lacks; DCP would refuse them.
                _prune_missing(targets, key, saved_fqns)

        rebuild_keys = {
            k
            for k, kind in saved_kinds.items()
            if kind in (state_mod.VALUE, state_mod.STATEFUL) and (k in kinds_live or kind == state_mod.VALUE)
        }
        has_rng = any(p[:3] == (state_mod.RESERVED_KEY, state_mod.RNG, rng_key) for p in saved_paths)

        def rebuild(path: tuple) -> bool:
            if path[0] in rebuild_keys:
                return True
            return has_rng and self.config.capture_rng and path[:3] == (state_mod.RESERVED_KEY, state_mod.RNG, rng_key)

        planner = local.RestorePlanner(rebuild, allow_partial_load=True, trust_pickles=trust_pickles)
        local.dcp_read(targets, step_dir, metadata, planner, self._groups.ctl)
        kinds_all = dict(kinds_live)
        for key in rebuild_keys:
            kinds_all.setdefault(key, saved_kinds[key])
            # An empty dict (e.g. a disabled GradScaler's state) has no entries in
            # DCP's metadata: it comes back as an empty dict.
            targets.setdefault(key, {})
        state_mod.restore(state, kinds_all, {k: v for k, v in targets.items() if k in kinds_all}, strict=strict)
        if self.config.capture_rng:
            if has_rng:
                state_mod.set_rng_state(targets[state_mod.RESERVED_KEY][state_mod.RNG][rng_key])
            else:
                state_mod.seed_fresh_rank(step, rank)
                log.warning(
                    "shardckpt: step %d has no RNG state for rank %d (saved with world size %d); "
                    "seeded it deterministically from (step, rank)",
                    step,
                    rank,
                    manifest.world_size,
                )

    # ------------------------------------------------------------ remote tier

    def _setup_remote(self) -> None:
        """Register this process as a trainer of the node; local rank 0 starts the uploader."""
        if self.config.uploader == UploaderMode.OFF:
            return
        os.makedirs(self.root, exist_ok=True)
        self._trainer_file = upload.register_trainer(self.root)
        if self.config.uploader != UploaderMode.AUTO or _dist.local_rank() != 0:
            return
        running = upload.uploader_running(self.root)
        if running is not None:
            log.info("shardckpt: uploader pid %d already serves %s", running, self.root)
            return
        upload.spawn_uploader(self.root, self.config.remote, self._uploader_args())
        self._uploader_spawned = time.monotonic()
        log.info(
            "shardckpt: started the uploader for %s -> %s; log in %s",
            self.root, remote.safe_url(self.config.remote),
            os.path.join(upload.state_dir(self.root), "uploader.log"),
        )

    def _uploader_args(self) -> list[str]:
        cfg = self.config
        args = [
            "--exit-when-idle",
            "--node", _dist.node_id(),
            "--concurrency", str(cfg.transfer_concurrency),
            "--part-size", str(cfg.part_size),
            "--request-timeout", str(cfg.request_timeout_s),
            "--max-attempts", str(cfg.remote_max_attempts),
            "--backoff-max", str(cfg.backoff_max_s),
            "--step-deadline", str(cfg.step_deadline_s),
        ]
        if cfg.endpoint_url:
            args += ["--endpoint-url", cfg.endpoint_url]
        if cfg.remote_keep_last is not None:
            args += ["--keep-last", str(cfg.remote_keep_last)]
        if cfg.remote_keep_every is not None:
            args += ["--keep-every", str(cfg.remote_keep_every)]
        return args

    def _remote_store(self) -> remote.Store:
        if self._store is None:
            self._store = remote.open_store(self.config.remote, self.config.transfer_options())
        return self._store

    def _remote_status(self) -> dict[str, Any]:
        url = self.config.remote
        info = upload.read_status(self.root)
        pending = upload.pending_steps(self.root, url) if self.config.uploader != UploaderMode.OFF else []
        marked = [
            s for s in layout.committed_steps(self.root)
            if upload.is_uploaded(os.path.join(self.root, layout.step_dirname(s)), url)
        ]
        known = [s for s in (info.get("latest_remote"), marked[-1] if marked else None) if isinstance(s, int)]
        known += list(self._remote_committed)
        pid = upload.uploader_running(self.root)
        return {
            "remote": remote.safe_url(url),
            "latest_remote": max(known) if known else None,
            "pending_upload_steps": pending,
            "pending_upload_bytes": sum(upload.local_bytes(self.root, s) for s in pending),
            "last_upload_error": info.get("last_error"),
            "uploader": {"pid": pid, "running": pid is not None, "state": info.get("state"), "mode": self.config.uploader.value},
            "drain": self._drain_report,
        }

    def _close_remote(self, timeout: float | None) -> None:
        try:
            if self.config.uploader != UploaderMode.OFF and _dist.local_rank() == 0:
                self._drain_report = self._drain(timeout)
        finally:
            upload.unregister_trainer(self._trainer_file)
            self._trainer_file = None
            if self._store is not None:
                self._store.close()
                self._store = None

    def _drain(self, timeout: float | None) -> dict[str, Any]:
        """Wait until this node's committed steps are committed remotely (bounded).

        Ends early when the uploader reports every pending step as failed for a
        reason retries cannot fix (see ``remote.RemoteError.retryable``); the
        report's ``ended`` says why the wait stopped.
        """
        url = self.config.remote
        limit = self.config.drain_timeout_s if timeout is None else min(timeout, self.config.drain_timeout_s)
        t0 = time.monotonic()
        last_log = t0
        ended = "uploaded"
        while True:
            pending = upload.pending_steps(self.root, url)
            running = upload.uploader_running(self.root)
            starting = (
                running is None
                and self._uploader_spawned is not None
                and upload.read_status(self.root).get("state") is None
                and time.monotonic() - self._uploader_spawned < 60.0
            )
            waited = time.monotonic() - t0
            if not pending:
                break
            if running is None and not starting and waited > 5.0:
                ended = "no uploader running"
                break
            if waited >= limit:
                ended = "drain_timeout_s"
                break
            # The uploader found that retrying will not help (a missing bucket, rejected
            # credentials): waiting out drain_timeout_s would only delay the report.
            if running is not None and set(pending) <= set(upload.read_status(self.root).get("failed_permanently") or []):
                ended = "permanent upload error"
                break
            if time.monotonic() - last_log >= 10.0:
                last_log = time.monotonic()
                log.info("shardckpt: close() waits for uploads of steps %s to %s", pending, remote.safe_url(url))
            time.sleep(0.2)
        info = upload.read_status(self.root)
        report = {
            "pending_steps": pending,
            "pending_bytes": sum(upload.local_bytes(self.root, s) for s in pending),
            "uploader_running": running is not None,
            "last_error": info.get("last_error"),
            "waited_s": round(time.monotonic() - t0, 3),
            "ended": ended,
        }
        if pending:
            if running is not None:
                what = (
                    f"the uploader (pid {running}) keeps working on them after this process exits; "
                    f"its log is {os.path.join(upload.state_dir(self.root), 'uploader.log')}"
                )
            else:
                what = (
                    f"no uploader is running: run `shardckpt sync --local {self.root} --remote "
                    f"{remote.safe_url(url)} --once` to upload them"
                )
            log.warning(
                "shardckpt: close(): steps %s (%s) of %s are not yet committed on %s after %.0f s; %s. Last upload error: %s",
                pending, _fmt_bytes(report["pending_bytes"]), self.root, remote.safe_url(url), report["waited_s"], what,
                report["last_error"],
            )
        return report

    def _fetch_missing(self, step: int, step_dir: str) -> set[str]:
        """Node leaders bring missing files of ``step`` from the remote; all ranks agree.

        Returns the names this node fetched (already verified against the
        manifest while downloading). Collective over the ``ctl`` group.
        """
        error: tuple[str, str] | None = None
        fetched: list[str] = []
        if _dist.local_rank() == 0:
            try:
                fetched = sorted(self._fetch_node(step, step_dir))
            except CorruptCheckpointError as exc:
                error = ("corrupt", str(exc))
            except (RemoteError, OSError) as exc:
                error = ("remote", remote.redact(str(exc)))
        gathered = self._groups.all_gather_ctl((error, fetched))
        errors = [g[0] for g in gathered if g[0] is not None]
        if errors:
            kind, message = next((e for e in errors if e[0] == "corrupt"), errors[0])
            more = f" ({len(errors) - 1} more node(s) failed too)" if len(errors) > 1 else ""
            if kind == "corrupt":
                raise CorruptCheckpointError(message + more)
            raise RemoteError(message + more)
        leader = _dist.rank() - _dist.local_rank()
        mine = gathered[leader][1] if 0 <= leader < len(gathered) else []
        return set(mine)

    def _fetch_node(self, step: int, step_dir: str) -> set[str]:
        manifest = layout.read_manifest(step_dir)
        if manifest is not None and not layout.missing_files(step_dir, manifest):
            return set()
        if step not in self._remote_committed:
            return set()  # verification reports what is missing
        return upload.fetch_step(self._remote_store(), self.root, step)

    # ------------------------------------------------------------ signals

    def _install_signal_handlers(self) -> None:
        if not self.config.preemption_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("shardckpt: not on the main thread; preemption signals are not handled")
            return
        for signum in self.config.preemption_signals:
            previous = signal.getsignal(signum)
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._make_handler(previous))

    def _make_handler(self, previous: Any) -> Callable:
        def handler(signum: int, frame: Any) -> None:
            first = self._preempt_signal is None
            self._preempt_signal = signum
            if first:
                log.warning(
                    "shardckpt: received signal %d; the next save() saves at once and waits for the commit",
                    signum,
                )
            if callable(previous):
                previous(signum, frame)

        return handler

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        self._previous_handlers.clear()


def _shape_mismatches(flat_live: dict[str, Any], metadata: Any) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for fqn, value in flat_live.items():
        saved = metadata.state_dict_metadata.get(fqn)
        if isinstance(value, torch.Tensor) and isinstance(saved, TensorStorageMetadata):
            if tuple(value.shape) != tuple(saved.size):
                out.append(f"{fqn} saved {tuple(saved.size)}, live {tuple(value.shape)}")
    return sorted(out)


def _mismatch_message(step: int, step_dir: str, missing: list[str], unexpected: list[str]) -> str:
    def show(items: list[str]) -> str:
        head = ", ".join(items[:20])
        return head + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")

    parts = [f"step {step} in {step_dir} does not match the state being loaded."]
    if missing:
        parts.append(f"Missing from the checkpoint ({len(missing)}): {show(missing)}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the state ({len(unexpected)}): {show(unexpected)}.")
    parts.append(
        "Remedy: load into the same model/optimizer structure that was saved, or pass strict=False "
        "to load the keys that match and keep the rest as initialised."
    )
    return " ".join(parts)


def _prune_missing(targets: dict[str, Any], key: str, saved_fqns: set[str]) -> None:
    def walk(obj: Any, prefix: str) -> Any:
        if isinstance(obj, dict):
            out = {}
            for k, v in obj.items():
                sub = walk(v, f"{prefix}.{k}")
                if sub is not _DROP:
                    out[k] = sub
            return out if out or not obj else _DROP
        return obj if prefix in saved_fqns or any(f.startswith(prefix + ".") for f in saved_fqns) else _DROP

    pruned = walk(targets[key], key)
    if pruned is _DROP:
        del targets[key]
    else:
        targets[key] = pruned


_DROP = object()
