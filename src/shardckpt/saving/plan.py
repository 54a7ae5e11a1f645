"""The save plan: what capturing a state gives, made once, then checked cheaply at every later save.

DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` walk every
parameter's names at every call (milliseconds for a few hundred tensors). What
they return for a module and its optimizer does not change between two steps
of a training loop: the same names, each a view of the same live parameter,
buffer or optimizer-state tensor. :meth:`SavePlan.build` calls them once
(``state.capture``) and then *proves* that, entry by entry:

* a module's entry is kept when every tensor DCP returned is a view of one of
  the module's live parameters or buffers with the same storage pointer,
  shape, stride, offset and dtype (for a DTensor: of its local shard, with the
  same placements and global shape);
* an optimizer's entry is kept when its ``state`` holds the optimizer's own
  per-parameter dicts and its ``param_groups`` map one to one onto the
  optimizer's groups (no state-dict hooks on the optimizer);
* the RNG state's tensors are the plan's own: :meth:`SavePlan.refresh` writes
  the generators' state into them in place at every save
  (``state.capture.HeldRng``), so the staging program copies them
  with the rest, without a walk.

Anything else (a module whose state-dict hooks make new tensors, FSDP1's
flattened state, a module with extra state) is captured again at every save,
as are the values that change every step: plain values, stateful objects'
``state_dict()``, the param groups' hyperparameters (a scheduler's learning
rate).

:meth:`SavePlan.holds` is the check of every later save, O(number of tensors)
comparisons of identities and integers: the state's keys and objects (a
replaced model, a plain value changing type or kind), every submodule's
parameters, buffers and children (a parameter replaced, a module added), every
parameter's and buffer's storage pointer, shape, stride, dtype and
``requires_grad`` (a ``.data`` swap, ``model.half()``, an FSDP2 reshard that
moves the local shard: the plan's views would read the old memory), the
optimizer's param groups (one added, a parameter added) and per parameter the
identity of its state dict, its keys and its tensors (state created by the
first step, a ``load_state_dict``) and each tensor's shape and dtype (the
copies read these very tensors; their buffers are laid out for those two).
When any differs, the Saver builds a new plan: a stale plan would copy the
tensors of the last build, not the live ones.

The comparisons run as C-level maps over whole lists (``map(len, dicts)``,
``map(Tensor.data_ptr, tensors)``, ...) and one list comparison each: after a
training step the tensors' metadata is out of the CPU's caches, and a Python
frame per tensor cost as much again as the reads themselves.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardckpt.state import capture as state_mod
from shardckpt.state.keys import MODULE, OPTIMIZER, RNG, VALUE

_tokens = itertools.count(1)


def _sharded(t: Any) -> tuple:
    """What a view of the DTensor ``t`` depends on: its shard's storage pointer, shape, stride and dtype, its
    placements and global shape."""
    local = t._local_tensor
    return (id(local), local.data_ptr(), local.shape, local.stride(), local.dtype, t.shape, t.placements,
            t.requires_grad)


_PTR = torch.Tensor.data_ptr
_STRIDE = torch.Tensor.stride
_META = operator.attrgetter("shape", "dtype", "requires_grad")
_FORM = operator.attrgetter("shape", "dtype")
_VALUES = operator.methodcaller("values")


class _Geometry:
    """What the copies of some tensors depend on, read at every check without a Python frame per tensor (C-level
    maps over the whole list; a DTensor's, :func:`_sharded`, one by one: whether it is one is asked once, here, a
    tensor's class cannot change).

    ``views``: the plan copies views of these tensors made at its build (a module's state dict), which read the
    memory the tensor had then: a plain tensor's storage pointer, stride, shape, dtype and ``requires_grad``.
    Otherwise the copies read the tensors themselves (an optimizer's state, the very objects), whose buffers are
    laid out for their shape and dtype: those two."""

    def __init__(self, tensors: list[torch.Tensor], *, views: bool) -> None:
        self.dense = [t for t in tensors if not isinstance(t, DTensor)]
        self.sharded = [t for t in tensors if isinstance(t, DTensor)]
        self.views = views
        self.recorded = self.read()

    def read(self) -> tuple:
        dense = self.dense
        if not self.views:
            return list(map(_FORM, dense)), list(map(_sharded, self.sharded))
        return (list(map(_PTR, dense)), list(map(_STRIDE, dense)), list(map(_META, dense)),
                list(map(_sharded, self.sharded)))

    def holds(self) -> bool:
        return self.read() == self.recorded


def _view_key(t: torch.Tensor) -> tuple:
    """What identifies the memory a captured tensor reads (compared with the live tensors')."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return (local.data_ptr(), tuple(local.shape), local.stride(), local.storage_offset(), local.dtype,
            isinstance(t, DTensor))


def _kind_of(value: Any) -> str:
    return state_mod.classify({"k": value})["k"]


class _ModuleWatch:
    """A module's tree as the plan saw it: per submodule the names and identities of its parameters, buffers and
    children and the sizes of what changes its state dict (non-persistent buffers, state-dict hooks), read for all
    submodules at once by C-level maps; the geometry of every parameter and buffer."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = list(module.modules())
        self.dicts = [d for m in self.modules for d in (m._parameters, m._buffers, m._modules)]
        self.counted = [c for m in self.modules
                        for c in (m._non_persistent_buffers_set, m._state_dict_hooks, m._state_dict_pre_hooks)]
        self.structure = self._structure()
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for m in self.modules:
            for t in itertools.chain(m._parameters.values(), m._buffers.values()):
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    tensors.append(t)
        self.geometry = _Geometry(tensors, views=True)

    def _structure(self) -> tuple:
        """Every watched dict's size, keys in order and values' identities; the sizes of the counted ones. (The
        identities are of objects the watch holds: the modules, and the tensors its geometry keeps.)"""
        dicts = self.dicts
        chain = itertools.chain.from_iterable
        return (list(map(len, dicts)), list(chain(dicts)), list(map(id, chain(map(_VALUES, dicts)))),
                list(map(len, self.counted)))

    def views(self) -> set[tuple]:
        return {_view_key(t) for t in itertools.chain(self.geometry.dense, self.geometry.sharded)}

    def holds(self) -> bool:
        return self._structure() == self.structure and self.geometry.holds()


class _OptimizerWatch:
    """An optimizer as the plan saw it; :meth:`capture` gives DCP's state dict of it again, its
    ``param_groups`` read anew (their hyperparameters change between steps), its ``state`` the live dicts."""

    def __init__(self, optim: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
        self.optim = optim
        groups = osd.get("param_groups")
        if (set(osd) != {"state", "param_groups"} or not isinstance(groups, list)
                or len(groups) != len(optim.param_groups) or _hooked(optim)):
            raise _NotPlannable
        self.fqns: list[list[str]] = []
        by_fqn: dict[str, Any] = {}
        for saved, live in zip(groups, optim.param_groups):
            if (list(saved) != [k for k in live if k != "params"] + ["params"]
                    or len(saved["params"]) != len(live["params"])):
                raise _NotPlannable
            self.fqns.append(list(saved["params"]))
            by_fqn.update(zip(saved["params"], live["params"]))
        self.groups = [(tuple(map(id, g["params"])), tuple(g)) for g in optim.param_groups]
        self.state = osd["state"]
        self.params: list[tuple[Any, int, tuple, list[tuple[Any, torch.Tensor]]]] = []
        tensors: list[torch.Tensor] = []
        for fqn, p in by_fqn.items():
            live = optim.state.get(p)
            if fqn in self.state and self.state[fqn] is not live:
                raise _NotPlannable
            if live is None:
                self.params.append((p, id(None), (), []))
                continue
            own = [(k, v) for k, v in live.items() if isinstance(v, torch.Tensor)]
            self.params.append((p, id(live), tuple(live), own))
            tensors.extend(v for _k, v in own)
        if len(self.state) != sum(1 for _p, sid, _k, _o in self.params if sid != id(None)):
            raise _NotPlannable
        self.geometry = _Geometry(tensors, views=False)
        self.tensors_only = len(optim.state) == len(self.params) and all(
            len(own) == len(keys) and sid != id(None) for _p, sid, keys, own in self.params)
        """Every parameter has its state, the optimizer's state holds nothing else, and it is made of tensors only
        (the common case: checked by C-level maps over all of it at once, in its own order; otherwise entry by
        entry, a value that is not a tensor may change)."""
        self.layout = self._layout(optim.state) if self.tensors_only else None

    @staticmethod
    def _layout(state: dict[Any, dict[str, Any]]) -> tuple:
        """The optimizer state's parameters and dicts (identities, in order), the dicts' sizes, keys in order and
        values' identities. Read by iterating the state, not by looking each parameter up (a tensor's hash is a
        Python call). None of these identities can be reused while the plan lives: the parameters are its
        groups', the dicts ``self.state`` keeps, the values the geometry keeps."""
        chain = itertools.chain.from_iterable
        lives = list(state.values())
        return (list(map(id, state)), list(map(id, lives)), list(map(len, lives)), list(chain(lives)),
                list(map(id, chain(map(_VALUES, lives)))))

    def holds(self) -> bool:
        optim = self.optim
        if len(optim.param_groups) != len(self.groups) or _hooked(optim):
            return False
        for g, (ids, keys) in zip(optim.param_groups, self.groups):
            if tuple(map(id, g["params"])) != ids or tuple(g) != keys:
                return False
        state = optim.state
        if self.tensors_only:
            if len(state) != len(self.params) or self._layout(state) != self.layout:
                return False
        else:
            for p, sid, keys, own in self.params:
                live = state.get(p)
                if id(live) != sid:
                    return False
                if live is not None:
                    if tuple(live) != keys:
                        return False
                    for k, v in own:
                        if live[k] is not v:
                            return False
        return self.geometry.holds()

    def capture(self) -> dict[str, Any]:
        groups = []
        for g, fqns in zip(self.optim.param_groups, self.fqns):
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(fqns)
            groups.append(packed)
        return {"state": self.state, "param_groups": groups}


def _hooked(optim: torch.optim.Optimizer) -> bool:
    return bool(getattr(optim, "_optimizer_state_dict_pre_hooks", None)
                or getattr(optim, "_optimizer_state_dict_post_hooks", None))


class _NotPlannable(Exception):
    """An entry whose capture is not proven to stay the same: captured again at every save."""


class SavePlan:
    """What a state's capture gives, proven to stay the same until :meth:`holds` says otherwise."""

    def __init__(self, state: Mapping[str, Any], rank: int, capture_rng: bool, *, light: bool,
                 trainable_only: bool) -> None:
        self.token = next(_tokens)
        """This build's identity (a staging program made for one plan is reused only under the same token)."""
        self.rank, self.capture_rng, self.light, self.trainable_only = rank, capture_rng, light, trainable_only
        captured, self.kinds, self.frozen = state_mod.capture(state, rank, capture_rng, light=light,
                                                              trainable_only=trainable_only)
        self._pairs = state_mod.pair_optimizers(state, self.kinds)
        self._top = [(key, id(value), type(value), self.kinds.get(key, OPTIMIZER)) for key, value in state.items()]
        self._modules: dict[str, _ModuleWatch] = {}
        self._optimizers: dict[str, _OptimizerWatch] = {}
        self._kept: dict[str, Any] = {}
        self._rng: state_mod.HeldRng | None = None
        for key, kind in self.kinds.items():
            if kind == RNG:  # the same tensors at every save, their values refreshed in place (refresh())
                self._kept[key] = captured[key]
                self._rng = state_mod.HeldRng(captured[key][RNG][state_mod.rng_key(rank)])
            elif kind == MODULE:
                watch = _ModuleWatch(state[key])
                self._modules[key] = watch
                if _all_views_of(captured[key], watch.views()):
                    self._kept[key] = captured[key]
            elif kind == OPTIMIZER:
                try:
                    self._optimizers[key] = _OptimizerWatch(state[key], captured[key])
                except _NotPlannable:
                    pass
        self.fixed = [(key,) for key in self._kept] + [(key, "state") for key in self._optimizers]
        """Paths of the subtrees whose tensors are the same objects at every save under this plan."""
        self.first: dict[str, Any] | None = captured
        """The build's own capture, used by the save that built the plan."""

    def holds(self, state: Mapping[str, Any]) -> bool:
        """Every fact the plan rests on is unchanged (O(number of tensors) comparisons)."""
        if len(state) != len(self._top):
            return False
        for (key, vid, vtype, kind), (live_key, value) in zip(self._top, state.items()):
            if key != live_key or type(value) is not vtype:
                return False
            if kind == VALUE:
                if vid != id(value) and _kind_of(value) != VALUE:
                    return False
            elif vid != id(value):
                return False
        for watch in self._modules.values():
            if not watch.holds():
                return False
        for watch in self._optimizers.values():
            if not watch.holds():
                return False
        return True

    def refresh(self) -> bool:
        """The plan's own tensors that change at every save brought up to date in place: the RNG state (call
        after :meth:`holds`, right before :meth:`capture`). ``False``: they cannot take it (a generator appeared,
        CUDA's); a new plan is needed."""
        if self._rng is None or self.first is not None:
            return True
        return self._rng.refresh()

    def volatile(self, captured: dict[str, Any]) -> dict[str, Any]:
        """``captured`` without the subtrees at the fixed paths (what may change between saves under this plan)."""
        out = {k: v for k, v in captured.items() if k not in self._kept}
        for key in self._optimizers:
            if isinstance(out.get(key), dict):
                out[key] = {k: v for k, v in out[key].items() if k != "state"}
        return out

    def capture(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str], dict[str, dict[str, Any]]]:
        """``state.capture``'s result for ``state`` under this plan (call :meth:`holds` first)."""
        first, self.first = self.first, None
        if first is not None:
            return first, self.kinds, self.frozen
        sd: dict[str, Any] = {}
        for key, kind in self.kinds.items():
            if key in self._kept:
                sd[key] = self._kept[key]
            elif key in self._optimizers:
                sd[key] = self._optimizers[key].capture()
            else:
                sd[key], _left = state_mod.capture_entry(state, key, kind, self._pairs,
                                                         trainable_only=self.trainable_only)
        return sd, self.kinds, self.frozen


def _all_views_of(captured: Any, views: set[tuple]) -> bool:
    """Every leaf of a module's captured state dict is a tensor reading one of the live tensors' memory."""
    if not isinstance(captured, dict):
        return False
    for value in captured.values():
        if not isinstance(value, torch.Tensor) or _view_key(value) not in views:
            return False
    return True
