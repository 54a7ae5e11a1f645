"""Plain values in a save: their dict keys' types, and one value for every rank.

DCP stores nested dicts under string paths, so a key's type is lost on the
way (``{0: "a"}`` comes back as ``{"0": "a"}``) and keys whose strings
coincide (``1`` and ``"1"``) collide. :func:`encode_keys` writes a key that is
not a ``str`` as a tagged string, ``"#int:5"``, ``"#float:0.5"``,
``"#bool:True"``, ``"#none"`` (a ``str`` key starting with ``#`` is escaped as
``"#str:..."``); :func:`decode_keys` turns them back. Other key types are
refused at save with a :class:`ConfigError` naming the key.

DCP also drops an empty dict (it has no leaf to write), and with it a list
that holds nothing else (``LambdaLR``'s ``lr_lambdas: [{}]``): the key would be
missing from what is restored. :func:`encode_keys` writes an empty dict as the
leaf :data:`EMPTY_DICT` and :func:`decode_keys` turns it back into ``{}``.

DCP also keeps one copy of an entry that several ranks save under the same
name, written by whichever rank its planner picks; when the ranks' values
differ (a metric computed on rank 0 only), that is an arbitrary rank's value,
and when their types differ (a 0-d tensor on one rank, a float on another)
the planner fails. :func:`agree` compares the plain values of every rank at
save (one ``all_gather`` over the ``ctl`` side group) and keeps rank 0's where
they differ: the other ranks leave that key out of what they write.
"""

from __future__ import annotations

import hashlib
import logging
import math
import pickle
from typing import Any

import torch

from shardckpt import _dist
from shardckpt.errors import ConfigError

MODULE, OPTIMIZER, STATEFUL, VALUE, RNG = "module", "optimizer", "stateful", "value", "rng"
"""The kinds of a state key (recorded in the manifest's ``keys`` table)."""
STOCK = "stock"  # a key of an adopted stock DCP checkpoint: kind unknown until loaded

log = logging.getLogger("shardckpt")

_TAG = "#"
EMPTY_DICT = "\x00shardckpt:empty-dict\x00"
"""The leaf an empty dict is saved as (DCP writes nothing for an empty dict)."""
_SMALL_PICKLE = 4096  # plain leaves up to this size are compared by value, larger ones by digest
_SMALL_TENSOR = 64  # tensors with up to this many elements are compared by value, larger ones by shape/dtype


# ------------------------------------------------------------------ dict keys


def _encode_key(key: Any, where: str) -> str:
    if type(key) is str:
        return f"{_TAG}str:{key}" if key.startswith(_TAG) else key
    if type(key) is bool:
        return f"{_TAG}bool:{key}"
    if type(key) is int:
        return f"{_TAG}int:{key}"
    if type(key) is float:
        return f"{_TAG}float:{key!r}"
    if key is None:
        return f"{_TAG}none"
    raise ConfigError(
        f"the dict at {where} has a key {key!r} of type {type(key).__name__}: keys of plain values must be "
        f"str, int, float, bool or None to round-trip. Remedy: convert the key (e.g. int(key) or str(key)), or "
        f"keep the object in a stateful object with its own state_dict()"
    )


def decode_key(key: Any) -> Any:
    """One dict key as it was before :func:`encode_keys` tagged it."""
    if not isinstance(key, str) or not key.startswith(_TAG):
        return key
    tag, _, text = key[1:].partition(":")
    if tag == "str":
        return text
    if tag == "int":
        return int(text)
    if tag == "float":
        return float(text)
    if tag == "bool":
        return text == "True"
    if tag == "none":
        return None
    return key  # not ours


def encode_keys(value: Any, where: str) -> Any:
    """``value`` with every dict key DCP would turn into a string written as a tagged string.

    Walks dicts and lists (what DCP walks into; a tuple is stored whole, its
    keys intact). Returns ``value`` itself when nothing needs a tag: the
    caller's objects are never changed.
    """
    if isinstance(value, dict):
        if not value:
            return EMPTY_DICT
        out = {}
        changed = False
        for k, v in value.items():
            name = _encode_key(k, where)
            item = encode_keys(v, f"{where}[{k!r}]")
            changed |= name is not k or item is not v
            out[name] = item
        return out if changed else value
    if isinstance(value, list):
        items = [encode_keys(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if any(a is not b for a, b in zip(items, value)) else value
    return value


def decode_keys(value: Any) -> Any:
    """The inverse of :func:`encode_keys` (in place for dicts and lists, which are freshly loaded)."""
    if isinstance(value, str) and value == EMPTY_DICT:
        return {}
    if isinstance(value, dict):
        items = [(decode_key(k), decode_keys(v)) for k, v in value.items()]
        value.clear()
        value.update(items)
        return value
    if isinstance(value, list):
        value[:] = [decode_keys(v) for v in value]
    return value


# ---------------------------------------------------------- one value per key


def _leaf(value: Any) -> tuple:
    """What is compared across ranks for one leaf DCP stores."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):  # shards differ by rank by design: compare the global shape
        return ("dtensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, torch.Tensor):
        if value.numel() <= _SMALL_TENSOR:
            return ("tensor", tuple(value.shape), str(value.dtype), value.detach().cpu().tolist())
        return ("tensor", tuple(value.shape), str(value.dtype))
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    try:
        blob = pickle.dumps(value, protocol=4)
    except Exception:  # noqa: BLE001 - the write reports it, naming the entry
        return (kind, "unpicklable")
    if len(blob) <= _SMALL_PICKLE:
        return (kind, "value", value)
    return (kind, "digest", len(blob), hashlib.sha256(blob).hexdigest())


def _same(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return a is b
    if len(a) != len(b) or a[:-1] != b[:-1]:
        return False
    x, y = a[-1], b[-1]
    try:
        if bool(x == y):
            return True
    except Exception:  # noqa: BLE001 - e.g. numpy arrays: compare their bytes below
        pass
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return pickle.dumps(x, protocol=4) == pickle.dumps(y, protocol=4)
    except Exception:  # noqa: BLE001
        return False


def _show(leaf: tuple | None) -> str:
    if leaf is None:
        return "absent"
    if leaf[0] in ("tensor", "dtensor"):
        shape = "x".join(map(str, leaf[1])) or "0-d"
        body = f" {leaf[3]!r}" if len(leaf) > 3 else ""
        return f"{leaf[0]} {shape} {leaf[2].replace('torch.', '')}{body}"[:80]
    kind = leaf[0].rpartition(".")[2]
    if leaf[1] == "value":
        return f"{kind} {leaf[2]!r}"[:80]
    return kind


def _summaries(key: str, value: Any) -> dict[str, tuple]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({key: value})
    return {fqn: _leaf(item) for fqn, item in flat.items()}


def agree(
    captured: dict[str, Any], kinds: dict[str, str], groups: _dist.SideGroups, step: int, warned: set[str]
) -> dict[str, Any]:
    """Tag dict keys, then make every rank save rank 0's plain values (collective over ``ctl``).

    Returns the state dict to write (``captured`` with tagged keys; on ranks
    other than 0, without the plain values that differ from rank 0's). A key
    refused on any rank raises :class:`ConfigError` on every rank. ``warned``
    holds the keys already warned about (one warning per key and instance).
    """
    out = dict(captured)
    error = None
    mine: dict[str, dict[str, tuple]] = {}
    try:
        for key, kind in kinds.items():
            if kind in (VALUE, STATEFUL) and key in out:
                out[key] = encode_keys(out[key], repr(key))
            if kind == VALUE and key in out:
                mine[key] = _summaries(key, out[key])
    except ConfigError as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the exchange below, then all raise
        error = f"the plain values could not be compared ({type(exc).__name__}: {exc})"
    if _dist.world_size() == 1:
        if error is not None:
            raise ConfigError(f"step {step}: {error}")
        return out
    gathered = groups.all_gather_ctl((mine, error))
    errors = [(r, e) for r, (_m, e) in enumerate(gathered) if e is not None]
    if errors:
        ranks = ", ".join(str(r) for r, _e in errors)
        raise ConfigError(f"step {step}: nothing was saved; on rank(s) {ranks}: {errors[0][1]}")
    first = gathered[0][0]
    rank = _dist.rank()
    for key in sorted(set().union(*(set(m) for m, _e in gathered))):
        ref = first.get(key, {})
        differ: dict[int, list[str]] = {}
        for r, (theirs, _e) in enumerate(gathered[1:], start=1):
            leaves = theirs.get(key, {})
            diffs = [
                f"{fqn}: rank 0 {_show(ref.get(fqn))}, rank {r} {_show(leaves.get(fqn))}"
                for fqn in sorted(set(ref) | set(leaves))
                if not _same(ref.get(fqn), leaves.get(fqn))
            ]
            if diffs:
                differ[r] = diffs
        if not differ:
            continue
        sharded = any(leaf[0] == "dtensor" for m, _e in gathered for leaf in m.get(key, {}).values())
        example = next(iter(differ.values()))[0]
        message = (
            f"the plain value {key!r} differs across ranks (rank(s) {', '.join(map(str, sorted(differ)))} differ "
            f"from rank 0; e.g. {example})"
        )
        remedy = (
            f"Remedy: wrap a value that belongs to each rank in shardckpt.PerRank(...), or make it the same on every "
            f"rank before save() (e.g. torch.distributed.broadcast_object_list from rank 0)"
        )
        if sharded:  # leaving the key out would leave out this rank's shards too
            raise ConfigError(f"step {step}: nothing was saved: {message}. {remedy}.")
        if rank != 0:
            out.pop(key, None)
        if key not in warned:
            warned.add(key)
            if rank == 0:
                log.warning("shardckpt: step %d: %s; saving rank 0's value. %s", step, message, remedy)
    return out
