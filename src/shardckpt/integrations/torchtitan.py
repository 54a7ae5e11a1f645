"""shardckpt as a torchtitan checkpoint backend (torchtitan 0.3).

Select it in a job's config the way torchtitan selects any checkpoint
manager, through the ``checkpoint`` field of ``Trainer.Config``::

    from shardckpt.integrations.torchtitan import ShardckptCheckpointManager

    config.checkpoint = ShardckptCheckpointManager.Config(
        enable=True, interval=100, keep_latest_k=3,
        remote="s3://bucket/runs/llama3",
    )

The trainer then calls the manager as it calls its own DCP manager (every
rank, at the same points): ``load(step)`` once before the loop, ``save(step)``
after every step (the interval decides), ``maybe_wait_for_staging()`` before
every optimizer step, ``close()`` at the end.

What is saved: the model parts, the optimizers, the LR schedulers, the
dataloader (per data-parallel rank), the train state and any other entry of
``states``, plus per-rank RNG. Saves are asynchronous: ``save`` returns once
the state is copied into host memory; the write, the commit (manifest last)
and the upload to ``remote`` run in the background. Restores reshard to the
current world size; every manifest records the batch shape of torchtitan's
config (``training.local_batch_size``, the ``Trainer``'s accumulation steps),
so that the elastic plan of a resume at another world size knows the saved
global batch (a warning says when torchtitan's config does not keep it). A
dataloader state saved at another data-parallel degree cannot be mapped to the
new ranks: it is dropped with a warning and every rank's dataloader starts
from the beginning of its data.

The last step (``save(step, last_step=True)``) is saved in full by default
(``last_save_model_only=False`` here, unlike torchtitan's own manager), so
that a resume takes it. With ``last_save_model_only=True`` it is saved without
optimizer state; a resume then takes the newest full step and one warning names
the newer model-only step(s) it did not use, and why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Literal

import torch
import torch.nn as nn
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
)

import shardckpt
from shardckpt import _dist
from shardckpt.errors import ConfigError
from shardckpt.options import record_shape

log = logging.getLogger("shardckpt")

__all__ = ["ShardckptCheckpointManager", "DataloaderState"]


class DataloaderState:
    """The dataloader as a per-rank entry of the state.

    torchtitan's dataloader keys its state by data-parallel rank
    (``dp_rank_N``) and raises when the data-parallel degree changed. Saved
    here as ``{"dp_world_size": W, "dp_rank_0": {...}, ...}`` (the entries of
    all ranks end up in the step; ranks of one data-parallel rank save the
    same entry). On restore at the same degree each rank takes its own entry;
    at another degree no saved position belongs to the new ranks: the state
    is dropped with a warning and every dataloader starts from the beginning.

    torchtitan's ``ParallelAwareDataloader`` pickles its state into bytes;
    here the underlying ``StatefulDataLoader`` state is saved as plain values
    instead, so that a restore never unpickles bytes from the checkpoint.
    """

    def __init__(self, dataloader: Any, dp_rank: int, dp_world_size: int) -> None:
        self.dataloader = dataloader
        self.dp_rank = int(dp_rank)
        self.dp_world_size = int(dp_world_size)
        self.restored: bool | None = None
        """After a load: whether this rank's position came from the checkpoint."""

    def _inner(self) -> tuple[Any, Any]:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader
        except ImportError:  # pragma: no cover - torchtitan depends on torchdata
            StatefulDataLoader = None
        if StatefulDataLoader is not None and isinstance(self.dataloader, StatefulDataLoader):
            return StatefulDataLoader.state_dict, StatefulDataLoader.load_state_dict
        return type(self.dataloader).state_dict, type(self.dataloader).load_state_dict

    def state_dict(self) -> dict[str, Any]:
        get, _set = self._inner()
        return {"dp_world_size": self.dp_world_size, f"dp_rank_{self.dp_rank}": get(self.dataloader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("dp_world_size")
        mine = state.get(f"dp_rank_{self.dp_rank}")
        if saved != self.dp_world_size:
            self.restored = False
            log.warning(
                "shardckpt: the dataloader state was saved at data-parallel degree %s and this run has %d: a saved "
                "position belongs to a data shard that no longer exists, so it is dropped. Every rank's dataloader "
                "starts again from the beginning of its shard of the data: samples seen before the checkpoint are "
                "seen again and the data order differs from an uninterrupted run (model, optimizer, LR schedule "
                "and train step are restored).", saved, self.dp_world_size,
            )
            return
        if mine is None:
            self.restored = False
            log.warning("shardckpt: the checkpoint has no dataloader state for data-parallel rank %d; it starts "
                        "from the beginning of its data", self.dp_rank)
            return
        _get, put = self._inner()
        put(self.dataloader, mine)
        self.restored = True


def _batch_shape(states: dict[str, Any], dp_world_size: int | None) -> tuple[int, int] | None:
    """(``training.local_batch_size``, gradient accumulation steps) of torchtitan's job config, read from the
    ``Trainer`` that torchtitan passes in ``states`` (its ``config.training`` and ``gradient_accumulation_steps``);
    ``None`` when no state holds it, or when the data-parallel degree is not the world size (tensor, pipeline or
    context parallel: the elastic plan counts every rank as a data-parallel one, so a shape recorded per rank
    would give it a false global batch)."""
    if dp_world_size is None or dp_world_size != _dist.world_size():
        return None
    for value in states.values():
        training = getattr(getattr(value, "config", None), "training", None)
        local = getattr(training, "local_batch_size", None)
        if not isinstance(local, int) or isinstance(local, bool) or local < 1:
            continue
        accum = getattr(value, "gradient_accumulation_steps", None)
        if not isinstance(accum, int) or accum < 1:  # as torchtitan's Trainer computes it
            total = getattr(training, "global_batch_size", -1)
            accum = total // (local * dp_world_size) if isinstance(total, int) and total > 0 else 1
        return local, max(1, accum)
    return None


class ShardckptCheckpointManager(BaseCheckpointManager):
    """A torchtitan ``BaseCheckpointManager`` backed by :class:`shardckpt.Checkpointer`.

    Built by torchtitan from :class:`ShardckptCheckpointManager.Config`
    (``config.checkpoint.build(dataloader=..., model_parts=..., ...)``).
    Every rank builds one and calls it at the same points.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint fields, plus the shardckpt options that matter for a torchtitan job.

        ``folder`` (relative to the job's dump folder) is the local tier;
        ``interval``, ``keep_latest_k``, ``load_step``, ``load_only``,
        ``enable_first_step_checkpoint`` and ``last_save_model_only`` keep
        their torchtitan meaning (the last with another default). HF export and
        seed checkpoints are not offered (use ``shardckpt export`` to write
        safetensors from a step).
        """

        initial_load_model_only: bool = False
        """Not used (``initial_load_path`` is not supported); ``False`` here so that torchtitan does not warn
        that it has no effect."""

        last_save_model_only: bool = False
        """Save the last step without optimizer state (a light step). ``False`` here (torchtitan's own
        manager: ``True``): the last step is saved in full, so that a resume takes it. With ``True`` a resume
        takes the newest full step, and a warning names the model-only step(s) after it."""

        remote: str | None = None
        """Remote tier, any fsspec URL (``s3://bucket/prefix``); one uploader process per node."""

        remote_keep_last: int | None = None
        """Steps kept on the remote (``None``: all)."""

        endpoint_url: str | None = None
        """S3-compatible endpoint; ``None`` uses ``AWS_ENDPOINT_URL`` or AWS."""

        mode: Literal["async", "sync"] = "async"
        """``async``: a save blocks the step only while the state is copied into host memory."""

        every_seconds: float | None = None
        """Also save when this many seconds passed since the last save (beside ``interval``)."""

        verify_on_load: bool = True
        """Check every file of the step against its checksum before loading."""

        on_corrupt: Literal["error", "fallback"] = "error"
        """``fallback``: a step failing verification is skipped for the previous one, with a warning."""

        run_id: str | None = None
        """Names the run; a load refuses steps another run wrote."""

        start_fresh: bool = False
        """Start a new history although the remote holds another run's steps."""

        exit_on_preemption: bool = True
        """After SIGTERM the next step saves at once and waits for the commit; then the process exits
        (``SystemExit(143)``) instead of training on until it is killed."""

        extra: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Any other :class:`shardckpt.CheckpointConfig` field, by name."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.mode not in ("async", "sync"):
                raise ValueError(f"checkpoint.mode must be 'async' or 'sync', got {self.mode!r}")
            if self.on_corrupt not in ("error", "fallback"):
                raise ValueError(f"checkpoint.on_corrupt must be 'error' or 'fallback', got {self.on_corrupt!r}")
            for name in ("initial_load_path", "initial_load_in_hf", "last_save_in_hf", "create_seed_checkpoint"):
                if getattr(self, name):
                    raise ValueError(
                        f"checkpoint.{name} is not supported by ShardckptCheckpointManager. Remedy: load or "
                        f"export HF/seed checkpoints with torchtitan's CheckpointManager, or export a step to "
                        f"safetensors with `shardckpt export`."
                    )
            if self.exclude_from_loading:
                raise ValueError(
                    "checkpoint.exclude_from_loading is not supported by ShardckptCheckpointManager (a step "
                    "restores every entry it holds). Remedy: leave it empty; a dataloader saved at another "
                    "data-parallel degree is already dropped with a warning."
                )
            known = {f.name for f in dataclasses.fields(shardckpt.CheckpointConfig)}
            unknown = sorted(set(self.extra) - known)
            if unknown:
                raise ValueError(f"checkpoint.extra has unknown shardckpt option(s): {', '.join(unknown)}")

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
        dp_rank: int | None = None,
        dp_world_size: int | None = None,
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        self.config = config
        self.folder = os.path.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        if len(model_parts) != 1:
            raise ConfigError(
                f"ShardckptCheckpointManager saves one model part per rank; this job has {len(model_parts)} "
                f"(pipeline parallel with several stages per rank). Remedy: use torchtitan's CheckpointManager "
                f"for this job."
            )
        self.model = model_parts[0]
        self.state: dict[str, Any] = {MODEL: self.model}
        inner = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(inner) != 1 or not isinstance(inner[0], torch.optim.Optimizer):
            raise ConfigError(
                f"ShardckptCheckpointManager expects one torch optimizer for the model part, got {len(inner)}. "
                f"Remedy: build the OptimizersContainer over one model part."
            )
        # The optimizer itself (not the container's flattened state dict): shardckpt pairs it with the model
        # and reshards its state with the parameters on a world-size change.
        self.state[OPTIMIZER] = inner[0]
        if lr_schedulers is not None:
            self.state[LR_SCHEDULER] = lr_schedulers
        if dataloader is not None:
            if dp_rank is None:
                dp_rank = getattr(dataloader, "dp_rank", 0)
            if dp_world_size is None:
                dp_world_size = getattr(dataloader, "dp_world_size", 1)
            self.dataloader_state: DataloaderState | None = DataloaderState(dataloader, dp_rank, dp_world_size)
            self.state[DATALOADER] = self.dataloader_state
        else:
            self.dataloader_state = None
        for key, value in states.items():
            if key in self.state:
                raise ConfigError(f"states[{key!r}] collides with the manager's own entry {key!r}; rename it")
            self.state[key] = value
        options: dict[str, Any] = dict(
            local_dir=self.folder,
            remote=config.remote,
            keep_last=config.keep_latest_k or None,
            remote_keep_last=config.remote_keep_last,
            endpoint_url=config.endpoint_url,
            mode=config.mode,
            every_steps=config.interval,
            every_seconds=config.every_seconds,
            verify_on_load=config.verify_on_load,
            on_corrupt=config.on_corrupt,
            run_id=config.run_id,
            start_fresh=config.start_fresh,
        )
        # The batch shape from torchtitan's own config, recorded in every manifest for the elastic plan of a
        # resume at another world size (extra= may set it instead).
        self.batch_shape = _batch_shape(states, dp_world_size)
        if self.batch_shape is not None and "micro_batch_size" not in config.extra:
            options["micro_batch_size"], options["grad_accum_steps"] = self.batch_shape
        options.update(config.extra)
        self.ckpt = shardckpt.Checkpointer(**options)
        self.loaded_step: int | None = None

    @property
    def last_plan(self) -> Any:
        """The elastic plan of the last load (world sizes, batch, LR), or ``None``."""
        return self.ckpt.last_plan

    def _load(self, step: int = -1) -> bool:
        # Newer model-only steps passed over: the restorer's one WARNING names them, and the new branch.
        restored = self.ckpt.load(self.state, None if step == -1 else step)
        self.loaded_step = restored
        if restored is None:
            if step != -1:
                raise shardckpt.CheckpointNotFoundError(
                    f"checkpoint.load_step={step}: no committed step {step} in {self.folder}"
                    + (f" or {self.config.remote}" if self.config.remote else "")
                    + ". Remedy: pick a step from `shardckpt ls`, or -1 for the newest."
                )
            return False  # load() said that there is nothing to resume
        self._keep_shape(restored)
        return True

    def _keep_shape(self, step: int) -> None:
        """After a load: later saves record the shape this job trains with (torchtitan's accumulation comes from
        its config, not from the plan), and a WARNING says when that does not keep the saved global batch."""
        plan, shape = self.ckpt.last_plan, self.batch_shape
        if shape is None or "micro_batch_size" in self.config.extra:
            return
        record_shape(self.ckpt.config, *shape)
        if plan is None or plan.saved_global_batch is None or _dist.rank() != 0:
            return
        local, accum = shape
        now = plan.world_size * local * accum
        if now != plan.saved_global_batch:
            log.warning(
                "shardckpt: step %d was saved with a global batch of %d (%d rank(s) x training.local_batch_size %d x "
                "%d accumulation steps); this job trains with %d (%d rank(s) x %d x %d): torchtitan takes its "
                "accumulation steps from its config, not from the elastic plan. Remedy: "
                "training.global_batch_size=%d keeps the saved global batch%s.", step, plan.saved_global_batch,
                plan.saved_world_size, plan.saved_micro_batch, plan.saved_accum_steps, now, plan.world_size, local,
                accum, plan.saved_global_batch,
                "" if plan.exact else
                f" (with a training.local_batch_size that, times {plan.world_size} rank(s), divides it)",
            )

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.load_only:
            return False
        force = last_step or (curr_step == 1 and self.config.enable_first_step_checkpoint)
        light = True if (last_step and self.config.last_save_model_only) else None
        handle = self.ckpt.save(self.state, curr_step, force=force, light=light)
        if handle is None:
            return False
        self.save_future = handle
        if last_step:
            self._wait_for_saving()
        if self.ckpt.preempted and self.config.exit_on_preemption:
            log.warning("shardckpt: step %d committed after a preemption signal; exiting", curr_step)
            self.close()
            raise SystemExit(143)
        return True

    def _maybe_wait_for_staging(self) -> None:
        # The optimizer step writes parameters and optimizer state: the copies of the last save must be
        # complete before it (save() returns with them complete unless overlap_copies is on).
        self.ckpt.wait_for_copies()

    def _wait_for_saving(self) -> None:
        self.save_future = None
        self.ckpt.wait()

    def _close(self) -> None:
        self.save_future = None
        self.ckpt.close()
