"""A distributed sampler whose saved position is global, not a per-rank cursor.

Each epoch is one global order of the dataset (a seeded permutation). With
``W`` ranks and micro-batch ``b``, micro-round ``k`` of the epoch is the
slice ``order[k*W*b:(k+1)*W*b]`` and rank ``r`` takes its ``r``-th contiguous
part of ``b`` indices. An optimizer step with ``A`` accumulation steps
consumes ``A`` micro-rounds, ``W*b*A`` samples. The state is ``(epoch,
consumed)`` where ``consumed`` counts samples of the epoch consumed by all
ranks together, so a job that resumes at another world size (or micro-batch,
or accumulation) continues from the same sample: over the epoch nothing is
skipped and nothing is seen twice. An epoch ends after the last whole
optimizer step (``W*b*A`` samples); the remainder is dropped, as
``drop_last`` does, identically at every world size that keeps the global
batch.

Position tracking counts batches handed out: with a ``DataLoader`` using
``num_workers=0`` it matches what the training loop received. With worker
processes the loader fetches ahead; then call :meth:`set_consumed` (or
:meth:`advance`) from the training loop instead of relying on the count.

Users with their own loaders can use :func:`rank_slice` (the positions of
the epoch order that a rank reads at a global position) and
:meth:`ResumableSampler.indices_at` (the dataset indices themselves).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from shardckpt import _dist
from shardckpt.errors import ConfigError


def rank_slice(position: int, *, rank: int, world_size: int, micro_batch: int) -> slice:
    """Positions in the epoch order that ``rank`` reads in the micro-round starting at ``position``.

    ``position`` is the global number of samples of the epoch already
    consumed (a multiple of nothing in particular: after an elastic restore it
    is whatever the saved job had consumed). The micro-round covers
    ``order[position : position + world_size * micro_batch]``.
    """
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    if micro_batch < 1 or position < 0:
        raise ConfigError(f"micro_batch must be >= 1 and position >= 0, got {micro_batch}, {position}")
    start = position + rank * micro_batch
    return slice(start, start + micro_batch)


def epoch_order(dataset_len: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The global sample order of ``epoch``: the same on every rank and at every world size."""
    if not shuffle:
        return torch.arange(dataset_len)
    generator = torch.Generator()
    generator.manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(dataset_len, generator=generator)


class ResumableSampler(Sampler[int]):
    """Distributed sampler with a global, world-size independent position.

    ``ResumableSampler(len(dataset), batch_size=b)`` takes rank and world size
    from the process group; ``accum_steps`` (default 1) makes an epoch end on
    a whole optimizer step. Put it in the checkpointed state: its state dict
    holds ``(epoch, consumed)`` and the layout it ran with, which an elastic
    restore uses as the saved training shape.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        accum_steps: int = 1,
    ) -> None:
        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.rank = _dist.rank() if rank is None else int(rank)
        self.world_size = _dist.world_size() if world_size is None else int(world_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.consumed = 0
        self._accum_steps = 1
        self.saved_layout: dict[str, int] | None = None
        """The layout (world_size, batch_size, accum_steps) of the run that saved the loaded state."""
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        self.accum_steps = accum_steps

    @property
    def accum_steps(self) -> int:
        """Micro-batches per optimizer step (an elastic restore sets it from its plan)."""
        return self._accum_steps

    @accum_steps.setter
    def accum_steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"accum_steps must be a positive int, got {value!r}")
        if self.dataset_len < self.world_size * self.batch_size * value:
            raise ConfigError(
                f"dataset of {self.dataset_len} samples is smaller than one global batch "
                f"({self.world_size} ranks x {self.batch_size} x {value} accumulation steps)"
            )
        self._accum_steps = value

    @property
    def global_batch(self) -> int:
        """Samples of one micro-round over all ranks (``world_size * batch_size``)."""
        return self.world_size * self.batch_size

    @property
    def step_samples(self) -> int:
        """Samples of one optimizer step over all ranks (``world_size * batch_size * accum_steps``)."""
        return self.global_batch * self.accum_steps

    @property
    def epoch_end(self) -> int:
        """Samples of the epoch that are used: whole optimizer steps only."""
        return (self.dataset_len // self.step_samples) * self.step_samples

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The global sample order of ``epoch`` (identical on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        return epoch_order(self.dataset_len, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def indices_at(self, position: int | None = None, *, order: torch.Tensor | None = None) -> list[int]:
        """Dataset indices this rank reads in the micro-round starting at ``position`` (default: now)."""
        position = self.consumed if position is None else int(position)
        order = self.order() if order is None else order
        part = rank_slice(position, rank=self.rank, world_size=self.world_size, micro_batch=self.batch_size)
        return order[part].tolist()

    def batches_left(self) -> int:
        """Micro-batches this rank still reads in the current epoch."""
        return max(0, (self.epoch_end - self.consumed) // self.global_batch)

    def __len__(self) -> int:
        return self.batches_left() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        b, g = self.batch_size, self.global_batch
        while self.consumed + g <= self.epoch_end:
            block = self.indices_at(order=order)
            for i, index in enumerate(block):
                if i == b - 1:
                    # The whole micro-round is handed out once its last
                    # index is: count it before yielding so a save taken
                    # right after this batch resumes at the next one.
                    self.consumed += g
                yield index
        self.epoch += 1
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.consumed = 0

    def set_consumed(self, samples: int) -> None:
        """Set the global number of samples of this epoch already consumed."""
        if not 0 <= samples <= self.dataset_len:
            raise ConfigError(f"consumed must be within [0, {self.dataset_len}], got {samples}")
        self.consumed = int(samples)

    def advance(self, global_batches: int = 1) -> None:
        """Move the position on by ``global_batches`` micro-rounds (for users' own loaders)."""
        self.set_consumed(self.consumed + global_batches * self.global_batch)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "accum_steps": self.accum_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["dataset_len"]) != self.dataset_len:
            raise ConfigError(
                f"sampler state is for a dataset of {state['dataset_len']} samples, this one has "
                f"{self.dataset_len}; the data position cannot be restored"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.consumed = int(state["consumed"])
        if "batch_size" in state:
            self.saved_layout = {
                "world_size": int(state["world_size"]),
                "batch_size": int(state["batch_size"]),
                "accum_steps": int(state.get("accum_steps", 1)),
            }
        else:
            self.saved_layout = None
