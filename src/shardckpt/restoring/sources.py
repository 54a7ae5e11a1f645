"""The restore's sources: the ONE place that decides where each byte of the step being restored comes from.

The restorer reads as: survey (:mod:`.survey`) -> :meth:`Sources.complete`
(this module) -> match keys and shapes -> DCP read (``dcp/reader.py``) ->
apply. For the save chosen by the survey (identified by its save id, never by
its number alone), each directory copy takes every file it lacks from the
first source that holds it, in this order. Each source is a
:class:`~shardckpt.restoring.views.Source` of one typed list,
:attr:`Sources.order` (the memory tier, the replicas here, the peers, the
remote); the process group, between the last two, is every node's copies:

0. **this machine's shared memory** (``restoring/memory.py``): when every rank
   finds the copies of that very save it reads on its machine, the step is
   read from them and from nothing else (:meth:`MemorySource.complete`: a
   whole source); a
   restore whose layout needs a copy held on another machine falls through
   to the sources below for the same step;
1. **this node's disk** (``local_dir/step_<N>/``): what the copy holds of that
   very save is used as it is (a copy holding another save of the number is
   kept aside, and completed like a copy holding nothing);
2. **the step views of this node's copy**, :attr:`Sources.providers` in order,
   each a :class:`~shardckpt.steps.StepView` over a real store
   (:mod:`.views`): the **replicas held here** of other nodes' files
   (``ReplicaDirStore``), then **each peer** of the job through its daemon
   (``PeerStore``: its own copy, and the replicas it holds; while the peer
   tier is on). A view is offered only of the chosen save (its manifest read
   from that store, of that version and file table); each file is verified
   against the manifest as it arrives, and one that fails gives way to the
   next view. A copy holding nothing of the step takes the manifest from the
   first view too and is committed, manifest last, once complete. Adding a
   source of files is adding a :class:`~.views.Source` to that list;
3. **other nodes of the job over the process group** (no remote holds the
   save): each file a copy still lacks is sent by the committer of a copy that
   has it, checked on arrival (:mod:`.exchange`);
4. **the remote** (:class:`~.views.RemoteSource`: the save committed there, any store, ``steps/view.py``):
   a copy still holding nothing of the step becomes a sparse copy given,
   during the read, only the byte ranges its ranks read (need-only,
   chunk-verified, read once per job and shared between nodes:
   ``remote/ranged.py``); a copy holding part of it, or a step without chunk
   checksums, takes the whole files it lacks through the remote's step view,
   each verified while it downloads;
5. **refetch after a bad read**: a file that fails its size check before the
   read, or its checksum during the read, is fetched again from the remote
   (when the step is committed there) and the step is read again
   (:meth:`Sources.refetch`); otherwise every rank raises
   :class:`~shardckpt.errors.CorruptCheckpointError` (and with
   ``on_corrupt="fallback"`` the restorer moves on to an older step).

The survey learns what the views hold the way it learns the remote's steps:
each copy's committer lists its providers' stores (:meth:`Sources.offers`)
and every node reports what its own daemon serves, so a step is loadable when
the job's copies, views and remote hold every file of one save — no second
"newest" is decided anywhere else. :attr:`Sources.report` says, per kind of
source, what this node's copy took from it (files, bytes) and what it refused.

Which ranks do what: every call here is collective over the ``ctl`` side
group and every rank calls it alike. Only the *committer* of each directory
copy (one rank per copy, ``topology.py``) reads the views and the remote and
writes into the copy; files move between nodes only between the committers of
two copies, point to point; rank 0 lists the remote (in the survey). The size
check of a copy's files is split over the ranks sharing it. Every rank learns
every error in the same exchange and raises the same one: a corrupt file
before a network failure.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

from shardckpt import _dist, stores
from shardckpt import steps as steps_mod
from shardckpt._text import fmt_bytes
from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.format import layout
from shardckpt.options import CheckpointConfig
from shardckpt.remote import ranged
from shardckpt.restoring import exchange
from shardckpt.restoring.failure import Failure, raise_first
from shardckpt.restoring.survey import Survey, raise_not_found
from shardckpt.restoring.views import CopyFill, Peers, PeerTierFacts, RemoteSource, ReplicasHere, Source
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")

OTHER_NODES = "other nodes"
"""The process group's kind in :attr:`Sources.report`."""
REMOTE = RemoteSource.kind


class MemorySourceLike(Source, Protocol):
    """Source 0 as the sources use it (:class:`shardckpt.restoring.memory.MemorySource`), a whole source: what
    this machine's shared memory holds for the survey, a step completed from it, its read."""

    def report(self) -> Any: ...

    def complete(self, step: int, choice: Any, groups: _dist.SideGroups) -> tuple[layout.Manifest, set[str], str]:
        ...

    def view(self, step: int) -> Any: ...


class Sources:
    """Where a restore's bytes come from, in the order of the module docstring (collective over ``ctl``).

    ``peer``: the node's peer tier (``node/peer_tier.py``), read while peer replicas are on; ``memory``: the
    memory tier's restore half (``restoring/memory.py``); each ``None`` when the Checkpointer has none.
    """

    def __init__(self, config: CheckpointConfig, root: str, groups: _dist.SideGroups, *,
                 peer: PeerTierFacts | None = None, memory: MemorySourceLike | None = None) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self.topology = Topology.single()
        """Which ranks share this directory; set by the Checkpointer before the first load."""
        self.peer = peer
        self.memory = memory
        self.providers: list[Source] = [ReplicasHere(root), Peers(peer)]
        """The sources of files a copy reads from after its own disk, in this order (then the process group)."""
        self.remote = RemoteSource(config)
        self.order: list[Source] = [*([memory] if memory is not None else []), *self.providers, self.remote]
        """Every source of this rank, in the order of the module docstring (the process group, between the
        providers and the remote, is not a source of this node's: it is every node's copies)."""
        self.sparse: dict[int, ranged.SparseStep] = {}
        """Steps this rank reads from a sparse copy (need-only fetch from the remote, ``ranged.py``)."""
        self._report: dict[str, dict[str, int]] = {}
        self._read_sparse: ranged.SparseStep | None = None

    @property
    def report(self) -> dict[str, dict[str, int]]:
        """Where the last completed step's bytes came from on this rank's copy: per kind of source
        (``own disk``, ``replicas here``, ``peer``, ``other nodes``, ``remote``), the files and bytes taken
        from it and the files it offered that failed their check (``refused``). A need-only copy counts
        the bytes its node fetched from the remote for the read."""
        out = {kind: dict(got) for kind, got in self._report.items()}
        if self._read_sparse is not None:
            out[REMOTE] = {"files": len(self._read_sparse.manifest.files), "bytes": self._read_sparse.fetched_bytes,
                           "refused": 0}
        return out

    def close(self) -> None:
        for source in self.order:
            source.close()

    # ------------------------------------------------------------ the survey's view of the sources

    def offers(self) -> dict[int, dict[str, list[str]]]:
        """What this copy's providers hold on this node (its committer only): ``{step: {version: [names]}}``."""
        out: dict[int, dict[str, list[str]]] = {}
        if not self.topology.committer:
            return out
        for provider in self.providers:
            for step, by_version in provider.offers().items():
                for version, names in by_version.items():
                    held = out.setdefault(step, {}).setdefault(version, [])
                    held.extend(n for n in names if n not in held)
        return out

    def memory_report(self) -> Any:
        """What this machine's shared memory holds for the survey (``None`` while the memory tier is off)."""
        return self.memory.report() if self.memory is not None else None

    def peers_on(self) -> bool:
        """Whether every copy can read the other nodes' daemons (the peer tier is on: the same on every rank)."""
        return bool(self.peer is not None and self.peer.on)

    # ------------------------------------------------------------ the chosen step, completed

    def complete(self, step: int, step_dir: str, survey: Survey) -> tuple[layout.Manifest, set[str], str]:
        """Complete this copy of ``step`` from the sources, in the order of the module's docstring, and
        check its files' presence and sizes (collective over ``ctl``).

        Returns its manifest, the files this rank already checked (received
        and checked on the way; the checksums of the others are checked while
        they are read) and the directory to read (a sparse copy's, for a
        need-only restore).
        """
        self.sparse.pop(step, None)
        self._report, self._read_sparse, self.remote.surveyed = {}, None, survey.remote_manifests
        if step in survey.memory:  # source 0: the copies in this machine's shared memory
            return self.memory.complete(step, survey.memory[step], self._groups)
        received: set[str] = set()
        if step in survey.remote_unreadable:
            raise CorruptCheckpointError(
                f"step {step} is committed on the remote {stores.safe_url(self.config.remote)}, but it cannot be "
                f"used: {survey.remote_unreadable[step]}"
            )
        if step in survey.early:
            errors = survey.early[step]
            manifest = layout.read_manifest(step_dir)
        else:
            lacking = any(step not in m or m[step] for m in survey.missing)
            if lacking and step in survey.infos:  # (a manifest no copy can read: its own read below says so)
                received = self._gather(step, survey)
            sparse = self.sparse.get(step)
            if sparse is not None:
                step_dir, received = sparse.dir, set(sparse.manifest.files)
            manifest = sparse.manifest if sparse is not None else layout.read_manifest(step_dir)
            if manifest is None:
                raise_not_found(self.config, self.root, self.topology, step, survey)
            error, failed = self.check_share(step_dir, manifest, received)
            gathered = self._groups.all_gather_ctl((error, failed))
            errors = [e for e, _f in gathered if e]
            if errors and step in survey.remote_steps:
                errors = self.refetch(step, step_dir, errors, [f for _e, f in gathered])
        if errors:
            raise CorruptCheckpointError(errors[0] + (f" ({len(errors) - 1} more)" if len(errors) > 1 else ""))
        if manifest is None:
            raise_not_found(self.config, self.root, self.topology, step, survey)
        sparse = self.sparse.get(step)
        self._read_sparse = sparse
        if not self._report and sparse is None:
            self._report = {"own disk": {"files": len(manifest.files),
                                         "bytes": sum(e.size for e in manifest.files.values()), "refused": 0}}
        return manifest, received, (sparse.dir if sparse is not None else step_dir)

    def _gather(self, step: int, survey: Survey) -> set[str]:
        """Each copy takes what it lacks of ``step``: its views (each committer on its own), then the process
        group or the remote (collective); copies begun empty are committed manifest last. Returns the
        names this rank's copy received (each verified on the way)."""
        topo = self.topology
        version = survey.infos[step].version
        on_remote = step in survey.remote_steps
        copy: CopyFill | None = None
        stale = step in survey.stale[_dist.rank()]
        state: tuple[bool, list[str] | None, Failure | None, bool] = (False, None, None, stale)
        try:
            if topo.committer:
                try:
                    copy = CopyFill(self.root, step, version, stale=stale, remote_url=self.config.remote)
                    if copy.lacking() != []:
                        copy.fill([v for provider in self.providers for v in provider.views(step, version)])
                    state = (copy.manifest is not None, copy.lacking(), None, stale)
                except OSError as exc:  # damage (CorruptCheckpointError) or a store failing
                    state = (False, None, Failure.of(exc), stale)
            gathered = self._groups.all_gather_ctl(state)
            raise_first([g[2] for g in gathered], more=" ({} more node(s) failed too)")
            remote_manifest = None
            if on_remote:
                if self._open_need_only(step, version, gathered):
                    remote_manifest = self._fetch_rest(step, version, copy)
            else:
                received = self._exchange(step, copy, gathered)
                if copy is not None:
                    copy.received |= received
            error: Failure | None = None
            if copy is not None and step not in self.sparse:
                try:
                    copy.commit(remote_manifest)
                    copy.count_own()
                except (CorruptCheckpointError, OSError) as exc:
                    error = Failure.damage(exc)
            done = self._groups.all_gather_ctl((error, sorted(copy.received) if copy else [],
                                                copy.report if copy else {}))
            raise_first([d[0] for d in done], more=" ({} more node(s) failed too)")
            mine = done[topo.copy[0]]
            self._report = mine[2]
            if topo.committer and self._report:
                log.info("shardckpt: step %d: this node's copy from %s", step, "; ".join(
                    f"{kind}: {got['files']} file(s), {fmt_bytes(got['bytes'])}"
                    + (f", {got['refused']} refused" if got["refused"] else "") for kind, got in self._report.items()))
            return set(mine[1])
        finally:
            if copy is not None:
                copy.abandon()
            for provider in self.providers:
                provider.close()  # their connections: a restore's, not kept open on the peers afterwards

    def _fetch_rest(self, step: int, version: str, copy: CopyFill | None) -> layout.Manifest | None:
        """Each copy's committer takes what its copy still lacks from the remote (whole files through its
        step view, each verified while it downloads); all ranks agree. Returns the remote manifest."""
        error: Failure | None = None
        manifest = None
        if copy is not None and step not in self.sparse:
            try:
                found = self.remote.views(step, version)
                manifest = found[0].view.manifest
                if copy.lacking() != []:
                    where = self.remote.where()
                    t0 = time.monotonic()
                    copy.fill(found)
                    if copy.lacking() != []:  # the remote is the last source: its error is the step's
                        raise next((e for kind, _n, e in copy.failures if kind == REMOTE),
                                   CorruptCheckpointError(f"step {step}: files of this node's copy came from no "
                                                          f"source: {(copy.lacking() or [])[:5]}"))
                    got = copy.report.get(REMOTE, {})
                    if got.get("files"):
                        log.info("shardckpt: fetched %d file(s) of step %d from %s: %s in %.2f s", got["files"],
                                 step, where, fmt_bytes(got["bytes"]), time.monotonic() - t0)
            except OSError as exc:  # damage (CorruptCheckpointError) or a store failing
                error = Failure.of(exc)
        raise_first(self._groups.all_gather_ctl(error), more=" ({} more node(s) failed too)")
        return manifest

    def check_share(self, step_dir: str, manifest: layout.Manifest, skip: set[str]) -> tuple[str | None, list[str]]:
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

    def refetch(self, step: int, step_dir: str, errors: list[str], failed: list[list[str]]) -> list[str]:
        """Replace files that failed verification with the remote's copy (checked while downloading).

        Returns the errors left: none when every bad file was replaced by a good one.
        """
        group = self.topology.copy
        names = sorted({n for r in group for n in failed[r]})
        error = None
        if self.topology.committer and names:
            try:
                steps_mod.fetch_step(self.store(), self.root, step, names=names)
                manifest = layout.read_manifest(step_dir)
                got = self._report.setdefault(REMOTE, {"files": 0, "bytes": 0, "refused": 0})
                got["files"] += len(names)
                got["bytes"] += sum(manifest.files[n].size for n in names) if manifest is not None else 0
                log.warning(
                    "shardckpt: step %d: replaced %d file(s) of %s that failed verification with the remote's "
                    "copy (%s)", step, len(names), step_dir, ", ".join(names[:5]),
                )
            except (CorruptCheckpointError, RemoteError, OSError) as exc:
                error = f"{errors[0]} The remote copy could not replace it: {stores.redact(str(exc))}"
        left = [e for e in self._groups.all_gather_ctl(error) if e]
        return left

    def reader_source(self, step: int) -> steps_mod.StepView | None:
        """Where the checked reader fetches the ranges of a sparse copy from (the remote), else None."""
        sparse = self.sparse.get(step)  # its manifest: the remote's, with the stored form of compressed files
        return steps_mod.StepView(self.store(), sparse.manifest) if sparse is not None else None

    def store(self) -> stores.Store:
        """The remote store (opened on first use, closed by :meth:`close`)."""
        return self.remote.store()

    def _open_need_only(self, step: int, version: str, gathered: list[Any]) -> bool:
        """Copies still holding nothing of ``step`` become sparse copies, filled while the step is read
        with only the ranges their ranks read (``ranged.py``). Collective over ``ctl``.

        ``gathered``: each committer's ``(has the manifest, files lacking, error, held another save)`` after
        its views. Returns whether some copy still needs whole files (:meth:`_fetch_rest`): a copy holding
        part of the step or another save of it (kept aside: the step is fetched whole, and committed), or a
        step without chunk checksums.
        """
        topo = self.topology
        empty = not gathered[topo.copy[0]][0] and not gathered[topo.copy[0]][3]
        result: tuple[str | None, Failure | None, bool] = (None, None, False)
        sparse = None
        if empty and topo.committer:
            try:
                store = self.store()
                source = steps_mod.StepView.of_step(store, step)
                sparse = ranged.SparseStep.open(
                    self.root, version,
                    lambda: self.remote.manifest(step, source.deadline), source, metadata=False,
                )
                result = (None if sparse is None else sparse.dir, None, sparse is not None and sparse.has_metadata())
            except OSError as exc:  # damage (CorruptCheckpointError) or a store failing
                result = (None, Failure.of(exc), False)
        answers = self._groups.all_gather_ctl(result)
        raise_first([e for _d, e, _m in answers])
        self._share_metadata(step, sparse, [(r, g[2]) for r, g in enumerate(answers)
                                            if g[0] is not None and topo.copy_of(r)[0] == r])
        mine = answers[topo.copy[0]][0]
        if mine is not None:
            self.sparse[step] = sparse if sparse is not None else ranged.SparseStep.attach(mine)
        return any(answers[c][0] is None and (not gathered[c][0] or gathered[c][1]) for c in topo.committers)

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
        error: Failure | None = None
        if me in order and sparse is not None:
            path = os.path.join(sparse.dir, layout.METADATA_NAME)
            size = sparse.manifest.files[layout.METADATA_NAME].size
            source = steps_mod.StepView.of_step(self.store(), step)

            def fetch() -> Failure | None:
                try:
                    sparse._ensure_metadata(source)
                    return None
                except OSError as exc:  # damage (CorruptCheckpointError) or a store failing
                    return Failure.of(exc)

            if not holders and me == order[0]:
                error = fetch()  # on failure it sends what it has: the receivers' check refuses it
            have = max(1, len(holders))
            while have < len(order):
                for j in range(have, min(2 * have, len(order))):
                    src, dst = order[j - have], order[j]
                    if me == src:
                        exchange.send_file(path, size, dst, self._groups.ctl)
                    elif me == dst:
                        try:
                            exchange.receive_file(path, sparse.manifest.files[layout.METADATA_NAME], src,
                                                  self._groups.ctl, step)
                        except CorruptCheckpointError as exc:
                            log.warning("shardckpt: step %d: %s; fetching it from the remote instead", step, exc)
                            error = fetch()
                have *= 2
        raise_first(self._groups.all_gather_ctl(error))

    def _exchange(self, step: int, copy: CopyFill | None, gathered: list[Any]) -> set[str]:
        """Node-local copies without the save on a remote: each copy receives the files it still lacks
        from another node's copy (:mod:`.exchange`). Returns the names this copy received."""
        topo = self.topology
        lacking = {c: gathered[c][1] for c in topo.committers if gathered[c][1]}
        if not lacking:
            return set()
        plan: list[tuple[str, int, int]] = []
        for dst in topo.committers:
            if not gathered[dst][0]:
                raise CorruptCheckpointError(
                    f"step {step}: the copy of rank {dst}'s node holds nothing of this save and no source gave it "
                    f"the step's manifest ({topo.describe()}). Remedy: load an earlier step (load(step=...) or "
                    f"on_corrupt='fallback'), or configure remote= so that every node's files are uploaded."
                )
            for name in lacking.get(dst, []):
                src = next((c for c in topo.committers if c != dst and gathered[c][0]
                            and name not in (gathered[c][1] or [])), None)
                if src is None:
                    step_dir = os.path.join(self.root, layout.step_dirname(step))
                    elsewhere = "" if topo.shared else (
                        f", and no other node's directory of this job has it ({topo.describe()})")
                    raise CorruptCheckpointError(
                        f"step {step}: file {os.path.join(step_dir, name)} named in the manifest is missing"
                        f"{elsewhere}. "
                        f"Remedy: load an earlier step (load(step=...) or on_corrupt='fallback'), run on the nodes "
                        f"that saved it, or configure remote= so that every node's files are uploaded."
                    )
                plan.append((name, src, dst))
        rank = _dist.rank()
        manifest = copy.manifest if copy is not None else None
        error: str | None = None
        received: list[str] = []
        total = 0
        t0 = time.monotonic()
        for name, src, dst in plan:
            if rank == src:
                exchange.send_file(os.path.join(copy.target, name), manifest.files[name].size, dst, self._groups.ctl)
            elif rank == dst:
                try:
                    exchange.receive_file(os.path.join(copy.target, name), manifest.files[name], src,
                                          self._groups.ctl, step)
                    received.append(name)
                    total += manifest.files[name].size
                except (CorruptCheckpointError, OSError) as exc:
                    error = error or str(exc)
        errors = [e for e in self._groups.all_gather_ctl(error) if e]
        if errors:
            raise CorruptCheckpointError(errors[0])
        if received:
            copy.report[OTHER_NODES] = {"files": len(received), "bytes": total, "refused": 0}
            log.info(
                "shardckpt: step %d: received %d file(s), %s, from other nodes' copies into %s in %.2f s",
                step, len(received), fmt_bytes(total), copy.target, time.monotonic() - t0,
            )
        return set(received)
