"""Process-group helpers: side groups for background work, rank-agreement calls.

The trainer's process group is never used by shardckpt's background thread.
Two gloo side groups are created on first use (a collective over the default
group, issued from the main thread):

* ``io``  used only by the background writer thread (DCP's save collectives,
  the checksum exchange, the commit barrier);
* ``ctl`` used only by the main thread (save decisions, load agreement, DCP's
  load collectives).

Without an initialised process group every helper degrades to the
single-process answer.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def local_rank() -> int:
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else rank()


def local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value is not None else world_size()


def node_id() -> str:
    return f"{socket.gethostname()}:{os.environ.get('GROUP_RANK', '0')}"


class SideGroups:
    def __init__(self, timeout_s: float) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.io: Any = None
        self.ctl: Any = None
        self._ready = False

    def ensure(self) -> bool:
        """Create the groups on first use; True when this call created them."""
        if self._ready or not is_dist():
            return False
        # new_group is collective over the default group: every rank reaches
        # this point in the same order (first save or first load).
        self.io = dist.new_group(backend="gloo", timeout=self.timeout)
        self.ctl = dist.new_group(backend="gloo", timeout=self.timeout)
        self._ready = True
        return True

    def destroy(self, *, io: bool = True) -> None:
        """Release the groups' sockets (each Checkpointer has its own pair).

        ``io=False`` keeps the writer's group: a write still in flight uses it.
        """
        if not self._ready or not is_dist():
            return
        for name in ("io", "ctl") if io else ("ctl",):
            group = getattr(self, name)
            setattr(self, name, None)
            if group is not None:
                try:
                    dist.destroy_process_group(group)
                except (RuntimeError, ValueError):
                    pass  # the default group is gone already: so are its subgroups
        self._ready = False

    # ---- main-thread (ctl) helpers

    def all_reduce_max(self, values: list[int]) -> list[int]:
        if not is_dist():
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl)
        return t.tolist()

    def all_gather_ctl(self, obj: Any) -> list[Any]:
        return _all_gather(obj, self.ctl)

    def broadcast_ctl(self, obj: Any) -> Any:
        if not is_dist():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    # ---- background-thread (io) helpers

    def all_gather_io(self, obj: Any) -> list[Any]:
        return _all_gather(obj, self.io)

    def barrier_io(self) -> None:
        if is_dist():
            dist.barrier(group=self.io)


def _all_gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (between our own ranks only: these are trusted peers)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=group)
    return out
