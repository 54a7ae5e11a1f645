"""The restore's sources: the ONE place that decides where each byte of the step being restored comes from.

The restorer reads as: survey (:mod:`.survey`) -> :meth:`Sources.complete`
(this module) -> match keys and shapes -> DCP read (``dcp/reader.py``) ->
apply. For the step chosen by the survey (identified by its save id, never by
its number alone), the bytes come from, in this order:

0. **this machine's shared memory** (``tiers/memory.py``): when every rank
   finds the copies of that very save it reads on its machine, the step is
   read from them and from nothing else (:meth:`MemoryTier.complete`); a
   restore whose layout needs a copy held on another machine falls through
   to the sources below for the same step;
1. **this node's disk** (``local_dir/step_<N>/``): whatever the node's own
   copy holds of that very save is used as it is (a copy holding another save
   of the number is kept aside and treated as absent);
2. **replicas held here** (``.shardckpt-replicas/<owner>/``): files of other
   nodes' copies of the same save that this node's peer daemon received are
   hard-linked into the step directory (:meth:`Sources.before_survey`);
3. **peer daemons** (over HTTP, ``stores/peer_client.py``): a node whose disk
   lacks a newer step that a peer holds a replica of its files of (a
   replacement node with an empty disk) brings them back first, each file
   checked against the owner's manifest (:meth:`Sources.before_survey`, run
   before 2 so that 2 can complete a step brought back);
4. **other nodes of the job over the process group** (no remote configured,
   node-local copies): each file a copy lacks is sent by the committer of a
   copy that has it (:meth:`Sources._exchange_with_peers`);
5. **the remote** (any store, ``tiers/steps.py``): a copy holding nothing of
   the step becomes a sparse copy given, during the read, only the byte ranges
   its ranks read (need-only, chunk-verified, read once per job and shared
   between nodes: ``tiers/ranged.py``); a copy holding part of it, or a step
   without chunk checksums, fetches the whole files it lacks, each verified
   while it downloads (:meth:`Sources._fetch_missing`);
6. **refetch after a bad read**: a file that fails its size check before the
   read, or its checksum during the read, is fetched again from the remote
   (when the step is committed there) and the step is read again
   (:meth:`Sources.refetch`); otherwise every rank raises
   :class:`~shardckpt.errors.CorruptCheckpointError` (and with
   ``on_corrupt="fallback"`` the restorer moves on to an older step).

Which ranks do what: every call here is collective over the ``ctl`` side
group and every rank calls it alike. Only the *committer* of each directory
copy (one rank per copy, ``topology.py``) talks to the peer daemons and the
remote and writes into the copy; files move between nodes only between the
committers of two copies, point to point; rank 0 lists the remote (in the
survey). The size check of a copy's files is split over the ranks sharing it.
Every rank learns every error in the same exchange and raises the same one:
a corrupt file before a network failure.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist

from shardckpt import _dist
from shardckpt import _failpoints
from shardckpt import stores
from shardckpt._text import fmt_bytes
from shardckpt.errors import CorruptCheckpointError, RemoteError
from shardckpt.format import layout, replicas, step_dirs
from shardckpt.options import CheckpointConfig
from shardckpt.restoring.survey import Survey, raise_not_found
from shardckpt.tiers import ranged, remote_commit
from shardckpt.tiers import steps as steps_mod
from shardckpt.topology import Topology

log = logging.getLogger("shardckpt")

PEER_CHUNK = 64 << 20
"""Bytes per message when a node-local copy receives a file from another node."""


def _raise_first(errors: list[tuple[str, str] | None], more: str = "") -> None:
    """Raise the first gathered ``(kind, message)`` error, a corrupt file before a network failure.

    ``more`` (with ``{}`` for the count of the other errors) is appended when there are several.
    """
    found = [e for e in errors if e is not None]
    if not found:
        return
    kind, message = next((e for e in found if e[0] == "corrupt"), found[0])
    if more and len(found) > 1:
        message += more.format(len(found) - 1)
    raise (CorruptCheckpointError if kind == "corrupt" else RemoteError)(message)


class Sources:
    """Where a restore's bytes come from, in the order of the module docstring (collective over ``ctl``)."""

    def __init__(self, config: CheckpointConfig, root: str, groups: _dist.SideGroups) -> None:
        self.config = config
        self.root = root
        self._groups = groups
        self._store: stores.Store | None = None
        self.topology = Topology.single()
        """Which ranks share this directory; set by the Checkpointer before the first load."""
        self.peer: Any = None
        """The node's peer tier (``node/peer_tier.py``) when peer replicas are on, set by the Checkpointer."""
        self.memory: Any = None
        """Source 0: the memory tier (``tiers/memory.py``), set by the Checkpointer."""
        self.sparse: dict[int, ranged.SparseStep] = {}
        """Steps this rank reads from a sparse copy (need-only fetch from the remote, ``ranged.py``)."""
        self.surveyed: dict[int, layout.Manifest] = {}
        """Remote manifests read by this rank's survey (rank 0): the chosen step's is not read again."""

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # ------------------------------------------------------------ 2-3. before the survey: peers, replicas

    def before_survey(self) -> None:
        """Sources 3 then 2: own files brought back from a peer daemon's replica (collective), then the
        replicas of other nodes' files held here linked into the step directories they complete."""
        if self.peer is not None:
            self.peer.fetch_own(self._groups)
        adopted = replicas.adopt_replicas(self.root)
        if adopted:
            log.info("shardckpt: using the replicas of other nodes' files held in %s: %s", replicas.replicas_root(self.root),
                     ", ".join(f"step {s}: {len(n)} file(s)" for s, n in sorted(adopted.items())))

    # ------------------------------------------------------------ the chosen step, completed

    def complete(self, step: int, step_dir: str, survey: Survey) -> tuple[layout.Manifest, set[str], str]:
        """Complete this copy of ``step`` from the sources, in the order of the module's docstring, and
        check its files' presence and sizes (collective over ``ctl``).

        Returns its manifest, the files this rank already checked (downloaded
        and checked on the way; the checksums of the others are checked while
        they are read) and the directory to read (a sparse copy's, for a
        need-only restore).
        """
        if step in survey.memory:  # source 0: the copies in this machine's shared memory
            return self.memory.complete(step, survey.memory[step], self._groups)
        received: set[str] = set()
        self.sparse.pop(step, None)
        if step in survey.remote_unreadable:
            raise CorruptCheckpointError(
                f"step {step} is committed on the remote {stores.safe_url(self.config.remote)}, but it cannot be "
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
        return manifest, received, (sparse.dir if sparse is not None else step_dir)

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
        return self._open_store()

    def _open_store(self) -> stores.Store:
        if self._store is None:
            self._store = stores.open_store(self.config.remote, self.config.transfer_options())
        return self._store

    def _remote_manifest(self, step: int, deadline: stores.Deadline) -> layout.Manifest | None:
        """The remote manifest of ``step``: the survey's when it read it (one read per node per restore)."""
        surveyed = self.surveyed.get(step)
        return surveyed if surveyed is not None else remote_commit.remote_manifest(self.store(), step, deadline)

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
        if self.topology.committer and step not in self.sparse:
            try:
                if stale:
                    kept = step_dirs.keep_aside(self.root, step)
                    log.warning(
                        "shardckpt: step %d in %s is another save than the one committed on %s (a stale copy, e.g. "
                        "from before a rollback elsewhere): kept aside as %s; fetching the live one",
                        step, step_dir, stores.safe_url(self.config.remote), kept,
                    )
                fetched = sorted(steps_mod.fetch_step(self.store(), self.root, step, manifest=self.surveyed.get(step)))
            except CorruptCheckpointError as exc:
                error = ("corrupt", str(exc))
            except (RemoteError, OSError) as exc:
                error = ("remote", stores.redact(str(exc)))
        gathered = self._groups.all_gather_ctl((error, fetched))
        _raise_first([g[0] for g in gathered], more=" ({} more node(s) failed too)")
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
                store = self.store()
                source = steps_mod.StepView.of_step(store, step)
                sparse = ranged.SparseStep.open(
                    self.root, survey.infos[step].version,
                    lambda: self._remote_manifest(step, source.deadline), source, metadata=False,
                )
                result = (None if sparse is None else sparse.dir, None, sparse is not None and sparse.has_metadata())
            except CorruptCheckpointError as exc:
                result = (None, ("corrupt", str(exc)), False)
            except (RemoteError, OSError) as exc:
                result = (None, ("remote", stores.redact(str(exc))), False)
        gathered = self._groups.all_gather_ctl(result)
        _raise_first([e for _d, e, _m in gathered])
        self._share_metadata(step, sparse, [(r, g[2]) for r, g in enumerate(gathered)
                                            if g[0] is not None and topo.copy_of(r)[0] == r])
        mine = gathered[topo.copy[0]][0]
        if mine is not None:
            self.sparse[step] = sparse if sparse is not None else ranged.SparseStep.attach(mine)
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
        if me in order and sparse is not None:
            path = os.path.join(sparse.dir, layout.METADATA_NAME)
            size = sparse.manifest.files[layout.METADATA_NAME].size
            source = steps_mod.StepView.of_step(self.store(), step)

            def fetch() -> tuple[str, str] | None:
                try:
                    sparse._ensure_metadata(source)
                    return None
                except CorruptCheckpointError as exc:
                    return ("corrupt", str(exc))
                except (RemoteError, OSError) as exc:
                    return ("remote", stores.redact(str(exc)))

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
        _raise_first(self._groups.all_gather_ctl(error))

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
