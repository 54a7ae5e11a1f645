"""Processes by ``/proc``: whether one is alive (a reused pid never looks alive), and ending a job started in a
session of its own with everything it started. Imports nothing of the package."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Sequence


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


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux; torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen, pids: Sequence[int] = ()) -> None:
    """SIGKILL a job started in a session of its own: the command, everything it started (and ``pids``).

    Returns once every one of them is gone (a zombie at most): SIGKILL is
    delivered at once but a big process takes a while to exit.
    """
    victims = [proc.pid, *descendants(proc.pid), *pids]
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(running(pid) for pid in victims[1:]):
        time.sleep(0.05)


def running(pid: int) -> bool:
    """``pid`` exists and has not exited (not a zombie)."""
    return proc_start(pid) is not None
