"""The node's state directory, ``<local_dir>/.shardckpt-remote/``: the files a node's trainers and its daemons share.

Everything in it is private to the job's user, whatever the umask: the
directory (and its ``trainers/``) mode 0700, every file 0600. It holds the
uploader's ``status.json``, ``uploader.lock`` and ``uploader.log``; the peer
tier's key pair (``peer-key.pem``, ``peer-cert.pem``), ``peers.json`` (the
job's nodes and their certificates, written by the trainer),
``peer-agreed.json`` (the step below which replicas may go, agreed at a save),
``peer.json`` (the peer daemon's address and what it replicated),
``peer.lock`` and ``peer.log``; and one file per live trainer in
``trainers/``. Readers here import no daemon: what a status file says is read
by path (the ``remote/``, ``steps/`` and ``saving/`` layers use it without importing
``node/``).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from shardckpt.errors import CorruptCheckpointError
from shardckpt.format import layout

STATE_DIR = ".shardckpt-remote"
PEERS_NAME = "peers.json"
"""The job's nodes with their addresses and certificates, for the peer daemon (written by the trainer)."""
AGREED_NAME = "peer-agreed.json"
"""The newest step complete across any single node's loss, as the job's nodes agreed at a save (by the trainer)."""
PEER_STATUS_NAME = "peer.json"
"""The peer daemon's status: its address and what it replicated."""
DIR_MODE = 0o700
FILE_MODE = 0o600


def state_dir(root: str) -> str:
    return os.path.join(root, STATE_DIR)


def private_dir(path: str) -> str:
    """Make ``path`` (and missing parents) a directory of mode 0700 whatever the umask; a looser existing
    one of this user is tightened. Returns ``path``."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    info = os.stat(path)
    if stat.S_IMODE(info.st_mode) != DIR_MODE and info.st_uid == os.getuid():
        os.chmod(path, DIR_MODE)
    return path


def make_state_dir(root: str) -> str:
    """The state directory of ``root``, made private (0700) when needed."""
    return private_dir(state_dir(root))


def write_private(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically as a file of mode 0600."""
    layout.atomic_write_text(path, text, mode=FILE_MODE)


def open_private_log(path: str) -> int:
    """A log file opened for appending, mode 0600 (tightened when it was looser); returns its descriptor."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        pass
    return fd


def read_json(path: str) -> dict[str, Any]:
    """A JSON object file; ``{}`` when absent, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        return body if isinstance(body, dict) else {}
    except (OSError, ValueError):
        return {}


def replicated(root: str, step: int, manifest: layout.Manifest | None = None) -> dict[str, Any] | None:
    """What this node's peer daemon recorded of sending its files of ``step``, for the save committed here
    (``{"holders", "time", "seconds"}``); ``None`` when not replicated (or another save was)."""
    info = read_json(os.path.join(state_dir(root), PEER_STATUS_NAME))
    sent = (info.get("replicated") or {}).get(str(step))
    if manifest is None:
        try:
            manifest = layout.read_manifest(os.path.join(root, layout.step_dirname(step)))
        except CorruptCheckpointError:  # an unreadable manifest: nothing is known replicated
            manifest = None
    if not sent or manifest is None or sent.get("version") != layout.version_of(manifest):
        return None
    return sent
