"""What the restore reads into, checked before anything is read: no meta tensors, no key left behind.

Two traps of the matching step, each refused with an error that names every
entry concerned and the remedy:

* **Targets on the meta device.** torchtitan and PyTorch's FSDP2 example
  build the model under ``torch.device("meta")`` and call ``to_empty()``
  before use. A ``load()`` before ``to_empty()`` has nothing to read into:
  copying into a meta tensor is a no-op, so the model and its optimizer
  state would stay on meta while the load said "restored". :func:`meta_entries`
  lists them (parameters, buffers, optimizer state, plain tensors); the
  restorer raises :class:`~shardckpt.errors.MetaDeviceError` on every rank
  before the read (the lists are exchanged, so every rank takes the same path).
* **A saved key that nothing restores.** The manifest's kinds table says how
  each top-level key was saved (module, optimizer, stateful, value); the
  live state says how it is loaded. Where the two disagree such that the
  saved entries are read into nothing (saved as a module, passed as a plain
  value; or a key missing from the kinds table), the live object would keep
  its values without a word. :func:`unrestored` lists those keys, and the
  load raises instead.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping

import torch

from shardckpt.errors import MetaDeviceError, StateMismatchError

log = logging.getLogger("shardckpt")

_SHOWN = 60


def _walk(prefix: str, value: Any, out: list[str]) -> None:
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            out.append(prefix)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _walk(f"{prefix}.{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(f"{prefix}.{i}", v, out)


def meta_entries(state: Mapping[str, Any], kinds: Mapping[str, str], targets: Mapping[str, Any]) -> list[str]:
    """Dotted names of the entries of the state to load into that live on the meta device.

    ``targets``: the modules' and optimizers' state dicts the read goes into
    (:func:`shardckpt.state.capture.live_targets`); plain values are walked as they are.
    """
    out: list[str] = []
    for key, value in targets.items():
        _walk(key, value, out)
    for key, kind in kinds.items():
        if key not in targets and kind == "value":
            _walk(key, state.get(key), out)
    return sorted(out)


def refuse_meta(per_rank: list[list[str]], step: int, step_dir: str, rank: int = 0) -> None:
    """Raise :class:`MetaDeviceError` when any rank's state holds meta tensors (``per_rank``:
    :func:`meta_entries` of every rank, the same list on every rank). Rank 0's error lists the
    entries; the other ranks' errors are one short line pointing at it (the job prints the list once)."""
    ranks = [r for r, names in enumerate(per_rank) if names]
    if not ranks:
        return
    names = sorted({n for r in ranks for n in per_rank[r]})
    if rank != 0:
        raise MetaDeviceError(
            f"cannot restore step {step} from {step_dir}: {len(names)} entr{'y' if len(names) == 1 else 'ies'} of "
            f"the state to load into {'is' if len(names) == 1 else 'are'} on the meta device (rank 0's error lists "
            f"them). Nothing was loaded. Remedy: `model.to_empty(device=...)` before load(), then create the "
            f"optimizer from its parameters.",
            unexpected=names,
        )
    shown = ", ".join(names[:_SHOWN]) + (f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")
    optim = [n for n in names if ".state." in n]
    where = "" if len(per_rank) <= 1 else f" on rank(s) {', '.join(map(str, ranks[:16]))}"
    raise MetaDeviceError(
        f"cannot restore step {step} from {step_dir}: {len(names)} entr{'y' if len(names) == 1 else 'ies'} of the "
        f"state to load into {'is' if len(names) == 1 else 'are'} on the meta device{where} (no storage to read "
        f"into): {shown}."
        + (f" {len(optim)} of them are optimizer state, initialised from meta parameters." if optim else "")
        + " Nothing was loaded. Remedy: materialize the model before load(): `model.to_empty(device=...)` "
        "(after fully_shard() for FSDP2), then create the optimizer from its parameters, then load(); "
        "the checkpoint provides every value, so no init_weights() is needed for a resume.",
        unexpected=names,
    )


def unrestored(
    saved_top: Iterable[str],
    saved_kinds: Mapping[str, str],
    live_kinds: Mapping[str, str],
    loaded: Iterable[str],
    reserved: str,
) -> list[str]:
    """``key (saved as K, passed as L)`` for each top-level key the step holds data of that the
    read would not restore: read into nothing while the live state has the key, or dropped
    because the kinds table does not name it. (A key saved as a module, optimizer or stateful
    object that the live state lacks is the strict check's "unexpected" key, not this.)"""
    loaded = set(loaded)
    out = []
    for key in sorted(set(saved_top)):
        if key == reserved or key in loaded:
            continue
        if key in live_kinds:
            saved = saved_kinds.get(key, "nothing: it is not in the manifest's kinds table")
            out.append(f"{key} (saved as {saved}, passed as {live_kinds[key]})")
        elif key not in saved_kinds:
            out.append(f"{key} (not in the manifest's kinds table)")
    return out


def refuse_unrestored(keys: list[str], step: int, step_dir: str, manifest_path: str, *, strict: bool) -> None:
    """Raise :class:`StateMismatchError` for the keys of :func:`unrestored`; with ``strict=False``
    a warning names them (the caller asked to load what matches)."""
    if not keys:
        return
    what = (f"step {step} in {step_dir} holds data for {', '.join(keys)}, but as recorded in {manifest_path} it "
            f"would not be read into the object passed")
    if not strict:
        log.warning("shardckpt: loading with strict=False: %s; those keys keep their live values", what)
        return
    raise StateMismatchError(
        f"{what}: those keys would keep their live values. Nothing was loaded. "
        f"Remedy: pass the kind of object each key was saved from (a module, an optimizer, an object with "
        f"state_dict()/load_state_dict(), or a plain value); if you did, the manifest was altered: run "
        f"`shardckpt verify` and load an earlier step (load(state, step=N)).",
        unexpected=[k.split(" ", 1)[0] for k in keys],
    )
