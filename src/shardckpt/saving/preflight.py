"""Checks before the first save: the local directory is writable, the remote works and holds no other
run's history, the state and the metrics make sense (and, at every save, no gradients pending). Each says
what to do when it fails."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any, Callable

import torch

from shardckpt import _dist, stores
from shardckpt.errors import ConfigError, CorruptCheckpointError, RemoteError
from shardckpt.format import lineage as lineage_mod
from shardckpt.options import CheckpointConfig, OnRemoteUnavailable, UploaderMode
from shardckpt.remote import listing as remote_listing
from shardckpt.saving import pending_grads

log = logging.getLogger("shardckpt")


def check_remote(
    cfg: CheckpointConfig, groups: _dist.SideGroups, store: Callable[[], stores.Store], writer: Any
) -> None:
    """First save: rank 0 lists the remote (and probes a write when this job uploads); all ranks agree.

    With ``on_remote_unavailable="error"`` (the default) a failure raises
    :class:`RemoteError` on every rank, naming the remote and the remedy. A
    remote holding another history's steps raises :class:`ConfigError`
    (unless ``start_fresh``: the new history then forks beside it, in ``writer``).
    """
    uploads = cfg.uploader != UploaderMode.OFF
    error = None
    foreign: tuple[str, float] | None = None
    if _dist.rank() == 0:
        deadline = stores.Deadline(min(60.0, cfg.step_deadline_s))
        try:
            remote_listing.probe(store(), deadline, write=uploads)
            if uploads and writer.lineage is None:
                foreign = _foreign_history(cfg, store(), deadline)
        except (RemoteError, OSError, ConfigError, CorruptCheckpointError) as exc:
            error = stores.redact(str(exc))
            if isinstance(exc, CorruptCheckpointError):
                error = (f"the newest step on {stores.safe_url(cfg.remote)} cannot be read ({error}); this run "
                         f"loaded nothing and will not save over it. Remedy: load(state) first, a prefix of its own, "
                         f"or start_fresh=True.")
            if isinstance(exc, (ConfigError, CorruptCheckpointError)):
                foreign = ("refused", 0.0)
        if uploads and cfg.remote_keep_last is None:
            log.warning(
                "shardckpt: remote retention keeps every step committed on %s (remote_keep_last=None); set "
                "remote_keep_last (and remote_keep_every) to bound what the bucket holds, or clean it with "
                "`shardckpt gc`", stores.safe_url(cfg.remote),
            )
    error, foreign = groups.broadcast_ctl((error, foreign))
    if foreign is not None and foreign[0] == "refused":
        raise ConfigError(error)
    if foreign is not None:
        # start_fresh: a new history beside the remote's, forked before all of its steps.
        writer.continue_lineage(lineage_mod.Lineage().fork(lineage_mod.NO_STEP, foreign[0]), foreign[1])
    if error is None:
        return
    if cfg.on_remote_unavailable == OnRemoteUnavailable.WARN:
        if _dist.rank() == 0:
            log.warning(
                "shardckpt: the remote %s does not work (on_remote_unavailable='warn': training goes on with "
                "local checkpoints only, uploads are retried): %s", stores.safe_url(cfg.remote), error,
            )
        return
    raise RemoteError(
        f"the remote {stores.safe_url(cfg.remote)} cannot be {'written' if uploads else 'listed'}, so no step "
        f"would reach it: {error} Nothing was saved. Set on_remote_unavailable='warn' to train on with local "
        f"checkpoints only."
    )

def _foreign_history(
    config: CheckpointConfig, store: stores.Store, deadline: stores.Deadline
) -> tuple[str, float] | None:
    """First save of a run that loaded nothing: does the remote hold another history's steps?

    Saving into it would take that history over (and replace its steps of
    the same numbers): refused with a :class:`ConfigError`, unless
    ``start_fresh`` — then the new history is a branch of its own (returns
    its id and the remote's newest time, which the new saves come after).
    """
    where = stores.safe_url(config.remote)
    if config.start_fresh:
        try:
            dirs, newest = remote_listing.newest_committed(store, deadline)
        except CorruptCheckpointError:  # an unreadable newest step: the new saves come after now
            log.warning("shardckpt: start_fresh=True: the newest step on %s cannot be read; a new history starts "
                        "beside it", where)
            return uuid.uuid4().hex[:10], time.time()
        if newest is None:
            return None
    else:
        dirs, newest = remote_listing.newest_committed(store, deadline)
        if newest is None:
            return None
        raise ConfigError(
            f"the remote {where} already holds committed steps (the newest is step {newest.step}; step "
            f"directories {dirs[0]}..{dirs[-1]}), but this run saves without having loaded any: its saves would "
            f"take that history over and replace its steps of the same numbers. Nothing was saved. Remedy: call "
            f"load(state) before the first save to continue that run; or point remote= at a prefix of its own; "
            f"or set start_fresh=True (SHARDCKPT_START_FRESH=1) to start a new history there deliberately."
        )
    log.warning(
        "shardckpt: start_fresh=True: %s holds steps up to %d of another history; this run starts a new one "
        "beside it (those steps are no longer resumed by default; remote steps of the same numbers as new saves "
        "are replaced)", where, newest.step,
    )
    return uuid.uuid4().hex[:10], newest.created


def at_save(state: dict[str, Any], step: int, *, first: bool) -> None:
    """Every save: gradients pending (``saving/pending_grads.py``); the first: an optimizer missing."""
    pending_grads.warn(state, step)
    if first:
        note_missing_optimizer(state)


def note_missing_optimizer(state: dict[str, Any]) -> None:
    """First save: a module with trainable parameters and no optimizer in the state is worth one line."""
    if _dist.rank() != 0 or any(isinstance(v, torch.optim.Optimizer) for v in state.values()):
        return
    trainable = sorted(
        k for k, v in state.items() if isinstance(v, torch.nn.Module) and any(p.requires_grad for p in v.parameters())
    )
    if trainable:
        log.info(
            "shardckpt: the state holds module(s) %s with trainable parameters but no optimizer: a resume restores "
            "the weights only, the optimizer starts fresh. Add the optimizer to the state to resume training exactly",
            ", ".join(repr(k) for k in trainable),
        )


def check_writable(root: str) -> None:
    """An unwritable local_dir is a configuration error now, not at the first save hours later."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".shardckpt-writable-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"local_dir {root} is not a writable directory ({type(exc).__name__}: {exc}). Remedy: point "
            f"local_dir at a directory this process can create and write (node-local NVMe or a shared "
            f"filesystem)."
        ) from exc


def metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    out = {}
    for name, value in (metrics or {}).items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"metrics must map names to numbers, got {name!r}: {value!r}")
        out[str(name)] = float(value)
    return out
