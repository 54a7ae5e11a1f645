"""Each run of ``shardckpt check-resume`` apart from the others in every tier, and nothing left after a check.

The three runs use one checkpoint path (``<workdir>/ckpt``: paths saved in the
state compare equal); a finished run's directory is moved aside
(:func:`set_aside`) so that the next run finds it empty. The memory tier keeps
its copies in ``/dev/shm`` under a namespace named after that path
(``format/shm.py``), which a rename does not move: a run from scratch would
resume the previous run's memory copy. So each *line* of runs gets a tmpfs
directory of its own, given to the job as ``SHARDCKPT_SHM_DIR``
(:class:`MemoryDirs`): each reference run one, the killed run and the run
resuming it one together (the resume may restore from memory, as a restarted
job does). A line's directory is removed once its last run ended
(:meth:`MemoryDirs.release`); the memory keepers its trainers started
(``node/memory_keeper.py``) then find no trainer and no namespace and exit,
and :func:`settle` waits for them (and for the uploaders) to be gone.

The peer tier (on when a job's nodes each have their own ``local_dir``) keeps
its replicas and its daemon's state under each node's ``local_dir``, and each
run's nodes pin each other's certificates (``peers.json``, written by the run):
a line's runs neither find nor trust another line's daemons. A node's daemon
outlives its trainers to serve the job's other nodes (``SHARDCKPT_PEER_LINGER_S``,
60 s): once a line's runs are over nothing needs it, and :func:`settle` ends it
(SIGTERM, its ordinary stop) before the line's directory is moved aside, so
that no daemon of one line runs while the next line does. Torch-free.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import tempfile
import time

from shardckpt.format import node_state, shm
from shardckpt.node import node_registry

SETTLE_S = 60.0
"""How long :func:`settle` waits for a run's daemons to drain and exit before it ends them."""


class MemoryDirs:
    """The check's own tmpfs directory (under ``SHARDCKPT_SHM_DIR`` or ``/dev/shm``), one sub-directory per line."""

    def __init__(self, fallback: str) -> None:
        try:
            base = shm.shm_root()
            os.makedirs(base, exist_ok=True)
            self.root = tempfile.mkdtemp(prefix=f"shardckpt-check-{os.getuid()}-", dir=base)  # mode 0700
        except OSError:  # no usable tmpfs: the memory tier of the runs (if on) says so; keep them apart all the same
            self.root = tempfile.mkdtemp(prefix="shm-", dir=fallback)

    def of(self, line: str) -> str:
        """The ``SHARDCKPT_SHM_DIR`` of the runs of ``line`` (created on first use)."""
        path = os.path.join(self.root, line)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def release(self, line: str) -> None:
        """The line's runs are over: its memory copies go (its keepers then exit)."""
        shutil.rmtree(os.path.join(self.root, line), ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def set_aside(ckpt: str, name: str) -> None:
    """Move a finished run's checkpoints aside so that the next run finds the path empty."""
    if os.path.isdir(ckpt):
        settle(ckpt, keepers=False)
        os.rename(ckpt, f"{ckpt}.{name}")


def _roots(where: str) -> list[str]:
    """Every ``local_dir`` under ``where`` that a run's daemons used (it holds their state directory)."""
    roots = []
    for dirpath, dirnames, _files in os.walk(where):
        if node_registry.STATE_DIR in dirnames:
            roots.append(dirpath)
        dirnames[:] = [d for d in dirnames if d != node_registry.STATE_DIR and not d.startswith("step_")]
    return roots


def _keeper_locks(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(root, node_registry.STATE_DIR, "memory-*.lock")))


def _keeper_pids(root: str) -> list[int]:
    """The pids the memory keepers of ``root`` logged at start (``memory.log``)."""
    try:
        with open(os.path.join(root, node_registry.STATE_DIR, "memory.log"), errors="replace") as f:
            return [int(m) for m in re.findall(r"memory keeper \(pid (\d+)\)", f.read())]
    except OSError:
        return []


def _peer_daemon(root: str) -> tuple[int, int | None] | None:
    """The pid (and start time) of the peer daemon serving ``root``, ``None`` when none runs."""
    info = node_state.read_json(os.path.join(node_state.state_dir(root), node_state.PEER_STATUS_NAME))
    pid, start = info.get("pid"), info.get("pid_start")
    if info.get("state") != "running" or not isinstance(pid, int) or not node_registry.pid_alive(pid, start):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return (pid, start) if b"peer_daemon" in f.read() else None  # else: gone, and its pid reused
    except OSError:
        return None


def settle(where: str, *, keepers: bool = True, wait_s: float = SETTLE_S) -> list[str]:
    """Wait (bounded) for the uploaders a run started under ``where`` to drain and exit, and (``keepers``) for its
    memory keepers to exit once their memory is released; end those left, and the peer daemons (they only linger
    for nodes whose runs are over). Returns what had to be ended before its time."""
    ended = []
    deadline = time.monotonic() + wait_s
    for root in _roots(where):
        daemon = _peer_daemon(root)
        if daemon is not None and not node_registry.trainers_alive(root):
            try:
                os.kill(daemon[0], signal.SIGTERM)
            except OSError:
                pass
            while node_registry.pid_alive(*daemon) and time.monotonic() < deadline:
                time.sleep(0.1)
        while node_registry.uploader_running(root) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = node_registry.uploader_running(root)
        if pid:
            os.kill(pid, signal.SIGTERM)
            ended.append(f"the uploader of {root} (pid {pid})")
        if not keepers:
            continue
        while any(node_registry.lock_held(p) for p in _keeper_locks(root)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if any(node_registry.lock_held(p) for p in _keeper_locks(root)):
            for pid in _keeper_pids(root):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"memory_keeper" not in f.read():
                            continue  # gone, and its pid reused
                    os.kill(pid, signal.SIGTERM)
                    ended.append(f"the memory keeper of {root} (pid {pid})")
                except OSError:
                    pass
    return ended
