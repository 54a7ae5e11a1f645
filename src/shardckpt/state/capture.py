"""Capture and restore of the full training state.

``capture`` turns the user's ``state`` dict into a DCP state dict plus a
``kinds`` map (top-level key -> kind). ``restore`` puts a loaded state dict
back into the live objects. Kinds:

* ``module``    ``nn.Module`` (plain, DDP, FSDP2) via DCP's ``get_model_state_dict``
* ``optimizer`` an optimizer, paired with the module that owns its parameters
* ``stateful``  anything with ``state_dict()`` / ``load_state_dict()``
* ``value``     plain values: tensors, numbers, strings, containers of them
* ``rng``       per-rank RNG state, stored under a per-rank key (DCP keeps one
  copy of a key saved by several ranks, so per-rank state needs its own key)

A data loader or sampler with ``state_dict()`` (other than a
:class:`~shardckpt.ResumableSampler`, whose position is global) is stateful
and per rank by nature: its state is captured as :class:`keys.Own` and
stored under this rank's key (see :mod:`shardckpt.state.values`), as is every
``torch.Generator`` in a plain value or a stateful object's state.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from shardckpt.errors import ConfigError, MetaDeviceError
from shardckpt.state.keys import Own, decode_key, decode_keys
from shardckpt.state.sampler import ResumableSampler

try:  # numpy is optional
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch wheels' users
    np = None  # type: ignore[assignment]

log = logging.getLogger("shardckpt")

RESERVED_KEY = "_shardckpt"
from shardckpt.state.keys import MODULE, OPTIMIZER, RNG, STATEFUL, STOCK, VALUE  # noqa: E402,F401 - the kinds, part of this API


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def classify(state: Mapping[str, Any]) -> dict[str, str]:
    kinds: dict[str, str] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or "." in key:
            raise ConfigError(f"state keys must be non-empty strings without '.', got {key!r}")
        if key == RESERVED_KEY:
            raise ConfigError(f"the state key {RESERVED_KEY!r} is reserved for shardckpt's own entries")
        if isinstance(value, nn.Module):
            kinds[key] = MODULE
        elif isinstance(value, torch.optim.Optimizer):
            kinds[key] = OPTIMIZER
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            kinds[key] = STATEFUL
        else:
            kinds[key] = VALUE
    return kinds


def per_rank_by_nature(value: Any) -> bool:
    """A data loader or sampler whose state is each rank's own position (not a ResumableSampler's global one)."""
    from torch.utils.data import DataLoader, Sampler

    return isinstance(value, (DataLoader, Sampler)) and not isinstance(value, ResumableSampler)


def pair_optimizers(state: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, str]:
    """Optimizer key -> key of the module that owns its parameters."""
    modules = {k: state[k] for k, kind in kinds.items() if kind == MODULE}
    pairs: dict[str, str] = {}
    for key, kind in kinds.items():
        if kind != OPTIMIZER:
            continue
        params = {id(p) for group in state[key].param_groups for p in group["params"]}
        owners = [
            mk for mk, module in modules.items() if any(id(p) in params for p in module.parameters())
        ]
        if not owners and any(p.device.type == "meta" for group in state[key].param_groups for p in group["params"]):
            raise MetaDeviceError(
                f"optimizer {key!r} holds parameters on the meta device that belong to no module in the state: "
                f"it was created before `to_empty()`, which gave the module new parameters. Remedy: build the "
                f"model on meta, (shard it,) call `model.to_empty(device=...)`, then create the optimizer from "
                f"model.parameters(), then load().",
                unexpected=[key],
            )
        if len(owners) != 1:
            found = "no module" if not owners else f"several modules ({', '.join(owners)})"
            raise ConfigError(
                f"optimizer {key!r} must be paired with exactly one module in the state dict; "
                f"its parameters belong to {found}. Put the module it optimises in the same state dict."
            )
        pairs[key] = owners[0]
    return pairs


def capture(
    state: Mapping[str, Any],
    rank: int,
    capture_rng: bool,
    *,
    light: bool = False,
    trainable_only: bool = False,
) -> tuple[dict[str, Any], dict[str, str], dict[str, dict[str, Any]]]:
    """Build the DCP state dict (tensors still live: staging copies them).

    ``light`` leaves the optimizers out (a light step: model and small state).
    ``trainable_only`` leaves out each module's frozen entries (see
    :func:`frozen_names`). Returns ``(state dict, kinds, frozen)`` where
    ``frozen`` maps a module key to ``{fqn: {"shape", "dtype"}}`` of what was left out.
    """
    kinds = classify(state)
    pairs = pair_optimizers(state, kinds)
    sd: dict[str, Any] = {}
    frozen: dict[str, dict[str, Any]] = {}
    for key, kind in kinds.items():
        if kind == OPTIMIZER and light:
            continue
        sd[key], left_out = capture_entry(state, key, kind, pairs, trainable_only=trainable_only)
        if left_out is not None:
            frozen[key] = left_out
    if light:
        kinds = {k: v for k, v in kinds.items() if v != OPTIMIZER}
    if capture_rng:
        sd[RESERVED_KEY] = {RNG: {rng_key(rank): get_rng_state()}}
        kinds[RESERVED_KEY] = RNG
    return sd, kinds, frozen


def capture_entry(
    state: Mapping[str, Any], key: str, kind: str, pairs: Mapping[str, str], *, trainable_only: bool = False,
) -> tuple[Any, dict[str, Any] | None]:
    """One entry of :func:`capture`: ``(what is saved of state[key], what trainable_only left out or None)``."""
    value = state[key]
    if kind == MODULE:
        sd = get_model_state_dict(value)
        if not trainable_only:
            return sd, None
        left_out = frozen_names(value) & set(sd)
        return {n: v for n, v in sd.items() if n not in left_out}, {n: _describe(sd[n]) for n in sorted(left_out)}
    if kind == OPTIMIZER:
        return get_optimizer_state_dict(state[pairs[key]], value), None
    if kind == STATEFUL:
        return (Own(value.state_dict()) if per_rank_by_nature(value) else value.state_dict()), None
    return value, None


def frozen_names(module: nn.Module) -> set[str]:
    """State-dict names of a module's frozen entries: parameters that do not require
    grad, and the buffers of submodules without any trainable parameter in or below them."""
    base = getattr(module, "module", module) if type(module).__name__ == "DistributedDataParallel" else module
    params = dict(base.named_parameters())
    owners = set()  # modules with a trainable parameter in them or below them
    for name, p in params.items():
        if p.requires_grad:
            parts = name.split(".")[:-1]
            owners.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    out = {name for name, p in params.items() if not p.requires_grad}
    out |= {name for name, _b in base.named_buffers() if name.rpartition(".")[0] not in owners}
    return out


def _describe(tensor: Any) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", "")}


@torch.no_grad()
def fingerprints(module: nn.Module, names: list[str], group: Any) -> dict[str, list[float]]:
    """A cheap, world-size independent fingerprint of named entries: ``[sum, sum of squares]``
    in float64, summed over the shards of sharded tensors (collective over ``group``; every
    rank calls it with the same names)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    sd = get_model_state_dict(module)
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    values = torch.zeros(len(names), 2, dtype=torch.float64)
    for i, name in enumerate(names):
        tensor = sd.get(name)
        if tensor is None:
            continue
        sharded = isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if sharded or rank0:
            local = local.detach().to(torch.float64)
            values[i, 0] = local.sum()
            values[i, 1] = (local * local).sum()
    if dist.is_available() and dist.is_initialized() and names:
        dist.all_reduce(values, group=group)
    return {name: [float(values[i, 0]), float(values[i, 1])] for i, name in enumerate(names)}


def fingerprints_differ(saved: list[float], live: list[float]) -> bool:
    """Sums of another partition of the same values differ by rounding only."""
    return any(abs(a - b) > 1e-6 * max(1.0, abs(a), abs(b)) for a, b in zip(saved, live))


def live_targets(state: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
    """State dicts that DCP loads into in place (modules and optimizers)."""
    pairs = pair_optimizers(state, kinds)
    out: dict[str, Any] = {}
    for key, kind in kinds.items():
        if kind == MODULE:
            out[key] = get_model_state_dict(state[key])
        elif kind == OPTIMIZER:
            # Also initialises a fresh optimizer's state, which DCP loads into.
            out[key] = get_optimizer_state_dict(state[pairs[key]], state[key])
    return out


class LiveTensors:
    """The caller's own tensors that saved plain values and stateful objects can be read into.

    ``find(path, md)`` walks the saved path (dict keys as DCP stores them:
    tagged by :func:`keys.encode_keys`; list positions) through the live
    ``state[key]`` of a plain value, or through ``state_dict()`` of a stateful
    object (called once per key in ``keys``: its tensors are usually the
    object's own), and returns the tensor there when it is a plain tensor of
    the saved shape and dtype: exactly the tensors :func:`fill_in_place` would
    copy into. The reader then fills it from the file directly; the copy
    afterwards is a no-op.
    """

    def __init__(self, state: Mapping[str, Any], kinds: Mapping[str, str], keys: Iterable[str]) -> None:
        # Taken before the read, outside DCP: an error in a state_dict() is the caller's own, not a read failure.
        self._roots: dict[str, Any] = {}
        for key in keys:
            kind, value = kinds.get(key), state.get(key, _NOTHING)
            if kind == STATEFUL and value is not _NOTHING:
                self._roots[key] = value.state_dict()
            elif kind == VALUE:
                self._roots[key] = value

    def find(self, path: tuple, md: Any) -> torch.Tensor | None:
        node = self._roots.get(str(path[0]), _NOTHING)
        for part in path[1:]:
            if isinstance(node, dict):
                name = decode_key(part)
                node = node[name] if name in node else node.get(part, _NOTHING)
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            else:
                return None
        if (
            type(node) is torch.Tensor
            and tuple(node.shape) == tuple(md.size)
            and node.dtype == md.properties.dtype
        ):
            return node
        return None


_NOTHING = object()


def restore(
    state: dict[str, Any],
    kinds: Mapping[str, str],
    loaded: Mapping[str, Any],
    *,
    strict: bool,
) -> list[str]:
    """Apply ``loaded`` to the live objects; returns the top-level keys restored."""
    pairs = pair_optimizers(state, kinds)
    options = StateDictOptions(strict=strict)
    restored = []
    for key, value in loaded.items():
        if key == RESERVED_KEY:
            continue
        kind = kinds.get(key, VALUE)
        if kind == MODULE:
            set_model_state_dict(state[key], value, options=options)
        elif kind == OPTIMIZER:
            set_optimizer_state_dict(state[pairs[key]], state[key], value, options=options)
        elif kind == STATEFUL:
            state[key].load_state_dict(decode_keys(value))  # a per-rank state: this rank's own
        else:
            value = decode_keys(value)
            state[key] = fill_in_place(state[key], value) if key in state else value
        restored.append(key)
    return restored


@torch.no_grad()
def fill_in_place(live: Any, loaded: Any) -> Any:
    """Put ``loaded`` into the caller's own ``live`` object where types allow; returns what to store.

    A user who keeps a reference (``meta = {}``; ``state = {"meta": meta}``)
    must see the restored values in *their* object, not in a new one that
    replaced it in ``state``. Dicts are updated key by key (keys only the
    live dict has stay), lists take the loaded items (same length: item by
    item, recursively), tensors of the same shape and dtype are copied into.
    Anything else (numbers, strings, tuples) is returned as loaded.
    """
    if isinstance(live, dict) and isinstance(loaded, dict):
        for k, v in loaded.items():
            live[k] = fill_in_place(live[k], v) if k in live else v
        return live
    if isinstance(live, list) and isinstance(loaded, (list, tuple)):
        if len(live) == len(loaded):
            for i, v in enumerate(loaded):
                live[i] = fill_in_place(live[i], v)
        else:
            live[:] = list(loaded)
        return live
    if isinstance(live, torch.Generator) and isinstance(loaded, torch.Generator) and live.device == loaded.device:
        live.set_state(loaded.get_state())  # a generator the caller holds continues from the saved state
        return live
    if (
        isinstance(live, torch.Tensor)
        and isinstance(loaded, torch.Tensor)
        and type(live) is torch.Tensor
        and live.shape == loaded.shape
        and live.dtype == loaded.dtype
    ):
        if live is not loaded:  # read straight into it (LiveTensors): nothing to copy
            live.copy_(loaded)
        return live
    return loaded


# ---------------------------------------------------------------- RNG state


def get_rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG state as tensors only (no pickled objects)."""
    version, internal, gauss = random.getstate()
    out = {
        "python": (torch.from_numpy(np.array((version, *internal), dtype=np.int64)) if np is not None
                   else torch.tensor([version, *internal], dtype=torch.int64)),  # (numpy: 3x faster)
        "python_gauss": torch.tensor(_gauss_pair(gauss), dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = torch.from_numpy(keys.astype(np.int64))
        out["numpy_meta"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
        out["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    stacked = _cuda_states()
    if stacked is not None:
        out["cuda"] = stacked
    return out


def _gauss_pair(gauss: float | None) -> tuple[float, float]:
    """Python's cached gaussian as ``(value, present)``."""
    return (0.0, 0.0) if gauss is None else (float(gauss), 1.0)


def _cuda_states() -> torch.Tensor | None:
    """CUDA's generators' states stacked on the CPU; ``None`` while CUDA is not initialised (initialised implies
    available; ``is_available()`` would query the device at every save)."""
    if not torch.cuda.is_initialized():
        return None
    return torch.stack([s.cpu() for s in torch.cuda.get_rng_state_all()])


class HeldRng:
    """The tensors of one :func:`get_rng_state` result, kept to take this process's RNG state again in place
    (:meth:`refresh`): a save plan copies them as part of its fixed program, without walking them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self._views = {k: t.numpy() for k, t in tensors.items()} if np is not None else {}
        """numpy views of the tensors (``Tensor.numpy()`` is a call into torch each time)."""
        self._python: tuple | None = None
        """Python's generator state last written (a generator the loop does not use is not written again)."""

    def refresh(self) -> bool:
        """The tensors made this process's RNG state now, in place: the same values as a new
        :func:`get_rng_state`. ``False``, the tensors untouched: they cannot take it (CUDA's generators
        appeared since, numpy is missing, a size differs); take a new :func:`get_rng_state` instead."""
        held, views = self.tensors, self._views
        if not views or "numpy" not in held:
            return self._copy_fresh()
        stacked = _cuda_states()
        if (stacked is not None) != ("cuda" in held):
            return False
        python = random.getstate()
        now = torch.get_rng_state()
        _name, keys, pos, has_gauss, cached = np.random.get_state()
        version, internal, gauss = python
        if (held["python"].shape != (len(internal) + 1,) or held["torch"].shape != now.shape
                or held["numpy"].shape != keys.shape or (stacked is not None and held["cuda"].shape != stacked.shape)):
            return False
        if python != self._python:  # (a tuple of ints compared at C speed: cheaper than writing it)
            self._python = None
            views["python"][0] = version
            views["python"][1:] = internal
            views["python_gauss"][:] = _gauss_pair(gauss)
            self._python = python
        held["torch"].copy_(now)
        views["numpy"][:] = keys
        views["numpy_meta"][:] = (pos, has_gauss)
        views["numpy_gauss"][0] = cached
        if stacked is not None:
            held["cuda"].copy_(stacked)
        return True

    def _copy_fresh(self) -> bool:
        """Without numpy: a new :func:`get_rng_state` copied into the tensors (when it has the same ones)."""
        fresh = get_rng_state()
        if list(fresh) != list(self.tensors) or any(
                fresh[k].shape != t.shape or fresh[k].dtype != t.dtype for k, t in self.tensors.items()):
            return False
        for k, t in self.tensors.items():
            t.copy_(fresh[k])
        return True


def set_rng_state(saved: Mapping[str, torch.Tensor]) -> None:
    values = saved["python"].tolist()
    gauss_value, has_gauss = saved["python_gauss"].tolist()
    random.setstate((int(values[0]), tuple(int(v) for v in values[1:]), gauss_value if has_gauss else None))
    torch.set_rng_state(saved["torch"].to(torch.uint8).cpu())
    if np is not None and "numpy" in saved:
        pos, has_gauss_np = saved["numpy_meta"].tolist()
        np.random.set_state(
            (
                "MT19937",
                saved["numpy"].numpy().astype(np.uint32),
                int(pos),
                int(has_gauss_np),
                float(saved["numpy_gauss"].item()),
            )
        )
    if "cuda" in saved and torch.cuda.is_available():
        states = saved["cuda"]
        count = min(states.shape[0], torch.cuda.device_count())
        torch.cuda.set_rng_state_all([states[i].to(torch.uint8).cpu() for i in range(count)])


def seed_fresh_rank(step: int, rank: int) -> None:
    """Deterministic RNG for a rank that has no saved state (the world grew)."""
    seed = (step * 1_000_003 + rank * 7919 + 0x5EED) % (2**31 - 1)
    random.seed(seed)
    torch.manual_seed(seed)
    if np is not None:
        np.random.seed(seed)
