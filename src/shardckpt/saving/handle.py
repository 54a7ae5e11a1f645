"""A save in flight, as ``Checkpointer.save()`` returns it."""

from __future__ import annotations

import concurrent.futures


class SaveHandle:
    """A save in flight. ``wait()`` returns the step directory once committed (a save kept in memory only
    is done when ``save()`` returns: ``tier == "memory"``)."""

    def __init__(self, step: int, future: concurrent.futures.Future, tier: str = "disk") -> None:
        self.step = step
        self._future = future
        self.tier = tier
        """``disk``: ``wait()`` returns once the step is committed on disk; ``memory``: it was kept in memory only."""
        self.reported = False
        """Its failure was raised to the caller already (by this handle): not raised again."""

    @classmethod
    def held(cls, step: int, where: str) -> "SaveHandle":
        """A save kept in memory only: done when ``save()`` returns; ``wait()`` returns its record's path."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(where)
        return cls(step, future, "memory")

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> str:
        """Block until committed (or ``timeout`` seconds); re-raises a failure."""
        try:
            return self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"step {self.step} was not committed within {timeout} s") from None
        except BaseException:
            self.reported = True
            raise

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"
