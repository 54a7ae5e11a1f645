"""Hugging Face: ``transformers.Trainer``, custom loops on ``accelerate``, torchdata's ``StatefulDataLoader``.

``pip install "shardckpt[hf]"``. Importing this module imports torch and
shardckpt's public API; transformers is imported when :class:`ShardckptTrainer`
is first used, accelerate and torchdata never (they are recognised by their
attributes), so :func:`accelerator_state` and :class:`LoaderState` work with
only what a loop already imports.

**Trainer.** ``ShardckptTrainer`` is a ``transformers.Trainer``;
``ShardckptTrainerMixin`` turns any ``Trainer`` subclass (TRL's
``SFTTrainer``, your own) into one: ``class MyTrainer(ShardckptTrainerMixin,
SFTTrainer)``. The Trainer's ``checkpoint-N`` folders are replaced by
shardckpt steps, saved at the Trainer's save points (``save_strategy`` /
``save_steps``) and, when the checkpointer has an interval policy of its own
(``every_steps`` / ``every_seconds``), by that policy too. A save holds the
model (plain, DDP, FSDP2 as accelerate prepares it), the optimizer, the LR
scheduler, accelerate's GradScaler, the Trainer's state (global step, epoch,
best metric, log history, stateful callbacks), per-rank RNG and the data
position. ``train(resume_from_checkpoint=True)`` restores the newest live
step (local, else remote) at any world size, or starts fresh when there is
none.

**The data position.** With a map-style data set and ``train_sampling_strategy``
``"random"`` (the default) or ``"sequential"``, the training sampler is a
:class:`shardckpt.ResumableSampler`: one global order per epoch, sharded by
rank, so a resume at another world size continues at the same sample. The
position saved is the one of the batches the training loop consumed (counted
where the loop draws them), not the sampler's own count, which runs ahead
with ``dataloader_num_workers > 0``.

**Call order of a resumed ``train()``** (every rank alike): ``peek()`` the
step (plain values only: the Trainer's state, the saved batch shape) →
``gradient_accumulation_steps`` set to keep the saved global batch →
the Trainer builds its loader, optimizer and scheduler → ``load()`` of that
step into them → the Trainer skips the consumed batches by index (no data is
read) → the RNG saved with the step is put back after the first batch is
drawn, where the uninterrupted run had it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

import shardckpt
from shardckpt import CheckpointNotFoundError, ConfigError, ResumableSampler
from shardckpt.format import layout
from shardckpt.integrations.accelerate import (
    LoaderState,
    _rank0,
    _scheduler,
    _unwrap,
    _world_size,
    accelerator_state,
    apply_plan,
)

log = logging.getLogger("shardckpt")

TRAINER_KEY = "trainer"
"""The state key of the Trainer's own values (a plain dict, one for all ranks)."""

_MARKER = "shardckpt://resume"
"""What the Trainer's inner loop gets as ``resume_from_checkpoint`` while shardckpt resumes it."""

_PER_RANK_FIELDS = ("is_local_process_zero", "is_world_process_zero")
"""TrainerState fields that differ between ranks: not saved (the one saved state is for all ranks)."""

__all__ = [
    "LoaderState",
    "ShardckptTrainer",  # noqa: F822 - made lazily by the module __getattr__ (imports transformers)
    "ShardckptTrainerMixin",
    "TrainerSampler",
    "accelerator_state",
    "apply_plan",
]


# ---------------------------------------------------------------- small parts


def _rng_snapshot() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, CUDA)."""
    snap: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snap["cuda"] = torch.cuda.get_rng_state_all()
    return snap


def _rng_apply(snap: Mapping[str, Any]) -> None:
    random.setstate(snap["python"])
    np.random.set_state(snap["numpy"])
    torch.set_rng_state(snap["torch"])
    if "cuda" in snap:
        torch.cuda.set_rng_state_all(snap["cuda"])


class TrainerSampler(ResumableSampler):
    """The Trainer's training sampler: a :class:`ResumableSampler` whose saved position is the loop's.

    ``loop_position`` (``(epoch, samples consumed)``, set by the Trainer
    before each save) replaces the sampler's own count in ``state_dict()``:
    the sampler counts what it handed to the loader, which with worker
    processes is ahead of what training consumed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop_position: tuple[int, int] | None = None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.loop_position is not None:
            state["epoch"], state["consumed"] = self.loop_position
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.loop_position = None  # the position just loaded is the true one, not the loop's of before


class _PreemptionVote:
    """Agree on a preemption signal once per optimizer step, without blocking the step.

    Each call resolves the previous call's all-reduce (long done) and starts
    the next one on a gloo group of its own, as the checkpointer's own vote
    does inside ``save()``: a signal seen by any rank takes effect at the same
    step on every rank, one step later.
    """

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer
        self.group = None
        self.pending: tuple[Any, torch.Tensor] | None = None
        if _world_size() > 1:
            self.group = dist.new_group(backend="gloo")

    def poll(self) -> bool:
        if self.group is None:
            return self.checkpointer.preemption_requested
        agreed = self.finish()
        flag = torch.tensor([int(self.checkpointer.preemption_requested)], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending = (work, flag)
        return agreed

    def finish(self) -> bool:
        """Complete the vote in flight (every rank started the same one); its outcome."""
        if self.pending is None:
            return False
        work, flag = self.pending
        self.pending = None
        work.wait()
        return bool(flag.item())


# ---------------------------------------------------------------- Trainer


def _best_metric_name(args: Any) -> str | None:
    metric = getattr(args, "metric_for_best_model", None)
    if not metric:
        return None
    return metric if metric.startswith("eval_") else f"eval_{metric}"


def _derived_options(args: Any) -> dict[str, Any]:
    """Checkpointer options that follow from ``TrainingArguments`` (a ``SHARDCKPT_*`` variable wins)."""
    options: dict[str, Any] = {"local_dir": os.path.join(args.output_dir, "shardckpt")}
    if args.save_total_limit is not None:
        options["keep_last"] = int(args.save_total_limit)
    metric = _best_metric_name(args)
    if metric is not None:
        options.update(keep_best=1, best_metric=metric, best_mode="max" if args.greater_is_better else "min")
    return {k: v for k, v in options.items() if f"SHARDCKPT_{k.upper()}" not in os.environ}


def _check_mapping(args: Any, config: Any) -> None:
    """A checkpointer passed in must keep what ``TrainingArguments`` ask to keep."""
    limit = args.save_total_limit
    if limit is not None and config.keep_last != limit:
        raise ConfigError(
            f"TrainingArguments.save_total_limit={limit} but the checkpointer keeps keep_last={config.keep_last} "
            f"steps in {config.local_dir}. Remedy: Checkpointer(keep_last={limit}, ...), or leave save_total_limit "
            f"unset (None) and let the checkpointer's keep_last decide."
        )
    metric = _best_metric_name(args)
    if metric is None:
        return
    mode = "max" if args.greater_is_better else "min"
    named = config.best_metric in (metric, metric[len("eval_"):])
    if not named or not config.keep_best or config.best_mode != mode:
        problem = (
            f"TrainingArguments.metric_for_best_model={args.metric_for_best_model!r} (greater_is_better="
            f"{bool(args.greater_is_better)}) but the checkpointer has keep_best={config.keep_best}, "
            f"best_metric={config.best_metric!r}, best_mode={config.best_mode!r}"
        )
        remedy = f"Checkpointer(keep_best=1, best_metric={metric!r}, best_mode={mode!r}, ...)"
        if args.load_best_model_at_end:
            raise ConfigError(f"{problem}: load_best_model_at_end needs the best step kept. Remedy: {remedy}.")
        log.warning("shardckpt: %s: the best step may be purged by keep_last. Remedy: %s.", problem, remedy)


class ShardckptTrainerMixin:
    """Checkpoints of a ``transformers.Trainer`` (or any subclass) through a :class:`shardckpt.Checkpointer`.

    ``class MyTrainer(ShardckptTrainerMixin, SFTTrainer): ...`` (the mixin
    first). Takes ``checkpointer=`` besides the Trainer's own arguments; without
    one, it builds ``Checkpointer(local_dir=<output_dir>/shardckpt,
    keep_last=save_total_limit, keep_best=1, best_metric="eval_<metric>",
    best_mode=...)`` (``SHARDCKPT_*`` variables win over these). A checkpointer
    passed in must agree with ``save_total_limit`` and
    ``metric_for_best_model`` when they are set (else ``ConfigError``).
    """

    def __init__(self, *args: Any, checkpointer: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "is_deepspeed_enabled", False):
            raise ConfigError(
                "ShardckptTrainer does not checkpoint DeepSpeed engines (their ZeRO state is DeepSpeed's own "
                "format). Remedy: FSDP2 through accelerate (fsdp_config with fsdp_version 2), or the stock Trainer."
            )
        if checkpointer is None:
            checkpointer = shardckpt.Checkpointer(**_derived_options(self.args))
        elif not isinstance(checkpointer, shardckpt.Checkpointer):
            raise ConfigError(
                f"checkpointer must be a shardckpt.Checkpointer, got {type(checkpointer).__name__}. Remedy: "
                f"checkpointer=shardckpt.Checkpointer(local_dir=..., remote=...), or leave it out."
            )
        _check_mapping(self.args, checkpointer.config)
        self.checkpointer = checkpointer
        self.resumed_step: int | None = None
        """The step the last ``train()`` resumed (``None``: it started fresh)."""
        self.preempted = False
        """True once a preemption signal stopped ``train()`` after committing a step."""
        self._sc_resume: Any = None
        self._sc_sampler: TrainerSampler | None = None
        self._sc_rng: dict[str, Any] | None = None
        self._sc_metrics: dict[int, dict[str, float]] = {}
        self._sc_saved_step: int | None = None
        self._sc_vote: _PreemptionVote | None = None
        self._sc_scheduler: tuple[Any, Any] | None = None
        """The Trainer's LR scheduler and its wrapper in the saved state, the same wrapper while it is the same."""
        self._sc_epoch = 0
        self._sc_drawn = 0
        self._sc_warned_sampler = False

    # ---- entry point

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, ignore_keys_for_eval: Any = None,
              **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint``: ``True`` (the newest live step, or a fresh start when
        there is none), a step number, or ``None``/``False`` (start fresh)."""
        spec = resume_from_checkpoint
        if isinstance(spec, str) and spec.isdigit():
            spec = int(spec)
        if isinstance(spec, str):
            raise ConfigError(
                f"resume_from_checkpoint={spec!r}: {type(self).__name__} resumes from its checkpointer "
                f"({self.checkpointer.root}), not from a folder. Remedy: pass True (the newest live step), a step "
                f"number, or None; to start from a stock Trainer folder, load its weights into the model first."
            )
        self._sc_resume = None
        self.resumed_step = None
        self.preempted = False
        if spec is True or (isinstance(spec, int) and not isinstance(spec, bool)):
            looked = self.checkpointer.peek(None if spec is True else spec)
            if looked is None and spec is not True:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint={spec}: no committed step {spec} in {self.checkpointer.root}"
                    f"{' or ' + self.checkpointer.config.remote if self.checkpointer.config.remote else ''}. "
                    f"Remedy: `shardckpt ls {self.checkpointer.root}` lists the steps; pass True for the newest."
                )
            if looked is None:
                if _rank0():
                    log.info("shardckpt: nothing to resume in %s; training starts fresh", self.checkpointer.root)
            else:
                self._sc_keep_global_batch(looked)
                self._sc_resume = looked
        if self._sc_vote is None:
            self._sc_vote = _PreemptionVote(self.checkpointer)
        try:
            output = super().train(resume_from_checkpoint=None, trial=trial,  # type: ignore[misc]
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._sc_resume = None
            self._sc_vote.finish()
        self.checkpointer.wait()  # the last save is committed (or its failure raised) when train() returns
        if self.preempted:
            # The job is about to end: this node's uploads of the step go out before train() returns.
            self.checkpointer.close()
        return output

    def _sc_keep_global_batch(self, looked: Any) -> None:
        saved = looked.values.get(TRAINER_KEY)
        if not isinstance(saved, dict) or "state" not in saved:
            raise ConfigError(
                f"step {looked.step} at {looked.source} was not saved by a shardckpt Trainer (no {TRAINER_KEY!r} "
                f"value). Remedy: resume it with Checkpointer.load() in your own loop, or start fresh "
                f"(resume_from_checkpoint=None) with another local_dir."
            )
        world, micro, accum = (int(saved[k]) for k in ("world_size", "per_device_train_batch_size",
                                                         "gradient_accumulation_steps"))
        new_world, new_micro = max(1, int(self.args.world_size)), int(self._train_batch_size)
        global_batch = world * micro * accum
        if global_batch % (new_world * new_micro):
            raise ConfigError(
                f"step {looked.step} at {looked.source} was trained with a global batch of {global_batch} "
                f"({world} ranks x {micro} per device x {accum} accumulation steps), which {new_world} ranks x "
                f"per_device_train_batch_size {new_micro} cannot keep. Remedy: a per_device_train_batch_size that "
                f"divides {global_batch // new_world if global_batch % new_world == 0 else global_batch}, or a "
                f"world size that divides "
                f"{global_batch // new_micro if global_batch % new_micro == 0 else global_batch}."
            )
        new_accum = global_batch // (new_world * new_micro)
        if new_accum != self.args.gradient_accumulation_steps and _rank0():
            log.info(
                "shardckpt: resuming step %d: gradient_accumulation_steps %d -> %d to keep the global batch of %d "
                "(%d ranks x %d per device)", looked.step, self.args.gradient_accumulation_steps, new_accum,
                global_batch, new_world, new_micro,
            )
        self.args.gradient_accumulation_steps = new_accum

    # ---- the Trainer's hooks

    def _inner_training_loop(self, batch_size: Any = None, args: Any = None, resume_from_checkpoint: Any = None,
                             trial: Any = None, ignore_keys_for_eval: Any = None) -> Any:
        # The inner loop's resume branches (skip the consumed batches, put the RNG back after the first draw)
        # run on this marker; what they would read from a folder is overridden below.
        marker = _MARKER if self._sc_resume is not None else None
        return super()._inner_training_loop(batch_size=batch_size, args=args,  # type: ignore[misc]
                                            resume_from_checkpoint=marker, trial=trial,
                                            ignore_keys_for_eval=ignore_keys_for_eval)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        from transformers.trainer_utils import has_length

        dataset = train_dataset if train_dataset is not None else self.train_dataset
        strategy = getattr(self.args, "train_sampling_strategy", "random")
        if dataset is None or not has_length(dataset) or strategy not in ("random", "sequential"):
            self._sc_sampler = None
            if not self._sc_warned_sampler and _rank0():
                self._sc_warned_sampler = True
                log.warning(
                    "shardckpt: train_sampling_strategy=%r (or a data set without a length): the Trainer's own "
                    "sampler is kept and a resume skips batches by global_step, which is only right at the same "
                    "world size and batch shape", strategy,
                )
            return super()._get_train_sampler(train_dataset)  # type: ignore[misc]
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self._sc_sampler = TrainerSampler(
            len(dataset), batch_size=int(self._train_batch_size), rank=int(self.args.process_index),
            world_size=max(1, int(self.args.world_size)), shuffle=strategy == "random", seed=int(seed),
            accum_steps=int(self.args.gradient_accumulation_steps),
        )
        return self._sc_sampler

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()  # type: ignore[misc]
        # The sampler already gives each rank its part: accelerate's shard wrapper becomes a passthrough
        # (what the Trainer does for its own rank-aware BatchRebalanceSampler).
        shard = getattr(loader, "batch_sampler", None)
        inner = getattr(shard, "batch_sampler", None)
        if self._sc_sampler is not None and getattr(inner, "sampler", None) is self._sc_sampler:
            shard.num_processes = 1
            shard.process_index = 0
        return loader

    def _init_training_state(self, max_steps: Any, num_update_steps_per_epoch: Any, num_train_epochs: Any,
                             resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        epochs, skip = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial
        )
        looked = self._sc_resume
        if looked is None:
            return epochs, skip
        from transformers.trainer_callback import TrainerState
        from transformers.trainer_utils import compare_trainer_and_checkpoint_args

        saved = looked.values[TRAINER_KEY]
        self.state = TrainerState(**json.loads(saved["state"]))
        self.state.is_local_process_zero = self.is_local_process_zero()  # type: ignore[attr-defined]
        self.state.is_world_process_zero = self.is_world_process_zero()  # type: ignore[attr-defined]
        self.state.train_batch_size = self._train_batch_size
        self.state.compute_steps(self.args, max_steps)
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()  # type: ignore[attr-defined]
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        if self._sc_sampler is None or self.args.ignore_data_skip:
            # The stock arithmetic, for the Trainer's own samplers.
            epochs = int(self.state.global_step // num_update_steps_per_epoch)
            skip = 0 if self.args.ignore_data_skip else (
                (self.state.global_step % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps)
            return epochs, skip
        epoch, consumed = int(saved["epoch"]), int(saved["consumed"])
        micro_round = self._sc_sampler.global_batch
        if consumed % micro_round:
            raise ConfigError(
                f"step {looked.step}: the data position (epoch {epoch}, sample {consumed}) is not a whole number of "
                f"micro-batches of {micro_round} "
                f"({self._sc_sampler.world_size} ranks x {self._sc_sampler.batch_size}). "
                f"Remedy: a per_device_train_batch_size and world size whose product divides {consumed}."
            )
        return epoch, consumed // micro_round

    def _prepare_for_training(self, max_steps: Any, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        model, train_dataloader = super()._prepare_for_training(  # type: ignore[misc]
            max_steps, train_dataloader, None
        )
        looked = self._sc_resume
        if looked is None:
            return model, train_dataloader
        state = self._sc_state()
        expected = looked.values[TRAINER_KEY]["state"]
        step = self.checkpointer.load(state, looked.step, elastic=shardckpt.ElasticPolicy())
        got = state[TRAINER_KEY]
        if step != looked.step or got.get("state") != expected:
            raise CheckpointNotFoundError(
                f"step {looked.step} changed between the look at it and its load (loaded {step}) in "
                f"{self.checkpointer.root}: another job writes there. Remedy: give each job its own local_dir/remote."
            )
        plan = self.checkpointer.last_plan
        if (plan is not None and plan.accum_steps is not None
                and plan.accum_steps != self.args.gradient_accumulation_steps):
            raise ConfigError(
                f"step {step}: the elastic plan asks for {plan.accum_steps} accumulation steps, the Trainer runs "
                f"{self.args.gradient_accumulation_steps}. Remedy: leave gradient_accumulation_steps to the resume."
            )
        if self._sc_sampler is not None:
            # The Trainer skips the consumed micro-batches itself (by index, no data read): start the epoch
            # from its beginning so that those skipped are exactly the ones consumed.
            self._sc_sampler.epoch = int(got["epoch"])
            self._sc_sampler.set_consumed(0)
            self._sc_sampler.loop_position = None
        self._sc_rng = _rng_snapshot()
        self.resumed_step = step
        if _rank0():
            log.info(
                "shardckpt: Trainer resumed step %d (global_step %d) from %s: epoch %d, sample %d of the global "
                "order, %d ranks x %d per device x %d accumulation steps", step, self.state.global_step,
                looked.source, int(got["epoch"]), int(got["consumed"]), max(1, int(self.args.world_size)),
                self._train_batch_size, self.args.gradient_accumulation_steps,
            )
        return model, train_dataloader

    def _load_rng_state(self, checkpoint: Any) -> None:
        if checkpoint != _MARKER:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        if self._sc_rng is not None:
            _rng_apply(self._sc_rng)
            self._sc_rng = None
        return None

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        epoch = kwargs["epoch"]
        resuming = (kwargs.get("resume_from_checkpoint") is not None and epoch == kwargs.get("epochs_trained")
                    and not self.args.ignore_data_skip)
        self._sc_epoch = int(epoch)
        self._sc_drawn = int(kwargs.get("steps_trained_in_current_epoch") or 0) if resuming else 0
        return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        self._sc_drawn += len(batches)
        return batches, items

    def _evaluate(self, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool = False) -> Any:
        metrics = super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)  # type: ignore[misc]
        if isinstance(metrics, dict):
            self._sc_metrics = {self.state.global_step: metrics}
        return metrics

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        preempt = self._sc_vote.poll() if self._sc_vote is not None else False
        if preempt:
            self.control.should_save = True
        super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        cfg = self.checkpointer.config
        if self._sc_saved_step != self.state.global_step and (
            cfg.every_steps is not None or cfg.every_seconds is not None
        ):
            self._sc_save(force=False)
        if (preempt or self.checkpointer.preempted) and not self.preempted:
            self.checkpointer.wait()
            self.preempted = True
            self.control.should_training_stop = True
            if _rank0():
                log.warning("shardckpt: preemption: step %d committed; the Trainer stops", self.state.global_step)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._sc_save(force=True)

    def _load_best_model(self) -> None:
        # Only the model, as the stock Trainer: load() says at WARNING which keys of the step it leaves out and
        # that a later save would start a branch (both as docs/guides/huggingface.md describes).
        self.checkpointer.wait()
        step = self.checkpointer.load({"model": self.model_wrapped}, "best", strict=False)
        if _rank0():
            log.info("shardckpt: load_best_model_at_end: loaded the model of the best step %s (%s); the optimizer, "
                     "scheduler and data position keep their end-of-training state", step,
                     self.checkpointer.config.best_metric)

    # ---- what a save holds

    def _sc_values(self) -> dict[str, Any]:
        from transformers.trainer_callback import ExportableState

        callbacks = [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]
        stateful: dict[str, Any] = {}
        for cb in callbacks:
            name = type(cb).__name__
            if name in stateful:
                stateful[name] = ((stateful[name] if isinstance(stateful[name], list) else [stateful[name]])
                                  + [cb.state()])
            else:
                stateful[name] = cb.state()
        self.state.stateful_callbacks = stateful
        epoch, consumed = self._sc_epoch, 0
        if self._sc_sampler is not None:
            consumed = self._sc_drawn * self._sc_sampler.global_batch
            if consumed >= self._sc_sampler.epoch_end:
                epoch, consumed = epoch + 1, 0
            self._sc_sampler.loop_position = (epoch, consumed)
        fields = dataclasses.asdict(self.state)
        for per_rank in _PER_RANK_FIELDS:
            fields.pop(per_rank, None)
        return {
            "state": json.dumps(fields, sort_keys=True),
            "world_size": max(1, int(self.args.world_size)),
            "per_device_train_batch_size": int(self._train_batch_size),
            "gradient_accumulation_steps": int(self.args.gradient_accumulation_steps),
            "epoch": epoch,
            "consumed": consumed,
        }

    def _sc_state(self) -> dict[str, Any]:
        model = self.model_wrapped if isinstance(self.model_wrapped, torch.nn.Module) else self.model
        state: dict[str, Any] = {"model": model}
        if self.optimizer is not None:
            state["optimizer"] = _unwrap(self.optimizer, "optimizer")
        if self.lr_scheduler is not None:
            # One wrapper while the scheduler is the same object: a state of the same objects at every save
            # keeps its save plan (saving/plan.py) instead of being captured by DCP again.
            held = self._sc_scheduler
            if held is None or held[0] is not self.lr_scheduler:
                held = self._sc_scheduler = (self.lr_scheduler, _scheduler(self.lr_scheduler))
            state["scheduler"] = held[1]
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        if self._sc_sampler is not None:
            state["sampler"] = self._sc_sampler
        state[TRAINER_KEY] = self._sc_values()
        return state

    def _sc_save(self, *, force: bool) -> None:
        step = int(self.state.global_step)
        if step == self._sc_saved_step:
            return
        metrics = self._sc_metrics.pop(step, None)
        numbers = {k: float(v) for k, v in (metrics or {}).items()
                   if k.startswith("eval_") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        best = self.checkpointer.config.best_metric
        if best and best not in numbers and f"eval_{best}" in numbers:
            numbers[best] = numbers[f"eval_{best}"]
        if self.state.best_global_step:  # the best step's directory, as the Trainer's own checkpoint-N folder
            self.state.best_model_checkpoint = os.path.join(self.checkpointer.root,
                                                            layout.step_dirname(int(self.state.best_global_step)))
        handle = self.checkpointer.save(self._sc_state(), step, force=force, metrics=numbers or None)
        if handle is not None:
            self._sc_saved_step = step


def __getattr__(name: str) -> Any:
    # ShardckptTrainer subclasses transformers.Trainer: transformers is imported on first use only.
    if name == "ShardckptTrainer":
        from transformers import Trainer

        cls = type("ShardckptTrainer", (ShardckptTrainerMixin, Trainer), {
            "__module__": __name__,
            "__doc__": "A ``transformers.Trainer`` that checkpoints through shardckpt "
                       "(see :class:`ShardckptTrainerMixin`).",
        })
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
