"""A distributed sampler whose saved position is global, not a per-rank cursor.

Each epoch is one global order of the dataset (a seeded permutation). Global
batch ``i`` is the slice ``order[i*G:(i+1)*G]`` with ``G = world_size *
batch_size``; rank ``r`` takes its ``r``-th contiguous part. The state is
``(epoch, consumed)`` where ``consumed`` counts samples of the epoch consumed
by all ranks together, so a job that resumes at another world size (or batch
size) continues from the same sample: over the epoch nothing is skipped and
nothing is seen twice.

Position tracking counts batches handed out: with a ``DataLoader`` using
``num_workers=0`` it matches what the training loop received. With worker
processes the loader fetches ahead; then call :meth:`set_consumed` (or
:meth:`advance`) from the training loop instead of relying on the count.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from .errors import ConfigError


class ResumableSampler(Sampler[int]):
    def __init__(
        self,
        dataset_len: int,
        *,
        batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        from . import _dist

        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.rank = _dist.rank() if rank is None else int(rank)
        self.world_size = _dist.world_size() if world_size is None else int(world_size)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.consumed = 0
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.dataset_len < self.global_batch:
            raise ConfigError(
                f"dataset of {self.dataset_len} samples is smaller than one global batch "
                f"({self.world_size} ranks x {self.batch_size})"
            )

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The global sample order of ``epoch`` (identical on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.dataset_len, generator=generator)

    def batches_left(self) -> int:
        return max(0, (self.dataset_len - self.consumed) // self.global_batch)

    def __len__(self) -> int:
        return self.batches_left() * self.batch_size

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        b, g = self.batch_size, self.global_batch
        while self.consumed + g <= self.dataset_len:
            start = self.consumed + self.rank * b
            block = order[start : start + b].tolist()
            for i, index in enumerate(block):
                if i == b - 1:
                    # The whole global batch is handed out once its last
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
        self.set_consumed(self.consumed + global_batches * self.global_batch)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self.dataset_len,
            "global_batch": self.global_batch,
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
