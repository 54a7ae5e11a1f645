"""Retention as pure policies over a list of committed steps.

A policy maps the sorted list of committed steps to the set it wants kept;
policies compose with :class:`AnyOf` (keep what any of them keeps). The
:func:`plan_deletions` helper applies the invariants that hold regardless of
policy: the newest committed step is always kept, and only steps that are
committed (and, where a guard says so, safe elsewhere) can be dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Protocol, Sequence


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int]) -> set[int]:
        """Return the subset of ``steps`` (sorted, oldest first) to keep."""


@dataclasses.dataclass(frozen=True)
class KeepLast:
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepLast.n must be >= 1, got {self.n}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"KeepEvery.k must be >= 1, got {self.k}")

    def keep(self, steps: Sequence[int]) -> set[int]:
        return {s for s in steps if s % self.k == 0}


@dataclasses.dataclass(frozen=True)
class KeepAll:
    def keep(self, steps: Sequence[int]) -> set[int]:
        return set(steps)


@dataclasses.dataclass(frozen=True)
class AnyOf:
    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps)
        return kept


def policy_from(keep_last: int | None, keep_every: int | None) -> RetentionPolicy:
    if keep_last is None:
        return KeepAll()
    policies: list[RetentionPolicy] = [KeepLast(keep_last)]
    if keep_every is not None:
        policies.append(KeepEvery(keep_every))
    return AnyOf(tuple(policies)) if len(policies) > 1 else policies[0]


def plan_deletions(
    steps: Iterable[int],
    policy: RetentionPolicy,
    deletable: Callable[[int], bool] = lambda step: True,
) -> list[int]:
    """Steps to delete: not kept by ``policy``, never the newest, only if ``deletable``."""
    ordered = sorted(set(steps))
    if not ordered:
        return []
    kept = policy.keep(ordered) | {ordered[-1]}
    return [s for s in ordered if s not in kept and deletable(s)]
