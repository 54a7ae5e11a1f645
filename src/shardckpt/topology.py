"""Which ranks share one copy of the checkpoint directory.

A multi-node job either points every node at one shared directory (NFS,
Lustre, a shared volume) or gives each node its own (node-local NVMe). The
user does not have to say which: at the first save or load every rank writes
a probe file named with a nonce agreed by all ranks, then looks up every
rank's probe *by name* (a lookup by a never-seen name reaches the server even
on NFS, where directory listings may be cached), and the ranks exchange what
they saw. Ranks that see each other's probes share a copy; the copies are the
connected groups of that relation.

Each copy has one *committer*, its lowest rank: it renames the step into
place, applies retention and removes leftovers there. A shared directory is
one copy with committer rank 0; node-local directories are one copy per
node, each holding the shard files of its own ranks (and ``.metadata``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid

from shardckpt import _dist
from shardckpt.errors import ShardckptError
from shardckpt.format.step_dirs import PROBE_PREFIX

log = logging.getLogger("shardckpt")



@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    copies: tuple[tuple[int, ...], ...]
    """The groups of ranks sharing one directory copy, each sorted, ordered by their lowest rank."""

    @classmethod
    def single(cls) -> "Topology":
        return cls(0, 1, ((0,),))

    @property
    def copy(self) -> tuple[int, ...]:
        """The ranks that share this rank's directory."""
        return self.copy_of(self.rank)

    def copy_of(self, rank: int) -> tuple[int, ...]:
        for group in self.copies:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in no copy of {self.copies}")

    @property
    def committer(self) -> bool:
        """This rank commits, applies retention and cleans up in its directory."""
        return self.rank == self.copy[0]

    @property
    def committers(self) -> list[int]:
        return [group[0] for group in self.copies]

    @property
    def shared(self) -> bool:
        return len(self.copies) == 1

    def share_of(self, names: list[str]) -> list[str]:
        """This rank's part of ``names`` when the ranks of its copy split work on it."""
        group = self.copy
        return names[group.index(self.rank) :: len(group)]

    def describe(self) -> str:
        if self.shared:
            return f"one directory shared by all {self.world_size} rank(s)"
        return f"node-local: {len(self.copies)} copies ({', '.join(_span(g) for g in self.copies)})"


def _span(group: tuple[int, ...]) -> str:
    if len(group) > 1 and list(group) == list(range(group[0], group[-1] + 1)):
        return f"ranks {group[0]}-{group[-1]}"
    return "ranks " + ",".join(map(str, group)) if len(group) > 1 else f"rank {group[0]}"


def detect(root: str, groups: _dist.SideGroups) -> Topology:
    """Find which ranks share ``root`` (collective over the ``ctl`` group; every rank calls it)."""
    if not _dist.is_dist():
        return Topology.single()
    rank, world = _dist.rank(), _dist.world_size()
    nonce = groups.broadcast_ctl(uuid.uuid4().hex)

    def probe(r: int) -> str:
        return os.path.join(root, f"{PROBE_PREFIX}{nonce}-{r}")

    error = None
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(probe(rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    errors = [e for e in groups.all_gather_ctl(error) if e]
    if errors:
        raise ShardckptError(
            f"cannot write into the checkpoint directory {root} ({errors[0]}). Remedy: make local_dir a "
            f"writable directory on every node."
        )
    seen = [r for r in range(world) if os.path.exists(probe(r))]
    views = groups.all_gather_ctl(seen)
    try:
        os.unlink(probe(rank))
    except OSError:
        pass
    parent = list(range(world))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for r, visible in enumerate(views):
        for other in visible:
            parent[find(other)] = find(r)
    members: dict[int, list[int]] = {}
    for r in range(world):
        members.setdefault(find(r), []).append(r)
    copies = tuple(sorted(tuple(sorted(g)) for g in members.values()))
    topology = Topology(rank, world, copies)
    if rank == 0:
        log.info("shardckpt: checkpoint directory %s: %s", root, topology.describe())
    return topology
