"""The restore path: candidates -> fetch -> verify -> match keys -> load -> elastic plan.

``Restorer.load`` runs on the main thread of every rank, collectively over the
``ctl`` side group::

    1. pick the steps every rank can load, newest first (local steps, and
       with a remote the steps committed there; rank 0 lists the remote)
    2. node leaders fetch missing files from the remote, each checked against
       the manifest while it downloads; all ranks learn every node's outcome
    3. verify checksums, the work split over ranks; a failure is seen by all
       (and with on_corrupt="fallback" every rank moves on to the next step)
    4. read DCP's metadata through the restricted unpickler, check run id,
       keys and shapes (strict)
    5. DCP read into the live module / optimizer state dicts and into rebuilt
       entries (plain values, stateful objects, this rank's RNG)
    6. apply to the live objects, restore RNG; one log line; the elastic plan
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from . import _dist, layout, local, remote, remote_commit
from . import elastic as elastic_mod
from . import state as state_mod
from ._text import fmt_bytes
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    RemoteError,
    StateMismatchError,
)
from .options import CheckpointConfig, OnCorrupt

log = logging.getLogger("shardckpt")


class Restorer:
    """Loads committed steps of ``root`` (and of the remote, when set) into live state."""

    def __init__(self, config: CheckpointConfig, root: str, groups: _dist.SideGroups) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self._store: remote.Store | None = None
        self.remote_committed: set[int] = set()
        """Steps seen committed on the remote at the last listing."""
        self.last_plan: elastic_mod.ElasticPlan | None = None

    def steps(self) -> list[int]:
        return layout.committed_steps(self.root)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

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
        Collective over the ``ctl`` group: every rank calls it alike.
        """
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
                    fmt_bytes(manifest.total_bytes),
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
            return candidate
        raise CorruptCheckpointError(
            f"no committed step in {self.root} passed verification; the last error was: {last_error}"
        ) from last_error

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
                listing = (remote_commit.remote_steps(self._remote_store(), remote.Deadline(self.config.step_deadline_s)), None)
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
        self.remote_committed = set(found or [])
        return sorted(complete | self.remote_committed)

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

    def _remote_store(self) -> remote.Store:
        if self._store is None:
            self._store = remote.open_store(self.config.remote, self.config.transfer_options())
        return self._store


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
        if step not in self.remote_committed:
            return set()  # verification reports what is missing
        return remote_commit.fetch_step(self._remote_store(), self.root, step)


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
