"""Retention as pure policies over the committed steps of a tier.

A policy maps the sorted list of *live* steps (see ``lineage.py``: steps of a
branch abandoned by a rollback are never counted, never deleted here) and
what their manifests say (``infos``: metrics, kind) to the set it wants kept.
Policies compose with :class:`AnyOf`: a step is kept when any policy keeps it,
so the best step is never purged by ``keep_last`` and vice versa.
:func:`plan_deletions` then applies the invariants that hold regardless of
policy: the newest live step is always kept, and only steps that a guard
says are safe elsewhere (uploaded, with a remote) can go.

    KeepLast(n)              the newest n full steps
    KeepLast(n, kind=LIGHT)  the newest n light steps (model + small state, no optimizer)
    KeepEvery(k)             every step that is a multiple of k
    KeepBest(k, "val_loss")  the k best steps by a metric recorded at save (min or max)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

FULL, LIGHT = "full", "light"


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[int], infos: Mapping[int, Any]) -> set[int]:
        """The subset of ``steps`` (sorted, oldest first) to keep; ``infos[step]`` has
        ``.kind`` and ``.metrics`` (see ``lineage.StepInfo``)."""


def _kind(infos: Mapping[int, Any], step: int) -> str:
    info = infos.get(step)
    return getattr(info, "kind", FULL) if info is not None else FULL


@dataclasses.dataclass(frozen=True)
class KeepLast:
    """The newest ``n`` steps of one kind (``kind``: full steps by default; light steps are counted apart)."""

    n: int
    kind: str = FULL
    """Counts only steps of this kind (``full`` or ``light``)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"KeepLast.n must be >= 1, got {self.n}")

    def keep(self, steps: Sequence[int], infos: Mapping[int, Any] = {}) -> set[int]:  # noqa: B006 - read only
        return set([s for s in sorted(steps) if _kind(infos, s) == self.kind][-self.n :])


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Every step whose number is a multiple of ``k`` (milestones kept for good, e.g. ``KeepEvery(1000)``)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"KeepEvery.k must be >= 1, got {self.k}")

    def keep(self, steps: Sequence[int], infos: Mapping[int, Any] = {}) -> set[int]:  # noqa: B006
        return {s for s in steps if s % self.k == 0}


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """The ``k`` steps with the best value of ``metric`` (``mode`` min or max); steps without it do not compete."""

    k: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"KeepBest.k must be >= 1, got {self.k}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"KeepBest.mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: Sequence[int], infos: Mapping[int, Any] = {}) -> set[int]:  # noqa: B006
        return set(ranked(steps, infos, self.metric, self.mode)[: self.k])


def ranked(steps: Iterable[int], infos: Mapping[int, Any], metric: str, mode: str) -> list[int]:
    """Steps that recorded ``metric``, best first (ties: the newer step first)."""
    scored = []
    for step in steps:
        info = infos.get(step)
        value = (getattr(info, "metrics", None) or {}).get(metric) if info is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            scored.append((value if mode == "min" else -value, -step))
    return [-neg_step for _value, neg_step in sorted(scored)]


@dataclasses.dataclass(frozen=True)
class KeepAll:
    """Every step: nothing is deleted (what ``keep_last=None`` means)."""

    def keep(self, steps: Sequence[int], infos: Mapping[int, Any] = {}) -> set[int]:  # noqa: B006
        return set(steps)


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """A step is kept when any of ``policies`` keeps it, e.g. ``AnyOf((KeepLast(3), KeepEvery(1000)))``."""

    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int], infos: Mapping[int, Any] = {}) -> set[int]:  # noqa: B006
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(steps, infos)
        return kept


def policy_from(
    keep_last: int | None,
    keep_every: int | None = None,
    *,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    keep_last_light: int | None = None,
) -> RetentionPolicy:
    """The policy of a configuration: ``keep_last=None`` keeps everything."""
    if keep_last is None:
        return KeepAll()
    policies: list[RetentionPolicy] = [KeepLast(keep_last), KeepLast(keep_last_light or keep_last, kind=LIGHT)]
    if keep_every is not None:
        policies.append(KeepEvery(keep_every))
    if keep_best is not None and best_metric:
        policies.append(KeepBest(keep_best, best_metric, best_mode))
    return AnyOf(tuple(policies))


def plan_deletions(
    steps: Iterable[int],
    policy: RetentionPolicy,
    deletable: Callable[[int], bool] = lambda step: True,
    infos: Mapping[int, Any] | None = None,
    protect: Iterable[int] = (),
) -> list[int]:
    """Steps to delete: not kept by ``policy``, never the newest, never one of ``protect``
    (the step just saved), only if ``deletable``."""
    ordered = sorted(set(steps))
    if not ordered:
        return []
    kept = policy.keep(ordered, infos or {}) | {ordered[-1]} | set(protect)
    return [s for s in ordered if s not in kept and deletable(s)]
