"""The three durability levels of a save, in one log line: ``step 500: local 0.4 s, peer 1.9 s, remote 14.2 s``.

Each level is timed from the start of the save: ``local`` when the step was
committed in the local directory, ``peer`` when this node's daemon finished
replicating it (its status file), ``remote`` when the uploader marked it
committed on the remote (the step's upload mark). The later levels become
known after the save returns: the line is logged (on rank 0, for its node)
when a level was learned, looked at by the next ``save()`` and by
``close()``; ``close()`` also logs the levels still pending. (The peer daemon
replicates the newest step: a step followed by the next save before its
replication began stays ``peer pending``.)
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from shardckpt.format import layout, node_state
from shardckpt.remote import commit as remote_commit

log = logging.getLogger("shardckpt")


class DurabilityLog:
    """The steps this instance committed whose peer or remote level is not yet logged."""

    def __init__(self, root: str, *, peer_on: Any, remote: bool) -> None:
        self.root = root
        self._peer_on = peer_on
        """A callable: whether the peer tier is on (decided at the first save or load)."""
        self.remote = remote
        self._lock = threading.Lock()
        self._steps: dict[int, dict[str, Any]] = {}

    def committed(self, step: int, started: float, local_s: float) -> None:
        """A save of ``step`` that started at ``started`` (``time.time()``) committed locally ``local_s`` later."""
        with self._lock:
            self._steps[step] = {"started": started, "local": local_s, "logged": None}
            for old in sorted(self._steps)[:-8]:  # a bounded record: the newest saves only
                del self._steps[old]

    def levels(self, step: int) -> dict[str, float | None] | None:
        """Seconds from the save's start to each level of ``step`` (``None``: not reached); ``None``
        when the step is no longer committed here (retention deleted it)."""
        entry = self._steps[step]
        manifest = _manifest(self.root, step)
        if manifest is None:
            return None
        out: dict[str, float | None] = {"local": entry["local"]}
        if self._peer_on():
            sent = node_state.replicated(self.root, step, manifest)
            out["peer"] = max(entry["local"], sent["time"] - entry["started"]) if sent else None
        if self.remote:
            mark = _upload_mark(self.root, step, manifest)
            out["remote"] = max(entry["local"], mark - entry["started"]) if mark is not None else None
        return out

    def report(self, *, final: bool = False) -> list[str]:
        """Log a line for each step whose known levels grew since its last line (``final``: also each
        step not yet complete, naming what is pending). Returns the lines logged."""
        lines = []
        with self._lock:
            for step in sorted(self._steps):
                levels = self.levels(step)
                if levels is None:
                    del self._steps[step]
                    continue
                known = tuple(k for k, v in levels.items() if v is not None)
                complete = len(known) == len(levels)
                if known != self._steps[step]["logged"] or (final and not complete):
                    line = f"shardckpt: step {step}: " + ", ".join(
                        f"{k} {v:.1f} s" if v is not None else f"{k} pending" for k, v in levels.items())
                    if final and not complete:
                        line += " (at close())"
                    lines.append(line)
                    log.info("%s", line)
                self._steps[step]["logged"] = known
                if complete:
                    del self._steps[step]
        return lines


def _manifest(root: str, step: int) -> layout.Manifest | None:
    try:
        return layout.read_manifest(os.path.join(root, layout.step_dirname(step)))
    except Exception:  # noqa: BLE001 - a deleted or unreadable step has no level to report
        return None


def _upload_mark(root: str, step: int, manifest: layout.Manifest | None) -> float | None:
    """When the uploader marked this save of ``step`` committed on the remote (``time.time()``)."""
    if manifest is None:
        return None
    try:
        with open(os.path.join(root, layout.step_dirname(step), remote_commit.UPLOADED_NAME), encoding="utf-8") as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    if (mark.get("files_digest") != remote_commit.files_digest(manifest)
            or not isinstance(mark.get("time"), (int, float))):
        return None
    return float(mark["time"])
