"""Chunk arithmetic of a step's files: which chunks cover byte ranges, requests, read-once plans.

Pure functions over the manifest's chunk tables (:data:`layout.CHUNK_BYTES`);
used by the need-only restore (``remote/ranged.py``) and by the checked reader's
coordinator (``dcp/reader.py``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

from shardckpt.format import layout

Chunks = dict[str, set[int]]
"""Chunk indices per file of a step."""


def chunk_runs(intervals: Iterable[tuple[int, int]], chunk: int, size: int) -> list[int]:
    """The chunk indices covering byte intervals ``[start, end)`` of a file of ``size`` bytes, sorted."""
    out: set[int] = set()
    for start, end in intervals:
        end = min(end, size)
        if end > start:
            out.update(range(start // chunk, (end - 1) // chunk + 1))
    return sorted(out)


def coalesce(indices: list[int], chunk: int, size: int, max_bytes: int) -> list[tuple[int, int]]:
    """Requests ``(offset, length)`` for the sorted chunk ``indices``: runs of consecutive chunks,
    each split to at most ``max_bytes`` (at least one chunk)."""
    per = max(1, max_bytes // chunk)
    out: list[tuple[int, int]] = []
    run: list[int] = []
    for i in indices + [-2]:
        if run and (i != run[-1] + 1 or len(run) == per):
            start = run[0] * chunk
            out.append((start, min(size, (run[-1] + 1) * chunk) - start))
            run = []
        if i >= 0:
            run.append(i)
    return out


def _union_bytes(intervals: Iterable[tuple[int, int]], size: int) -> int:
    """How many bytes the union of ``[start, end)`` intervals covers."""
    total, reach = 0, 0
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, size)
        if end > start:
            total += end - start
            reach = end
    return total


def share_plan(wants: list[Chunks], holds: list[Chunks], files: dict[str, layout.FileEntry]) -> list[dict[str, Any]]:
    """Who fetches which chunk and passes it to whom, for copies ``0..n-1`` of a step.

    ``wants[c]``: the chunks copy ``c``'s ranks read; ``holds[c]``: those it already holds.
    Each chunk some copy lacks is given to exactly one copy: one that holds it (nothing is
    fetched), else one of the copies wanting it, chosen so that the bytes each copy fetches
    are even (runs of consecutive chunks stay together: fewer, larger requests). Returns per
    copy ``{"fetch": Chunks, "send": {copy: Chunks}, "recv": {copy: Chunks}}``.
    """
    n = len(wants)
    plan: list[dict[str, Any]] = [{"fetch": {}, "send": {}, "recv": {}} for _ in range(n)]
    load = [0] * n
    groups: dict[tuple[int, ...], list[tuple[str, int, int]]] = defaultdict(list)

    def span(name: str, i: int) -> int:
        entry = files[name]
        chunk, _sums = layout.chunk_table(entry.chunks, entry.size)  # type: ignore[misc]
        return min(entry.size, (i + 1) * chunk) - i * chunk

    def give(owner: int, name: str, i: int, lacking: list[int]) -> None:
        plan[owner]["fetch"].setdefault(name, set()).add(i)
        for c in lacking:
            if c != owner:
                plan[owner]["send"].setdefault(c, {}).setdefault(name, set()).add(i)
                plan[c]["recv"].setdefault(owner, {}).setdefault(name, set()).add(i)

    for name in sorted({f for w in wants for f in w}):
        if name not in files:
            continue
        indices = sorted(set().union(*(w.get(name, set()) for w in wants)))
        for i in indices:
            needing = [c for c in range(n) if i in wants[c].get(name, ())]
            lacking = [c for c in needing if i not in holds[c].get(name, ())]
            if not lacking:
                continue
            holders = [c for c in range(n) if i in holds[c].get(name, ())]
            if holders:
                give(holders[0], name, i, lacking)
            elif len(lacking) == 1:
                give(lacking[0], name, i, lacking)
                load[lacking[0]] += span(name, i)
            else:
                groups[tuple(lacking)].append((name, i, span(name, i)))
    # Chunks several copies lack: filled in order, each copy up to the level that evens the loads.
    for lacking, chunks in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        members = list(lacking)
        level = (sum(load[c] for c in members) + sum(s for _n, _i, s in chunks)) / len(members)
        members.sort(key=lambda c: load[c])
        k = 0
        for name, i, size in chunks:
            while k < len(members) - 1 and load[members[k]] + size / 2 > level:
                k += 1
            owner = members[k]
            give(owner, name, i, list(lacking))
            load[owner] += size
    return plan
