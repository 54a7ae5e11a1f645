"""What runs on this node: trainer processes and the uploader, seen through files.

A node's trainers and its uploader share ``<local_dir>/.shardckpt-remote/``::

    uploader.lock         flock held by the running uploader (one per local_dir)
    status.json           what it is doing: pending steps and bytes, last error
    uploader.log          its log
    trainers/<host>-<pid>.json   one per live trainer process of this node

Liveness is checked by pid and process start time, so a reused pid never
looks like a live trainer or uploader.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from shardckpt._proc import pid_alive, proc_start  # noqa: F401 - part of this module's interface
from shardckpt.format import node_state
from shardckpt.format.node_state import STATE_DIR, make_state_dir, open_private_log, read_json, state_dir  # noqa: F401 - re-exported


def daemon_logging() -> None:
    """A per-node daemon's log: timestamped lines of logger "shardckpt" on stderr (its log file)."""
    import logging

    logger = logging.getLogger("shardckpt")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("SHARDCKPT_LOG_LEVEL", "INFO").upper())
        logger.propagate = False


def process_record(state: str, node: str) -> dict[str, Any]:
    """The fields a daemon's status file starts with: who writes it, so readers can tell it is alive."""
    pid = os.getpid()
    return {"state": state, "pid": pid, "pid_start": proc_start(pid), "node": node, "host": socket.gethostname()}


def read_status(root: str) -> dict[str, Any]:
    return read_json(os.path.join(state_dir(root), "status.json"))


def register_trainer(root: str) -> str:
    """Record this process as a live trainer of the node; returns the file to remove."""
    make_state_dir(root)
    directory = node_state.private_dir(os.path.join(state_dir(root), "trainers"))
    pid = os.getpid()
    path = os.path.join(directory, f"{socket.gethostname()}-{pid}.json")
    body = {"pid": pid, "host": socket.gethostname(), "start": proc_start(pid), "time": time.time()}
    node_state.write_private(path, json.dumps(body))
    return path


def unregister_trainer(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def trainers_alive(root: str) -> list[int]:
    directory = os.path.join(state_dir(root), "trainers")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    alive = []
    host = socket.gethostname()
    for name in names:
        body = read_json(os.path.join(directory, name))
        pid = body.get("pid")
        if not isinstance(pid, int) or body.get("host") != host:
            continue
        if pid_alive(pid, body.get("start")):
            alive.append(pid)
        else:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    return alive


LOCK_NAME = "uploader.lock"


def lock_path(root: str) -> str:
    return os.path.join(state_dir(root), LOCK_NAME)


def uploader_running(root: str) -> int | None:
    """Pid of the uploader serving ``root``, else ``None`` (0 when it runs but its pid is unknown).

    The uploader holds ``uploader.lock`` while it runs, so the lock, not the
    pid, is the test: a sidecar in another container (another PID namespace,
    where its pid means nothing here) is seen as running all the same.
    """
    if not lock_held(lock_path(root)):
        return None
    pid = read_status(root).get("pid")
    return pid if isinstance(pid, int) else 0  # held: an uploader runs


def acquire_lock(path: str, wait_s: float = 0.0) -> int | None:
    """An exclusive ``flock`` of ``path`` (created 0600), waiting up to ``wait_s`` for another holder to let
    go: the open descriptor (the lock is held while it stays open), else ``None``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    end = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() >= end:
                os.close(fd)
                return None
            time.sleep(0.1)


def lock_held(path: str) -> bool:
    """Another process holds the ``flock`` of ``path`` (a daemon's lock: held while it runs)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


# A node daemon (the uploader, the peer daemon, the memory keeper) forks once
# more and the intermediate exits: the daemon is then no descendant of the
# trainer (a kill of the trainer's process tree spares it) and runs in a
# session of its own. It imports only its module's
# dependencies (no torch): a stub package object stands in for
# shardckpt/__init__.py, which imports torch.
_BOOTSTRAP = (
    "import os, sys, types\n"
    "if os.fork() > 0:\n"
    "    os._exit(0)\n"
    "pkg = types.ModuleType('shardckpt'); pkg.__path__ = [sys.argv[1]]; sys.modules['shardckpt'] = pkg\n"
    "module, _, func = sys.argv[2].partition(':')\n"
    "main = getattr(__import__('shardckpt.' + module, fromlist=[func]), func)\n"
    "sys.exit(main(sys.argv[3:]))\n"
)


def spawn_node_daemon(root: str, entry: str, args: list[str], log_name: str) -> None:
    """Start a per-node daemon (``entry`` is ``module:function`` of this package) detached from the trainer."""
    directory = make_state_dir(root)
    env = dict(os.environ)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # shardckpt/, above node/
    logfile = os.fdopen(open_private_log(os.path.join(directory, log_name)), "ab")
    try:
        cmd = [sys.executable, "-c", _BOOTSTRAP, package_dir, entry, *args]
        launcher = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, cwd=root,
        )
    finally:
        logfile.close()
    launcher.wait(timeout=60)  # the intermediate exits right after its fork


# ------------------------------------------------------------ remote listing
