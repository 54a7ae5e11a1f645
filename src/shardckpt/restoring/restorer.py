"""The restore path: survey -> sources.complete(step) -> match keys and shapes -> DCP read -> apply.

``Restorer.load`` runs on the main thread of every rank, collectively over the
``ctl`` side group::

    1. survey (``survey.py``): every rank's committed steps, rank 0's remote
       listing, one exchange; which steps are live and which every rank can load
    2. sources.complete(step) (``sources.py``, the ONE place that orders where
       the bytes come from: this node's disk -> the step views of real stores
       (replicas held here, each peer's daemon) -> other nodes over the process
       group -> the remote, need-only or whole files); then a size check of every file (a stat, split over
       the ranks of each copy): a missing or truncated file stops the step
       before anything is read
    3. match: DCP's metadata read through the restricted unpickler; run id,
       keys and shapes checked (strict)
    4. DCP read (``dcp/reader.py``) into the live module / optimizer state
       dicts and into rebuilt entries (plain values, stateful objects, this
       rank's RNG), stored tensors straight into the live tensors' memory,
       each file checksummed by one rank of its copy while it is read; one
       exchange: a file failing it is fetched again (``sources.refetch``) and
       the step read again; every rank sees every failure (and with
       ``on_corrupt="fallback"`` every rank moves on to the next step)
    5. apply to the live objects, restore RNG; one log line; the elastic plan;
       the lineage the next saves continue (agreed on rank 0)
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from shardckpt import _dist, stores
from shardckpt._text import fmt_bytes
from shardckpt.dcp import planner as dcp_planner
from shardckpt.dcp import reader as dcp_reader
from shardckpt.dcp.memory import MemoryMiss
from shardckpt.errors import (
    CorruptCheckpointError,
    ForeignCheckpointError,
    MetaDeviceError,
    StateMismatchError,
)
from shardckpt.format import layout
from shardckpt.format import lineage as lineage_mod
from shardckpt.options import CheckpointConfig, OnCorrupt, run_config_of
from shardckpt.restoring import elastic as elastic_mod
from shardckpt.restoring import run_config as run_config_mod
from shardckpt.restoring import targets as targets_mod
from shardckpt.restoring.sources import MemorySourceLike, Sources
from shardckpt.restoring.survey import Survey, Surveyor
from shardckpt.restoring.views import PeerTierFacts
from shardckpt.state import capture as state_mod
from shardckpt.state import keys as keys_mod
from shardckpt.state import per_rank
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")


class Restorer:
    """Loads committed steps of ``root`` (and of the remote, when set) into live state."""

    def __init__(self, config: CheckpointConfig, root: str, groups: _dist.SideGroups, *,
                 peer: PeerTierFacts | None = None, memory: MemorySourceLike | None = None) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self.sources = Sources(config, root, groups, peer=peer, memory=memory)
        """Where the bytes of the step being restored come from, in one place (``sources.py``)."""
        self.surveyor = Surveyor(config, root, groups, self.sources)
        self.last_plan: elastic_mod.ElasticPlan | None = None
        self.next_lineage: lineage_mod.Lineage | None = None
        """The lineage the saves after the last load continue (agreed by all ranks)."""
        self.newest_created = 0.0
        """The newest manifest time seen by the last load: later saves are stamped after it."""
        self.loaded: lineage_mod.StepInfo | None = None
        """The step the last load restored (its version and history)."""
        self.restored_from: str | None = None
        """Where the last load read it: the step directory, or ``memory (<its shared memory>)``."""

    @property
    def topology(self) -> Topology:
        """Which ranks share this directory; set by the Checkpointer before the first load."""
        return self.sources.topology

    @topology.setter
    def topology(self, value: Topology) -> None:
        self.sources.topology = value

    @property
    def remote_committed(self) -> set[int]:
        """Steps seen committed on the remote at the last listing."""
        return self.surveyor.remote_committed

    def steps(self) -> list[int]:
        return layout.committed_steps(self.root)

    def store(self) -> stores.Store:
        """The remote store (opened on first use, closed by :meth:`close`)."""
        return self.sources.store()

    def close(self) -> None:
        self.sources.close()

    def load(
        self,
        state: dict[str, Any],
        step: int | str | None = None,
        *,
        strict: bool | None = None,
        trust_pickles: bool = False,
        elastic: "elastic_mod.ElasticPolicy | None" = None,
    ) -> int | None:
        """Restore ``state`` in place from ``step`` (default: the newest live step).

        Returns the restored step, or ``None`` when there is nothing to resume.
        The resulting plan is logged in one line and kept as ``self.last_plan``.
        Collective over the ``ctl`` group: every rank calls it alike.
        """
        strict = self.config.strict if strict is None else strict
        t_start = time.monotonic()
        survey = self.surveyor.run(step)
        if step == "best" and survey.candidates:
            step = survey.candidates[0]
        self.newest_created = max((i.created for i in survey.infos.values()), default=0.0)
        if not survey.candidates:
            if step is not None:
                self.surveyor.raise_not_found(step, survey)
            if _dist.rank() == 0:
                where = f"{self.root}{' or the remote' if self.config.remote else ''}"
                if survey.infos:  # steps exist: starting fresh is never silent
                    log.warning("shardckpt: committed steps exist in %s but none is resumed: %s; starting fresh",
                                where, _why_none(survey, self.config.start_fresh))
                else:
                    log.info("shardckpt: nothing to resume in %s; starting fresh", where)
            self.last_plan = None
            self.next_lineage = self._agree_lineage(survey, None)
            return None
        last_error: BaseException | None = None
        queue = list(survey.candidates)
        while queue:
            candidate = queue.pop(0)
            step_dir = os.path.join(self.root, layout.step_dirname(candidate))
            try:
                if candidate in survey.conflicts:
                    raise CorruptCheckpointError(
                        f"step {candidate} in {step_dir}: {survey.conflicts[candidate]}. Remedy: load another step "
                        f"(load(state, step=N), or on_corrupt='fallback'); `shardckpt ls` shows the run's history."
                    )
                manifest, checked, step_dir = self.sources.complete(candidate, step_dir, survey)
                self._load_checked(
                    state, candidate, step_dir, manifest, checked, survey, strict=strict, trust_pickles=trust_pickles
                )
            except MemoryMiss as exc:  # every rank alike: the same step from the other sources, if they have it
                survey.memory.pop(candidate, None) if not exc.gone else survey.memory.clear()
                queue[:0] = [candidate] if candidate in survey.elsewhere else []
                if _dist.rank() == 0:
                    log.warning("shardckpt: %s; %s", exc, "reading it from the other tiers" if queue[:1] == [candidate]
                                else "it is on no other tier: trying an older step")
                continue
            except CorruptCheckpointError as exc:
                if self.config.on_corrupt == OnCorrupt.FALLBACK and step is None:
                    if _dist.rank() == 0:
                        log.warning("shardckpt: step %d failed verification, falling back: %s", candidate, exc)
                    last_error = exc
                    continue
                raise
            took = time.monotonic() - t_start
            if _dist.rank() == 0:
                self._warn_config_changes(candidate, manifest)
                note = f" ({survey.abandoned[candidate]})" if candidate in survey.abandoned else ""
                note += " (a light step: no optimizer state)" if manifest.kind == "light" else ""
                log.info(
                    "shardckpt: restored step %d%s from %s: %s, world size %d -> %d, %.2f s",
                    candidate, note, step_dir, fmt_bytes(manifest.total_bytes), manifest.world_size,
                    _dist.world_size(), took,
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
            self.next_lineage = self._agree_lineage(survey, candidate, newest=step is None)
            self.loaded, self.restored_from = survey.infos[candidate], step_dir
            return candidate
        raise CorruptCheckpointError(
            f"no committed step in {self.root} passed verification; the last error was: {last_error}"
        ) from last_error

    # ------------------------------------------------------------ lineage, run config

    def _warn_config_changes(self, step: int, manifest: layout.Manifest) -> None:
        """``run_config`` of this run against the one the step was saved with: a warning listing changed keys."""
        changed = self._config_changes(manifest)
        if not changed:
            return
        log.warning(
            "shardckpt: run_config differs from the one step %d was saved with (%d key(s)): %s", step, len(changed),
            "; ".join(changed[:20]) + (f"; ... ({len(changed) - 20} more)" if len(changed) > 20 else "")
            + " (integer changes first; leave keys that differ on every run out with run_config_ignore=[...])",
        )

    def _config_changes(self, manifest: layout.Manifest, dims: tuple[set[int], set[int]] | None = None) -> list[str]:
        """``key: saved -> current`` for each ``run_config`` entry that differs (empty when either is unknown),
        those that can change shapes first, ``run_config_ignore`` left out (``run_config.py``)."""
        return run_config_mod.differences((manifest.run or {}).get("config"), run_config_of(self.config.run_config),
                                          self.config.run_config_ignore, saved_dims=dims[0] if dims else (),
                                          live_dims=dims[1] if dims else ())

    def _agree_lineage(self, survey: Survey, step: int | None, newest: bool = False) -> lineage_mod.Lineage:
        """The lineage of the next saves, decided on rank 0 (a new branch gets one id everywhere). ``newest``:
        ``step`` is the one a load of the newest step chose (newer light steps are passed over)."""
        mine = lineage_mod.continue_from(survey.infos, step) if _dist.rank() == 0 else None
        agreed = self._groups.broadcast_ctl(mine)
        if (step is not None and agreed.forks and agreed.forks[-1][1] == agreed.branch
                and agreed != survey.infos[step].lineage and _dist.rank() == 0):
            self._warn_new_branch(survey, step, newest)
        return agreed

    def _warn_new_branch(self, survey: Survey, step: int, newest: bool) -> None:
        """One WARNING that the next save starts a new branch from ``step``, and why: a rollback asked for, or
        (``newest``) newer steps passed over because they hold no optimizer state."""
        newer = sorted(s for s in survey.infos if s > step)
        live, _abandoned = lineage_mod.classify(dict(survey.infos))
        passed = [s for s in live if s > step]
        if newest and passed and all(survey.infos[s].kind == "light" for s in passed):
            log.warning(
                "shardckpt: resumed step %d, not the newer step(s) %s: they were saved without optimizer state "
                "(light: save(..., light=True), full_every, or a model-only last step such as torchtitan's "
                "checkpoint.last_save_model_only=True), and a resume needs it. The next save starts a new branch "
                "from step %d: step(s) %s are kept but no longer resumed by default, nor counted by retention. "
                "Steps %d..%d are trained again; when one of them is saved again, its earlier save is moved aside "
                "(as %s-..., listed by `shardckpt ls`; `shardckpt gc` removes it). Remedy: save the last step "
                "in full (torchtitan: checkpoint.last_save_model_only=False, its manager's default)",
                step, ", ".join(map(str, passed)), step, ", ".join(map(str, passed)), step + 1, passed[-1],
                layout.KEPT_PREFIX + layout.step_dirname(passed[0]),
            )
        else:
            log.warning(
                "shardckpt: rolled back to step %d: the next save starts a new branch; steps %s are kept "
                "but no longer resumed by default, nor counted by retention (`shardckpt gc` removes them). A "
                "save of one of those step numbers on the new branch replaces it in %s: the earlier save is "
                "moved aside (as %s-..., listed by `shardckpt ls`)",
                step, newer, self.root, layout.KEPT_PREFIX + layout.step_dirname(newer[0] if newer else step),
            )

    # ------------------------------------------------------------ 3-5. match, DCP read, apply

    def _load_checked(
        self,
        state: dict[str, Any],
        step: int,
        step_dir: str,
        manifest: layout.Manifest,
        checked: set[str],
        survey: Survey,
        *,
        strict: bool,
        trust_pickles: bool,
    ) -> None:
        """Read the step into ``state``, checksums compared on the way; every rank learns every failure.

        A file that fails is fetched again from the remote (when the step is
        there) and the step read again; else every rank raises
        :class:`CorruptCheckpointError` (the state may then hold part of the
        failed step: a fallback reads an older step over it).
        """
        for attempt in (1, 2):
            gathered = self._load_step(
                state, step, step_dir, manifest, strict=strict, trust_pickles=trust_pickles, checked=checked
            )
            errors = [message for per_rank in gathered for _name, message in per_rank]
            if not errors:
                return
            if attempt == 1 and step in survey.remote_steps:
                left = self.sources.refetch(step, step_dir, errors,
                                            [[name for name, _m in per_rank] for per_rank in gathered])
                if not left:
                    continue
                errors = left
            raise CorruptCheckpointError(
                errors[0] + (f" ({len(errors) - 1} more)" if len(errors) > 1 else "")
                + " The state passed to load() may hold part of this step: load another step into it."
            )

    def _check_frozen(
        self, state: dict[str, Any], step: int, manifest: layout.Manifest, targets: dict[str, Any]
    ) -> dict[str, dict[str, Any]]:
        """A ``trainable_only`` step: its frozen keys are absent by design; the live base must match them.

        They are taken out of what DCP loads (and returned, to be put back
        before the state dicts are applied: the live base stays as it is); the
        live frozen values are fingerprinted (collective) and compared with the
        fingerprints taken when the run first saved. A mismatch is a warning
        naming the keys.
        """
        differ: list[str] = []
        absent: list[str] = []
        kept: dict[str, dict[str, Any]] = {}
        for key, entries in sorted(manifest.frozen.items()):
            live = targets.get(key)
            if live is None or key not in state:
                continue
            present = sorted(n for n in entries if n in live)
            absent += [f"{key}.{n}" for n in sorted(entries) if n not in live]
            prints = state_mod.fingerprints(state[key], present, self._groups.ctl)
            for name in present:
                shape = list(live[name].shape)
                if shape != entries[name].get("shape") or state_mod.fingerprints_differ(
                        entries[name].get("fingerprint", [0.0, 0.0]), prints[name]):
                    differ.append(f"{key}.{name}")
                kept.setdefault(key, {})[name] = live.pop(name)
        if (differ or absent) and _dist.rank() == 0:
            log.warning(
                "shardckpt: step %d was saved with trainable_only: its frozen base was left out, and the base loaded "
                "here does not match the one it was saved with%s%s. Remedy: load the same base weights before "
                "load(), or ignore this if the change is intended.", step,
                f"; values differ: {', '.join(differ[:10])}" + (f" (+{len(differ) - 10})" if len(differ) > 10 else "")
                if differ else "",
                f"; missing here: {', '.join(absent[:10])}" if absent else "",
            )
        return kept

    def _load_step(
        self,
        state: dict[str, Any],
        step: int,
        step_dir: str,
        manifest: layout.Manifest,
        *,
        strict: bool,
        trust_pickles: bool,
        checked: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> list[list[tuple[str, str]]]:
        """Read ``step`` into ``state``; returns per rank the ``(file, problem)`` of checksum failures.

        Collective: the failures are exchanged right after the read, and only
        when there are none is the state applied to the live objects.
        """
        run_id = self.config.run_id
        if run_id is not None and manifest.run_id is not None and manifest.run_id != run_id:
            raise ForeignCheckpointError(
                f"step {step} in {step_dir} was written by run {manifest.run_id!r}, this is run {run_id!r} "
                f"(see {os.path.join(step_dir, layout.MANIFEST_NAME)}). Remedy: point local_dir/remote at this "
                f"run's checkpoints, or set run_id to {manifest.run_id!r} (or None) to continue that run."
            )
        memory = self.sources.memory.view(step) if self.sources.memory is not None else None
        metadata = memory.metadata if memory is not None else dcp_planner.read_metadata(
            step_dir, step, trust_pickles=trust_pickles,
            entry=manifest.files.get(layout.METADATA_NAME) if self.config.verify_on_load else None)
        kinds_live = state_mod.classify(state)
        # Adopted stock DCP checkpoints record no kinds: take the live ones.
        saved_kinds = {
            k: (kinds_live.get(k, state_mod.VALUE) if v == state_mod.STOCK else v) for k, v in manifest.keys.items()
        }
        if manifest.kind == "light":
            lacking = sorted(k for k, kind in kinds_live.items() if kind == state_mod.OPTIMIZER)
            kinds_live = {k: v for k, v in kinds_live.items() if k not in lacking}
            if lacking and _dist.rank() == 0:
                log.warning(
                    "shardckpt: step %d is a light step (no optimizer state): %s keep(s) the state they have; "
                    "load a full step for everything", step, ", ".join(lacking),
                )
        try:
            targets = state_mod.live_targets(state, kinds_live)
        except MetaDeviceError as exc:  # an optimizer built from meta parameters before to_empty()
            raise MetaDeviceError(f"cannot restore step {step} from {step_dir}: {exc}",
                                  unexpected=exc.unexpected) from None
        meta = targets_mod.meta_entries(state, kinds_live, targets)
        targets_mod.refuse_meta(self._groups.all_gather_ctl(meta), step, step_dir, _dist.rank())
        frozen = self._check_frozen(state, step, manifest, targets) if manifest.frozen else {}
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
            changed = self._config_changes(manifest, run_config_mod.reshaped_dims(flat_live, metadata))
            raise StateMismatchError(
                f"step {step} in {step_dir} holds tensors of other shapes than the state being loaded "
                f"(a checkpoint of another model?): {'; '.join(reshaped[:10])}"
                + (f"; ... ({len(reshaped) - 10} more)" if len(reshaped) > 10 else "")
                + (f". run_config differs from the one it was saved with: {'; '.join(changed[:10])}"
                   if changed else "")
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
            message = _mismatch_message(step, step_dir, missing, unexpected, strict=strict)
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
        left = targets_mod.unrestored(top_saved, saved_kinds, kinds_live, set(targets) | rebuild_keys,
                                      state_mod.RESERVED_KEY)
        targets_mod.refuse_unrestored(left, step, step_dir, os.path.join(step_dir, layout.MANIFEST_NAME), strict=strict)
        # Per-rank entries (generators, data loaders): each rank reads its own; a data loader's only at the
        # world size that saved it. A key holding nothing else that this rank does not read is left as it is.
        own_entries = per_rank.per_rank_entries(saved_paths)
        same_world = manifest.world_size == _dist.world_size()
        unread = {k for k, e in own_entries.items()
                  if e["only"] and (rank not in e["ranks"] or (e["whole"] and not same_world))}
        note = per_rank.per_rank_note(own_entries, manifest.world_size, _dist.world_size())
        if note and rank == 0:
            log.warning("shardckpt: step %d: %s", step, note)

        def rebuild(path: tuple) -> bool:
            own = keys_mod.path_rank(path)
            if own is not None and (own[0] != rank or (own[1] and not same_world)):
                return False
            if path[0] in rebuild_keys:
                return True
            return has_rng and self.config.capture_rng and path[:3] == (state_mod.RESERVED_KEY, state_mod.RNG, rng_key)

        # Plain values and stateful objects are read into the caller's own tensors where
        # they match (as modules are): no second allocation, no copy afterwards.
        live = state_mod.LiveTensors(state, kinds_live, rebuild_keys)
        planner = dcp_planner.RestorePlanner(rebuild, allow_partial_load=True, trust_pickles=trust_pickles,
                                             into=live.find)
        if memory is not None:  # copies in memory: read as they are (their record proved them complete)
            failures = memory.read(targets, planner, self._groups.ctl)
        else:
            failures = dcp_reader.dcp_read(
                targets, step_dir, metadata, planner, self._groups.ctl, step=step,
                entries=manifest.files if self.config.verify_on_load else None,
                copies=[list(c) for c in self.topology.copies], checked=checked,
                sparse=self.sources.sparse.get(step), source=self.sources.reader_source(step),
            )
        # Every rank learns every checksum failure here, before anything is applied to the
        # live objects (applying may be collective: all ranks must take the same path).
        gathered = self._groups.all_gather_ctl(failures)
        if any(gathered):
            return gathered
        for key, entries in frozen.items():
            targets[key].update(entries)  # the live base, as it is
        kinds_all = dict(kinds_live)
        for key in rebuild_keys - unread:
            kinds_all.setdefault(key, saved_kinds[key])
            # An empty dict (e.g. a disabled GradScaler's state) has no entries in
            # DCP's metadata: it comes back as an empty dict.
            targets.setdefault(key, {})
        state_mod.restore(state, kinds_all, {k: v for k, v in targets.items() if k in kinds_all and k not in unread},
                          strict=strict)
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
        return gathered


def _why_none(survey: Survey, start_fresh: bool) -> str:
    """Each committed step and why it is not resumed (a load that starts fresh while steps exist)."""
    reasons = []
    for s in sorted(survey.infos):
        why = survey.abandoned.get(s) or survey.conflicts.get(s) or (
            "not complete on every rank" + ("; start_fresh=True" if start_fresh else ""))
        reasons.append(f"step {s} ({why})")
    shown = "; ".join(reasons[:10])
    return shown + (f"; ... ({len(reasons) - 10} more)" if len(reasons) > 10 else "")


def _shape_mismatches(flat_live: dict[str, Any], metadata: Any) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for fqn, value in flat_live.items():
        saved = metadata.state_dict_metadata.get(fqn)
        if isinstance(value, torch.Tensor) and isinstance(saved, TensorStorageMetadata):
            if tuple(value.shape) != tuple(saved.size):
                out.append(f"{fqn} saved {tuple(saved.size)}, live {tuple(value.shape)}")
    return sorted(out)


def _mismatch_message(step: int, step_dir: str, missing: list[str], unexpected: list[str], *,
                      strict: bool = True) -> str:
    def show(items: list[str]) -> str:
        head = ", ".join(items[:20])
        return head + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")

    parts = [f"step {step} in {step_dir} does not match the state being loaded."]
    if missing:
        parts.append(f"Missing from the checkpoint ({len(missing)}): {show(missing)}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the state ({len(unexpected)}): {show(unexpected)}.")
    if strict:
        parts.append(
            "Remedy: load into the same model/optimizer structure that was saved, or pass strict=False "
            "to load the keys that match and keep the rest as initialised."
        )
    else:
        parts.append("The keys that match are loaded, the rest keep their live values; to read a step's plain "
                     "values before building the model, use peek().")
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
