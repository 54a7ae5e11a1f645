"""1. The survey: which committed steps exist where, which are live, which every rank can load.

One exchange over the ``ctl`` side group: every rank reads the manifests of
its directory, each copy's committer lists what its step views hold on this
node (the replicas held here: :meth:`Sources.offers`), rank 0 lists the
remote (the index, ``remote/index.py``); every rank then computes alike
which steps are live (``lineage.py``: steps of a branch abandoned by a
rollback are not resumed by default) and which of them every rank can load:
held complete in the shared memory of the ranks' machines
(``restoring/memory.py``), complete in its directory, committed on the remote, or
one save whose every file some copy, view (a replica here, a peer's daemon,
which serves what its node reported) or node holds. Steps are compared by
version (:func:`shardckpt.format.layout.version_of`), never by number alone.
Where the bytes then come from is :mod:`shardckpt.restoring.sources`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Protocol

from shardckpt import _dist, stores
from shardckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, RemoteError
from shardckpt.format import layout, retention
from shardckpt.format import lineage as lineage_mod
from shardckpt.options import CheckpointConfig, OnCorrupt
from shardckpt.remote import listing as remote_listing
from shardckpt.restoring import memory as memory_mod
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")


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
    conflicts: dict[int, str] = dataclasses.field(default_factory=dict)
    """Steps whose lineage contradicts the run's other steps (``lineage.conflicts``), with the reason:
    never resumed; loading one raises :class:`CorruptCheckpointError`."""
    memory: dict[int, Any] = dataclasses.field(default_factory=dict)
    """Steps every rank can restore from the copies in its machine's shared memory (``restoring/memory.py``)."""
    elsewhere: set[int] = dataclasses.field(default_factory=set)
    """Candidates every rank can load without the memory copies (from disk, the other nodes, the remote)."""
    remote_manifests: dict[int, layout.Manifest] = dataclasses.field(default_factory=dict)
    """Remote manifests read by this rank's listing (rank 0's only): the chosen step's is not read again."""


class SurveySources(Protocol):
    """What the survey asks of the restore's sources (:class:`~shardckpt.restoring.sources.Sources`):
    it reads them and never writes into them."""

    @property
    def topology(self) -> Topology: ...

    def store(self) -> stores.Store: ...

    def offers(self) -> dict[int, dict[str, list[str]]]: ...

    def peers_on(self) -> bool: ...

    def memory_report(self) -> Any: ...

    def check_share(self, step_dir: str, manifest: layout.Manifest, skip: set[str]) -> tuple[str | None, list[str]]:
        ...


class Surveyor:
    """Runs the survey for a :class:`~shardckpt.restoring.restorer.Restorer` (collective over ``ctl``)."""

    def __init__(self, config: CheckpointConfig, root: str, groups: _dist.SideGroups, sources: SurveySources) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self.sources = sources
        """The restore's :class:`~shardckpt.restoring.sources.Sources` (its remote store, its size check)."""
        self.remote_committed: set[int] = set()
        """Steps seen committed on the remote at the last listing."""

    @property
    def topology(self) -> Topology:
        return self.sources.topology

    def raise_not_found(self, step: int, survey: Survey) -> None:
        raise_not_found(self.config, self.root, self.topology, step, survey)

    def run(self, step: int | str | None) -> Survey:
        """One exchange: every rank's steps, rank 0's remote listing, early verification.

        Steps are compared by version (:func:`shardckpt.format.layout.version_of`): for
        each step number the newest save anywhere is the one that counts; a
        rank's copy of another save of that number is stale, and is treated as
        absent there (kept aside and replaced when the step is fetched).
        """
        infos, missing, present, unreadable = _scan(self.root)
        read: dict[int, layout.Manifest] = {}
        remote_report: tuple[dict[int, Any], dict[int, str], str | None] | None = None
        if self.config.remote is not None and _dist.rank() == 0:
            try:
                listed, bad = remote_listing.remote_infos(
                    self.sources.store(), stores.Deadline(self.config.step_deadline_s), read=read)
                remote_report = (listed, bad, None)
            except RemoteError as exc:
                remote_report = ({}, {}, stores.redact(str(exc)))
        early = self._early_check(step, infos, missing)
        payload = {
            "infos": {s: i.to_json() for s, i in infos.items()},
            "missing": missing,
            "present": present,
            "offers": self.sources.offers(),
            "unreadable": sorted(unreadable),
            "remote": remote_report,
            "early": early,
            "partials": _partial_saves(self.root),
            "memory": self.sources.memory_report(),
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
        memory = memory_mod.usable([g["memory"] for g in gathered], _dist.world_size())
        for s, choice in memory.items():
            take(s, choice.info)
        listed, remote_bad, error = gathered[0]["remote"] or ({}, {}, None)
        for s, body in listed.items():
            take(s, body)
        # The remote can complete a step only when it holds the very save that counts.
        remote_steps = {s for s, body in listed.items()
                        if lineage_mod.StepInfo.from_json(s, body).version == merged[s].version}
        if error is not None:
            self._remote_unlisted(error, gathered)
        self.remote_committed = remote_steps
        conflicts = lineage_mod.conflicts(merged)  # never the head, never live: a load of one raises (restorer.py)
        live, abandoned = lineage_mod.classify(merged)
        stale = [
            {s for s, body in g["infos"].items()
             if lineage_mod.StepInfo.from_json(s, body).version != merged[s].version}
            for g in gathered
        ]
        per_rank_missing = [{s: m for s, m in g["missing"].items() if s not in st} for g, st in zip(gathered, stale)]

        peers_on = self.sources.peers_on()

        def covered(s: int) -> bool:
            # Every file of this save held somewhere in the job (a copy, a replica here: what each node's
            # daemon serves its peers too), and every copy lacking the save can read its manifest from a view.
            version = merged[s].version
            holders = [r for r, g in enumerate(gathered) if s in g["infos"] and s not in stale[r]]
            if not holders:
                return False
            needed = set(gathered[holders[0]]["present"][s]) | set(gathered[holders[0]]["missing"][s])
            held: set[str] = set()
            for r in holders:
                held.update(gathered[r]["present"][s])
            for g in gathered:
                held.update(g["offers"].get(s, {}).get(version, []))
            lacking = [c for c in self.topology.committers if c not in holders]
            return needed <= held and all(peers_on or version in gathered[c]["offers"].get(s, {}) for c in lacking)

        memory = {s: c for s, c in memory.items() if c.version == merged[s].version}

        def elsewhere(s: int) -> bool:
            # Committed remotely, or this very save committed in every rank's directory (files a copy lacks
            # come from the views or another node's copy; completing says which are nowhere), or every file
            # of it held somewhere in the job.
            return s in remote_steps or all(s in m for m in per_rank_missing) or covered(s)

        def loadable(s: int) -> bool:
            return s in memory or elsewhere(s)

        unreadable_everywhere = set.intersection(*(set(g["unreadable"]) for g in gathered)) if gathered else set()
        remote_unreadable = {s: why for s, why in remote_bad.items() if s not in merged}
        if step == "best":
            step = self._best(live, merged, loadable)
        if step is not None:
            ok = (step in unreadable_everywhere or step in remote_unreadable or step in conflicts
                  or (step in merged and loadable(step)))
            candidates = [step] if ok else []
        else:
            newest_live = max((s for s in live if loadable(s)), default=-1)
            # A step whose manifest no rank (nor the remote) can read is listed when it is newer than
            # every live step (most likely the last save): verification then reports it.
            broken = {s for s in unreadable_everywhere | set(remote_unreadable) | set(conflicts) if s > newest_live}
            pool = {s for s in live if loadable(s)} | broken
            unassembled = [s for s in live if s > newest_live and not loadable(s)]
            if unassembled and not self._unassembled(max(unassembled), gathered, stale, newest_live):
                pool = set()  # start_fresh: a new history
            # Full steps first (newest first), light ones only when no full step loads.
            candidates = sorted(pool, key=lambda s: (merged[s].kind == "full" if s in merged else True, s),
                                reverse=True)
        verified: dict[int, list[str]] = {}
        reports = [g["early"] for g in gathered]
        if candidates and all(r is not None and r[0] == candidates[0] for r in reports):
            verified[candidates[0]] = [r[1] for r in reports if r[1]]
        return Survey(merged, live, abandoned, candidates, remote_steps, per_rank_missing, verified, stale,
                      remote_unreadable, conflicts, memory, {s for s in candidates if s in merged and elsewhere(s)},
                      read)

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
        absent = (sorted(set.intersection(*(set(gathered[r]["missing"].get(step, [])) for r in holders)))
                  if holders else [])
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
            log.info("shardckpt: the best step by %s (%s) is %d: %s", metric, mode, ranked[0],
                     infos[ranked[0]].metrics[metric])
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
        error, _names = self.sources.check_share(step_dir, manifest, set())
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
                f"cannot list the remote {stores.safe_url(self.config.remote)} and {where} holds no "
                f"committed step, so nothing was loaded (starting fresh could discard a run that exists "
                f"remotely). Cause: {error}"
            )
        if _dist.rank() == 0:
            log.warning(
                "shardckpt: cannot list the remote %s; using local steps only (a newer step committed "
                "remotely would be missed): %s",
                stores.safe_url(self.config.remote), error,
            )


def raise_not_found(config: CheckpointConfig, root: str, topology: Topology, step: int, survey: Survey) -> None:
    """Raise :class:`CheckpointNotFoundError` for ``step``, with the likely cause and the remedy."""
    step_dir = os.path.join(root, layout.step_dirname(step))
    if os.path.isdir(step_dir) and not os.path.exists(os.path.join(step_dir, layout.MANIFEST_NAME)):
        hint = (
            " It has no shardckpt manifest: either a save was interrupted before its commit, or it "
            "was written by plain torch.distributed.checkpoint.save. Remedy: load an earlier step; "
            "to use a stock DCP checkpoint, commit a copy of it with `shardckpt adopt DIR --into "
            "LOCAL_DIR --step N`, or read it with torch.distributed.checkpoint.load directly."
        )
    elif step in survey.infos and config.remote is None and not topology.shared:
        hint = (
            f" Its files are spread over node-local directories and some nodes' files are not on any "
            f"node of this job ({topology.describe()}). Remedy: run on the nodes that saved it, "
            f"copy their local_dir into one shared directory, or configure remote= so that every "
            f"node's files are uploaded."
        )
    else:
        hint = f" Committed steps here: {layout.committed_steps(root) or 'none'}."
    raise CheckpointNotFoundError(f"step {step} is not committed in {root} on every rank.{hint}")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


def _scan(root: str) -> tuple[dict[int, lineage_mod.StepInfo], dict[int, list[str]], dict[int, list[str]], set[int]]:
    """This directory's committed steps: their lineage, the files each lacks and holds, unreadable manifests."""
    infos: dict[int, lineage_mod.StepInfo] = {}
    missing: dict[int, list[str]] = {}
    present: dict[int, list[str]] = {}
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
        present[step] = sorted(set(manifest.files) - set(missing[step]))
    return infos, missing, present, unreadable


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
