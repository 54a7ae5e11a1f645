"""Branches of a run's history: what a rollback does to the steps after it.

Users roll back: after a loss spike they ``load(state, step=100)`` while steps
200 and 300 exist, train on and save 110, 120, 130. Steps 200 and 300 belong
to an abandoned branch: a restart must resume 130, not 300, and retention
must not count 200 and 300 against the new branch (keeping the three highest
step numbers would delete 110 and 120). The abandoned steps are kept (they
may be wanted) until ``shardckpt gc``, and ``shardckpt ls`` marks them.

Every manifest records its :class:`Lineage`: the branch it was saved on and
the chain of rollbacks that led there (``forks``: the step rolled back to and
the branch that started there, oldest first; the run's first branch is
``""``). A pure function of the committed manifests then says which steps are
*live*: those on the lineage of the *head*, the most recently created step.
A step is on that lineage when its branch is in the head's chain and no later
fork of the chain rolled back below it.

A save continues the lineage of the step it was loaded from, unless steps
newer than that step exist on that lineage: then the first save starts a new
branch forked at the loaded step. A job that saves without loading into a
directory that already holds steps starts a new branch forked "before step
0": the earlier steps are kept, abandoned, never mixed into its history.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any, Mapping

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout

NO_STEP = -1
"""The fork point of a branch started without loading any step."""


@dataclasses.dataclass(frozen=True)
class Lineage:
    branch: str = ""
    """The branch this step was saved on (``""``: the run's first branch)."""
    forks: tuple[tuple[int, str], ...] = ()
    """``(step rolled back to, branch started there)`` for each rollback leading here, oldest first."""

    def fork(self, step: int, branch: str | None = None) -> "Lineage":
        """The lineage of a new branch that starts from ``step`` of this one.

        ``branch``: the new branch's id (ranks that fork in the background pass one they
        agreed on); a fresh random one by default.
        """
        branch = branch or uuid.uuid4().hex[:10]
        return Lineage(branch, self.forks + ((int(step), branch),))

    def chain(self) -> list[str]:
        return [""] + [branch for _step, branch in self.forks]

    def to_json(self) -> dict[str, Any]:
        return {"branch": self.branch, "forks": [[s, b] for s, b in self.forks]}

    @classmethod
    def from_json(cls, body: Any) -> "Lineage":
        """Manifests without a lineage (older ones, adopted steps) are on the first branch."""
        if not isinstance(body, Mapping):
            return cls()
        forks = tuple((int(s), str(b)) for s, b in body.get("forks", []))
        return cls(str(body.get("branch", "")), forks)


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What history and retention need of one committed step (from its manifest)."""

    step: int
    created: float
    lineage: Lineage
    kind: str = "full"
    """``full``, or ``light`` (model and small state, no optimizer state)."""
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """The metrics recorded at save (``save(..., metrics={...})``)."""
    version: str = ""
    """The save's identity (:func:`shardckpt.format.layout.version_of`): two saves of one step number differ here."""

    def to_json(self) -> list[Any]:
        return [self.created, self.lineage.to_json(), self.kind, dict(self.metrics), self.version]

    @classmethod
    def from_json(cls, step: int, body: Any) -> "StepInfo":
        created, lineage, kind, metrics, version = (list(body) + [None, None, "full", {}, ""])[:5]
        return cls(step, float(created or 0.0), Lineage.from_json(lineage), kind or "full", dict(metrics or {}),
                   str(version or ""))


def excluded_by(head: Lineage, step: int, lineage: Lineage) -> int | None | str:
    """Why ``step`` (saved with ``lineage``) is not on ``head``'s lineage.

    ``None``: it is on it. An int: the step a later rollback went back to.
    ``"branch"``: its branch is not in the head's chain (a branch abandoned in turn).
    """
    chain = head.chain()
    if lineage.branch not in chain:
        return "branch"
    position = chain.index(lineage.branch)
    for fork_step, _branch in head.forks[position:]:
        if step > fork_step:
            return fork_step
    return None


def head(infos: Mapping[int, StepInfo]) -> StepInfo | None:
    """The most recently created step: its lineage is the run's current history."""
    if not infos:
        return None
    return max(infos.values(), key=lambda i: (i.created, i.step))


def conflicts(infos: Mapping[int, StepInfo]) -> dict[int, str]:
    """Steps whose recorded history contradicts the others': ``{step: why}``.

    Every manifest records the chain of forks that led to its branch; a
    branch started once, so every step that names a branch must record the
    same forks up to it. The first step (by creation) naming a branch
    defines its history; a later step recording another one cannot be
    placed in the run's history (its manifest was edited, or written by a
    bug) and is not resumed.
    """
    history: dict[str, tuple[tuple[tuple[int, str], ...], int]] = {}
    out: dict[int, str] = {}
    for info in sorted(infos.values(), key=lambda i: (i.created, i.step)):
        forks = info.lineage.forks
        for i, (_at, branch) in enumerate(forks):
            prefix = forks[: i + 1]
            known, by = history.setdefault(branch, (prefix, info.step))
            if known != prefix:
                out[info.step] = (
                    f"its lineage says branch {branch!r} started at step {prefix[-1][0]} after "
                    f"{[list(f) for f in prefix[:-1]]}, but step {by} records it started at step {known[-1][0]} after "
                    f"{[list(f) for f in known[:-1]]}: the step cannot be placed in the run's history"
                )
                break
    return out


def classify(infos: Mapping[int, StepInfo]) -> tuple[list[int], dict[int, str]]:
    """The live steps (oldest first) and the abandoned ones with a reason for each (a step whose
    lineage contradicts the others', :func:`conflicts`, is never live nor the head)."""
    bad = conflicts(infos)
    abandoned: dict[int, str] = {s: f"unusable: {why}" for s, why in bad.items()}
    infos = {s: i for s, i in infos.items() if s not in bad}
    top = head(infos)
    if top is None:
        return [], abandoned
    live: list[int] = []
    for step in sorted(infos):
        why = excluded_by(top.lineage, step, infos[step].lineage)
        if why is None:
            live.append(step)
        elif why == "branch":
            abandoned[step] = "abandoned: on a branch that a later rollback left"
        elif why == NO_STEP:
            abandoned[step] = "abandoned: from a run that started over without loading it"
        else:
            abandoned[step] = f"abandoned: rolled back to step {why}"
    return live, abandoned


def continue_from(infos: Mapping[int, StepInfo], step: int | None) -> Lineage:
    """The lineage of the saves that follow a load of ``step`` (``None``: nothing was loaded).

    Continues the loaded step's lineage, or forks at it when steps newer than
    it exist on that lineage (a rollback). With nothing loaded: the first
    branch in an empty history, else a new branch forked before every step.
    """
    if step is None or step not in infos:
        return Lineage().fork(NO_STEP) if infos else Lineage()
    base = infos[step].lineage
    newer = [s for s, info in infos.items() if s > step and excluded_by(base, s, info.lineage) is None]
    return base.fork(step) if newer else base


def info_of(manifest: Any) -> StepInfo:
    """The :class:`StepInfo` of a :class:`~shardckpt.format.layout.Manifest`."""
    return StepInfo(manifest.step, manifest.created, Lineage.from_json(manifest.lineage), manifest.kind,
                    dict(manifest.metrics), layout.version_of(manifest))


def local_infos(root: str) -> dict[int, StepInfo]:
    """The :class:`StepInfo` of every committed step in ``root`` whose manifest is readable."""
    out: dict[int, StepInfo] = {}
    for step in layout.committed_steps(root):
        try:
            manifest = layout.read_manifest(os.path.join(root, layout.step_dirname(step)))
        except CorruptCheckpointError:
            continue
        if manifest is not None:
            out[step] = info_of(manifest)
    return out
