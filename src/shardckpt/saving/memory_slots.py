"""The memory tier's slots: one buffer file of shared memory per slot, mapped, and the views the stager copies into.

A slot's buffer holds every staged tensor of a rank back to back (aligned to
``format/shm.ALIGN``); :class:`SlotStager` is the ``HostStager`` whose buffers
are views of it, so the save's copy lands in shared memory and the disk write
reads it there. Used by ``saving/memory.py`` (which lays slots out, picks
them and records their copies).
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import threading
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardckpt.errors import SaveError
from shardckpt.format import shm
from shardckpt.saving.stage import HostStager, leaf_signature, plain_sequence


def align(n: int) -> int:
    return (n + shm.ALIGN - 1) // shm.ALIGN * shm.ALIGN


def state_key(path: tuple) -> str:
    """A tensor's place in the state dict as text (a container is a dict or a list: "0" and 0 never meet)."""
    return "\x1f".join(map(str, path))


def leaves(obj: Any, path: tuple = ()) -> Any:
    """``(path, tensor)`` of every tensor in a captured state, walked as ``HostStager.stage`` walks it."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        if plain_sequence(obj):
            return  # (an optimizer's parameter names)
        for i, v in enumerate(obj):
            yield from leaves(v, path + (i,))


class Unfit(Exception):
    """Why this rank cannot keep its copies in shared memory (the tier steps aside)."""


class Slot:
    """One slot of this rank: a buffer file of the namespace mapped here, and the save its record names."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffer = ""
        """The buffer's file name in the namespace ("": not laid out yet)."""
        self.size = 0
        self.entries: dict[str, tuple[str, int, int]] = {}
        """Path in the state dict -> (signature, offset, bytes)."""
        self.region: mmap.mmap | None = None
        self.base: torch.Tensor | None = None
        """All of the buffer's bytes (its address: pinning, offsets)."""
        self.stager: SlotStager | None = None
        self.holds: tuple[int, str, float] | None = None
        """(step, version, created) of the save whose record exists, else None."""
        self.cache: dict[tuple[str, int], list[Any]] = {}
        self.pinned = 0
        self.summing: tuple[threading.Event, concurrent.futures.Future] | None = None
        """The checksum being taken of the save the slot holds (step 6)."""
        self.values_fd: int | None = None
        """The slot's values file, open for writing while the slot is laid out (:meth:`write_values`)."""
        self.values_held: bytes | None = None
        """What that file holds (``None``: unknown)."""

    def write_values(self, path: str, data: bytes) -> None:
        """The slot's values file at ``path`` made to hold ``data``: written in place through a descriptor kept
        open with the slot, only when ``data`` changed (a rewrite with ``O_TRUNC`` frees the file's pages and takes
        new ones: after a training step 130 µs against 22 for a write over them), cut when it was longer; opened
        again when the file is no longer linked (removed under this process: the record must name a file)."""
        if self.values_fd is not None:
            st = os.fstat(self.values_fd)
            if st.st_nlink == 0:
                self.close_values()
        if self.values_fd is None:
            self.values_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            self.values_held = None
            st = os.fstat(self.values_fd)
        if self.values_held == data and st.st_size == len(data):
            return
        self.values_held = None
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.pwrite(self.values_fd, view[done:], done)
        if st.st_size > len(data):
            os.ftruncate(self.values_fd, len(data))
        self.values_held = data

    def close_values(self) -> None:
        if self.values_fd is not None:
            os.close(self.values_fd)
        self.values_fd, self.values_held = None, None

    def fits(self, wanted: list[tuple[str, str, int]]) -> bool:
        return bool(self.buffer) and all(self.entries.get(k, ("",))[0] == sig for k, sig, _n in wanted)

    def view(self, obj: torch.Tensor, path: tuple) -> Any:
        """The slot's buffer for the tensor ``obj`` at ``path``: a view of the shared memory."""
        found = self.entries.get(state_key(path))
        if found is None or self.base is None or found[0] != repr(leaf_signature(obj)):
            raise SaveError(f"the memory slot {self.index} has no buffer laid out for {state_key(path)}")
        local = obj._local_tensor if isinstance(obj, DTensor) else obj
        _sig, offset, _nbytes = found
        if local.numel():
            # A storage of its own over exactly its bytes: DCP's writer then writes it as it is (it copies a
            # view of a larger storage first).
            buf = torch.frombuffer(self.region, dtype=local.dtype, count=local.numel(), offset=offset).view(local.shape)
        else:
            buf = torch.empty(local.shape, dtype=local.dtype)
        return DTensor(buf, obj._spec, requires_grad=False) if isinstance(obj, DTensor) else buf

    def offset_of(self, local: torch.Tensor) -> int:
        assert self.base is not None
        offset = local.data_ptr() - self.base.data_ptr()
        if local.numel() and not 0 <= offset <= self.size - local.numel() * local.element_size():
            raise SaveError(f"a staged tensor lies outside memory slot {self.index}")
        return max(offset, 0)


class SlotStager(HostStager):
    """``HostStager`` whose buffers are views of one slot's shared memory."""

    def __init__(self, slot: Slot) -> None:
        super().__init__(pin_memory=False)
        self._slot = slot

    def _allocate(self, obj: torch.Tensor, path: tuple) -> Any:
        return self._slot.view(obj, path)
