"""Digests of a training state, per top-level key, for ``shardckpt check-resume``.

:func:`digest` hashes what a ``save()`` call was given, as the save would
capture it (``state.capture``: a module's and an optimizer's state dicts,
``state_dict()`` of stateful objects, plain values) plus this process's RNG
state, without copying it: xxh3-64 over every tensor's bytes (this rank's
shard of a DTensor), over a ``torch.Generator``'s ``get_state()`` (never its
pickle, whose bytes differ between two processes for one state), and over a
canonical encoding of everything else (dicts in key order, pickles of plain
leaves: a float by its bit pattern, so that NaN is equal to NaN). The
fingerprint is a function of the state alone. Per key it keeps

* ``d``: the digest of the whole entry;
* ``parts``: one digest per entry of its state dict (a module's tensors, an
  optimizer's ``state`` and ``param_groups``, a sampler's fields), so that a
  report can say which part differs;
* ``values``: the small plain fields as they are (a sampler's ``epoch`` and
  position, a counter), ``value`` for a key that is a small plain value
  itself, and ``lr`` for an optimizer (its groups' learning rates), so that a
  report can show them;
* ``kind`` and ``role``: what the entry is (``model``, ``optimizer``,
  ``scheduler``, ``data``, ``rng``, ``value``, ``state``).

Every user key is kept under its own name; the check's own entry (this
process's generators) under :data:`OWN`, the state key no user key may take
(``state.RESERVED_KEY``). Used while a check runs
(:mod:`shardckpt.check_resume.probe`) and by ``shardckpt diff``.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any, Mapping

import torch
import xxhash

from shardckpt.saving import pending_grads
from shardckpt.state import capture as state_mod
from shardckpt.state.keys import MODULE, OPTIMIZER, STATEFUL

OWN = state_mod.RESERVED_KEY
"""The key of the process's generators in a record: reserved, so that no user key (``rng`` included) is hidden."""
MAX_PARTS = 4096
"""Entries of one key digested one by one; a larger entry keeps its whole digest only."""
_DATA_WORDS = ("sampler", "loader", "dataloader", "data")


def digest(state: Mapping[str, Any], rank: int) -> dict[str, dict[str, Any]]:
    """Per top-level key of ``state`` (and :data:`OWN`, this process's generators): its digests."""
    captured, kinds, _frozen = state_mod.capture(state, rank, capture_rng=False)
    out = {}
    for key, value in captured.items():
        out[key] = entry(value, kinds[key], _role(key, state[key], kinds[key], value))
    out[OWN] = entry(state_mod.get_rng_state(), "rng", "rng")
    for key in pending_grads.pending(state):  # not state (a checkpoint holds no .grad): what a resume loses
        out[key]["pending_grads"] = True
    return out


def _role(key: str, live: Any, kind: str, captured: Any) -> str:
    if kind == MODULE:
        return "model"
    if kind == OPTIMIZER:
        return "optimizer"
    if isinstance(live, torch.Generator):
        return "rng"
    names = " ".join([c.__name__.lower() for c in type(live).__mro__] + [key.lower()])
    if "scheduler" in names or (isinstance(captured, Mapping) and "last_epoch" in captured and "base_lrs" in captured):
        return "scheduler"
    if any(word in names for word in _DATA_WORDS):
        return "data"
    return "state" if kind == STATEFUL else "value"


def entry(value: Any, kind: str, role: str) -> dict[str, Any]:
    """The digests of one top-level key's captured value (see the module's docstring)."""
    whole = xxhash.xxh3_64()
    entry: dict[str, Any] = {"kind": kind, "role": role}
    if isinstance(value, Mapping) and len(value) <= MAX_PARTS:
        parts, values = {}, {}
        for name in _sorted(value):
            h = xxhash.xxh3_64()
            _feed(h, value[name])
            parts[str(name)] = h.hexdigest()
            whole.update(f"{name!r}={parts[str(name)]};".encode())
            if _small(value[name]):
                values[str(name)] = value[name]
        entry["parts"], entry["values"] = parts, values
        if kind == OPTIMIZER:
            groups = value.get("param_groups") or []
            entry["lr"] = [g.get("lr") for g in groups if isinstance(g, Mapping) and _small(g.get("lr"))]
    else:
        _feed(whole, value)
        if _small(value):
            entry["value"] = value
    entry["d"] = whole.hexdigest()
    return entry


def fingerprint(value: Any) -> str:
    """The digest of one value (a tensor, a generator, a plain or nested value): equal exactly when the values are."""
    h = xxhash.xxh3_64()
    _feed(h, value)
    return h.hexdigest()


def _small(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    return value is None or isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 80)


def _sorted(mapping: Mapping[Any, Any]) -> list[Any]:
    return sorted(mapping, key=lambda k: (type(k).__name__, repr(k)))


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` into the hash ``h``: its structure and every byte of it, in a fixed order."""
    if isinstance(value, torch.Tensor):
        _feed_tensor(h, value)
    elif isinstance(value, torch.Generator):  # by its state: the pickle's bytes differ between processes
        h.update(f"G{value.device}".encode())
        _feed_tensor(h, value.get_state())
    elif isinstance(value, float):  # the bit pattern: NaN equal to NaN, -0.0 not 0.0
        h.update(b"F" + struct.pack("<d", value))
    elif isinstance(value, Mapping):
        h.update(f"D{len(value)}(".encode())
        for key in _sorted(value):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b")")
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__[0]}{len(value)}(".encode())
        for item in value:
            _feed(h, item)
        h.update(b")")
    elif isinstance(value, (set, frozenset)):
        h.update(f"S{len(value)}(".encode())
        for item in sorted(value, key=repr):
            _feed(h, item)
        h.update(b")")
    elif type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype"):
        h.update(f"A{value.dtype.str}{getattr(value, 'shape', ())}".encode())
        h.update(value.tobytes())
    else:
        try:
            h.update(b"P" + pickle.dumps(value, protocol=4))
        except Exception:  # noqa: BLE001 - an object that cannot be pickled: only its type is compared
            h.update(f"O{type(value).__module__}.{type(value).__qualname__}".encode())


def _feed_tensor(h: Any, tensor: torch.Tensor) -> None:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
    if callable(to_local):
        tensor = to_local()
    tensor = tensor.detach()
    h.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.device.type == "meta":
        return
    if tensor.layout != torch.strided or tensor.is_quantized:
        h.update(pickle.dumps(tensor.cpu(), protocol=4))
        return
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    h.update(tensor.reshape(-1).view(torch.uint8).numpy())
