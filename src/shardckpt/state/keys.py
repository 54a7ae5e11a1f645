"""Plain values' keys in a save: the kinds of a state's entries, their dict keys' types, what belongs to one rank.

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

**What belongs to one rank.** Some values are per rank by nature: a
``torch.Generator`` anywhere in a plain value or a stateful object's state (a
per-rank shuffle generator), and the state of a data loader or sampler
(``torch.utils.data.DataLoader`` / ``Sampler`` with ``state_dict()``, other
than :class:`shardckpt.ResumableSampler`, whose position is global). Those
are saved under a key of their own rank, ``#rank:<r>``, and each rank reads
back its own (:func:`rank_of`); what a restore at another world size does
with them is in :mod:`shardckpt.state.per_rank`.
"""

from __future__ import annotations

import logging
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
_RANK = "#rank:"
"""The key of a per-rank entry: ``#rank:<r>`` holds rank ``r``'s value."""
_GENERATOR = "#generator:"
"""The key of a ``torch.Generator``'s state: ``{"#generator:<device type>": get_state()}``."""


class Own:
    """A captured value that belongs to this rank: :func:`encode_keys` stores it under ``#rank:<r>``."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def rank_of(part: Any) -> int | None:
    """The rank a ``#rank:<r>`` path element names, else ``None``."""
    if isinstance(part, str) and part.startswith(_RANK) and part[len(_RANK):].isdigit():
        return int(part[len(_RANK):])
    return None


def path_rank(path: tuple) -> tuple[int, bool] | None:
    """``(rank, whole)`` of a saved path inside a per-rank entry, else ``None``; ``whole``: the
    entry is a whole object's per-rank state (a data loader's), not a generator."""
    for i, part in enumerate(path):
        r = rank_of(part)
        if r is not None:
            after = path[i + 1] if i + 1 < len(path) else None
            return r, not (isinstance(after, str) and after.startswith(_GENERATOR))
    return None


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


def encode_keys(value: Any, where: str, rank: int = 0, _own: bool = False) -> Any:
    """``value`` with every dict key DCP would turn into a string written as a tagged string.

    Walks dicts and lists (what DCP walks into; a tuple is stored whole, its
    keys intact). A ``torch.Generator`` becomes its state under this rank's
    key (``{"#rank:<r>": {"#generator:cpu": state}}``), an :class:`Own`
    value its content under this rank's key. Returns ``value`` itself when
    nothing needs a tag: the caller's objects are never changed.
    """
    if isinstance(value, Own):
        return {f"{_RANK}{rank}": encode_keys(value.value, where, rank, True)}
    if isinstance(value, torch.Generator):
        body = {f"{_GENERATOR}{value.device.type}": value.get_state()}
        return body if _own else {f"{_RANK}{rank}": body}
    if isinstance(value, dict):
        if not value:
            return EMPTY_DICT
        out = {}
        changed = False
        for k, v in value.items():
            name = _encode_key(k, where)
            item = encode_keys(v, f"{where}[{k!r}]", rank, _own)
            changed |= name is not k or item is not v
            out[name] = item
        return out if changed else value
    if isinstance(value, list):
        items = [encode_keys(v, f"{where}[{i}]", rank, _own) for i, v in enumerate(value)]
        return items if any(a is not b for a, b in zip(items, value)) else value
    if isinstance(value, tuple) and _holds_generator(value):
        raise ConfigError(
            f"{where} is a tuple holding a torch.Generator: a tuple is stored whole (pickled), and a generator "
            f"is each rank's own, stored under its rank's key. Remedy: hold it in a list or a dict"
        )
    return value


def _holds_generator(value: Any) -> bool:
    if isinstance(value, torch.Generator):
        return True
    if isinstance(value, dict):
        return any(_holds_generator(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_generator(v) for v in value)
    return False


def decode_keys(value: Any, rank: int | None = None) -> Any:
    """The inverse of :func:`encode_keys` (in place for dicts and lists, which are freshly loaded).

    A per-rank entry becomes ``rank``'s value (default: this process's rank);
    a rank without one is left out of its dict (``None`` for a whole value).
    """
    out = _decode(value, _dist.rank() if rank is None else rank)
    return None if out is ABSENT else out


class _Absent:
    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return "<absent>"


ABSENT = _Absent()


def _decode(value: Any, rank: int) -> Any:
    if isinstance(value, str) and value == EMPTY_DICT:
        return {}
    if isinstance(value, dict):
        if value and all(rank_of(k) is not None for k in value):
            own = value.get(f"{_RANK}{rank}", ABSENT)
            return ABSENT if own is ABSENT else _decode(own, rank)
        if len(value) == 1:
            (name, state), = value.items()
            if isinstance(name, str) and name.startswith(_GENERATOR) and isinstance(state, torch.Tensor):
                generator = torch.Generator(device=name[len(_GENERATOR):])
                generator.set_state(state.to(torch.uint8).cpu())
                return generator
        items = [(decode_key(k), _decode(v, rank)) for k, v in value.items()]
        value.clear()
        value.update((k, v) for k, v in items if v is not ABSENT)
        return value
    if isinstance(value, list):
        value[:] = [None if item is ABSENT else item for item in (_decode(v, rank) for v in value)]
    return value
