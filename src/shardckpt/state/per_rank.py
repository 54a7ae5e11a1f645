"""Per-rank entries after a restore: which saved entries belong to one rank, and what another world size does with them.

At another world size a generator follows
the RNG rule (rank ``r`` gets saved rank ``r``'s; a new rank keeps its
current state), and a data loader's or sampler's per-rank state is not
applied at all (its position belongs to the saved layout):
:func:`per_rank_note` says which in one WARNING.
"""

from __future__ import annotations

from typing import Any

from shardckpt.state.keys import path_rank, rank_of


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
