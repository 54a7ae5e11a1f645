"""shardckpt in a Lightning ``Trainer``: one callback, every strategy that trains with torch optimizers.

::

    from shardckpt.integrations.lightning import ShardckptCheckpoint

    trainer = L.Trainer(strategy="ddp",   # or ModelParallelStrategy() (FSDP2), FSDPStrategy(), "auto"
                        callbacks=[ShardckptCheckpoint("checkpoints/run1", every_n_train_steps=100,
                                                       remote="s3://bucket/runs/run1")])
    trainer.fit(model, datamodule, ckpt_path="last")

Saving: every rank takes part. After the optimizer step of every
``every_n_train_steps``-th global step the callback hands the module, the
optimizers and Lightning's own checkpoint content (loops' progress,
callbacks' state, LR schedulers, precision plugin state, datamodule state and
whatever ``on_save_checkpoint`` hooks add; the training dataloaders' states
under a key of each rank's own) to a
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

What Lightning restores too late is set from the restored state: the
dataloaders' positions are restored per rank (each rank's loader reads its
own part of the data), and the epoch their samplers see (``set_epoch``) is
set before the restored position is applied to them: Lightning calls
``set_epoch`` only after the training dataloader's iterator was made, so a
sampler whose order is a function of the epoch would otherwise replay epoch
0's order in any later epoch. A loader restored at the end of its epoch (a
step saved after the epoch's last batch) starts the next epoch, which
Lightning would otherwise run with no batch. At another world size the plan
keeps the global batch (``accumulate_grad_batches`` is set for it) and a
warning says that the data position cannot be mapped.

The final step of a fit that ends at ``max_steps`` (or ``max_epochs``) is
saved and committed before ``fit()`` returns.

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
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import SIGTERMException

import shardckpt
from shardckpt.errors import ConfigError
from shardckpt.options import record_shape
from shardckpt.restoring.elastic import ElasticPolicy, OnInexact, compute_plan
from shardckpt.state.per_rank import PerRank

log = logging.getLogger("shardckpt")

__all__ = ["ShardckptCheckpoint"]

LIGHTNING_KEY = "lightning"
LOADERS_KEY = "lightning_loaders"
"""The training dataloaders' states, one entry per rank (saved apart from the loops' state)."""
MARKER = "lightning-last.json"
FINISHED = "_iterator_finished"
"""The key of a torchdata ``StatefulDataLoader``'s state that says its iterator is exhausted."""


class LoaderStates(PerRank):
    """The states of the fit loop's dataloaders, kept per rank.

    Each rank's loader reads its own part of the data, so its state (position,
    a sampler's generator) is its own: at the same world size every rank gets
    its own back. At another world size rank ``r`` gets saved rank ``r``'s
    state, a new rank rank 0's; ``restored`` says whether this rank's own came back.
    """

    def load_state_dict(self, state: Any) -> None:
        saved = {int(k[4:]): v for k, v in state.items()
                 if isinstance(k, str) and k.startswith("rank") and k[4:].isdigit()}
        self.saved_world_size = max(saved) + 1 if saved else 0
        own = saved.get(self.rank)
        self.restored = own is not None
        self.value = own if own is not None else saved.get(0)


def _samplers(loader: Any) -> list[Any]:
    found = {}
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if sampler is not None:
            found[id(sampler)] = sampler
    return list(found.values())


def _micro_batch(loaders: list[Any]) -> int | None:
    """The per-rank batch size of the training dataloaders (``None``: unknown, or not one size)."""
    sizes = set()
    for loader in loaders:
        size = getattr(loader, "batch_size", None)
        if size is None:
            size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
        sizes.add(size)
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) and size > 0 else None


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
        self._loaders = LoaderStates()
        self._restored_data = False  # a restore whose data position is still to be applied to the loaders
        self._warned_sampler = False
        self._after_epoch_end = False  # the restored step was saved after the last batch of its epoch

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
        # No path in it: a run resumed from a copied or moved directory finds its callback under the same key.
        return type(self).__qualname__

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
        # Each rank's loaders read their own part of the data: their states are saved per rank (LoaderStates).
        self._loaders.value = checkpoint["loops"].get("fit_loop", {}).get("state_dict", {}).pop("combined_loader", None)
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
        state[LOADERS_KEY] = self._loaders
        # The batch shape the manifest records, for the elastic plan of a resume at another world size.
        loader = trainer.fit_loop._combined_loader
        record_shape(self.checkpointer.config, _micro_batch(loader.flattened) if loader is not None else None,
                     int(trainer.accumulate_grad_batches))
        self.checkpointer.save(state, step, force=True)
        self._last_saved = step
        if wait:
            self.checkpointer.wait()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # Every rank reaches this hook with the same global step: they agree on the due steps.
        if step > 0 and step != self._last_saved and (step % self.every_n_train_steps == 0 or _last_step(trainer)):
            self._save(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        after, self._after_epoch_end = self._after_epoch_end, False
        fit_loop = trainer.fit_loop
        total = fit_loop.epoch_progress.total
        done = total.ready == total.started == total.processed == total.completed
        if after and fit_loop.restarted_mid_epoch and done:
            # A step saved after the last batch of its epoch: Lightning restores its fit loop "mid-epoch", counts
            # that epoch done, then starts the next one without counting it ready and started (two loop counters
            # one lower than in the uninterrupted fit) and without on_train_epoch_start. Start it as that fit does.
            fit_loop.reset_restart_stage()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ckpt is not None:
            self._ckpt.wait()  # the final step is committed before fit() returns

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
        self._restored_data = False
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to restore: Lightning saves no entry for this callback

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
        self._wrap_fit_loop(trainer)
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
            # This callback has no state (steps saved before it had one keyed by its local_dir: left out, so that
            # Lightning does not ask for a callback of that key).
            content["callbacks"] = {k: v for k, v in (content.get("callbacks") or {}).items()
                                    if k != self.state_key and not k.startswith(f"{self.state_key}{{")}
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
        state = self._state(trainer)
        self._loaders.value, self._loaders.restored = None, False
        if LOADERS_KEY in self._peek.keys:
            state[LOADERS_KEY] = self._loaders
        restored = self.checkpointer.load(state, step)
        if restored != step:
            raise shardckpt.CheckpointNotFoundError(
                f"ckpt_path='last' resolved to step {step} in {self.shardckpt_config.local_dir}, but loading it "
                f"restored {restored!r} (was it deleted meanwhile?). Remedy: run fit(ckpt_path='last') again."
            )
        self.restored_step = restored
        self._last_saved = restored
        self._last_plan = self.checkpointer.last_plan
        self._restored_data = True  # applied to the loaders once the fit loop has made them (_prepare_loaders)

    # ------------------------------------------------------------ the data position

    def _wrap_fit_loop(self, trainer: pl.Trainer) -> None:
        """Run :meth:`_prepare_loaders` where the fit loop applies the restored dataloader states: after it has
        made the loaders, before it makes their iterators (``FitLoop.setup_data``)."""
        fit_loop = trainer.fit_loop
        if id(fit_loop) in self._wrapped:
            return
        self._wrapped.add(id(fit_loop))
        load_states = fit_loop._load_combined_loader_states

        def load_states_hook() -> None:
            self._prepare_loaders(trainer)
            load_states()

        fit_loop._load_combined_loader_states = load_states_hook

    def _prepare_loaders(self, trainer: pl.Trainer) -> None:
        fit_loop = trainer.fit_loop
        loaders = list(fit_loop._combined_loader.flattened) if fit_loop._combined_loader is not None else []
        self._check_samplers(trainer, loaders)
        if not self._restored_data:
            return
        self._restored_data = False
        # Lightning calls set_epoch at the start of each epoch of its loop, which on a resume comes after the
        # loaders' iterators were made from the restored position: set the restored epoch first.
        epoch = fit_loop.epoch_progress.current.processed
        if self._loaders.value is not None:
            fit_loop._combined_loader_states_to_load = list(self._loaders.value)
        if fit_loop.epoch_loop.batch_progress.is_last_batch:
            epoch = self._after_last_batch(trainer, epoch)
        for loader in loaders:
            for sampler in _samplers(loader):
                if callable(getattr(sampler, "set_epoch", None)):
                    sampler.set_epoch(epoch)
        plan = self._last_plan
        if plan is not None:
            self._keep_global_batch(trainer, plan, loaders)
            if plan.resharded and fit_loop._combined_loader_states_to_load and trainer.global_rank == 0:
                log.warning(
                    "shardckpt: step %d was saved by %d ranks and resumes at %d: each rank's dataloaders get the "
                    "position saved by the rank of the same number (a new rank: rank 0's), but they read another "
                    "split of the data now, so the rest of epoch %d is not the samples the saved run had left (some "
                    "are skipped or seen twice). Model, optimizers, LR schedulers and the step are restored. "
                    "Remedy: resume at %d ranks for the exact data order.", plan.step, plan.saved_world_size,
                    plan.world_size, epoch, plan.saved_world_size,
                )

    def _after_last_batch(self, trainer: pl.Trainer, epoch: int) -> int:
        """A step saved after the last batch of its epoch: the fit goes on with the next epoch (Lightning moves its
        loop there), but a restored loader position at the end of the epoch would make that epoch end at once, with
        no batch (the fit would skip a whole epoch). Mark each loader state as exhausted instead, so that the
        loader starts the next epoch, and return that epoch's number."""
        fit_loop = trainer.fit_loop
        states = fit_loop._combined_loader_states_to_load
        self._after_epoch_end = True
        if all(isinstance(state, dict) and FINISHED in state for state in states):
            fit_loop._combined_loader_states_to_load = [{**state, FINISHED: True} for state in states]
        elif trainer.global_rank == 0:
            log.warning(
                "shardckpt: step %d was saved after the last batch of epoch %d, and a training dataloader's state is "
                "not a StatefulDataLoader's: nothing says that it starts epoch %d where the saved run did (Lightning "
                "runs an epoch whose loader is at its end with no batch). Remedy: a torchdata StatefulDataLoader.",
                self.restored_step, epoch, epoch + 1,
            )
        return epoch + 1

    def _keep_global_batch(self, trainer: pl.Trainer, plan: Any, loaders: list[Any]) -> None:
        """Set ``accumulate_grad_batches`` to keep the saved global batch (the loaders' batch size is known now)."""
        micro = _micro_batch(loaders)
        if plan.saved_micro_batch is None or micro is None:
            return  # the plan line said that the batch shape is unknown
        kept = compute_plan(
            ElasticPolicy(on_inexact=OnInexact.NEAREST), step=plan.step, saved_world_size=plan.saved_world_size,
            world_size=plan.world_size, saved_micro_batch=plan.saved_micro_batch,
            saved_accum_steps=plan.saved_accum_steps, micro_batch=micro,
        )
        self._last_plan = dataclasses.replace(kept, rng=plan.rng)
        accum = int(trainer.accumulate_grad_batches)
        if kept.accum_steps != accum:
            trainer.accumulate_grad_batches = kept.accum_steps
            if trainer.global_rank == 0:
                (log.info if kept.exact else log.warning)(
                    "shardckpt: step %d: accumulate_grad_batches %d -> %d: global batch %d -> %d (%d rank(s) x batch "
                    "size %d x %d)%s", plan.step, accum, kept.accum_steps, kept.saved_global_batch, kept.global_batch,
                    plan.world_size, micro, kept.accum_steps,
                    "" if kept.exact else " (not exact: no accumulation keeps it)",
                )
        record_shape(self.checkpointer.config, micro, kept.accum_steps)

    def _check_samplers(self, trainer: pl.Trainer, loaders: list[Any]) -> None:
        """A WARNING, once, for samplers whose order a resume cannot reproduce (each seen to fail: see the guide)."""
        if self._warned_sampler or trainer.global_rank != 0:
            return
        for loader in loaders:
            for sampler in _samplers(loader):
                if isinstance(sampler, DistributedSamplerWrapper):
                    problem = _wrapper_problem(sampler)
                elif (type(sampler).__module__.startswith("torchdata.") and type(sampler).__name__ == "RandomSampler"
                      and getattr(sampler, "generator", None) is not None
                      and sampler.generator is getattr(loader, "generator", None)):
                    problem = (
                        "the training dataloader's RandomSampler draws from the loader's own generator "
                        "(StatefulDataLoader(shuffle=True, generator=...)): a resume restores the sampler's "
                        "generator as of the start of the epoch, not the seed the loader drew from it after the "
                        "permutation, so every epoch after the one a run resumes in is shuffled differently from "
                        "the saved run"
                    )
                else:
                    continue
                self._warned_sampler = True
                log.warning(
                    "shardckpt: %s. Remedy: a sampler whose order a checkpoint restores: each rank its part of the "
                    "data with sampler=torchdata.stateful_dataloader.sampler.RandomSampler(part, "
                    "generator=torch.Generator().manual_seed(seed)) (a generator of its own) and "
                    "Trainer(use_distributed_sampler=False), or "
                    "sampler=torch.utils.data.DistributedSampler(dataset, seed=seed), which Lightning keeps.", problem,
                )
                return


def _wrapper_problem(sampler: DistributedSamplerWrapper) -> str:
    """What a resume does with Lightning's ``DistributedSamplerWrapper`` (seen in real runs: see the guide).

    The wrapper lists the wrapped sampler's order anew each time the loader makes an iterator (``reset()``), and
    a resumed loader makes its iterator and then applies the restored position, a count of samples, to an order
    drawn from the wrapped sampler's generator as it is then, which no checkpoint holds: the resumed epoch goes on
    in another order from the first step after the restored one, in epoch 0 as in any later epoch."""
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
    name = type(inner).__qualname__ if inner is not None else "a sampler"
    random = inner is not None and hasattr(inner, "generator")
    return (
        f"Lightning replaced the training dataloader's sampler ({name}) with its DistributedSamplerWrapper "
        f"(use_distributed_sampler=True): a resume in any epoch, epoch 0 included, differs from the saved run from "
        f"the first step after the restored one (the rest of that epoch sees some samples twice and skips others), "
        f"and every later epoch is in another order too"
        + ("" if random else f" (if {name}'s order is random; a fixed order resumes exactly)")
        + ". The wrapper draws the wrapped sampler's order anew each time the loader makes an iterator, from "
        "generator state that no checkpoint holds, and the restored position counts samples into that new order"
    )


def _last_step(trainer: pl.Trainer) -> bool:
    """Whether the fit stops after this optimizer step (``max_steps``, or the last batch of ``max_epochs``)."""
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return (max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs
            and trainer.fit_loop.epoch_loop._num_ready_batches_reached())
