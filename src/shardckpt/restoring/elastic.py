"""Elastic restore: what changes when a job resumes at another world size.

A checkpoint saved by ``W`` ranks restores at any ``W'`` (DCP reshards the
module and optimizer tensors). What the tensors cannot say is how training
should go on. That is the :class:`ElasticPlan`, computed by ``load()`` from
an :class:`ElasticPolicy` chosen by the user:

* ``keep_global_batch`` (default): the global batch ``W * b * A`` (ranks x
  micro-batch x accumulation steps) is kept; the accumulation steps are
  recomputed for the new world size and micro-batch. The learning rate is
  left alone. When ``W' * b'`` does not divide the global batch, the policy's
  ``on_inexact`` decides: ``error`` (the default of an explicit
  ``ElasticPolicy()``) raises, ``nearest`` takes the nearest accumulation
  count and logs the changed global batch as a warning. ``load()`` without
  ``elastic=`` uses ``ElasticPolicy(on_inexact="nearest")``: a restore never
  fails over the batch unless the user asked for that.
* ``scale_lr``: the accumulation steps are kept (or set by the policy), the
  global batch follows the world size, and the learning rate is scaled by
  ``G' / G`` (``linear``) or ``sqrt(G' / G)`` (``sqrt``). The factor is
  applied to every optimizer's param groups and every LR scheduler in the
  state, so the schedule continues at the same step on the new scale.

The training shape that was saved (micro-batch, accumulation) comes from the
manifest metadata (written when ``CheckpointConfig.micro_batch_size`` /
``grad_accum_steps`` are set) or else from a :class:`ResumableSampler` in the
state, which records its layout in its own state dict. The new micro-batch is
the policy's ``micro_batch``, else the config's ``micro_batch_size``, else the
sampler's ``batch_size``, else the saved one.

Per-rank state when the world size changes: rank ``r < min(W, W')`` gets rank
``r``'s saved RNG state; the saved state of ranks ``>= W'`` is dropped; ranks
``>= W`` are seeded deterministically from ``(step, rank)``
(``state.seed_fresh_rank``). The plan line says which ranks were dropped or
seeded. User state wrapped in :class:`PerRank` follows the same rule, with a
``fresh(rank)`` callback for the new ranks.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Any, Iterable, Mapping

import torch

from shardckpt.errors import ConfigError
from shardckpt.options import ACCUM_KEY, MICRO_BATCH_KEY, record_shape  # noqa: F401 - part of this module's API
from shardckpt.state.sampler import ResumableSampler

log = logging.getLogger("shardckpt")

__all__ = [
    "BatchPolicy",
    "ElasticPlan",
    "ElasticPolicy",
    "LRRule",
    "OnInexact",
    "apply_lr_factor",
    "compute_plan",
]

# Manifest metadata keys recording the saved training shape.


class BatchPolicy(str, enum.Enum):
    """What is kept when the world size changes."""

    KEEP_GLOBAL_BATCH = "keep_global_batch"
    SCALE_LR = "scale_lr"


class LRRule(str, enum.Enum):
    """How ``scale_lr`` maps the global-batch ratio to a learning-rate factor."""

    LINEAR = "linear"
    SQRT = "sqrt"


class OnInexact(str, enum.Enum):
    """What ``keep_global_batch`` does when the global batch cannot be kept exactly."""

    ERROR = "error"
    NEAREST = "nearest"


@dataclasses.dataclass(kw_only=True, frozen=True)
class ElasticPolicy:
    """How ``load()`` adapts batch and learning rate to a new world size."""

    batch: BatchPolicy = BatchPolicy.KEEP_GLOBAL_BATCH
    """``keep_global_batch`` (recompute accumulation) or ``scale_lr`` (scale the LR)."""

    lr_rule: LRRule = LRRule.LINEAR
    """With ``scale_lr``: ``linear`` (factor ``G'/G``) or ``sqrt`` (``sqrt(G'/G)``)."""

    on_inexact: OnInexact = OnInexact.ERROR
    """With ``keep_global_batch`` when ``W' * b'`` does not divide the global batch:
    ``error`` raises :class:`ConfigError`, ``nearest`` rounds the accumulation and logs it."""

    micro_batch: int | None = None
    """Per-rank micro-batch of the resumed run; ``None``: the config's
    ``micro_batch_size``, else the sampler's ``batch_size``, else the saved one."""

    accum_steps: int | None = None
    """With ``scale_lr``: accumulation steps of the resumed run; ``None`` keeps the saved ones."""

    require_shape: bool = False
    """Raise when the saved micro-batch is unknown instead of logging a plan without batch fields."""

    def __post_init__(self) -> None:
        for name, enum_type in (("batch", BatchPolicy), ("lr_rule", LRRule), ("on_inexact", OnInexact)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum_type(value))
            except ValueError:
                allowed = ", ".join(e.value for e in enum_type)
                raise ConfigError(f"ElasticPolicy.{name} must be one of {allowed}, got {value!r}") from None
        for name in ("micro_batch", "accum_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"ElasticPolicy.{name} must be a positive int or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ElasticPlan:
    """What the resumed run must do; ``Checkpointer.last_plan`` after ``load()``.

    Batch fields are ``None`` when the saved micro-batch is unknown (no
    ``micro_batch_size`` in the config that saved, no ``ResumableSampler`` in
    the state); such a plan is never ``exact``: nothing says that the global
    batch is kept. ``epoch`` / ``samples_consumed`` are the global data position
    of the first ``ResumableSampler`` in the state (``None`` without one).
    """

    step: int
    policy: str
    saved_world_size: int
    world_size: int
    saved_micro_batch: int | None = None
    micro_batch: int | None = None
    saved_accum_steps: int | None = None
    accum_steps: int | None = None
    saved_global_batch: int | None = None
    global_batch: int | None = None
    lr_factor: float = 1.0
    exact: bool = True
    epoch: int | None = None
    samples_consumed: int | None = None
    rng: bool = True
    """Whether RNG state is restored per rank (``capture_rng``)."""

    @property
    def resharded(self) -> bool:
        return self.world_size != self.saved_world_size

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def rng_note(self) -> str:
        if not self.rng:
            return "RNG not captured (capture_rng=False)"
        w, w2 = self.saved_world_size, self.world_size
        if w2 < w:
            return f"RNG of saved ranks {_span(w2, w)} dropped"
        if w2 > w:
            return f"ranks {_span(w, w2)} seeded from (step, rank)"
        return "RNG restored per rank"

    def summary(self) -> str:
        """The plan in one line (logged by ``load()`` on rank 0)."""
        parts = [f"elastic plan for step {self.step} ({self.policy}): "
                 f"world {self.saved_world_size} -> {self.world_size}"]
        if self.global_batch is not None:
            parts.append(
                f"micro-batch {self.saved_micro_batch} -> {self.micro_batch}, accumulation "
                f"{self.saved_accum_steps} -> {self.accum_steps}, global batch {self.saved_global_batch} -> "
                f"{self.global_batch}{'' if self.exact else ' (not exact)'}"
            )
        elif self.resharded:
            parts.append(
                f"batch shape unknown: the global batch becomes x{self.world_size / self.saved_world_size:.6g} unless "
                f"the micro-batch or the accumulation steps change (not exact; set micro_batch_size and "
                f"grad_accum_steps in CheckpointConfig, or keep a ResumableSampler in the state, for a plan that "
                f"keeps it)"
            )
        else:
            parts.append("batch shape unknown (set micro_batch_size in CheckpointConfig or use a ResumableSampler)")
        parts.append(f"LR x{self.lr_factor:.6g}")
        if self.samples_consumed is not None:
            parts.append(f"data position epoch {self.epoch} sample {self.samples_consumed}")
        parts.append(self.rng_note())
        return ", ".join(parts)


def _span(lo: int, hi: int) -> str:
    return str(lo) if hi - lo == 1 else f"{lo}..{hi - 1}"


def compute_plan(
    policy: ElasticPolicy,
    *,
    step: int,
    saved_world_size: int,
    world_size: int,
    saved_micro_batch: int | None,
    saved_accum_steps: int | None = 1,
    micro_batch: int | None = None,
    epoch: int | None = None,
    samples_consumed: int | None = None,
) -> ElasticPlan:
    """Pure plan computation (no side effects); raises ConfigError per the policy."""
    base = dict(
        step=step,
        policy=(policy.batch.value if policy.batch == BatchPolicy.KEEP_GLOBAL_BATCH
                else f"scale_lr/{policy.lr_rule.value}"),
        saved_world_size=saved_world_size,
        world_size=world_size,
        epoch=epoch,
        samples_consumed=samples_consumed,
    )
    if saved_micro_batch is None:
        if policy.require_shape:
            raise ConfigError(
                f"step {step}: the checkpoint does not record its micro-batch size, so the elastic policy "
                f"{policy.batch.value!r} cannot be applied. Remedy: set CheckpointConfig.micro_batch_size (and "
                f"grad_accum_steps) when saving, or keep a ResumableSampler in the state"
            )
        return ElasticPlan(**base, exact=False)
    saved_accum = saved_accum_steps or 1
    new_micro = policy.micro_batch or micro_batch or saved_micro_batch
    saved_global = saved_world_size * saved_micro_batch * saved_accum
    per_round = world_size * new_micro
    if policy.batch == BatchPolicy.KEEP_GLOBAL_BATCH:
        exact = saved_global % per_round == 0
        if exact:
            accum = saved_global // per_round
        elif policy.on_inexact == OnInexact.ERROR:
            divisors = [d for d in range(1, saved_global + 1) if saved_global % (world_size * d) == 0]
            hint = (
                f"micro-batch sizes that keep it at {world_size} ranks: {divisors}"
                if divisors
                else f"no micro-batch keeps it at {world_size} ranks"
            )
            raise ConfigError(
                f"step {step}: the global batch {saved_global} ({saved_world_size} ranks x micro-batch "
                f"{saved_micro_batch} x accumulation {saved_accum}) cannot be kept at {world_size} ranks with "
                f"micro-batch {new_micro} ({hint}). Remedy: choose such a micro-batch, or load with "
                f"ElasticPolicy(on_inexact='nearest') or ElasticPolicy(batch='scale_lr')"
            )
        else:
            accum = max(1, int(math.floor(saved_global / per_round + 0.5)))
        return ElasticPlan(
            **base,
            saved_micro_batch=saved_micro_batch,
            micro_batch=new_micro,
            saved_accum_steps=saved_accum,
            accum_steps=accum,
            saved_global_batch=saved_global,
            global_batch=per_round * accum,
            lr_factor=1.0,
            exact=exact,
        )
    accum = policy.accum_steps or saved_accum
    new_global = per_round * accum
    ratio = new_global / saved_global
    factor = ratio if policy.lr_rule == LRRule.LINEAR else math.sqrt(ratio)
    return ElasticPlan(
        **base,
        saved_micro_batch=saved_micro_batch,
        micro_batch=new_micro,
        saved_accum_steps=saved_accum,
        accum_steps=accum,
        saved_global_batch=saved_global,
        global_batch=new_global,
        lr_factor=1.0 if new_global == saved_global else factor,
        exact=True,
    )


# ------------------------------------------------------------ LR application

# Param-group entries that hold learning rates (torch's schedulers keep
# ``initial_lr``; OneCycleLR keeps ``max_lr`` / ``min_lr``).
_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
# Scheduler attributes that hold learning rates (lists or scalars).
_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min")


def _is_scheduler(obj: Any) -> bool:
    from torch.optim import lr_scheduler

    return isinstance(obj, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau))


def _scale(value: Any, factor: float) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor):
        return value * factor
    if isinstance(value, (int, float)):
        return value * factor
    if isinstance(value, list):
        return [_scale(v, factor) for v in value]
    if isinstance(value, tuple):
        return tuple(_scale(v, factor) for v in value)
    return value


def apply_lr_factor(factor: float, optimizers: Iterable[Any] = (), schedulers: Iterable[Any] = ()) -> None:
    """Multiply every learning rate of ``optimizers`` and ``schedulers`` by ``factor``.

    Param groups: ``lr``, ``initial_lr``, ``max_lr``, ``min_lr``. Schedulers
    (recursing into ``SequentialLR`` / ``ChainedScheduler``): ``base_lrs``,
    ``_last_lr``, ``max_lrs``, ``min_lrs``, ``eta_min``. The step counter
    (``last_epoch``) is untouched, so the schedule goes on at the same step
    on the new scale. A tensor ``lr`` is updated in place.
    """
    if factor == 1.0:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key in _GROUP_LR_KEYS:
                if key not in group:
                    continue
                value = group[key]
                if isinstance(value, torch.Tensor):
                    value.mul_(factor)
                else:
                    group[key] = _scale(value, factor)
    seen: set[int] = set()
    for scheduler in schedulers:
        _scale_scheduler(scheduler, factor, seen)


def _scale_scheduler(scheduler: Any, factor: float, seen: set[int]) -> None:
    if id(scheduler) in seen:
        return
    seen.add(id(scheduler))
    for attr in _SCHED_LR_ATTRS:
        if hasattr(scheduler, attr):
            setattr(scheduler, attr, _scale(getattr(scheduler, attr), factor))
    for child in getattr(scheduler, "_schedulers", ()) or ():
        _scale_scheduler(child, factor, seen)


# ------------------------------------------------------------ per-rank user state


# ------------------------------------------------------------ after a restore


def _samplers(state: Mapping[str, Any]) -> list[Any]:
    return [v for v in state.values() if isinstance(v, ResumableSampler)]


def saved_shape(manifest_metadata: Mapping[str, Any], state: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(micro-batch, accumulation) recorded at save time, or (None, None)."""
    micro = manifest_metadata.get(MICRO_BATCH_KEY)
    if micro is not None:
        return int(micro), int(manifest_metadata.get(ACCUM_KEY) or 1)
    for sampler in _samplers(state):
        layout = sampler.saved_layout
        if layout and layout.get("batch_size"):
            return int(layout["batch_size"]), int(layout.get("accum_steps") or 1)
    return None, None


def after_restore(
    state: dict[str, Any],
    *,
    step: int,
    saved_world_size: int,
    world_size: int,
    manifest_metadata: Mapping[str, Any],
    policy: ElasticPolicy | None,
    config: Any,
    log_plan: bool,
) -> ElasticPlan:
    """Compute the plan, apply it to the live objects and log it in one line.

    Applying means: the LR factor to every optimizer and scheduler in
    ``state``; the accumulation steps to every ``ResumableSampler`` (its epoch
    ends on a whole optimizer step) and to the config, so that the next saves
    record the shape the run now has.
    """
    if policy is None:
        # No policy asked for: keep the global batch where possible, never fail
        # a restore over it (an inexact batch is logged as a warning).
        policy = ElasticPolicy(on_inexact=OnInexact.NEAREST)
    samplers = _samplers(state)
    saved_micro, saved_accum = saved_shape(manifest_metadata, state)
    new_micro = getattr(config, "micro_batch_size", None)
    if new_micro is None and samplers:
        new_micro = samplers[0].batch_size
    epoch = consumed = None
    if samplers:
        epoch, consumed = samplers[0].epoch, samplers[0].consumed
    try:
        plan = compute_plan(
            policy,
            step=step,
            saved_world_size=saved_world_size,
            world_size=world_size,
            saved_micro_batch=saved_micro,
            saved_accum_steps=saved_accum,
            micro_batch=new_micro,
            epoch=epoch,
            samples_consumed=consumed,
        )
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}. (The tensors of step {step} are already restored; no learning rate or "
            f"accumulation was changed.)"
        ) from None
    plan = dataclasses.replace(plan, rng=bool(getattr(config, "capture_rng", True)))
    if plan.lr_factor != 1.0:
        optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        schedulers = [v for v in state.values() if _is_scheduler(v)]
        apply_lr_factor(plan.lr_factor, optimizers, schedulers)
    if plan.accum_steps is not None:
        for sampler in samplers:
            if sampler.batch_size != plan.micro_batch:
                log.warning(
                    "shardckpt: the ResumableSampler has batch_size %d but the elastic plan's micro-batch is %d; "
                    "construct it with batch_size=%d",
                    sampler.batch_size,
                    plan.micro_batch,
                    plan.micro_batch,
                )
            sampler.accum_steps = plan.accum_steps
        record_shape(config, plan.micro_batch, plan.accum_steps)
    for sampler in samplers:
        if sampler.world_size != world_size:
            log.warning(
                "shardckpt: a ResumableSampler was built for world size %d but the job has %d ranks; "
                "build it after init_process_group (or pass world_size=%d, rank=...)",
                sampler.world_size,
                world_size,
                world_size,
            )
    if log_plan:
        # A global batch that changed, or one that nothing says is kept at another world size. (At the same world
        # size an unknown batch shape changes nothing by itself.)
        changed = not plan.exact and (plan.resharded or plan.global_batch is not None)
        (log.warning if changed else log.info)("shardckpt: %s", plan.summary())
    return plan
