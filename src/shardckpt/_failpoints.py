"""Named fault points for crash-consistency and failure testing.

``SHARDCKPT_FAILPOINTS="commit.renamed"`` (a comma-separated list, each
``name`` or ``name@N`` for the N-th time it is reached) makes the process
SIGKILL itself at that point, the way a preempted machine dies; an item
``raise:name[@N]`` raises :class:`InjectedFault` there instead, the way a
failing disk or a full filesystem does; ``flip:name[@N]`` flips one bit of
the data a point hands over (bytes in transit damaged, as a bad link or NIC
would). The variable is read once at
import; unset (the default) every ``hit`` is a dict lookup.
With ``SHARDCKPT_FAILPOINTS_LOG=FILE`` a killed process first appends
``<name> <pid>`` to FILE, so a test harness knows which point killed whom.

In-process, :func:`arm` does the same for the current process only (a test
program arms one rank to fail while the others go on).
"""

from __future__ import annotations

import os
import signal
from typing import Any

KILL, RAISE, FLIP = "kill", "raise", "flip"

_SPEC: dict[str, tuple[int, str]] = {}
_COUNTS: dict[str, int] = {}


class InjectedFault(OSError):
    """The fault a ``raise`` point injects (an OSError, as a real I/O failure would be)."""


def arm(name: str, action: Any = RAISE, nth: int = 1) -> None:
    """Make the ``nth`` next hit of ``name`` in this process ``raise``, ``kill``, ``flip``, or call ``action()``.

    A callable lets a test act at that exact point (save the step again while
    it uploads, stall a write); it runs once, in the thread that hits the point.
    """
    if action not in (KILL, RAISE, FLIP) and not callable(action):
        raise ValueError(f"unknown fault action {action!r}")
    _COUNTS[name] = 0
    _SPEC[name] = (nth, action)


for _item in filter(None, (s.strip() for s in os.environ.get("SHARDCKPT_FAILPOINTS", "").split(","))):
    _action, _, _rest = _item.rpartition(":")
    _name, _, _nth = _rest.partition("@")
    arm(_name, _action or KILL, int(_nth) if _nth else 1)

POINTS = (
    "save.staged",  # state copied to host buffers, nothing written yet
    "write.done",  # DCP wrote every shard into the partial directory
    "commit.manifest_written",  # manifest in the partial directory, not renamed yet
    "commit.renamed",  # step visible, other ranks may not have seen it
    "retention.hidden",  # an old step lost its manifest, files not yet removed
)
"""The trainer's kill points, in the order a save reaches them (the kill soak walks them)."""

# Also reached, not walked by the soak: "write.hashed" (this rank hashed its
# files, before the exchange of file tables), "remote.file_written" (a
# file:// remote object written under its temporary name, not yet renamed),
# "stage.copies_pending" (the writer thread is about to wait for copies still
# running after save() returned, with overlap_copies), "checkin.arrived"
# (the last rank to check in to a save() counted itself, before it tells the
# others to go on) and "memory.copied" (this rank's copy into the memory tier
# is complete, its record not written yet: the slot holds no save).
# Also in the uploader: "upload.markers_checked" (the committer saw every node's
# marker; it checks the objects' identities next, then writes the manifest).
# Handing data over: "peer.chunk_read" (a chunk of a file about to be sent to
# another node's rank during a restore), "share.chunk_send" (a chunk of a shared
# fetch about to be passed to another node, ``ranged.SparseStep.share``).

# Inside the uploader process (``shardckpt.node.uploader``): the remote commit protocol.
UPLOADER_POINTS = (
    "upload.files_sent",  # this node's files uploaded and verified, no marker yet
    "upload.marker_written",  # node marker uploaded, the step's manifest not yet
    "upload.manifest_written",  # committed remotely, the local copy not yet marked uploaded
    "upload.retention_hidden",  # remote retention removed an old step's manifest, not its files
)


def hit(name: str, data: Any = None) -> None:
    """Reach fault point ``name``; ``data`` (a writable buffer) is what a ``flip`` damages."""
    if not _SPEC or name not in _SPEC:
        return
    _COUNTS[name] = _COUNTS.get(name, 0) + 1
    nth, action = _SPEC[name]
    if _COUNTS[name] != nth:
        return
    if callable(action):
        action()
        return
    if action == RAISE:
        raise InjectedFault(f"fault injected at {name}")
    if action == FLIP:
        if data is not None and len(data):
            data[len(data) // 2] ^= 0x01
        return
    log = os.environ.get("SHARDCKPT_FAILPOINTS_LOG")
    if log:
        try:
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"{name} {os.getpid()}\n")
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)
