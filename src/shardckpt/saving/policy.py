"""When to save: the interval policy, the time and preemption votes, the signal handlers.

Step-based decisions are the same on every rank by construction. Time- and
signal-based triggers can differ between ranks, so they are agreed with an
all-reduce. That vote is pipelined: each ``save()`` call starts a
non-blocking all-reduce of this rank's flags and acts on the result of the
previous call's vote, which has long completed. A signal or an elapsed
interval therefore takes effect one ``save()`` call later on every rank at
once, and deciding never blocks training.

Signal handlers only set flags (no logging, no locks: neither is safe in a
handler); what they noticed is logged by the next ``save()``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import signal
import statistics
import threading
import time
from typing import Any, Callable

import torch

from shardckpt import _dist
from shardckpt.options import CheckpointConfig

log = logging.getLogger("shardckpt")

AUTO_WINDOW = 5
"""``every_seconds="auto"`` weighs the median blocked time of the last saves."""
AUTO_MIN_S = 1.0
"""... and never saves more often than this."""


def auto_interval(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly: the interval minimising checkpoint overhead (``cost/T``) plus expected lost
    work (``T/2`` per failure, one failure per ``mtbf`` on average) is ``sqrt(2 * cost * mtbf)``."""
    return max(AUTO_MIN_S, math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s))


@dataclasses.dataclass(frozen=True)
class Decision:
    due: bool
    """This call saves."""
    preempt: bool
    """It is the save a preemption signal asked for: synchronous, sets ``preempted``."""


class SavePolicy:
    """Decides, on every rank alike, whether a ``save()`` call saves."""

    def __init__(self, config: CheckpointConfig, groups: _dist.SideGroups) -> None:
        self.config = config
        self._groups = groups
        self._vote: tuple[Any, torch.Tensor] | None = None
        self._last_save_time: float | None = None
        self.last_saved_step: int | None = None
        self.signal: int | None = None
        """The preemption signal received, if any (set by the handler)."""
        self.signal_at: float | None = None
        """``time.monotonic()`` when it arrived: the notice runs from then."""
        self._preempt_decided = False
        self._signal_reported = False
        self._previous_handlers: dict[int, Any] = {}
        self._blocked: list[float] = []
        self._committed: list[float] = []
        self._auto_logged: float | None = None

    def record_committed(self, seconds: float) -> None:
        """A save took ``seconds`` from its start to its commit (the latency a failure adds to lost work)."""
        self._committed = (self._committed + [seconds])[-AUTO_WINDOW:]

    # ---- the interval chosen from measured cost

    def record_blocked(self, seconds: float) -> None:
        """A save blocked training for ``seconds`` (the cost ``every_seconds="auto"`` weighs)."""
        self._blocked = (self._blocked + [seconds])[-AUTO_WINDOW:]
        if self.config.every_seconds == "auto":
            interval = self.interval_s()
            if interval is not None and (self._auto_logged is None or abs(interval / self._auto_logged - 1) > 0.2):
                self._auto_logged = interval
                if _dist.rank() == 0:
                    log.info("shardckpt: %s", self.explain_auto())

    def interval_s(self) -> float | None:
        """Seconds between time-based saves: ``every_seconds``, or the auto interval (``None`` before any save)."""
        every = self.config.every_seconds
        if every != "auto":
            return every
        if not self._blocked:
            return None
        return auto_interval(statistics.median(self._blocked), float(self.config.mtbf_s))

    def explain_auto(self) -> str:
        cost = statistics.median(self._blocked)
        interval = auto_interval(cost, float(self.config.mtbf_s))
        commit = (f" plus {statistics.median(self._committed):.1f} s until a save is committed"
                  if self._committed else "")
        return (
            f"every_seconds=auto: saving every {interval:.0f} s = sqrt(2 x {cost:.3f} s blocked per save x "
            f"{self.config.mtbf_s:.0f} s between failures) (Young/Daly); checkpoints then cost "
            f"{100 * cost / interval:.2f} % of training time and a failure loses {interval / 2:.0f} s of work on "
            f"average{commit}, the least of the two together"
        )

    # ---- decisions

    def decide(self, step: int, force: bool) -> Decision:
        cfg = self.config
        if step == self.last_saved_step and not force:
            return Decision(False, False)
        by_step = cfg.every_steps is not None and step % cfg.every_steps == 0
        every_call = cfg.every_steps is None and cfg.every_seconds is None
        if self._voting():
            by_time, preempt = self._resolve_vote()
        else:
            by_time, preempt = self._local_flags()
        return Decision(bool(force or every_call or by_step or by_time or preempt), bool(preempt))

    def may_collect(self, step: int, force: bool) -> bool:
        """Whether this call may issue a collective (a vote, or a save due by step), alike on every rank."""
        cfg = self.config
        every_call = cfg.every_steps is None and cfg.every_seconds is None
        by_step = cfg.every_steps is not None and step % cfg.every_steps == 0
        return self._voting() or force or every_call or by_step

    def started(self, step: int, preempt: bool) -> None:
        """A save of ``step`` started (after the checks that can still skip it)."""
        self._last_save_time = time.monotonic()
        self.last_saved_step = step
        if preempt:
            self._preempt_decided = True

    def _voting(self) -> bool:
        return _dist.is_dist() and (self.config.every_seconds is not None or bool(self._previous_handlers))

    def _local_flags(self) -> tuple[int, int]:
        cfg = self.config
        by_time = 0
        if cfg.every_seconds is not None and _dist.rank() == 0:
            interval = self.interval_s()
            # "auto" before its first measurement: only the first save is due (this call's own
            # save is measured after its vote starts).
            by_time = int(self._last_save_time is None
                          or (interval is not None and time.monotonic() - self._last_save_time >= interval))
        return by_time, int(self.signal is not None and not self._preempt_decided)

    def _resolve_vote(self) -> tuple[int, int]:
        vote = self._vote
        self._vote = None
        if vote is None:
            return 0, 0
        work, flags = vote
        work.wait()
        by_time, preempt = flags.tolist()
        return by_time, preempt

    def start_vote(self) -> None:
        """Start this call's vote (resolved by the next call); every rank calls it alike."""
        if not self._voting():
            return
        if self._vote is not None:  # an early return left one unresolved: finish it first
            self._resolve_vote()
        flags = torch.tensor(self._local_flags(), dtype=torch.int64)
        work = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self._groups.ctl,
                                            async_op=True)
        self._vote = (work, flags)

    def finish_vote(self) -> None:
        """Complete a vote still in flight (every rank started the same one)."""
        if self._vote is not None:
            self._resolve_vote()

    # ---- signals

    def install_signal_handlers(self) -> None:
        if not self.config.preemption_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("shardckpt: not on the main thread; preemption signals are not handled")
            return
        for signum in self.config.preemption_signals:
            previous = signal.getsignal(signum)
            self._previous_handlers[signum] = previous
            signal.signal(signum, self._make_handler(previous))

    def _make_handler(self, previous: Any) -> Callable:
        def handler(signum: int, frame: Any) -> None:
            # Only a flag: logging takes locks, which a handler interrupting
            # the logging module itself would deadlock on. report_signal() logs.
            if self.signal is None:
                self.signal_at = time.monotonic()
                self.signal = signum
            if callable(previous):
                previous(signum, frame)

        return handler

    def notice_left(self) -> float:
        """Seconds left of the preemption notice (``drain_timeout_s`` from the signal)."""
        since = 0.0 if self.signal_at is None else time.monotonic() - self.signal_at
        return max(0.0, self.config.drain_timeout_s - since)

    def report_signal(self) -> None:
        """Log, once, that a preemption signal arrived (called from ``save()``, not the handler)."""
        if self.signal is not None and not self._signal_reported:
            self._signal_reported = True
            log.warning(
                "shardckpt: received signal %d; this save() or the next one saves at once and waits for the commit",
                self.signal,
            )

    def restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous_handlers.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
        self._previous_handlers.clear()
