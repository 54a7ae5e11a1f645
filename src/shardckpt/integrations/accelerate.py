"""Custom loops on ``accelerate`` and torchdata's ``StatefulDataLoader``.

``pip install "shardckpt[hf]"``. Neither accelerate nor torchdata is imported:
they are recognised by their attributes, so :func:`accelerator_state` and
:class:`LoaderState` work with only what a loop already imports. The Trainer
side is :mod:`shardckpt.integrations.hf`, which re-exports these names.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch.distributed as dist

from shardckpt import ConfigError, PerRank, ResumableSampler

log = logging.getLogger("shardckpt")

_SAMPLER_KEYS = ("epoch", "consumed", "global_batch", "dataset_len")

__all__ = ["LoaderState", "accelerator_state", "apply_plan"]


def _rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate's ``AcceleratedOptimizer`` / ``AcceleratedScheduler`` -> the torch object inside."""
    inner = getattr(obj, attr, None)
    return inner if inner is not None and type(obj).__name__.startswith("Accelerated") else obj


class _KeepsLiveKeys:
    """A stateful object whose ``load_state_dict`` gets its live state with the loaded entries over it.

    Steps written by shardckpt 0.1.0 lack entries that held only empty dicts
    (``LambdaLR``'s ``lr_lambdas: [{}]`` for a ``functools.partial`` lambda, as
    the Trainer's schedules have; later versions store them); the scheduler's
    own ``load_state_dict`` would fail on the missing key when resuming one.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        full = self.obj.state_dict()
        full.update(state)
        self.obj.load_state_dict(full)


def _scheduler(obj: Any) -> Any:
    return _KeepsLiveKeys(_unwrap(obj, "scheduler"))


# ---------------------------------------------------------------- StatefulDataLoader


def _sampler_of(loader: Any) -> ResumableSampler | None:
    for holder in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(holder, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            return sampler
    return None


def _sampler_position(loader_state: Any) -> tuple[int, int, int] | None:
    """(epoch, consumed, global batch) of a ResumableSampler inside a StatefulDataLoader's state dict.

    The state holds the sampler's state as of the last batch yielded (in a
    snapshot when workers run, plus the batches yielded since it).
    """
    found: list[dict] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if all(k in node for k in _SAMPLER_KEYS):
                found.append(node)
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(loader_state)
    if not found:
        return None
    sampler = found[0]
    since = int(loader_state.get("_steps_since_snapshot", 0) or 0) if isinstance(loader_state, dict) else 0
    return (int(sampler["epoch"]), int(sampler["consumed"]) + since * int(sampler["global_batch"]),
            int(sampler["global_batch"]))


class LoaderState(PerRank):
    """A torchdata ``StatefulDataLoader`` in the checkpointed state, kept per rank.

    ``state["loader"] = LoaderState(loader)`` (:func:`accelerator_state` wraps
    loaders itself). At the same world size and ``num_workers`` each rank gets
    its own loader state back: the next batch is the one after the last batch
    the loop received, workers included. When either changed, a loader state
    cannot be reused; then only the global position of the
    :class:`shardckpt.ResumableSampler` inside (``sampler=`` or the loader's
    own) is restored, as of the last batch yielded, and a line says so. After
    a load, ``exact`` tells which of the two happened.
    """

    def __init__(self, loader: Any, *, sampler: ResumableSampler | None = None) -> None:
        super().__init__(None)
        if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
            raise ConfigError(
                f"LoaderState needs a loader with state_dict()/load_state_dict() (torchdata's StatefulDataLoader), "
                f"got {type(loader).__name__}. Remedy: torchdata.stateful_dataloader.StatefulDataLoader(...), or put "
                f"a shardckpt.ResumableSampler in the state and set its position from the loop."
            )
        self.loader = loader
        self.sampler = sampler if sampler is not None else _sampler_of(loader)
        self.exact: bool | None = None

    def state_dict(self) -> dict[str, Any]:
        self.value = {"loader": self.loader.state_dict(), "num_workers": int(getattr(self.loader, "num_workers", 0)),
                      "world_size": _world_size()}
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = {int(k[4:]): v for k, v in state.items()
                 if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()}
        self.saved_world_size = max(saved) + 1 if saved else 0
        world, workers = _world_size(), int(getattr(self.loader, "num_workers", 0))
        own = saved.get(self.rank)
        if own is not None and self.saved_world_size == world and int(own["num_workers"]) == workers:
            self.loader.load_state_dict(own["loader"])
            self.value, self.restored, self.exact = own, True, True
            return
        self.restored, self.exact = False, False
        source = own if own is not None else (saved[min(saved)] if saved else None)
        position = None if source is None else _sampler_position(source["loader"])
        if position is None or self.sampler is None:
            raise ConfigError(
                f"the saved loader state ({self.saved_world_size} ranks, num_workers "
                f"{None if source is None else source['num_workers']}) does not fit this run ({world} ranks, "
                f"num_workers {workers}) and holds no ResumableSampler position to continue from. Remedy: give the "
                f"StatefulDataLoader a shardckpt.ResumableSampler, or resume with the saved world size and num_workers."
            )
        epoch, consumed, _ = position
        # An iterator made before the load (state_dict() makes one, and its workers prefetch) read the sampler's
        # old position: drop it, so that the next iter(loader) starts from the one set here.
        self.loader.load_state_dict({})
        self.sampler.epoch = epoch
        self.sampler.set_consumed(min(consumed, self.sampler.dataset_len))
        if self.rank == 0:
            log.info(
                "shardckpt: loader state saved by %d ranks with num_workers=%s, resumed by %d with num_workers=%d: "
                "restored the sampler's global position only (epoch %d, sample %d)", self.saved_world_size,
                source["num_workers"], world, workers, epoch, consumed,
            )


# ---------------------------------------------------------------- accelerate


def _is_stateful_loader(obj: Any) -> bool:
    if getattr(obj, "use_stateful_dataloader", True) is False:
        return False  # accelerate's DataLoaderShard over a plain DataLoader: its state_dict() is not a position
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)) and \
        hasattr(obj, "num_workers") and hasattr(obj, "dataset")


def accelerator_state(accelerator: Any, **extra: Any) -> dict[str, Any]:
    """The checkpointed state of a custom loop on ``accelerate``, from what the accelerator prepared.

    Returns ``{"model": ..., "optimizer": ..., "scheduler": ..., "scaler": ...,
    "custom_0": ..., "loader": ...}``: every prepared model (``model``,
    ``model_1``, ...), optimizer and scheduler (the torch objects inside
    accelerate's wrappers), the GradScaler, every object given to
    ``accelerator.register_for_checkpointing`` (``custom_<i>``), every prepared
    ``StatefulDataLoader`` (``loader``, ``loader_1``, ...) as a
    :class:`LoaderState`, then ``extra`` (keyword values; a
    ``StatefulDataLoader`` among them is wrapped too). Build it once, after
    ``prepare()``, and pass the same dict to ``save()`` and ``load()``.
    """
    state: dict[str, Any] = {}

    def put(base: str, items: list[Any]) -> None:
        for i, item in enumerate(items):
            state[base if i == 0 else f"{base}_{i}"] = item

    put("model", list(getattr(accelerator, "_models", [])))
    put("optimizer", [_unwrap(o, "optimizer") for o in getattr(accelerator, "_optimizers", [])])
    put("scheduler", [_scheduler(s) for s in getattr(accelerator, "_schedulers", [])])
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        state["scaler"] = scaler
    for i, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
        state[f"custom_{i}"] = obj
    loaders = list(getattr(accelerator, "_dataloaders", []))
    put("loader", [LoaderState(d) for d in loaders if _is_stateful_loader(d)])
    plain = len([d for d in loaders if not _is_stateful_loader(d)])
    if plain and _rank0():
        log.warning(
            "shardckpt: %d prepared DataLoader(s) keep no position of their own and are not in the state; a resume "
            "starts them from the beginning of the epoch. Remedy: "
            "Accelerator(dataloader_config=DataLoaderConfiguration("
            "use_stateful_dataloader=True)), or a shardckpt.ResumableSampler in the state", plain,
        )
    for key, value in extra.items():
        state[key] = LoaderState(value) if _is_stateful_loader(value) and not isinstance(value, LoaderState) else value
    return state


def apply_plan(plan: Any, *, accelerator: Any = None, samplers: Any = ()) -> int | None:
    """Apply an elastic plan's accumulation to an accelerator and to samplers; return it (``None``: unknown).

    ``step = ckpt.load(state); accum = apply_plan(ckpt.last_plan, accelerator=accelerator,
    samplers=[sampler])``. ``load()`` applies the plan to a ``ResumableSampler``
    at the top of the state; a sampler inside a loader and the accelerator's
    ``gradient_accumulation_steps`` are the loop's to set: this does both.
    """
    if plan is None or plan.accum_steps is None:
        return None
    if accelerator is not None:
        accelerator.gradient_accumulation_steps = int(plan.accum_steps)
    for sampler in samplers:
        sampler.accum_steps = int(plan.accum_steps)
    return int(plan.accum_steps)
