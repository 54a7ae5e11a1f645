"""The restore path: survey -> fetch -> verify -> match keys -> load -> elastic plan.

``Restorer.load`` runs on the main thread of every rank, collectively over the
``ctl`` side group::

    1. survey: every rank reads the manifests of its directory; rank 0 lists
       the remote (and reads its manifests); one exchange. Every rank then
       computes alike which steps are live (``lineage.py``: steps of a branch
       abandoned by a rollback are not resumed by default) and which of them
       every rank can load: complete in its directory, committed on the
       remote, or completable from the other nodes' node-local copies
    2. fetch what a directory copy lacks: from the remote (each file checked
       against the manifest while it downloads; a copy holding nothing of the
       step becomes a sparse copy, given during the read only the chunks its
       ranks read: ``ranged.py``), else from the copies of other nodes over
       the process group (also checked); one exchange
    3. check presence and size of every file (a stat; the work split over the
       ranks of each copy); one exchange: a missing or truncated file stops
       the step before anything is read
    4. read DCP's metadata through the restricted unpickler, check run id,
       keys and shapes (strict)
    5. DCP read into the live module / optimizer state dicts and into rebuilt
       entries (plain values, stateful objects, this rank's RNG), stored
       tensors straight into the live tensors' memory, each file checksummed
       by one rank of its copy while it is read (``dcp_reader.py``); one
       exchange: a file failing it is fetched again from the remote when the
       step is there and the step read again; every rank sees every failure
       (and with ``on_corrupt="fallback"`` every rank moves on to the next step)
    6. apply to the live objects, restore RNG; one log line; the elastic plan;
       the lineage the next saves continue (agreed on rank 0)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from shardckpt import _dist
from shardckpt.format import layout, retention, step_dirs
from shardckpt.tiers import local, peer, ranged, remote, remote_commit
from shardckpt.restoring import elastic as elastic_mod
from shardckpt.restoring import run_config as run_config_mod
from shardckpt.restoring import targets as targets_mod
from shardckpt.format import lineage as lineage_mod
from shardckpt import state as state_mod
from shardckpt import _failpoints
from shardckpt._text import fmt_bytes
from shardckpt.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    RemoteError,
    StateMismatchError,
)
from shardckpt.options import CheckpointConfig, OnCorrupt
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")

PEER_CHUNK = 64 << 20
"""Bytes per message when a node-local copy receives a file from another node."""


@dataclasses.dataclass
class Survey:
    """What every rank knows after the survey exchange (identical on every rank)."""

    infos: dict[int, lineage_mod.StepInfo]
    live: list[int]
    abandoned: dict[int, str]
    candidates: list[int]
    """Steps every rank can load, newest first (or the one asked for)."""
    remote_steps: set[int]
    missing: list[dict[int, list[str]]]
    """Per rank: for each step it holds, the manifest files absent from its directory."""
    early: dict[int, list[str]]
    """Steps already verified during the survey -> the errors reported."""
    stale: list[set[int]] = dataclasses.field(default_factory=list)
    """Per rank: steps whose copy in its directory is another save than the one that counts."""
    remote_unreadable: dict[int, str] = dataclasses.field(default_factory=dict)
    """Steps committed on the remote whose manifest cannot be read (held by no rank), with the reason."""


class Restorer:
    """Loads committed steps of ``root`` (and of the remote, when set) into live state."""

    def __init__(self, config: CheckpointConfig, root: str, groups: _dist.SideGroups) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self._store: remote.Store | None = None
        self.topology = Topology.single()
        """Which ranks share this directory; set by the Checkpointer before the first load."""
        self.remote_committed: set[int] = set()
        """Steps seen committed on the remote at the last listing."""
        self.last_plan: elastic_mod.ElasticPlan | None = None
        self.next_lineage: lineage_mod.Lineage | None = None
        """The lineage the saves after the last load continue (agreed by all ranks)."""
        self.newest_created = 0.0
        """The newest manifest time seen by the last load: later saves are stamped after it."""
        self._sparse: dict[int, ranged.SparseStep] = {}
        """Steps this rank reads from a sparse copy (need-only fetch from the remote, ``ranged.py``)."""

    def steps(self) -> list[int]:
        return layout.committed_steps(self.root)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

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
        survey = self._survey(step)
        if step == "best" and survey.candidates:
            step = survey.candidates[0]
        self.newest_created = max((i.created for i in survey.infos.values()), default=0.0)
        if not survey.candidates:
            if step is not None:
                self._raise_not_found(step, survey)
            if _dist.rank() == 0:
                log.info("shardckpt: nothing to resume in %s%s; starting fresh", self.root,
                         " or the remote" if self.config.remote else "")
            self.last_plan = None
            self.next_lineage = self._agree_lineage(survey, None)
            return None
        last_error: BaseException | None = None
        for candidate in survey.candidates:
            step_dir = os.path.join(self.root, layout.step_dirname(candidate))
            try:
                manifest, checked = self._prepare(candidate, step_dir, survey)
                if candidate in self._sparse:
                    step_dir = self._sparse[candidate].dir
                self._load_checked(
                    state, candidate, step_dir, manifest, checked, survey, strict=strict, trust_pickles=trust_pickles
                )
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
            self.next_lineage = self._agree_lineage(survey, candidate)
            return candidate
        raise CorruptCheckpointError(
            f"no committed step in {self.root} passed verification; the last error was: {last_error}"
        ) from last_error

    # ------------------------------------------------------------ 1. survey

    def _survey(self, step: int | str | None) -> Survey:
        """One exchange: every rank's steps, rank 0's remote listing, early verification.

        Steps are compared by version (:func:`shardckpt.format.layout.version_of`): for
        each step number the newest save anywhere is the one that counts; a
        rank's copy of another save of that number is stale, and is treated as
        absent there (kept aside and replaced when the step is fetched).
        """
        adopted = peer.adopt_replicas(self.root)
        if adopted:
            log.info("shardckpt: using the replicas of other nodes' files held in %s: %s", peer.replicas_root(self.root),
                     ", ".join(f"step {s}: {len(n)} file(s)" for s, n in sorted(adopted.items())))
        infos, missing, unreadable = _scan(self.root)
        remote_report: tuple[dict[int, Any], dict[int, str], str | None] | None = None
        if self.config.remote is not None and _dist.rank() == 0:
            try:
                listed, bad = remote_commit.remote_infos(self._remote_store(), remote.Deadline(self.config.step_deadline_s))
                remote_report = (listed, bad, None)
            except RemoteError as exc:
                remote_report = ({}, {}, remote.redact(str(exc)))
        early = self._early_check(step, infos, missing)
        payload = {
            "infos": {s: i.to_json() for s, i in infos.items()},
            "missing": missing,
            "unreadable": sorted(unreadable),
            "remote": remote_report,
            "early": early,
            "partials": _partial_saves(self.root),
        }
        gathered = self._groups.all_gather_ctl(payload)

        merged: dict[int, lineage_mod.StepInfo] = {}

        def take(s: int, body: Any) -> None:
            info = lineage_mod.StepInfo.from_json(s, body)
            if s not in merged or info.created > merged[s].created:
                merged[s] = info

        for g in gathered:
            for s, body in g["infos"].items():
                take(s, body)
        listed, remote_bad, error = gathered[0]["remote"] or ({}, {}, None)
        for s, body in listed.items():
            take(s, body)
        # The remote can complete a step only when it holds the very save that counts.
        remote_steps = {s for s, body in listed.items()
                        if lineage_mod.StepInfo.from_json(s, body).version == merged[s].version}
        if error is not None:
            self._remote_unlisted(error, gathered)
        self.remote_committed = remote_steps
        live, abandoned = lineage_mod.classify(merged)
        stale = [
            {s for s, body in g["infos"].items() if lineage_mod.StepInfo.from_json(s, body).version != merged[s].version}
            for g in gathered
        ]
        per_rank_missing = [{s: m for s, m in g["missing"].items() if s not in st} for g, st in zip(gathered, stale)]

        def loadable(s: int) -> bool:
            # Committed remotely, or this very save committed in every rank's directory (files a
            # copy lacks come from another node's copy; fetching says which are nowhere).
            return s in remote_steps or all(s in m for m in per_rank_missing)

        unreadable_everywhere = set.intersection(*(set(g["unreadable"]) for g in gathered)) if gathered else set()
        remote_unreadable = {s: why for s, why in remote_bad.items() if s not in merged}
        if step == "best":
            step = self._best(live, merged, loadable)
        if step is not None:
            ok = step in unreadable_everywhere or step in remote_unreadable or (step in merged and loadable(step))
            candidates = [step] if ok else []
        else:
            newest_live = max((s for s in live if loadable(s)), default=-1)
            # A step whose manifest no rank (nor the remote) can read is listed when it is newer than
            # every live step (most likely the last save): verification then reports it.
            broken = {s for s in unreadable_everywhere | set(remote_unreadable) if s > newest_live}
            pool = {s for s in live if loadable(s)} | broken
            unassembled = [s for s in live if s > newest_live and not loadable(s)]
            if unassembled and not self._unassembled(max(unassembled), gathered, stale, newest_live):
                pool = set()  # start_fresh: a new history
            # Full steps first (newest first), light ones only when no full step loads.
            candidates = sorted(pool, key=lambda s: (merged[s].kind == "full" if s in merged else True, s), reverse=True)
        verified: dict[int, list[str]] = {}
        reports = [g["early"] for g in gathered]
        if candidates and all(r is not None and r[0] == candidates[0] for r in reports):
            verified[candidates[0]] = [r[1] for r in reports if r[1]]
        return Survey(merged, live, abandoned, candidates, remote_steps, per_rank_missing, verified, stale,
                      remote_unreadable)

    def _unassembled(self, step: int, gathered: list[dict[str, Any]], stale: list[set[int]], older: int) -> bool:
        """The newest live step cannot be assembled from what this job has: raise on every rank.

        (Starting fresh, or from an older step, would silently train over it.)
        ``start_fresh=True`` starts a new history instead (returns False: nothing
        is resumed); ``on_corrupt="fallback"`` goes on to the older steps that
        load (returns True), with a warning. Every rank computes the same from the survey.
        """
        holders = [r for r, g in enumerate(gathered) if step in g["infos"] and step not in stale[r]]
        lacking = [r for r in range(len(gathered)) if r not in holders]
        version = lineage_mod.StepInfo.from_json(step, gathered[holders[0]]["infos"][step]).version if holders else ""
        if holders and all(version in gathered[r]["partials"].get(step, []) for r in lacking):
            # The job died between the copies' commits: every lacking copy holds that save's
            # partial directory. The step never committed everywhere: the older step it replaced
            # is the one to resume.
            if _dist.rank() == 0:
                log.warning(
                    "shardckpt: step %d was committed on some nodes only (the job stopped between the copies' "
                    "commits: rank(s) %s hold only its partial directory); resuming the step before it",
                    step, _ranks(lacking),
                )
            return True
        absent = sorted(set.intersection(*(set(gathered[r]["missing"].get(step, [])) for r in holders))) if holders else []
        stale_ranks = [r for r in lacking if step in stale[r]]
        where = (
            f"rank(s) {_ranks(lacking)} hold no copy of it in their local_dir"
            + (f" (rank(s) {_ranks(stale_ranks)} hold another save of that number)" if stale_ranks else "")
            + f"; it was saved with {self.topology.describe() if self.topology.world_size > 1 else 'this layout'}"
        )
        files = (f" Missing files: {', '.join(absent[:8])}" + (f" (+{len(absent) - 8} more)" if len(absent) > 8 else "")
                 + "." if absent else "")
        if self.config.start_fresh:
            if _dist.rank() == 0:
                log.warning(
                    "shardckpt: step %d cannot be assembled (%s); start_fresh=True: starting a new history, the "
                    "existing steps are kept (abandoned; `shardckpt gc` removes them)", step, where,
                )
            return False
        if older >= 0 and self.config.on_corrupt == OnCorrupt.FALLBACK:
            if _dist.rank() == 0:
                log.warning(
                    "shardckpt: step %d cannot be assembled (%s);%s on_corrupt='fallback': loading step %d instead, "
                    "and the work after it is lost", step, where, files, older,
                )
            return True
        older_note = f" (step {older} can be loaded)" if older >= 0 else ""
        raise CheckpointNotFoundError(
            f"step {step}, the newest step of this run in {self.root}"
            f"{' or the remote' if self.config.remote else ''}, cannot be assembled: {where}.{files} Nothing was "
            f"loaded (starting fresh would train over it). Remedy: bring back that node's local_dir (its disk), or "
            f"configure remote= where its files were uploaded; or load an older step explicitly with "
            f"load(state, step=N){older_note}; or start a new run deliberately with start_fresh=True "
            f"(SHARDCKPT_START_FRESH=1): local steps are then kept aside, never deleted (a remote step of the "
            f"same number as a new save is replaced by it)."
        )

    def _best(self, live: list[int], infos: dict[int, lineage_mod.StepInfo], loadable: Any) -> int:
        metric, mode = self.config.best_metric, self.config.best_mode
        if not metric:
            raise ConfigError("load(step='best') needs best_metric (and best_mode) in the configuration")
        ranked = retention.ranked([s for s in live if loadable(s)], infos, metric, mode)
        if not ranked:
            raise CheckpointNotFoundError(
                f"no live step in {self.root}{' or the remote' if self.config.remote else ''} recorded the metric "
                f"{metric!r}. Remedy: pass it with save(state, step, metrics={{{metric!r}: value}})."
            )
        if _dist.rank() == 0:
            log.info("shardckpt: the best step by %s (%s) is %d: %s", metric, mode, ranked[0], infos[ranked[0]].metrics[metric])
        return ranked[0]

    def _early_check(
        self, step: int | str | None, infos: dict[int, lineage_mod.StepInfo], missing: dict[int, list[str]]
    ) -> tuple[int, str | None] | None:
        """Without a remote, check this rank's share of the step it expects before the exchange.

        When every rank checked the step that turns out to be the first
        candidate, verifying it needs no exchange of its own.
        """
        if self.config.remote is not None:
            return None
        if step == "best":
            return None
        live, _abandoned = lineage_mod.classify(infos)
        fulls = [s for s in live if not missing.get(s) and infos[s].kind == "full"]
        guess = step if step is not None else max(fulls or [s for s in live if not missing.get(s)], default=None)
        if guess is None or missing.get(guess) != []:
            return None
        step_dir = os.path.join(self.root, layout.step_dirname(guess))
        try:
            manifest = layout.read_manifest(step_dir)
        except CorruptCheckpointError as exc:
            return (guess, str(exc))
        if manifest is None:
            return None
        error, _names = self._check_share(step_dir, manifest, set())
        return (guess, error)

    def _remote_unlisted(self, error: str, gathered: list[dict[str, Any]]) -> None:
        """The remote could not be listed: go on with local steps only if every rank has one.

        Without any local step, "nothing to resume" would silently restart
        training from scratch: every rank raises instead.
        """
        have_local = [any(not m for m in g["missing"].values()) for g in gathered]
        if not all(have_local):
            mine = have_local[_dist.rank()]
            where = self.root if not mine else f"the local_dir of {have_local.count(False)} rank(s)"
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
        from shardckpt.checkpointer import run_config_of

        return run_config_mod.differences((manifest.run or {}).get("config"), run_config_of(self.config.run_config),
                                          self.config.run_config_ignore, saved_dims=dims[0] if dims else (),
                                          live_dims=dims[1] if dims else ())

    def _agree_lineage(self, survey: Survey, step: int | None) -> lineage_mod.Lineage:
        """The lineage of the next saves, decided on rank 0 (a new branch gets one id everywhere)."""
        mine = lineage_mod.continue_from(survey.infos, step) if _dist.rank() == 0 else None
        agreed = self._groups.broadcast_ctl(mine)
        if step is not None and agreed.forks and agreed.forks[-1][1] == agreed.branch and agreed != survey.infos[step].lineage:
            if _dist.rank() == 0:
                newer = sorted(s for s in survey.infos if s > step)
                log.warning(
                    "shardckpt: rolled back to step %d: the next save starts a new branch; steps %s are kept "
                    "but no longer resumed by default, nor counted by retention (`shardckpt gc` removes them)",
                    step, newer,
                )
        return agreed

    def _raise_not_found(self, step: int, survey: Survey) -> None:
        step_dir = os.path.join(self.root, layout.step_dirname(step))
        if os.path.isdir(step_dir) and not os.path.exists(os.path.join(step_dir, layout.MANIFEST_NAME)):
            hint = (
                " It has no shardckpt manifest: either a save was interrupted before its commit, or it "
                "was written by plain torch.distributed.checkpoint.save. Remedy: load an earlier step; "
                "to use a stock DCP checkpoint, commit a copy of it with `shardckpt adopt DIR --into "
                "LOCAL_DIR --step N`, or read it with torch.distributed.checkpoint.load directly."
            )
        elif step in survey.infos and self.config.remote is None and not self.topology.shared:
            hint = (
                f" Its files are spread over node-local directories and some nodes' files are not on any "
                f"node of this job ({self.topology.describe()}). Remedy: run on the nodes that saved it, "
                f"copy their local_dir into one shared directory, or configure remote= so that every "
                f"node's files are uploaded."
            )
        else:
            hint = f" Committed steps here: {self.steps() or 'none'}."
        raise CheckpointNotFoundError(f"step {step} is not committed in {self.root} on every rank.{hint}")

    # ------------------------------------------------------------ 2-3. fetch, verify

    def _prepare(self, step: int, step_dir: str, survey: Survey) -> tuple[layout.Manifest, set[str]]:
        """Complete this copy of ``step`` and check its files' presence and sizes (collective).

        Returns its manifest and the files this rank already checked (downloaded
        and checked on the way); the checksums of the others are checked while
        they are read (:meth:`_load_checked`).
        """
        received: set[str] = set()
        self._sparse.pop(step, None)
        if step in survey.remote_unreadable:
            raise CorruptCheckpointError(
                f"step {step} is committed on the remote {remote.safe_url(self.config.remote)}, but it cannot be "
                f"used: {survey.remote_unreadable[step]}"
            )
        if step in survey.early:
            errors = survey.early[step]
            manifest = layout.read_manifest(step_dir)
        else:
            lacking = any(step in m and m[step] for m in survey.missing) or any(step not in m for m in survey.missing)
            if lacking and step in survey.remote_steps:
                if self._open_need_only(step, survey):
                    received = self._fetch_missing(step, step_dir, stale=step in survey.stale[_dist.rank()])
            elif lacking:
                received = self._exchange_with_peers(step, step_dir, survey)
            sparse = self._sparse.get(step)
            if sparse is not None:
                step_dir, received = sparse.dir, set(sparse.manifest.files)
            manifest = sparse.manifest if sparse is not None else layout.read_manifest(step_dir)
            if manifest is None:
                self._raise_not_found(step, survey)
            error, failed = self._check_share(step_dir, manifest, received)
            gathered = self._groups.all_gather_ctl((error, failed))
            errors = [e for e, _f in gathered if e]
            if errors and step in survey.remote_steps:
                errors = self._refetch(step, step_dir, errors, [f for _e, f in gathered])
        if errors:
            raise CorruptCheckpointError(errors[0] + (f" ({len(errors) - 1} more)" if len(errors) > 1 else ""))
        if manifest is None:
            self._raise_not_found(step, survey)
        return manifest, received

    def _check_share(self, step_dir: str, manifest: layout.Manifest, skip: set[str]) -> tuple[str | None, list[str]]:
        """This rank's share of the size check of its copy (a stat each): (first error, failing files).

        A missing or truncated file is found here, before anything is read
        into the live state; checksums are compared while reading.
        """
        if not self.config.verify_on_load:
            return None, []
        names = sorted(n for n in manifest.files if n not in skip)
        error: str | None = None
        failed: list[str] = []
        for name in self.topology.share_of(names):
            try:
                layout.verify_files(step_dir, manifest, [name], hash=False)
            except CorruptCheckpointError as exc:
                error = error or str(exc)
                failed.append(name)
        return error, failed

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
                left = self._refetch(step, step_dir, errors, [[name for name, _m in per_rank] for per_rank in gathered])
                if not left:
                    continue
                errors = left
            raise CorruptCheckpointError(
                errors[0] + (f" ({len(errors) - 1} more)" if len(errors) > 1 else "")
                + " The state passed to load() may hold part of this step: load another step into it."
            )

    def _refetch(self, step: int, step_dir: str, errors: list[str], failed: list[list[str]]) -> list[str]:
        """Replace files that failed verification with the remote's copy (checked while downloading).

        Returns the errors left: none when every bad file was replaced by a good one.
        """
        group = self.topology.copy
        names = sorted({n for r in group for n in failed[r]})
        error = None
        if self.topology.committer and names:
            try:
                remote_commit.fetch_step(self._remote_store(), self.root, step, names=names)
                log.warning(
                    "shardckpt: step %d: replaced %d file(s) of %s that failed verification with the remote's "
                    "copy (%s)", step, len(names), step_dir, ", ".join(names[:5]),
                )
            except (CorruptCheckpointError, RemoteError, OSError) as exc:
                error = f"{errors[0]} The remote copy could not replace it: {remote.redact(str(exc))}"
        left = [e for e in self._groups.all_gather_ctl(error) if e]
        return left

    def store(self) -> remote.Store:
        """The remote store (opened on first use, closed by :meth:`close`)."""
        return self._remote_store()

    def _remote_store(self) -> remote.Store:
        if self._store is None:
            self._store = remote.open_store(self.config.remote, self.config.transfer_options())
        return self._store

    def _fetch_missing(self, step: int, step_dir: str, stale: bool = False) -> set[str]:
        """Each copy's committer brings missing files of ``step`` from the remote; all ranks agree.

        ``stale``: this directory holds another save of the step number than
        the one that counts; it is kept aside (never read as the step) and
        the step is fetched whole. Returns the names this copy fetched
        (already verified against the manifest while downloading). Collective
        over the ``ctl`` group.
        """
        error: tuple[str, str] | None = None
        fetched: list[str] = []
        if self.topology.committer and step not in self._sparse:
            try:
                if stale:
                    kept = step_dirs.keep_aside(self.root, step)
                    log.warning(
                        "shardckpt: step %d in %s is another save than the one committed on %s (a stale copy, e.g. "
                        "from before a rollback elsewhere): kept aside as %s; fetching the live one",
                        step, step_dir, remote.safe_url(self.config.remote), kept,
                    )
                fetched = sorted(remote_commit.fetch_step(self._remote_store(), self.root, step))
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
        return set(gathered[self.topology.copy[0]][1])

    def _open_need_only(self, step: int, survey: Survey) -> bool:
        """Copies holding nothing of ``step`` become sparse copies, filled while the step is read
        with only the ranges their ranks read (``ranged.py``). Collective over ``ctl``.

        Returns whether some copy still needs the whole-file fetch (:meth:`_fetch_missing`):
        a copy holding part of the step or another save of it, or a step without chunk checksums.
        """
        topo = self.topology
        empty = all(step not in survey.missing[r] and step not in survey.stale[r] for r in topo.copy)
        result: tuple[str | None, tuple[str, str] | None, bool] = (None, None, False)
        sparse = None
        if empty and topo.committer:
            try:
                store = self._remote_store()
                source = ranged.RemoteSource(store, step)
                sparse = ranged.SparseStep.open(
                    self.root, survey.infos[step].version,
                    lambda: remote_commit.remote_manifest(store, step, source.deadline), source, metadata=False,
                )
                result = (None if sparse is None else sparse.dir, None, sparse is not None and sparse.has_metadata())
            except CorruptCheckpointError as exc:
                result = (None, ("corrupt", str(exc)), False)
            except (RemoteError, OSError) as exc:
                result = (None, ("remote", remote.redact(str(exc))), False)
        gathered = self._groups.all_gather_ctl(result)
        errors = [e for _d, e, _m in gathered if e is not None]
        if errors:
            kind, message = next((e for e in errors if e[0] == "corrupt"), errors[0])
            raise (CorruptCheckpointError if kind == "corrupt" else RemoteError)(message)
        self._share_metadata(step, sparse, [(r, g[2]) for r, g in enumerate(gathered)
                                            if g[0] is not None and topo.copy_of(r)[0] == r])
        mine = gathered[topo.copy[0]][0]
        if mine is not None:
            self._sparse[step] = sparse if sparse is not None else ranged.SparseStep.attach(mine)
        whole = [r for r, m in enumerate(survey.missing) if step not in m or m[step]]
        return any(gathered[topo.copy_of(r)[0]][0] is None for r in whole)

    def _share_metadata(self, step: int, sparse: "ranged.SparseStep | None", copies: list[tuple[int, bool]]) -> None:
        """The step's ``.metadata`` into every new sparse copy, read from the remote once per job.

        ``copies``: the committing rank of each sparse copy and whether it holds it already.
        One copy fetches it when none does; then each holder passes it on, doubling the holders
        each round (log2 of the copies rounds), point to point over ``ctl``. A received file
        is checked against the manifest; one that fails is fetched from the remote instead.
        """
        holders = [r for r, ok in copies if ok]
        order = holders + [r for r, ok in copies if not ok]
        if len(order) == len(holders):
            return  # every copy holds it (every rank computes the same)
        me = _dist.rank()
        error: tuple[str, str] | None = None
        if me in order:
            assert sparse is not None
            path = os.path.join(sparse.dir, layout.METADATA_NAME)
            size = sparse.manifest.files[layout.METADATA_NAME].size
            source = ranged.RemoteSource(self._remote_store(), step)

            def fetch() -> tuple[str, str] | None:
                try:
                    sparse._ensure_metadata(source)
                    return None
                except CorruptCheckpointError as exc:
                    return ("corrupt", str(exc))
                except (RemoteError, OSError) as exc:
                    return ("remote", remote.redact(str(exc)))

            if not holders and me == order[0]:
                error = fetch()  # on failure it sends what it has: the receivers' check refuses it
            have = max(1, len(holders))
            while have < len(order):
                for j in range(have, min(2 * have, len(order))):
                    src, dst = order[j - have], order[j]
                    if me == src:
                        _send_file(path, size, dst, self._groups.ctl)
                    elif me == dst:
                        try:
                            _receive_file(path, sparse.manifest.files[layout.METADATA_NAME], src, self._groups.ctl,
                                          step)
                        except CorruptCheckpointError as exc:
                            log.warning("shardckpt: step %d: %s; fetching it from the remote instead", step, exc)
                            error = fetch()
                have *= 2
        errors = [e for e in self._groups.all_gather_ctl(error) if e is not None]
        if errors:
            kind, message = next((e for e in errors if e[0] == "corrupt"), errors[0])
            raise (CorruptCheckpointError if kind == "corrupt" else RemoteError)(message)

    def _exchange_with_peers(self, step: int, step_dir: str, survey: Survey) -> set[str]:
        """Node-local copies without a remote: each copy receives the files it lacks from another node.

        Every rank computes the same plan from the survey; only the committer
        of the copy that has a file and the committer of the copy that lacks
        it take part in its transfer (point-to-point over the ``ctl`` group),
        in the plan's order. Each received file is checked against the
        manifest before it is renamed into place. Returns the names this
        copy received.
        """
        topo = self.topology
        plan: list[tuple[str, int, int]] = []
        for dst in topo.committers:
            for name in sorted(survey.missing[dst].get(step, [])):
                src = next((c for c in topo.committers if c != dst and step in survey.missing[c]
                            and name not in survey.missing[c][step]), None)
                if src is None:
                    elsewhere = "" if topo.shared else f", and no other node's directory of this job has it ({topo.describe()})"
                    raise CorruptCheckpointError(
                        f"step {step}: file {os.path.join(step_dir, name)} named in the manifest is missing{elsewhere}. "
                        f"Remedy: load an earlier step (load(step=...) or on_corrupt='fallback'), run on the nodes "
                        f"that saved it, or configure remote= so that every node's files are uploaded."
                    )
                plan.append((name, src, dst))
        rank = _dist.rank()
        manifest = layout.read_manifest(step_dir) if any(rank in (s, d) for _n, s, d in plan) else None
        error: str | None = None
        received: list[str] = []
        total = 0
        t0 = time.monotonic()
        for name, src, dst in plan:
            if rank == src:
                _send_file(os.path.join(step_dir, name), manifest.files[name].size, dst, self._groups.ctl)
            elif rank == dst:
                try:
                    _receive_file(os.path.join(step_dir, name), manifest.files[name], src, self._groups.ctl, step)
                    received.append(name)
                    total += manifest.files[name].size
                except (CorruptCheckpointError, OSError) as exc:
                    error = error or str(exc)
        errors = [e for e in self._groups.all_gather_ctl(error) if e]
        if errors:
            raise CorruptCheckpointError(errors[0])
        if received:
            log.info(
                "shardckpt: step %d: received %d file(s), %s, from other nodes' copies into %s in %.2f s",
                step, len(received), fmt_bytes(total), step_dir, time.monotonic() - t0,
            )
        return set(received)

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
                if shape != entries[name].get("shape") or state_mod.fingerprints_differ(entries[name].get("fingerprint", [0.0, 0.0]), prints[name]):
                    differ.append(f"{key}.{name}")
                kept.setdefault(key, {})[name] = live.pop(name)
        if (differ or absent) and _dist.rank() == 0:
            log.warning(
                "shardckpt: step %d was saved with trainable_only: its frozen base was left out, and the base loaded "
                "here does not match the one it was saved with%s%s. Remedy: load the same base weights before "
                "load(), or ignore this if the change is intended.", step,
                f"; values differ: {', '.join(differ[:10])}" + (f" (+{len(differ) - 10})" if len(differ) > 10 else "") if differ else "",
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
        metadata = local.read_metadata(step_dir, step, trust_pickles=trust_pickles,
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
        targets = state_mod.live_targets(state, kinds_live)
        meta = targets_mod.meta_entries(state, kinds_live, targets)
        targets_mod.refuse_meta(self._groups.all_gather_ctl(meta), step, step_dir)
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
        left = targets_mod.unrestored(top_saved, saved_kinds, kinds_live, set(targets) | rebuild_keys, state_mod.RESERVED_KEY)
        targets_mod.refuse_unrestored(left, step, step_dir, os.path.join(step_dir, layout.MANIFEST_NAME), strict=strict)

        def rebuild(path: tuple) -> bool:
            if path[0] in rebuild_keys:
                return True
            return has_rng and self.config.capture_rng and path[:3] == (state_mod.RESERVED_KEY, state_mod.RNG, rng_key)

        # Plain values and stateful objects are read into the caller's own tensors where
        # they match (as modules are): no second allocation, no copy afterwards.
        live = state_mod.LiveTensors(state, kinds_live, rebuild_keys)
        planner = local.RestorePlanner(rebuild, allow_partial_load=True, trust_pickles=trust_pickles, into=live.find)
        sparse = self._sparse.get(step)
        failures = local.dcp_read(
            targets, step_dir, metadata, planner, self._groups.ctl, step=step,
            entries=manifest.files if self.config.verify_on_load else None,
            copies=[list(c) for c in self.topology.copies], checked=checked,
            sparse=sparse, source=ranged.RemoteSource(self._remote_store(), step) if sparse is not None else None,
        )
        # Every rank learns every checksum failure here, before anything is applied to the
        # live objects (applying may be collective: all ranks must take the same path).
        gathered = self._groups.all_gather_ctl(failures)
        if any(gathered):
            return gathered
        for key, entries in frozen.items():
            targets[key].update(entries)  # the live base, as it is
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
        return gathered


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


def _shape_mismatches(flat_live: dict[str, Any], metadata: Any) -> list[str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for fqn, value in flat_live.items():
        saved = metadata.state_dict_metadata.get(fqn)
        if isinstance(value, torch.Tensor) and isinstance(saved, TensorStorageMetadata):
            if tuple(value.shape) != tuple(saved.size):
                out.append(f"{fqn} saved {tuple(saved.size)}, live {tuple(value.shape)}")
    return sorted(out)


def _mismatch_message(step: int, step_dir: str, missing: list[str], unexpected: list[str], *, strict: bool = True) -> str:
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


def _scan(root: str) -> tuple[dict[int, lineage_mod.StepInfo], dict[int, list[str]], set[int]]:
    """This directory's committed steps: their lineage, the files each lacks, unreadable manifests."""
    infos: dict[int, lineage_mod.StepInfo] = {}
    missing: dict[int, list[str]] = {}
    unreadable: set[int] = set()
    for step in layout.committed_steps(root):
        step_dir = os.path.join(root, layout.step_dirname(step))
        try:
            manifest = layout.read_manifest(step_dir)
        except CorruptCheckpointError:
            unreadable.add(step)
            continue
        if manifest is None:
            continue
        infos[step] = lineage_mod.info_of(manifest)
        # Absent, not merely damaged: a file of the wrong size is verification's to report.
        missing[step] = layout.absent_files(step_dir, manifest)
    return infos, missing, unreadable


def _partial_saves(root: str) -> dict[int, list[str]]:
    """The saves whose commit never finished here: ``{step: [version, ...]}`` of this directory's
    partial step directories (``.partial-step_<N>-<count>-<nonce>`` holds save ``<nonce>-<count>``)."""
    out: dict[int, list[str]] = {}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        parsed = layout.parse_partial_save(name)
        if parsed is not None:
            out.setdefault(parsed[0], []).append(f"id:{parsed[1]}")
    return out


def _send_file(path: str, size: int, dst: int, group: Any) -> None:
    """Send ``size`` bytes of ``path`` to ``dst`` in chunks; never stops early (the receiver counts on them).

    A file that cannot be read is sent as zeros: the receiver's checksum refuses it.
    """
    try:
        f = open(path, "rb", buffering=0)
    except OSError:
        f = None
    try:
        sent = 0
        while sent < size:
            n = min(PEER_CHUNK, size - sent)
            buf = torch.zeros(n, dtype=torch.uint8)
            if f is not None:
                try:
                    f.readinto(memoryview(buf.numpy()))
                except OSError:
                    f.close()
                    f = None
            _failpoints.hit("peer.chunk_read", memoryview(buf.numpy()))
            dist.send(buf, dst=dst, group=group)
            sent += n
    finally:
        if f is not None:
            f.close()


def _receive_file(path: str, entry: layout.FileEntry, src: int, group: Any, step: int) -> None:
    """Receive one file from ``src``, check it against the manifest, rename it into place.

    Every chunk is received even when writing fails (the sender goes on
    sending); the failure is raised afterwards.
    """
    tmp = f"{path}.peer-{uuid.uuid4().hex[:8]}"
    checksum = layout.Checksum.like(entry.checksum)
    write_error: OSError | None = None
    f = None
    try:
        try:
            f = open(tmp, "wb")
        except OSError as exc:
            write_error = exc
        received = 0
        while received < entry.size:
            n = min(PEER_CHUNK, entry.size - received)
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, src=src, group=group)
            view = memoryview(buf.numpy())
            checksum.update(view)
            if f is not None and write_error is None:
                try:
                    f.write(view)
                except OSError as exc:
                    write_error = exc
            received += n
        if f is not None and write_error is None:
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as exc:
                write_error = exc
        if write_error is not None:
            raise CorruptCheckpointError(
                f"step {step}: could not write {path} received from rank {src} ({write_error}). Remedy: free "
                f"disk space under {os.path.dirname(os.path.dirname(path))}, then load again."
            ) from write_error
        if checksum.value() != entry.checksum:
            raise CorruptCheckpointError(
                f"step {step}: {os.path.basename(path)} from rank {src}'s copy fails its checksum; it was not "
                f"used. Remedy: run `shardckpt verify` on that node's local_dir, or load an earlier step."
            )
        f.close()
        f = None
        os.replace(tmp, path)
    finally:
        if f is not None:
            f.close()
        if os.path.exists(tmp):
            os.unlink(tmp)

