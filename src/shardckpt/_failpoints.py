"""Named kill points for crash-consistency testing.

``SHARDCKPT_FAILPOINTS="commit.before_rename"`` (a comma-separated list,
each ``name`` or ``name@N`` for the N-th time it is reached) makes the
process SIGKILL itself at that point, the way a preempted machine dies. It is
read once at import; unset (the default) every ``hit`` is a dict lookup.
With ``SHARDCKPT_FAILPOINTS_LOG=FILE`` the process first appends
``<name> <pid>`` to FILE, so a test harness knows which point killed whom.
"""

from __future__ import annotations

import os
import signal

_SPEC: dict[str, int] = {}
_COUNTS: dict[str, int] = {}

for _item in filter(None, (s.strip() for s in os.environ.get("SHARDCKPT_FAILPOINTS", "").split(","))):
    _name, _, _nth = _item.partition("@")
    _SPEC[_name] = int(_nth) if _nth else 1

POINTS = (
    "save.staged",  # state copied to host buffers, nothing written yet
    "write.done",  # DCP wrote every shard into the partial directory
    "commit.manifest_written",  # manifest in the partial directory, not renamed yet
    "commit.renamed",  # step visible, other ranks may not have seen it
    "retention.hidden",  # an old step lost its manifest, files not yet removed
)


# Inside the uploader process (``shardckpt.uploader``): the remote commit protocol.
UPLOADER_POINTS = (
    "upload.files_sent",  # this node's files uploaded and verified, no marker yet
    "upload.marker_written",  # node marker uploaded, the step's manifest not yet
    "upload.manifest_written",  # committed remotely, the local copy not yet marked uploaded
    "upload.retention_hidden",  # remote retention removed an old step's manifest, not its files
)


def hit(name: str) -> None:
    if not _SPEC or name not in _SPEC:
        return
    _COUNTS[name] = _COUNTS.get(name, 0) + 1
    if _COUNTS[name] == _SPEC[name]:
        log = os.environ.get("SHARDCKPT_FAILPOINTS_LOG")
        if log:
            try:
                with open(log, "a", encoding="utf-8") as f:
                    f.write(f"{name} {os.getpid()}\n")
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
