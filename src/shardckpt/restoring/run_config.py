"""The run-config comparison at load: what changed since the step was saved, what matters first.

A ``run_config`` that holds file paths, timestamps or a W&B run name differs
on every resume; a warning listing all of it buries the one change that
matters (``n_embd: 64 -> 96``). Two rules:

* keys the user names in ``CheckpointConfig.run_config_ignore`` are left out
  (dotted names, shell-style patterns; a name also covers what is under it:
  ``"data"`` leaves out ``data.path`` and ``data.shards``);
* differences that can change shapes come first: numbers whose old value is a
  dimension of a saved tensor whose shape changed and whose new value a
  dimension of the live one (when shapes are known), then other integer
  changes, then the rest. Each group is in key order.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable

_ABSENT = object()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(value, dict):
        return {prefix or "(value)": value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict) and item:
            out.update(flatten(item, name))
        else:
            out[name] = item
    return out


def ignored(key: str, patterns: Iterable[str]) -> bool:
    """Whether ``key`` (dotted) is left out by one of ``patterns`` (itself or a parent matches)."""
    parts = key.split(".")
    heads = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(head, p) for p in patterns for head in heads)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def differences(
    saved: Any,
    current: Any,
    ignore: Iterable[str] = (),
    *,
    saved_dims: Iterable[int] = (),
    live_dims: Iterable[int] = (),
) -> list[str]:
    """``key: old -> new`` for each entry that differs, shape-changing ones first (see the module)."""
    if saved is None or current is None or saved == current:
        return []
    patterns = tuple(ignore)
    old, new = flatten(saved), flatten(current)
    saved_dims, live_dims = set(saved_dims), set(live_dims)

    def rank(key: str) -> int:
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if _is_int(a) and _is_int(b):
            return 0 if a in saved_dims and b in live_dims else 1
        return 2

    keys = [k for k in set(old) | set(new)
            if old.get(k, _ABSENT) != new.get(k, _ABSENT) and not ignored(k, patterns)]
    keys.sort(key=lambda k: (rank(k), k))
    return [f"{k}: {old.get(k, '(absent)')!r} -> {new.get(k, '(absent)')!r}" for k in keys]


def reshaped_dims(flat_live: dict[str, Any], metadata: Any) -> tuple[set[int], set[int]]:
    """The dimensions of the saved and of the live tensors whose shapes differ."""
    saved: set[int] = set()
    live: set[int] = set()
    for fqn, value in flat_live.items():
        md = metadata.state_dict_metadata.get(fqn)
        size = getattr(md, "size", None)
        shape = getattr(value, "shape", None)
        if size is not None and shape is not None and tuple(size) != tuple(shape):
            saved.update(int(d) for d in size)
            live.update(int(d) for d in shape)
    return saved, live
