"""shardckpt in a Lightning ``Trainer``: one callback, every strategy that trains with torch optimizers.

::

    from shardckpt.integrations.lightning import ShardckptCheckpoint

    trainer = L.Trainer(strategy="ddp",   # or ModelParallelStrategy() (FSDP2), FSDPStrategy(), "auto"
                        callbacks=[ShardckptCheckpoint("checkpoints/run1", every_n_train_steps=100,
                                                       remote="s3://bucket/runs/run1")])
    trainer.fit(model, datamodule, ckpt_path="last")

Saving: every rank takes part. After the optimizer step of every
``every_n_train_steps``-th global step the callback hands the module, the
optimizers and Lightning's own checkpoint content (loops' progress and
dataloader state, callbacks' state, LR schedulers, precision plugin state,
datamodule state and whatever ``on_save_checkpoint`` hooks add) to a
:class:`shardckpt.Checkpointer`: the step returns once the state is staged
in host memory; the write, the commit and the upload run in the background.
The strategy's own ``save_checkpoint`` (and with it the ``CheckpointIO``
plugin that FSDP and ``ModelParallelStrategy`` bypass) is not involved.

Resuming: ``fit(ckpt_path="last")`` resolves to the newest live committed
step of shardckpt's manifests (local, else the remote; never a step whose
commit record is missing). The callback wraps three methods of the
strategy instance (``load_checkpoint``, ``load_model_state_dict``,
``load_optimizer_state_dict``) for that one path: Lightning restores its
loops, callbacks, schedulers and precision state from the saved content and
calls the ``on_load_checkpoint`` hooks with it as usual; the module and the
optimizers are loaded in place by shardckpt, resharded to the current world
size and strategy. Any other ``ckpt_path`` goes to the strategy unchanged.

SIGTERM: Lightning's own handler stays in charge. When it stops the loop
(``SIGTERMException``, raised on every rank at the same batch) the callback
saves the current step and waits for its commit before the trainer exits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import SIGTERMException

import shardckpt
from shardckpt.errors import ConfigError

log = logging.getLogger("shardckpt")

__all__ = ["ShardckptCheckpoint"]

LIGHTNING_KEY = "lightning"
MARKER = "lightning-last.json"


class ShardckptCheckpoint(ModelCheckpoint):
    """Async sharded checkpoints of a Lightning fit through shardckpt.

    ``local_dir``, ``remote``, ``keep_last`` and any other keyword of
    :class:`shardckpt.CheckpointConfig` configure the :class:`shardckpt.Checkpointer`
    (or pass ``config=``). ``every_n_train_steps``: save after every N-th
    optimizer step (global step). ``save_on_sigterm``: save and commit once
    more when Lightning stops on SIGTERM. A subclass of ``ModelCheckpoint``
    only so that ``ckpt_path="last"`` finds it; it writes no ``.ckpt`` files.
    """

    def __init__(
        self,
        local_dir: str = "checkpoints",
        *,
        every_n_train_steps: int = 1,
        save_on_sigterm: bool = True,
        config: shardckpt.CheckpointConfig | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise ConfigError(f"every_n_train_steps must be an int >= 1, got {every_n_train_steps!r}")
        if config is not None and options:
            raise ConfigError("pass either config= or keyword options, not both")
        if config is None:
            # Lightning's signal connector handles SIGTERM (and composes the handlers it finds): the save on
            # SIGTERM happens when Lightning stops the loop, on every rank at the same batch (on_exception).
            options.setdefault("preemption_signals", ())
            config = shardckpt.CheckpointConfig(local_dir=local_dir, **options)
        super().__init__(dirpath=config.local_dir, save_top_k=0, save_last=False)
        self.shardckpt_config = config
        self.every_n_train_steps = every_n_train_steps
        self.save_on_sigterm = save_on_sigterm
        self._ckpt: shardckpt.Checkpointer | None = None
        self._trainer: pl.Trainer | None = None
        self._peek: Any = None
        self._pending_step: int | None = None
        self._last_saved: int | None = None
        self._wrapped: set[int] = set()
        self.restored_step: int | None = None
        """The step the last ``fit(ckpt_path="last")`` restored (``None``: none)."""
        self._last_plan: Any = None

    # ------------------------------------------------------------ the checkpointer

    @property
    def checkpointer(self) -> shardckpt.Checkpointer:
        """The :class:`shardckpt.Checkpointer` behind this callback (created on first use)."""
        if self._ckpt is None:
            self._ckpt = shardckpt.Checkpointer(self.shardckpt_config)
        return self._ckpt

    @property
    def last_plan(self) -> Any:
        """The elastic plan of the last restore (world sizes, batch, LR), or ``None``."""
        return self._last_plan

    @property
    def state_key(self) -> str:
        return f"ShardckptCheckpoint{{{self.shardckpt_config.local_dir!r}}}"

    def _state(self, trainer: pl.Trainer) -> dict[str, Any]:
        model = trainer.strategy.model if trainer.strategy.model is not None else trainer.lightning_module
        state: dict[str, Any] = {"model": model}
        optimizers = trainer.optimizers
        for i, optimizer in enumerate(optimizers):
            state["optimizer" if len(optimizers) == 1 else f"optimizer_{i}"] = optimizer
        return state

    # ------------------------------------------------------------ saving

    def _lightning_content(self, trainer: pl.Trainer) -> dict[str, Any]:
        """What Lightning's ``dump_checkpoint`` writes, less the module's and optimizers' tensors
        (shardckpt saves those from the live objects), hooks called as Lightning calls them."""
        connector = trainer._checkpoint_connector
        checkpoint: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "pytorch-lightning_version": pl.__version__,
            "loops": connector._get_loops_state_dict(),
            "callbacks": call._call_callbacks_state_dict(trainer),
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        }
        precision = trainer.precision_plugin
        precision_state = precision.state_dict()
        if precision_state:
            checkpoint[type(precision).__qualname__] = precision_state
        precision.on_save_checkpoint(checkpoint)
        datamodule = trainer.datamodule
        if datamodule is not None:
            datamodule_state = call._call_lightning_datamodule_hook(trainer, "state_dict")
            if datamodule_state:
                checkpoint[type(datamodule).__qualname__] = datamodule_state
        call._call_callbacks_on_save_checkpoint(trainer, checkpoint)
        call._call_lightning_module_hook(trainer, "on_save_checkpoint", checkpoint)
        for key in ("state_dict", "optimizer_states"):
            if key in checkpoint:
                raise ConfigError(
                    f"an on_save_checkpoint hook put {key!r} into the checkpoint; with ShardckptCheckpoint the "
                    f"module and optimizers are saved from the live objects. Remedy: store extra state under "
                    f"another key."
                )
        return checkpoint

    def _save(self, trainer: pl.Trainer, *, wait: bool = False) -> None:
        step = trainer.global_step
        if step == self._last_saved:
            return
        state = self._state(trainer)
        state[LIGHTNING_KEY] = self._lightning_content(trainer)
        self.checkpointer.save(state, step, force=True)
        self._last_saved = step
        if wait:
            self.checkpointer.wait()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # Every rank reaches this hook with the same global step: they agree on the due steps.
        if step > 0 and step % self.every_n_train_steps == 0 and step != self._last_saved:
            self._save(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # saves follow optimizer steps only

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and self.save_on_sigterm and trainer.global_step > 0:
            # Lightning raises it on every rank at the same batch boundary (after broadcasting rank 0's flag).
            self._save(trainer, wait=True)
            if trainer.global_rank == 0:
                log.warning("shardckpt: SIGTERM: step %d committed in %s; Lightning stops the fit now",
                            trainer.global_step, self.shardckpt_config.local_dir)
        # Any other exception: no wait here (other ranks may be gone). Committed steps are safe; a save
        # that does not commit is never resumed.

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._last_saved = None
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()

    def state_dict(self) -> dict[str, Any]:
        return {"local_dir": os.path.abspath(self.shardckpt_config.local_dir)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------ resuming

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """``ckpt_path="last"``: the newest live committed step, as a small marker file naming it.

        Lightning picks the newest of its candidates by modification time; the
        marker is written now, so it wins over older ``last.ckpt`` files of other callbacks.
        """
        self._trainer = trainer
        # Every rank alone, no collective (the process group may not exist yet): the step load() would take.
        # A throwaway instance that starts nothing: the real one is made once the process group exists.
        looker = shardckpt.Checkpointer(dataclasses.replace(self.shardckpt_config, uploader="off",
                                                            preemption_signals=()))
        try:
            found = looker.peek()
        finally:
            looker.close()
        self._peek = found
        if found is None:
            return set()
        if LIGHTNING_KEY not in found.values:
            raise ConfigError(
                f"step {found.step} ({found.source}) was not saved by ShardckptCheckpoint (it holds no "
                f"{LIGHTNING_KEY!r} entry, or the entry holds a tensor over 1 MiB). Remedy: resume it with "
                f"shardckpt.Checkpointer.load, or point local_dir/remote at a Lightning run's checkpoints."
            )
        root = os.path.abspath(self.shardckpt_config.local_dir)
        os.makedirs(root, exist_ok=True)
        marker = os.path.join(root, MARKER)
        tmp = f"{marker}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump({"step": found.step, "source": found.source}, f)
        os.replace(tmp, marker)
        return {marker}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        strategy = trainer.strategy
        if id(strategy) in self._wrapped:
            return
        self._wrapped.add(id(strategy))
        load_checkpoint = strategy.load_checkpoint
        load_model = strategy.load_model_state_dict
        load_optimizers = strategy.load_optimizer_state_dict

        def ours(path: Any) -> bool:
            return (self._peek is not None and path is not None
                    and os.path.abspath(os.fspath(path)) == os.path.join(
                        os.path.abspath(self.shardckpt_config.local_dir), MARKER))

        def load_checkpoint_hook(checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            if not ours(checkpoint_path):
                return load_checkpoint(checkpoint_path, weights_only=weights_only)
            content = dict(self._peek.values[LIGHTNING_KEY])
            # Lightning checks these keys exist; the tensors are restored in place by shardckpt.
            content["state_dict"] = {}
            content["optimizer_states"] = []
            self._pending_step = self._peek.step
            if strategy.restore_checkpoint_after_setup:
                self._restore(trainer)  # the module is wrapped and the optimizers exist: load now
            elif not strategy.lightning_restore_optimizer:
                raise ConfigError(
                    f"{type(strategy).__name__} restores checkpoints before its setup and manages optimizer "
                    f"state itself: ShardckptCheckpoint cannot restore into it. Remedy: use DDP, FSDP or "
                    f"ModelParallelStrategy."
                )
            return content

        def load_model_hook(checkpoint: Any, strict: bool = True) -> None:
            if self._pending_step is None:
                load_model(checkpoint, strict=strict)
            # else: loaded with the optimizers once they exist (load_optimizer_state_dict, after setup)

        def load_optimizers_hook(checkpoint: Any) -> None:
            if self._pending_step is None:
                load_optimizers(checkpoint)
                return
            self._restore(trainer)

        strategy.load_checkpoint = load_checkpoint_hook
        strategy.load_model_state_dict = load_model_hook
        strategy.load_optimizer_state_dict = load_optimizers_hook

    def _restore(self, trainer: pl.Trainer) -> None:
        step, self._pending_step = self._pending_step, None
        restored = self.checkpointer.load(self._state(trainer), step)
        if restored != step:
            raise shardckpt.CheckpointNotFoundError(
                f"ckpt_path='last' resolved to step {step} in {self.shardckpt_config.local_dir}, but loading it "
                f"restored {restored!r} (was it deleted meanwhile?). Remedy: run fit(ckpt_path='last') again."
            )
        self.restored_step = restored
        self._last_saved = restored
        self._last_plan = self.checkpointer.last_plan
