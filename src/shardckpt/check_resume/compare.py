"""Comparing the records of two runs of ``shardckpt check-resume``, and what a difference usually means (torch-free).

A run's records (:mod:`shardckpt.check_resume.probe`) are, per *lane* (a rank, and
the checkpointer when a script has several), one record per ``save()`` call:
the step and, per top-level key of the state, its digest, the digests of its
parts and its small plain values. Two runs agree at a step when every lane has
a record of that step in both and every key's digest and every reported metric
is equal. :func:`first_difference` finds the first step where they do not;
:func:`meaning` says what the keys that differ there usually point at.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

Lane = tuple[str, int]
"""(checkpointer tag, rank)."""

OWN = "_shardckpt"
"""The record's key of the process's generators (``digest.OWN``, the state key no user key may take)."""
OWN_LABEL = "process RNG"


def label(key: str) -> str:
    """A key as a report names it: a user's key by its own name, the process's generators as such."""
    return OWN_LABEL if key == OWN else key


def same(a: Any, b: Any) -> bool:
    """Equal as recorded: floats by their bit pattern (NaN equal to NaN), lists and dicts item by item."""
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


ROLE_NAMES = {"model": "model", "optimizer": "optimizer", "scheduler": "LR scheduler", "data": "data position",
              "rng": "random generators", "value": "value", "state": "stateful object"}


def series(records: list[dict[str, Any]]) -> dict[Lane, dict[int, dict[str, Any]]]:
    """Lane -> step -> the record of the last ``save()`` call of that step."""
    out: dict[Lane, dict[int, dict[str, Any]]] = {}
    for record in records:
        if record.get("event") == "save":
            out.setdefault((record["tag"], int(record["rank"])), {})[int(record["step"])] = record
    return out


def loads(records: list[dict[str, Any]]) -> dict[Lane, int | None]:
    """Lane -> the step its last ``load()`` call restored (``None``: nothing to resume)."""
    out: dict[Lane, int | None] = {}
    for record in records:
        if record.get("event") == "load":
            out[(record["tag"], int(record["rank"]))] = record["step"]
    return out


def last_step(records: list[dict[str, Any]]) -> int | None:
    steps = [int(r["step"]) for r in records if r.get("event") == "save"]
    return max(steps) if steps else None


@dataclasses.dataclass
class KeyDiff:
    key: str
    role: str
    missing: str | None = None  # the run whose record lacks the key
    parts: list[str] = dataclasses.field(default_factory=list)
    nparts: int = 0
    values: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)  # name -> (this run, reference)
    lr: tuple[Any, Any] | None = None

    @property
    def lr_only(self) -> bool:
        """An optimizer whose learning rates differ and nothing but its groups' settings."""
        return self.lr is not None and self.parts == ["param_groups"]

    def text(self) -> str:
        name = f"{label(self.key)} [{ROLE_NAMES.get(self.role, self.role)}]"
        if self.missing:
            return f"{name} is missing in the {self.missing} run's state"
        notes = []
        if self.lr is not None:
            notes.append("learning rate " + _pair(*self.lr))
        notes += [f"{part} {_pair(a, b)}".strip() for part, (a, b) in sorted(self.values.items())][:6]
        rest = [p for p in self.parts if p not in self.values]
        if rest and self.nparts > 1:
            shown = ", ".join(rest[:4]) + (f", ... ({len(rest)} of {self.nparts} differ)" if len(rest) > 4 else "")
            notes.append(("differs in " if notes else "") + shown)
        return name + (": " + ", ".join(notes) if notes else "")


@dataclasses.dataclass
class LaneDiff:
    lane: Lane
    missing: str | None = None  # the run that has no save() call of this step
    keys: list[KeyDiff] = dataclasses.field(default_factory=list)
    metrics: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)

    def text(self) -> str:
        if self.missing:
            return f"no save() call of this step in the {self.missing} run"
        parts = [k.text() for k in self.keys]
        parts += [f"reported {name} {_pair(a, b)}" for name, (a, b) in sorted(self.metrics.items())]
        return "; ".join(parts)


@dataclasses.dataclass
class Difference:
    step: int
    lanes: list[LaneDiff]

    def roles(self) -> set[str]:
        found = set()
        for lane in self.lanes:
            if lane.missing:
                found.add("steps")
            for key in lane.keys:
                found.add("lr" if key.lr_only else key.role)
                if key.lr is not None:
                    found.add("lr")
            if lane.metrics:
                found.add("metrics")
        return found

    def keys(self) -> list[str]:
        """The keys that differ, the most telling first (as :data:`MEANINGS` orders their roles)."""
        found = {k.key: k for lane in self.lanes for k in lane.keys}
        return [label(key) for key, _ in sorted(found.items(), key=lambda kv: (_priority(kv[1]), kv[0]))]

    def lines(self) -> list[str]:
        """One line per group of lanes that differ alike (``ranks 0, 1: ...``)."""
        several = len({lane.lane[0] for lane in self.lanes}) > 1
        grouped: dict[tuple[str, str], list[int]] = {}
        for lane in self.lanes:
            grouped.setdefault((lane.lane[0], lane.text()), []).append(lane.lane[1])
        out = []
        for (tag, text), ranks in grouped.items():
            where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"
            out.append(f"  {where}{f' (checkpointer {tag})' if several else ''}: {text}")
        return out


def _fmt(value: Any, short: bool = True) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if short else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, short) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


def _pair(mine: Any, ref: Any) -> str:
    """``mine (reference ref)``, floats to 6 digits unless it takes all of them to tell the two apart."""
    short = _fmt(mine) != _fmt(ref)
    return f"{_fmt(mine, short)} (reference {_fmt(ref, short)})"


def _key_diff(key: str, a: dict[str, Any] | None, b: dict[str, Any] | None, run: str,
              skip: frozenset[str] = frozenset()) -> KeyDiff | None:
    """``a``: the key's entry in ``run``, ``b``: in the reference; ``skip``: its parts not compared."""
    if a is None or b is None:
        entry = a or b or {}
        return KeyDiff(key, entry.get("role", "value"), missing=run if a is None else "reference")
    if a.get("d") == b.get("d"):
        return None
    diff = KeyDiff(key, a.get("role", "value"))
    pa, pb = a.get("parts") or {}, b.get("parts") or {}
    diff.nparts = len(set(pa) | set(pb))
    diff.parts = sorted(p for p in set(pa) | set(pb) if pa.get(p) != pb.get(p) and p not in skip)
    if skip and not diff.parts:
        return None
    va, vb = dict(a.get("values") or {}), dict(b.get("values") or {})
    if "value" in a or "value" in b:  # a key that is a small plain value itself: shown as it is
        va[""], vb[""] = a.get("value"), b.get("value")
    diff.values = {name: (va.get(name), vb.get(name)) for name in sorted(set(va) | set(vb))
                   if not same(va.get(name), vb.get(name))}
    if not same(a.get("lr"), b.get("lr")) and (a.get("lr") or b.get("lr")):
        diff.lr = (a.get("lr"), b.get("lr"))
    return diff


def compare_step(mine: dict[str, Any] | None, ref: dict[str, Any] | None, lane: Lane, run: str,
                 skip: frozenset[tuple[str, str]] = frozenset()) -> LaneDiff | None:
    if mine is None or ref is None:
        return LaneDiff(lane, missing=run if mine is None else "reference")
    found = LaneDiff(lane)
    ka, kb = mine.get("keys") or {}, ref.get("keys") or {}
    for key in sorted(set(ka) | set(kb)):
        diff = _key_diff(key, ka.get(key), kb.get(key), run, frozenset(p for k, p in skip if k == key))
        if diff is not None:
            found.keys.append(diff)
    found.keys.sort(key=lambda k: (_priority(k), k.key))
    ma, mb = mine.get("metrics") or {}, ref.get("metrics") or {}
    found.metrics = {name: (ma.get(name), mb.get(name)) for name in sorted(set(ma) | set(mb))
                     if not same(ma.get(name), mb.get(name))}
    return found if found.keys or found.metrics else None


def first_difference(mine: list[dict[str, Any]], ref: list[dict[str, Any]], after: int, upto: int, run: str,
                     skip: frozenset[tuple[str, str]] = frozenset()) -> tuple[Difference | None, list[int]]:
    """The first step in ``(after, upto]`` where ``mine`` and the reference differ, and the steps compared equal
    (``skip``: ``(key, part)`` pairs not compared)."""
    sa, sb = series(mine), series(ref)
    lanes = sorted(set(sa) | set(sb))
    steps = sorted({s for lane in lanes for s in list(sa.get(lane, {})) + list(sb.get(lane, {})) if after < s <= upto})
    equal: list[int] = []
    for step in steps:
        diffs = [d for lane in lanes if (d := compare_step(sa.get(lane, {}).get(step), sb.get(lane, {}).get(step),
                                                           lane, run, skip)) is not None]
        if diffs:
            return Difference(step, diffs), equal
        equal.append(step)
    return None, equal


def unseeded(runs: list[list[dict[str, Any]]]) -> frozenset[tuple[str, str]]:
    """``(key, part)`` of the random generators that differ between runs from scratch at their first step:
    never seeded (Python's and NumPy's are seeded from the OS at start). Their state is not compared; were
    they used, what they feed (the model, the data) would differ and be reported."""
    found = set()
    first = [series(records) for records in runs]
    for other in first[1:]:
        for lane, steps in other.items():
            mine = first[0].get(lane, {})
            common = sorted(set(steps) & set(mine))
            if not common:
                continue
            ka, kb = steps[common[0]].get("keys") or {}, mine[common[0]].get("keys") or {}
            for key, entry in ka.items():
                if entry.get("role") == "rng" and key in kb:
                    pa, pb = entry.get("parts") or {}, kb[key].get("parts") or {}
                    found |= {(key, p) for p in set(pa) | set(pb) if pa.get(p) != pb.get(p)}
    return frozenset(found)


def key_roles(records: list[dict[str, Any]]) -> dict[str, str]:
    """Key -> role, as recorded (the keys a check compared)."""
    out: dict[str, str] = {}
    for record in records:
        for key, entry in (record.get("keys") or {}).items():
            out.setdefault(key, entry.get("role", "value"))
    return out


MEANINGS = [
    ("steps", "the runs called save() at different steps here: after the resume the loop numbers its steps "
              "differently (a step counter that is not restored, a step run twice or skipped)."),
    ("data", "the data position differs: the loader did not continue where the killed run stopped. Its position "
             "is not in the state, not restored, or reset after load() (set_epoch() from an epoch counter that is "
             "not saved, a sampler or iterator made again after load(), a loader that reads ahead of the loop)."),
    ("lr", "the learning rate differs: the LR scheduler is not in the state (or it is stepped a different "
           "number of times after the resume). Put the scheduler in the state passed to save() and load()."),
    ("scheduler", "the LR scheduler's state differs: it is stepped a different number of times after the "
                  "resume, or built from values that are not restored."),
    ("rng", "the random generators' state differs while the data position is equal: they are not restored "
            "(capture_rng=False?), seeded again after load() (a manual_seed() after the resume), or the resumed "
            "run draws from them in another order (something made after load() draws from the global generator: "
            "a model's initialisation, a DataLoader iterator without a generator of its own)."),
    ("value", "a saved value differs: it is computed from something outside the state (a global, a counter "
              "kept elsewhere) or set again after load()."),
    ("state", "a stateful object's state differs: it is not restored, or changed by something outside the state."),
    ("model", "the model differs while the data position and the random generators are equal: something "
              "outside the saved state drives the computation: an unregistered generator (a torch.Generator "
              "of its own for noise or augmentation), a sampler whose epoch or order is set from outside the "
              "state (by a framework, after the resume), a global, nondeterministic kernels. "),
    ("optimizer", "the optimizer's state differs while the model is equal: its state is not restored, or "
                  "something outside the state changes it."),
    ("metrics", "only the reported metrics differ; the state passed to save() is equal: the metric is computed "
                "from something outside the state (an unregistered generator, a global, evaluation data)."),
]


def _priority(diff: KeyDiff) -> int:
    role = "lr" if diff.lr is not None else diff.role
    order = [r for r, _text in MEANINGS]
    return order.index(role) if role in order else len(order)


def meaning(difference: Difference, reference_twice: bool) -> str:
    roles = difference.roles()
    for role, text in MEANINGS:
        if role in roles:
            if role == "model":
                text += ("The reference agreed with itself (--reference-twice): not nondeterminism, but state "
                         "outside the checkpoint." if reference_twice else
                         "Run again with --reference-twice to tell them apart.")
            elif role in ("value", "state", "metrics") and "model" in roles:
                text += (" The model differs too: through it, or through something outside the saved state (an "
                         "unregistered generator, a global, nondeterministic kernels).")
            return text
    return "the state passed to save() differs."


NONDETERMINISM = (
    "the script does not agree with itself from the start, so no resume of it can be exact; the resume is not "
    "blamed. Usual causes: nondeterministic kernels (torch.use_deterministic_algorithms(True); on GPUs also "
    "CUBLAS_WORKSPACE_CONFIG=:4096:8), generators never seeded, a DataLoader with workers or without a generator "
    "of its own, time or the environment feeding the computation."
)
