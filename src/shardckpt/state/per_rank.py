"""What belongs to one rank: :class:`PerRank` (a user's per-rank state), and the per-rank entries after a restore
(which saved entries belong to one rank, and what another world size does with them).

At another world size a generator follows
the RNG rule (rank ``r`` gets saved rank ``r``'s; a new rank keeps its
current state), and a data loader's or sampler's per-rank state is not
applied at all (its position belongs to the saved layout):
:func:`per_rank_note` says which in one WARNING.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from shardckpt import _dist
from shardckpt.state.keys import path_rank, rank_of

log = logging.getLogger("shardckpt")


def per_rank_entries(saved_paths: list[tuple]) -> dict[str, dict[str, Any]]:
    """``{key: {"ranks": {...}, "whole": bool, "only": bool}}`` of the keys holding per-rank entries:
    which ranks saved one, whether it is a whole object's state (a data loader's), and whether the key
    holds nothing else."""
    out: dict[str, dict[str, Any]] = {}
    shared: set[str] = set()
    for path in saved_paths:
        found = path_rank(path)
        if found is None:
            shared.add(str(path[0]))
            continue
        entry = out.setdefault(str(path[0]), {"ranks": set(), "whole": False, "only": True})
        entry["ranks"].add(found[0])
        entry["whole"] |= found[1] and len(path) > 1 and rank_of(path[1]) is not None
    for key, entry in out.items():
        entry["only"] = key not in shared
    return out


def per_rank_note(entries: dict[str, dict[str, Any]], saved_world: int, world: int) -> str | None:
    """One line on what a world-size change does to the per-rank entries (``None`` at the same size)."""
    if saved_world == world or not entries:
        return None
    whole = sorted(k for k, e in entries.items() if e["whole"])
    gens = sorted(k for k, e in entries.items() if not e["whole"])
    parts = []
    if whole:
        parts.append(f"the per-rank state of {', '.join(map(repr, whole))} (a data loader's or sampler's position "
                     f"belongs to the {saved_world}-rank layout) is not restored on any rank: it keeps its current "
                     f"state (a shardckpt.ResumableSampler keeps a global position across world sizes)")
    if gens:
        what = f"the random generator(s) in {', '.join(map(repr, gens))}"
        if world > saved_world:
            lo, hi = saved_world, world - 1
            parts.append(f"{what}: rank(s) {lo}{'' if lo == hi else f'..{hi}'} have no saved state and keep their "
                         f"current one")
        else:
            lo, hi = world, saved_world - 1
            parts.append(f"{what}: the states saved by rank(s) {lo}{'' if lo == hi else f'..{hi}'} are dropped")
    return f"saved by {saved_world} ranks, restored by {world}: " + "; ".join(parts)


class PerRank:
    """User state that belongs to one rank, with a defined elastic behaviour.

    ``state["stats"] = shardckpt.PerRank({"tokens": 0}, fresh=lambda rank: {"tokens": 0})``
    saves each rank's ``value`` under its own key (DCP keeps a single copy of
    a key saved by several ranks, so per-rank values need per-rank keys). On
    restore at world size ``W'`` from ``W`` ranks: rank ``r < W`` gets saved
    rank ``r``'s value; the values of saved ranks ``>= W'`` are dropped; a rank
    ``>= W`` gets ``fresh(rank)`` (default: it keeps its current value) and a
    warning is logged. ``value`` may hold tensors, numbers, strings and
    containers of them. After a load, ``restored`` says whether this rank's
    value came from the checkpoint and ``saved_world_size`` how many ranks
    saved one.
    """

    def __init__(self, value: Any = None, *, fresh: Any = None, rank: int | None = None) -> None:
        self.value = value
        self.fresh = fresh
        self._rank = rank
        self.restored = False
        self.saved_world_size: int | None = None

    @property
    def rank(self) -> int:
        return _dist.rank() if self._rank is None else self._rank

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{self.rank}": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        key = f"rank{self.rank}"
        saved = [k for k in state if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()]
        self.saved_world_size = (max(int(k[4:]) for k in saved) + 1) if saved else 0
        if key in state:
            self.value = state[key]
            self.restored = True
            return
        self.restored = False
        if self.fresh is not None:
            self.value = self.fresh(self.rank)
        log.warning(
            "shardckpt: no saved per-rank value for rank %d (saved by %d ranks); %s",
            self.rank,
            self.saved_world_size,
            "initialised it with fresh(rank)" if self.fresh is not None else "kept its current value",
        )
