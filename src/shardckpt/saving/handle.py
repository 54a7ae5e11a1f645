"""A save in flight, as ``Checkpointer.save()`` returns it."""

from __future__ import annotations

import concurrent.futures


class SaveHandle:
    """A save in flight. ``wait()`` returns the step directory once committed."""

    def __init__(self, step: int, future: concurrent.futures.Future) -> None:
        self.step = step
        self._future = future
        self.reported = False
        """Its failure was raised to the caller already (by this handle): not raised again."""

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
