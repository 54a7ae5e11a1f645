"""Whether a process is alive, by pid and start time (a reused pid never looks alive). Imports nothing of the package."""

from __future__ import annotations

import os


def proc_start(pid: int) -> str | None:
    """The start time of ``pid`` (clock ticks since boot, from ``/proc``); ``None`` when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def pid_alive(pid: int, start: str | None = None) -> bool:
    """``pid`` runs, and (when ``start`` is given) is the process that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = proc_start(pid)
    if os.path.exists("/proc/self/stat"):
        if now is None:
            return False  # a zombie
        if start is not None and now != start:
            return False  # the pid was reused
    return True
