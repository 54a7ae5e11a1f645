"""Progress lines of long transfers (uploads, downloads, verification)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("shardckpt")


PROGRESS_S = 10.0
"""Seconds between progress lines of one long upload or download."""


class Progress:
    """Logs ``<what>: x of y MiB (r MiB/s)`` every ``every_s`` while a transfer runs.

    Used as a context manager around the transfer; the store calls :meth:`add`
    as parts of files are confirmed. Short transfers (under ``every_s``) log
    nothing here.
    """

    bar_factory: Any = None
    """``(what, total) -> bar``: a progress bar with ``update(n)`` / ``close()`` that
    replaces the log lines (the command line sets one on a terminal)."""

    def __init__(self, what: str, total: int, every_s: float) -> None:
        self.what, self.total, self.every_s = what, total, every_s
        self._done = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None
        self._bar: Any = None

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            if self._bar is not None:
                self._bar.update(nbytes)

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def _report(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                done = self._done
            log.info(
                "shardckpt: %s: %.1f of %.1f MiB (%.1f MiB/s)",
                self.what, done / 2**20, self.total / 2**20, done / 2**20 / max(1e-9, self.elapsed()),
            )

    def __enter__(self) -> "Progress":
        self._started = time.monotonic()
        factory = Progress.bar_factory
        self._bar = factory(self.what, self.total) if factory is not None and self.total else None
        if self._bar is None:
            self._thread = threading.Thread(target=self._report, name="shardckpt-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
