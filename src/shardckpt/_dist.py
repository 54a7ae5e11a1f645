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
import itertools
import os
import socket
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardckpt import _failpoints


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
        if self.ctl is not None:
            # Every rank is done with the groups before any tears them down (a rank whose peer
            # is still sending can abort at exit); bounded: a rank that never closes costs 10 s.
            try:
                dist.monitored_barrier(group=self.ctl, timeout=datetime.timedelta(seconds=10))
            except Exception:  # noqa: BLE001 - closing goes on; the barrier is a courtesy
                pass
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


# ---- check-in before the first collective of a call

_checkin_instances = itertools.count()
_GAVE_UP = 1 << 30
"""Added to a call's arrival count by a rank that stopped waiting: later arrivals see it."""


class CheckIn:
    """Every rank announces a call in the default group's store before the call issues a collective.

    A collective that one rank never joins blocks the others until the
    group's timeout (30 minutes by default), then fails without saying who
    was missing. A check-in waits at most ``timeout_s``: each rank records
    the number of the call it reached (``at/r<rank>``, overwritten, so the
    store does not grow) and counts itself in (``<n>/count``); the last rank
    to arrive releases the others (``<n>/go``). A rank that waits in vain
    returns the ranks that never reached the call, and marks the call given
    up so that a rank arriving later learns it too instead of entering a
    collective alone. The ranks must check in at the same calls in the same
    order (the call numbers are counted per instance, in the order instances
    first check in).
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._prefix: str | None = None
        self._calls = 0

    def enter(self, on_wait: Callable[[int, float], None]) -> list[int] | None:
        """Check in this call: ``None`` when every rank did; else the ranks that did not reach it within
        the timeout (an empty list: they all did, but one gave up waiting before this rank arrived).

        ``on_wait(arrived, seconds_left)`` is called once when the wait grows long.
        """
        if self.timeout_s is None or not is_dist() or world_size() == 1:
            return None
        store = dist.distributed_c10d._get_default_store()
        if self._prefix is None:
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._prefix = f"shardckpt/checkin/{restart}/{next(_checkin_instances)}"
        n = self._calls = self._calls + 1
        me, size = rank(), world_size()
        base = f"{self._prefix}/{n}"
        store.set(f"{self._prefix}/at/r{me}", str(n))
        arrived = store.add(f"{base}/count", 1)
        if arrived == size:
            _failpoints.hit("checkin.arrived")
            store.set(f"{base}/go", "1")
            if n > 1:  # every rank is past the previous call: its keys are no longer read
                for key in (f"{self._prefix}/{n - 1}/count", f"{self._prefix}/{n - 1}/go"):
                    store.delete_key(key)
            return None
        if arrived < _GAVE_UP:
            deadline = time.monotonic() + self.timeout_s
            # Two blocking waits (a timed-out store wait logs in torch itself: no polling loop): a
            # short one, then, once on_wait has said so, the rest.
            first = max(1.0, min(10.0, self.timeout_s / 3))
            for i in range(2):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    store.wait([f"{base}/go"], datetime.timedelta(seconds=min(first, left) if i == 0 else left))
                    return None
                except dist.DistStoreError:
                    count = store.add(f"{base}/count", 0)
                    if count == size:
                        # Every rank arrived and none gave up, but the last one never said go: it died (or
                        # stalls) right after arriving. Go on as go would have said; a dead rank fails this
                        # rank's next collective at once, instead of after the whole timeout.
                        return None
                    if i == 0 and deadline - time.monotonic() > 0:
                        on_wait(count % _GAVE_UP, deadline - time.monotonic())
            seen = store.add(f"{base}/count", _GAVE_UP)
            if seen % _GAVE_UP == size and seen // _GAVE_UP == 1:
                # The last rank arrived just now, before anyone gave up: it sets go at once.
                try:
                    store.wait([f"{base}/go"], datetime.timedelta(seconds=10.0))
                    return None
                except dist.DistStoreError:
                    pass
            # Else another rank gave up first: every rank reports the call as failed alike.
        return [q for q in range(size) if not _reached(store, f"{self._prefix}/at/r{q}", n)]


def _reached(store: Any, key: str, n: int) -> bool:
    if not store.check([key]):
        return False
    return int(store.get(key)) >= n
